/** Load limits in front of the workers: per-tenant concurrency and token rate (→ 429), and one
 *  bounded queue for the whole router, fair between tenants (→ 503 when full or waited on too
 *  long; fair-queue.ts). Every refusal says how long to wait (`Retry-After`), or that waiting
 *  cannot help.
 *  Knows tenant names, token counts and time; knows nothing of HTTP bodies, workers or keys. */
import { LimitError } from './limit-error.js'
import {
  type QueueLimits,
  type RoomTurn,
  type Slot,
  type SlotClaim,
  queueLimitDefaults,
} from './queue-limits.js'
import { createFairQueue } from './fair-queue.js'
import { type LimitStore, type MaybePromise, createLocalLimitStore, thenOf } from './limit-store.js'
import type { TenantLimits } from '../tenants/tenants.js'

/** What a tenant's admitted request holds until it ends. */
export interface TenantTicket {
  /** Ends the request: frees its concurrency slot and refunds `numUnusedTokens` to the tenant's
   *  token budget. Idempotent. */
  release(numUnusedTokens: number): void
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
  /** A running slot, at once or after waiting in its tenant's queue (fair-queue.ts; `claim`
   *  defaults to one anonymous tenant); throws {@link LimitError} `capacity_exhausted` (503) when
   *  the queue is full (or a newcomer of a tenant with fewer queued took this request's place) or
   *  the wait exceeds `maxQueueWaitMs`, and `request_aborted` when `signal` fires first. `signal`
   *  names the request for {@link Limiter.waitForRoom}: the two waits share one bound. */
  acquireSlot(signal: AbortSignal, claim?: SlotClaim): Promise<Slot>
  /** The request's turn to ask the workers for KV room: at once when `hasFoundPoolFull` is false
   *  and no request waits for room, else once a running request ends (or the poll), the turn
   *  going to the waiting tenant with the least service (VTC, as for slots), first come first
   *  served within a tenant; rejects {@link LimitError} `capacity_exhausted` when the request's wait
   *  in all (from its `acquireSlot`) reaches `maxQueueWaitMs`, `request_aborted` when `signal`
   *  fires. End the turn when the attempt knows whether it got room. */
  waitForRoom(signal: AbortSignal, hasFoundPoolFull: boolean): Promise<RoomTurn>
  /** Requests waiting in the queue. */
  readonly numQueued: number
  /** Requests holding a running slot. */
  readonly numRunning: number
  /** Requests waiting for room in a full KV pool. */
  readonly numWaitingForRoom: number
  /** Queued requests by tenant (tenants with some queued only). */
  numQueuedByTenant(): Map<string, number>
  /** {@link QueueLimits.maxQueueWaitMs}. */
  readonly maxQueueWaitMs: number
  /** Asserts the invariants (tests call it after every operation). */
  check(): void
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

/** A {@link Limiter} counting tenants' limits and the fair queue's service counters in `store`
 *  (default: this process's memory, see limit-store.ts). `nowMs` is injectable for tests (default `performance.now`). */
export function createLimiter(queue?: QueueLimits, nowMs?: () => number): LocalLimiter
export function createLimiter(queue: QueueLimits, nowMs: () => number, store: LimitStore): Limiter
export function createLimiter(
  queue: QueueLimits = queueLimitDefaults,
  nowMs: () => number = () => performance.now(),
  store: LimitStore = createLocalLimitStore(nowMs),
): Limiter {
  const tenants = createTenantLimiter(store)
  const slots = createFairQueue(queue, nowMs, store.service)
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
    get numWaitingForRoom() {
      return slots.numWaitingForRoom()
    },
    numQueuedByTenant: slots.numQueuedByTenant,
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
function once(release: () => void): RoomHold {
  let isReleased = false
  return {
    release(): void {
      if (isReleased) return
      isReleased = true
      release()
    },
  }
}
