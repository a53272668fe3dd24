/** Load limits in front of the workers: per-tenant concurrency and token rate (→ 429), and one
 *  bounded FIFO queue for the whole router (→ 503 when full or waited on too long). Every refusal
 *  says how long to wait (`Retry-After`), or that waiting cannot help.
 *  Knows tenant names, token counts and time; knows nothing of HTTP bodies, workers or keys. */
import assert from 'node:assert/strict'
import { KvfenceError } from '../errors.js'
import type { TenantLimits } from './tenants.js'

/** A refusal for load, with the seconds the client should wait before trying again, or null
 *  when no wait can help (the request is larger than the tenant's whole limit). */
export class LimitError extends KvfenceError {
  constructor(
    code: 'rate_limited' | 'capacity_exhausted',
    message: string,
    /** Whole seconds for `Retry-After` (≥ 1), or null: retrying the same request cannot succeed. */
    readonly retryAfterSec: number | null,
  ) {
    super(code, message)
    this.name = 'LimitError'
  }
}

/** The router-wide limits. */
export interface QueueLimits {
  /** Requests running on the workers at once; more wait in the queue. */
  readonly maxConcurrentRequests: number
  /** Requests waiting at most; one more → 503 `capacity_exhausted`. */
  readonly maxQueuedRequests: number
  /** Longest wait in the queue (and for a full KV pool to free up), ms; then 503. */
  readonly maxQueueWaitMs: number
}

/** Defaults of {@link QueueLimits}. */
export const queueLimitDefaults: QueueLimits = Object.freeze({
  maxConcurrentRequests: 64,
  maxQueuedRequests: 256,
  maxQueueWaitMs: 30_000,
})

/** What a tenant's admitted request holds until it ends. */
export interface TenantTicket {
  /** Ends the request: frees its concurrency slot and refunds `numUnusedTokens` to the tenant's
   *  token budget. Idempotent. */
  release(numUnusedTokens: number): void
}

/** A running slot of the router-wide limit. */
export interface Slot {
  /** Frees the slot (hands it to the next queued request). Idempotent. */
  release(): void
}

/** A request counted against its tenant's concurrency limit; `release` (idempotent) stops
 *  counting it. */
export interface RoomHold {
  release(): void
}

/** The limiter: one per router. */
export interface Limiter {
  /** Admits a request of `tenant` that may use `numTokens` tokens (prompt + max completion);
   *  throws {@link LimitError} `rate_limited` (429) when the tenant is at its concurrency limit or
   *  out of tokens for now. */
  admitTenant(
    tenant: string,
    limits: TenantLimits,
    numTokens: number,
    hold?: RoomHold,
  ): TenantTicket
  /** Counts a request of `tenant` against its concurrency limit from now (before its prompt is
   *  tokenized), or throws what {@link Limiter.admitTenant} would for that limit: a tenant at its
   *  limit cannot make the router's event loop, which every tenant shares, tokenize prompts that
   *  will be refused anyway, and prompts being tokenized count as in flight. Pass the hold to
   *  `admitTenant`; release it if the request ends before that. */
  holdTenantRoom(tenant: string, limits: TenantLimits): RoomHold
  /** A running slot, at once or after waiting in the queue; throws {@link LimitError}
   *  `capacity_exhausted` (503) when the queue is full or the wait exceeds `maxQueueWaitMs`,
   *  and `request_aborted` when `signal` fires first. */
  acquireSlot(signal: AbortSignal): Promise<Slot>
  /** Resolves when a running request ends, or after `maxMs`, whichever is first (for retrying a
   *  request that found the KV pool full); rejects `request_aborted` when `signal` fires. */
  waitForRoom(maxMs: number, signal: AbortSignal): Promise<void>
  /** Requests waiting in the queue. */
  readonly numQueued: number
  /** Requests holding a running slot. */
  readonly numRunning: number
  /** {@link QueueLimits.maxQueueWaitMs}. */
  readonly maxQueueWaitMs: number
  /** Asserts the invariants (tests call it after every operation). */
  check(): void
}

interface Waiter {
  grant(): void
}

interface Bucket {
  tokens: number
  updatedMs: number
}

/** A {@link Limiter}. `nowMs` is injectable for tests (default `performance.now`). */
export function createLimiter(
  queue: QueueLimits = queueLimitDefaults,
  nowMs: () => number = () => performance.now(),
): Limiter {
  const running = new Map<string, number>() // tenant → requests in flight
  const buckets = new Map<string, Bucket>() // tenant → token bucket (tokensPerMinute)
  const waiters: Waiter[] = []
  let numRunning = 0
  let roomListeners: (() => void)[] = []

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

  function holdTenantRoom(tenant: string, limits: TenantLimits): RoomHold {
    const numRunningOfTenant = running.get(tenant) ?? 0
    const maxConcurrent = limits.maxConcurrentRequests
    if (maxConcurrent !== undefined && numRunningOfTenant >= maxConcurrent) {
      throw new LimitError(
        'rate_limited',
        `Rate limit reached: ${numRunningOfTenant} requests in flight, the limit of your key is ${maxConcurrent} at once.`,
        1,
      )
    }
    running.set(tenant, numRunningOfTenant + 1)
    let isReleased = false
    return {
      release(): void {
        if (isReleased) return
        isReleased = true
        const n = running.get(tenant)! - 1
        if (n === 0) running.delete(tenant)
        else running.set(tenant, n)
      },
    }
  }

  function admitTenant(
    tenant: string,
    limits: TenantLimits,
    numTokens: number,
    hold?: RoomHold,
  ): TenantTicket {
    const room = hold ?? holdTenantRoom(tenant, limits)
    try {
      return chargeTokens(tenant, limits, numTokens, room)
    } catch (err) {
      if (hold === undefined) room.release() // ours: a refused request is not in flight
      throw err
    }
  }

  function chargeTokens(
    tenant: string,
    limits: TenantLimits,
    numTokens: number,
    room: RoomHold,
  ): TenantTicket {
    const tpm = limits.tokensPerMinute
    let charged = 0
    if (tpm !== undefined) {
      if (numTokens > tpm) {
        throw new LimitError(
          'rate_limited',
          `Rate limit reached: this request may use ${numTokens} tokens (prompt + max_tokens), more than the limit of your key, ${tpm} tokens per minute; lower max_tokens or shorten the prompt.`,
          null, // no wait refills a bucket past its size
        )
      }
      const bucket = refill(tenant, tpm)
      if (bucket.tokens < numTokens) {
        const waitMs = ((numTokens - bucket.tokens) * 60_000) / tpm
        throw new LimitError(
          'rate_limited',
          `Rate limit reached: this request may use ${numTokens} tokens, ${Math.floor(bucket.tokens)} of your key's ${tpm} tokens per minute are left.`,
          Math.max(1, Math.ceil(waitMs / 1000)),
        )
      }
      bucket.tokens -= numTokens
      charged = numTokens
    }
    let isReleased = false
    return {
      release(numUnusedTokens: number): void {
        if (isReleased) return
        isReleased = true
        room.release()
        if (tpm !== undefined && charged > 0) {
          const bucket = refill(tenant, tpm)
          bucket.tokens = Math.min(tpm, bucket.tokens + Math.min(charged, numUnusedTokens))
        }
      },
    }
  }

  function makeSlot(): Slot {
    let isReleased = false
    return {
      release(): void {
        if (isReleased) return
        isReleased = true
        const next = waiters.shift()
        if (next !== undefined)
          next.grant() // the slot passes on; numRunning is unchanged
        else numRunning--
        const listeners = roomListeners
        roomListeners = []
        for (const listener of listeners) listener()
      },
    }
  }

  function acquireSlot(signal: AbortSignal): Promise<Slot> {
    if (signal.aborted) return Promise.reject(aborted())
    if (numRunning < queue.maxConcurrentRequests) {
      numRunning++
      return Promise.resolve(makeSlot())
    }
    if (waiters.length >= queue.maxQueuedRequests) {
      return Promise.reject(
        new LimitError(
          'capacity_exhausted',
          `The server is busy: ${numRunning} requests running and ${waiters.length} queued; retry later.`,
          1,
        ),
      )
    }
    return new Promise<Slot>((resolve, reject) => {
      const leave = () => {
        clearTimeout(timer)
        signal.removeEventListener('abort', onAbort)
        const i = waiters.indexOf(waiter)
        if (i !== -1) waiters.splice(i, 1)
      }
      const waiter: Waiter = {
        grant() {
          leave()
          resolve(makeSlot())
        },
      }
      const onAbort = () => {
        leave()
        reject(aborted())
      }
      const timer = setTimeout(() => {
        leave()
        reject(
          new LimitError(
            'capacity_exhausted',
            `The server is busy: the request waited ${queue.maxQueueWaitMs} ms in the queue; retry later.`,
            1,
          ),
        )
      }, queue.maxQueueWaitMs)
      signal.addEventListener('abort', onAbort, { once: true })
      waiters.push(waiter)
    })
  }

  function waitForRoom(maxMs: number, signal: AbortSignal): Promise<void> {
    if (signal.aborted) return Promise.reject(aborted())
    return new Promise<void>((resolve, reject) => {
      const done = () => {
        clearTimeout(timer)
        signal.removeEventListener('abort', onAbort)
        roomListeners = roomListeners.filter((l) => l !== done)
        resolve()
      }
      const onAbort = () => {
        clearTimeout(timer)
        roomListeners = roomListeners.filter((l) => l !== done)
        reject(aborted())
      }
      const timer = setTimeout(done, Math.max(0, maxMs))
      signal.addEventListener('abort', onAbort, { once: true })
      roomListeners.push(done)
    })
  }

  return {
    admitTenant,
    holdTenantRoom,
    acquireSlot,
    waitForRoom,
    get numQueued() {
      return waiters.length
    },
    get numRunning() {
      return numRunning
    },
    maxQueueWaitMs: queue.maxQueueWaitMs,
    check(): void {
      assert.ok(
        numRunning >= 0 && numRunning <= queue.maxConcurrentRequests,
        `running ${numRunning} outside [0, ${queue.maxConcurrentRequests}]`,
      )
      assert.ok(
        waiters.length <= queue.maxQueuedRequests,
        `queued ${waiters.length} > ${queue.maxQueuedRequests}`,
      )
      assert.ok(
        waiters.length === 0 || numRunning === queue.maxConcurrentRequests,
        `${waiters.length} requests queued while only ${numRunning} of ${queue.maxConcurrentRequests} slots run`,
      )
      for (const [tenant, n] of running) assert.ok(n > 0, `tenant ${tenant} counts ${n} requests`)
    },
  }
}

function aborted(): KvfenceError {
  return new KvfenceError('request_aborted', 'the client went away while the request waited')
}
