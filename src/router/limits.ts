/** Load limits in front of the workers: per-tenant concurrency and token rate (→ 429), and one
 *  bounded FIFO queue for the whole router (→ 503 when full or waited on too long). Every refusal
 *  says how long to wait (`Retry-After`), or that waiting cannot help.
 *  Knows tenant names, token counts and time; knows nothing of HTTP bodies, workers or keys. */
import assert from 'node:assert/strict'
import { KvfenceError } from '../errors.js'
import { type LimitStore, type MaybePromise, createLocalLimitStore, thenOf } from './limit-store.js'
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
  /** Admits a request of `tenant` that may use `numRequestedTokens` tokens (prompt + max completion);
   *  throws {@link LimitError} `rate_limited` (429) when the tenant is at its concurrency limit or
   *  out of tokens for now. */
  admitTenant(
    tenant: string,
    limits: TenantLimits,
    numRequestedTokens: number,
    hold?: RoomHold,
  ): MaybePromise<TenantTicket>
  /** Counts a request of `tenant` against its concurrency limit from now (before its prompt is
   *  tokenized), or throws what {@link Limiter.admitTenant} would for that limit: a tenant at its
   *  limit cannot make the router's event loop, which every tenant shares, tokenize prompts that
   *  will be refused anyway, and prompts being tokenized count as in flight. Pass the hold to
   *  `admitTenant`; release it if the request ends before that. */
  holdTenantRoom(tenant: string, limits: TenantLimits): MaybePromise<RoomHold>
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

/** A {@link Limiter} whose tenant limits are counted in this process: it answers at once. */
export interface LocalLimiter extends Limiter {
  admitTenant(
    tenant: string,
    limits: TenantLimits,
    numRequestedTokens: number,
    hold?: RoomHold,
  ): TenantTicket
  holdTenantRoom(tenant: string, limits: TenantLimits): RoomHold
}

/** A {@link Limiter} counting tenants' limits in `store` (default: this process's memory, see
 *  limit-store.ts). `nowMs` is injectable for tests (default `performance.now`). */
export function createLimiter(queue?: QueueLimits, nowMs?: () => number): LocalLimiter
export function createLimiter(queue: QueueLimits, nowMs: () => number, store: LimitStore): Limiter
export function createLimiter(
  queue: QueueLimits = queueLimitDefaults,
  nowMs: () => number = () => performance.now(),
  store: LimitStore = createLocalLimitStore(nowMs),
): Limiter {
  const tenants = createTenantLimiter(store)
  const slots = createSlotQueue(queue)
  return {
    admitTenant: tenants.admitTenant,
    holdTenantRoom: tenants.holdTenantRoom,
    acquireSlot: slots.acquireSlot,
    waitForRoom: slots.waitForRoom,
    get numQueued() {
      return slots.numQueued()
    },
    get numRunning() {
      return slots.numRunning()
    },
    maxQueueWaitMs: queue.maxQueueWaitMs,
    check(): void {
      slots.check()
      store.check()
    },
  }
}

// ---------------------------------------------------------------------------------------------
// Per tenant: concurrency and token rate

/** The tenant half of a {@link Limiter}: requests in flight and a token bucket per tenant,
 *  counted in `store`. */
function createTenantLimiter(store: LimitStore) {
  function holdTenantRoom(tenant: string, limits: TenantLimits): MaybePromise<RoomHold> {
    const maxConcurrent = limits.maxConcurrentRequests
    return thenOf(store.acquire(tenant, maxConcurrent), (grant) => {
      if (!grant.isGranted) {
        throw new LimitError(
          'rate_limited',
          `Rate limit reached: ${grant.numRunning} requests in flight, the limit of your key is ${maxConcurrent} at once.`,
          1,
        )
      }
      return once(() => grant.release())
    })
  }

  function admitTenant(
    tenant: string,
    limits: TenantLimits,
    numRequestedTokens: number,
    hold?: RoomHold,
  ): MaybePromise<TenantTicket> {
    return thenOf(hold ?? holdTenantRoom(tenant, limits), (room) => {
      const tpm = limits.tokensPerMinute
      const refused = (err: unknown): never => {
        if (hold === undefined) room.release() // ours: a refused request is not in flight
        throw err
      }
      if (tpm === undefined) return ticketOf(room, () => {})
      let charging: MaybePromise<number>
      try {
        charging = chargeTokens(store, tenant, tpm, numRequestedTokens)
      } catch (err) {
        return refused(err)
      }
      return thenOf(
        charging,
        (numCharged) =>
          ticketOf(room, (numUnusedTokens) => {
            const numRefunded = Math.min(numCharged, numUnusedTokens)
            if (numRefunded > 0) store.refund(tenant, tpm, numRefunded)
          }),
        refused,
      )
    })
  }

  return { holdTenantRoom, admitTenant }
}

/** Takes `numRequestedTokens` from the tenant's bucket (of `tpm` tokens per minute, in `store`)
 *  and returns them; throws `rate_limited` with the wait that refills enough, or with none when
 *  no wait can. */
function chargeTokens(
  store: LimitStore,
  tenant: string,
  tpm: number,
  numRequestedTokens: number,
): MaybePromise<number> {
  if (numRequestedTokens > tpm) {
    throw new LimitError(
      'rate_limited',
      `Rate limit reached: this request may use ${numRequestedTokens} tokens (prompt + max_tokens), more than the limit of your key, ${tpm} tokens per minute; lower max_tokens or shorten the prompt.`,
      null, // no wait refills a bucket past its size
    )
  }
  return thenOf(store.charge(tenant, tpm, numRequestedTokens), (charge) => {
    if (!charge.isCharged) {
      const waitMs = ((numRequestedTokens - charge.numTokensLeft) * 60_000) / tpm
      throw new LimitError(
        'rate_limited',
        `Rate limit reached: this request may use ${numRequestedTokens} tokens, ${Math.floor(charge.numTokensLeft)} of your key's ${tpm} tokens per minute are left.`,
        Math.max(1, Math.ceil(waitMs / 1000)),
      )
    }
    return numRequestedTokens
  })
}

/** A ticket releasing `room` and then refunding (`refund`) once, however often it is released. */
function ticketOf(room: RoomHold, refund: (numUnusedTokens: number) => void): TenantTicket {
  let isReleased = false
  return {
    release(numUnusedTokens: number): void {
      if (isReleased) return
      isReleased = true
      room.release()
      refund(numUnusedTokens)
    },
  }
}

/** A hold whose `release` runs `release` once, however often it is called. */
function once(release: () => void): RoomHold & Slot {
  let isReleased = false
  return {
    release(): void {
      if (isReleased) return
      isReleased = true
      release()
    },
  }
}

// ---------------------------------------------------------------------------------------------
// Router-wide: running slots and the FIFO queue

/** The router-wide half of a {@link Limiter}. */
function createSlotQueue(queue: QueueLimits) {
  const waiters: Waiter[] = []
  let numRunning = 0
  let roomListeners: (() => void)[] = []

  /** A running slot; releasing it hands it to the next waiter and wakes those waiting for room. */
  function makeSlot(): Slot {
    return once(() => {
      const next = waiters.shift()
      if (next !== undefined)
        next.grant() // the slot passes on; numRunning is unchanged
      else numRunning--
      const listeners = roomListeners
      roomListeners = []
      for (const listener of listeners) listener()
    })
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
    acquireSlot,
    waitForRoom,
    numQueued: () => waiters.length,
    numRunning: () => numRunning,
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
    },
  }
}

function aborted(): KvfenceError {
  return new KvfenceError('request_aborted', 'the client went away while the request waited')
}
