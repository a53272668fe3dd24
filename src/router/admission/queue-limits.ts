/** The router-wide queue's settings and what it hands out: a running slot for a claim, and a
 *  turn at the workers' KV room. Below both the limiter (limits.ts), which takes them, and the
 *  fair queue (fair-queue.ts), which implements them.
 *  Knows counts, weights and milliseconds; knows nothing of tenants' limits, HTTP or workers. */

/** The router-wide limits. */
export interface QueueLimits {
  /** Requests running on the workers at once; more wait in the queue. */
  readonly maxConcurrentRequests: number
  /** Requests waiting at most; one more → 503 `capacity_exhausted`. */
  readonly maxQueuedRequests: number
  /** Of the `maxConcurrentRequests` slots, the last this many are taken only by a request whose
   *  tenant has none running (fair-queue.ts), so that another tenant's first request need not
   *  wait for a busy tenant's request to end; 0: none. At most `maxConcurrentRequests − 1` take
   *  effect (one slot stays open to every tenant). Default 1 ({@link queueLimitDefaults}). */
  readonly reservedSlots?: number
  /** Longest a request waits in all, ms: in the queue and for a full KV pool to free up,
   *  together; then 503. */
  readonly maxQueueWaitMs: number
  /** How often the first request waiting for KV room tries again when no request ends, ms
   *  (default `roomPollMs` of fair-queue.ts); tests that assert orders set it past their length. */
  readonly roomPollMs?: number
}

/** Defaults of {@link QueueLimits}. */
export const queueLimitDefaults = Object.freeze({
  maxConcurrentRequests: 64,
  maxQueuedRequests: 256,
  // One is enough for a newcomer's first request to start at once; a second newcomer at the
  // same moment waits for the next slot to free, as all did without.
  reservedSlots: 1,
  maxQueueWaitMs: 30_000,
}) satisfies QueueLimits

/** A running slot of the router-wide limit. */
export interface Slot {
  /** Frees the slot (hands it to the next queued request), counting `numGeneratedTokens`
   *  (default 0) to its tenant's service. Idempotent. */
  release(numGeneratedTokens?: number): void
}

/** Who asks for a running slot: the tenant whose queue it waits in, the tenant's weight (its
 *  share of the service against other backlogged tenants, > 0) and the prompt's token count
 *  (charged to the tenant's service when the slot is granted). */
export interface SlotClaim {
  readonly tenant: string
  readonly weight: number
  readonly numPromptTokens: number
}

/** A request's turn to ask the workers for KV room. */
export interface RoomTurn {
  /** Ends the turn: `isRefused` when the pool was still full (the request waits again), else the
   *  turn passes to the next request waiting for room. Idempotent. */
  end(isRefused: boolean): void
}
