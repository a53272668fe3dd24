/** Where a tenant's limits are counted: its requests in flight (concurrency units), its token
 *  bucket (tokens per minute) and its virtual token counter (the fair queue's VTC, fair-queue.ts).
 *  One interface, two stores: this process's memory (the default, a single router) and Redis
 *  (redis-limits.ts: several router replicas share each tenant's limits and counters).
 *  The limiter (limits.ts) decides what a refusal says and the fair queue whom to serve; a store
 *  only counts.
 *  Knows tenant names, counts and time; knows nothing of HTTP, errors shown to clients or keys. */
import assert from 'node:assert/strict'

/** A value now (the in-process store) or later (a store across the network). */
export type MaybePromise<T> = T | Promise<T>

/** The answer to {@link LimitStore.acquire}: a unit held until `release` (idempotent), or a
 *  refusal with the tenant's requests in flight. */
export type ConcurrencyGrant =
  | { readonly isGranted: true; release(): void }
  | { readonly isGranted: false; readonly numRunning: number }

/** The answer to {@link LimitStore.charge}: charged, or refused with the tokens left now
 *  (fractional: the bucket refills continuously). */
export type TokenCharge =
  { readonly isCharged: true } | { readonly isCharged: false; readonly numTokensLeft: number }

/** Counts tenants' concurrency units and token buckets. A bucket of `tokensPerMinute` starts
 *  full and refills at `tokensPerMinute / 60 000` per ms, never past full. */
export interface LimitStore {
  /** Takes one concurrency unit of `tenant` when fewer than `maxConcurrent` are held (always
   *  when `maxConcurrent` is undefined). May reject (a store across the network) with a
   *  `LimitError` of its own policy. */
  acquire(tenant: string, maxConcurrent: number | undefined): MaybePromise<ConcurrencyGrant>
  /** Takes `numTokens` (≤ `tokensPerMinute`) from the tenant's bucket when it holds as many. */
  charge(tenant: string, tokensPerMinute: number, numTokens: number): MaybePromise<TokenCharge>
  /** Gives `numTokens` back to the tenant's bucket (never past full); best effort. */
  refund(tenant: string, tokensPerMinute: number, numTokens: number): void
  /** The tenants' virtual token counters the fair queue orders its backlogs by. */
  readonly service: ServiceCounters
  /** Asserts the store's invariants (tests call it after every operation). */
  check(): void
  /** Stops timers and connections. */
  close(): void
}

/** The fair queue's virtual token counters (VTC, fair-queue.ts), one per tenant, in weighted
 *  tokens ÷ the tenant's weight; a tenant never served counts 0. A counter never falls: it grows
 *  by {@link ServiceCounters.add} (service given) and {@link ServiceCounters.raiseTo} (VTC's lift).
 *  Every call answers at once (the fair queue decides on the hot path); a store shared across the
 *  network answers from its local view (redis-limits.ts). */
export interface ServiceCounters {
  /** The tenant's counter as this router sees it now. */
  counterOf(tenant: string): number
  /** Adds `amount` (≥ 0, finite) to the tenant's counter. */
  add(tenant: string, amount: number): void
  /** Raises the tenant's counter to `floor` when it is below (VTC's lift). */
  raiseTo(tenant: string, floor: number): void
  /** Asserts the counters' invariants. */
  check(): void
}

/** Service counters in this process's memory. */
export function createLocalServiceCounters(): ServiceCounters {
  const counters = new Map<string, number>() // tenant → counter (weighted tokens ÷ weight)
  return {
    counterOf: (tenant) => counters.get(tenant) ?? 0,
    add(tenant, amount) {
      counters.set(tenant, (counters.get(tenant) ?? 0) + amount)
    },
    raiseTo(tenant, floor) {
      if (floor > (counters.get(tenant) ?? 0)) counters.set(tenant, floor)
    },
    check() {
      checkCounters(counters)
    },
  }
}

/** Asserts that every counter of `counters` (tenant → counter) is finite and ≥ 0. */
export function checkCounters(counters: ReadonlyMap<string, number>): void {
  for (const [tenant, n] of counters) {
    assert.ok(Number.isFinite(n) && n >= 0, `tenant ${tenant}'s service counter is ${n}`)
  }
}

interface Bucket {
  tokens: number
  updatedMs: number
}

/** The in-process {@link LimitStore}: answers at once. `nowMs` is injectable for tests. */
export function createLocalLimitStore(nowMs: () => number = () => performance.now()): LimitStore {
  const running = new Map<string, number>() // tenant → concurrency units held
  const buckets = new Map<string, Bucket>() // tenant → token bucket (tokensPerMinute)
  const service = createLocalServiceCounters()

  /** The tenant's bucket, refilled for the time since it was last touched. */
  function refill(tenant: string, tokensPerMinute: number): Bucket {
    const now = nowMs()
    let bucket = buckets.get(tenant)
    if (bucket === undefined) {
      bucket = { tokens: tokensPerMinute, updatedMs: now }
      buckets.set(tenant, bucket)
    }
    const perMs = tokensPerMinute / 60_000
    bucket.tokens = Math.min(tokensPerMinute, bucket.tokens + (now - bucket.updatedMs) * perMs)
    bucket.updatedMs = now
    return bucket
  }

  return {
    acquire(tenant, maxConcurrent) {
      const numRunning = running.get(tenant) ?? 0
      if (maxConcurrent !== undefined && numRunning >= maxConcurrent)
        return { isGranted: false, numRunning }
      running.set(tenant, numRunning + 1)
      let isReleased = false
      return {
        isGranted: true,
        release() {
          if (isReleased) return
          isReleased = true
          const n = running.get(tenant)! - 1
          if (n === 0) running.delete(tenant)
          else running.set(tenant, n)
        },
      }
    },
    charge(tenant, tokensPerMinute, numTokens) {
      const bucket = refill(tenant, tokensPerMinute)
      if (bucket.tokens < numTokens) return { isCharged: false, numTokensLeft: bucket.tokens }
      bucket.tokens -= numTokens
      return { isCharged: true }
    },
    refund(tenant, tokensPerMinute, numTokens) {
      const bucket = refill(tenant, tokensPerMinute)
      bucket.tokens = Math.min(tokensPerMinute, bucket.tokens + numTokens)
    },
    service,
    check() {
      for (const [tenant, n] of running) assert.ok(n > 0, `tenant ${tenant} counts ${n} requests`)
      service.check()
    },
    close() {},
  }
}

/** `f(value)` now when `value` is here, else once it is: keeps an in-process store's answers
 *  synchronous. `onError` (default: rethrow) sees what `value` rejects with or `f` throws. */
export function thenOf<T, U>(
  value: MaybePromise<T>,
  f: (v: T) => MaybePromise<U>,
  onError: (err: unknown) => never = (err) => {
    throw err
  },
): MaybePromise<U> {
  if (value instanceof Promise) return value.then(f).catch(onError)
  try {
    return f(value)
  } catch (err) {
    return onError(err)
  }
}
