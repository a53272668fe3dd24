/** Where a tenant's limits are counted: its requests in flight (concurrency units) and its token
 *  bucket (tokens per minute). One interface, two stores: this process's memory (the default, a
 *  single router) and Redis (redis-limits.ts: several router replicas share each tenant's limits).
 *  The limiter (limits.ts) decides what a refusal says; a store only counts.
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
  /** Asserts the store's invariants (tests call it after every operation). */
  check(): void
  /** Stops timers and connections. */
  close(): void
}

interface Bucket {
  tokens: number
  updatedMs: number
}

/** The in-process {@link LimitStore}: answers at once. `nowMs` is injectable for tests. */
export function createLocalLimitStore(nowMs: () => number = () => performance.now()): LimitStore {
  const running = new Map<string, number>() // tenant → concurrency units held
  const buckets = new Map<string, Bucket>() // tenant → token bucket (tokensPerMinute)

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
    check() {
      for (const [tenant, n] of running) assert.ok(n > 0, `tenant ${tenant} counts ${n} requests`)
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
