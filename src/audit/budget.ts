/** The audit's budget: at most `maxRequests` requests, `concurrency` of them in flight, all within
 *  `maxSeconds`. Every request the auditor sends goes through `Budget.spend`, which reserves the
 *  request before it is sent, so no limit is ever exceeded, even by one. While a probe runs, the
 *  shares of the probes after it (plan.ts) are held back ({@link Budget.holdBack}): a probe may
 *  spend what earlier ones left, never what later ones were given.
 *  Knows nothing of HTTP. */
import { maxTimerSeconds } from '../common/timer-limit.js'
import { setMaxListeners } from 'node:events'
import type { BudgetLimits } from './types.js'

/** The shortest time budget (s): discovery alone needs a few round trips; less ended in an
 *  "internal error" or a false "cannot reach" when the deadline fell inside them. */
export const minAuditSeconds = 1
/** The longest time budget (s): the budget's deadline is a Node.js timer, which holds at most
 *  2^31 − 1 ms; a longer one fires after 1 ms (Node's TimeoutOverflowWarning), and every probe
 *  then ended inconclusive at once: an audit of a leaking endpoint exited 0. */
export const maxAuditSeconds = maxTimerSeconds

/** Thrown instead of sending a request the budget does not allow: its requests or its time are
 *  spent, the audit was `stopped` (interrupted: SIGINT, SIGTERM), or the budget was `closed`
 *  because the target was seen to answer no completion (gate.ts). */
export class BudgetExhaustedError extends Error {
  constructor(readonly reason: 'requests' | 'seconds' | 'stopped' | 'closed') {
    super(
      reason === 'requests'
        ? 'request budget exhausted'
        : reason === 'seconds'
          ? 'time budget exhausted'
          : reason === 'stopped'
            ? 'the audit was interrupted'
            : 'the audit stopped: the target answers no completion',
    )
    this.name = 'BudgetExhaustedError'
  }
}

/** Where a resumed audit's numbering starts: the requests an earlier run already sent and the
 *  milliseconds it lasted, so that request numbers stay unique and times increasing across runs. */
export interface BudgetOrigin {
  readonly requestsBefore: number
  readonly msBefore: number
}

/** Runs `work` until it is done or the budget stops it: resolves `null` when it finished, or the
 *  {@link BudgetExhaustedError}'s message when the budget ran out part-way (what was sent until
 *  then stays observed, so a probe can judge what it has). Rethrows any other error. */
export async function runUntilExhausted(work: () => Promise<void>): Promise<string | null> {
  try {
    await work()
    return null
  } catch (err) {
    if (!(err instanceof BudgetExhaustedError)) throw err
    return err.message
  }
}

export class Budget {
  readonly limits: BudgetLimits
  readonly startedAt: number // epoch ms
  readonly deadline: number // epoch ms
  /** Epoch ms that times in the report count from (`startedAt` less an earlier run's length). */
  readonly timeOrigin: number
  private readonly requestsBefore: number
  /** Aborted by {@link stop}: requests in flight are cut at once. */
  private readonly stopper = new AbortController()
  private isClosedNow = false
  /** Requests and milliseconds held back for the probes still to run. */
  private heldRequests = 0
  private heldMs = 0
  private numSent = 0
  private numRefusedNow = 0
  private numEndedOutOfTimeNow = 0
  private numInFlight = 0
  private mostInFlight = 0
  /** Requests in flight at most now: `limits.concurrency`, raised up to `limits.maxConcurrency`
   *  by {@link withInFlightLimit} for a probe that ramps. */
  private inFlightLimit: number
  private readonly waiting: (() => void)[] = []

  constructor(
    limits: BudgetLimits,
    now: number = Date.now(),
    origin: BudgetOrigin = { requestsBefore: 0, msBefore: 0 },
  ) {
    this.limits = Object.freeze({ ...limits })
    this.startedAt = now
    this.deadline = now + limits.maxSeconds * 1000
    this.timeOrigin = now - origin.msBefore
    this.requestsBefore = origin.requestsBefore
    this.inFlightLimit = limits.concurrency
    // Every request in flight listens for a stop: as many as the largest concurrency allowed.
    setMaxListeners(0, this.stopper.signal)
  }

  /** Ends the budget now (the audit was interrupted): nothing more is sent, {@link remainingMs}
   *  is 0 and {@link stopped} aborts, which cuts the requests in flight. */
  stop(): void {
    this.stopper.abort()
  }

  /** Sends nothing more from now on, but lets the requests in flight end as they will (unlike
   *  {@link stop}, nothing is cut: their answers are what the audit's tool error reports). */
  close(): void {
    this.isClosedNow = true
  }

  /** True once {@link close} was called. */
  get isClosed(): boolean {
    return this.isClosedNow
  }

  /** Aborts when {@link stop} is called. */
  get stopped(): AbortSignal {
    return this.stopper.signal
  }

  get isStopped(): boolean {
    return this.stopper.signal.aborted
  }

  /** The most requests `limits.maxConcurrency` allows in flight (`limits.concurrency` when it
   *  is not given). */
  get maxInFlightLimit(): number {
    return Math.max(this.limits.concurrency, this.limits.maxConcurrency ?? this.limits.concurrency)
  }

  /** The most requests that were in flight at once since the last {@link takeMostInFlight}. */
  takeMostInFlight(): number {
    const most = this.mostInFlight
    this.mostInFlight = this.numInFlight
    return most
  }

  /** Runs `work` with up to `limit` requests in flight (capped by {@link maxInFlightLimit}), then
   *  restores `limits.concurrency`. For probes that ramp their load; probes run one at a time. */
  async withInFlightLimit<T>(limit: number, work: () => Promise<T>): Promise<T> {
    this.inFlightLimit = Math.min(limit, this.maxInFlightLimit)
    try {
      return await work()
    } finally {
      this.inFlightLimit = this.limits.concurrency
    }
  }

  get requestsSent(): number {
    return this.numSent
  }

  /** Requests the running probe may still send: the budget's, less what is held back for the
   *  probes after it (never negative). */
  /** Requests refused so far for want of requests or time (a probe whose count rose while it ran
   *  was stopped by the budget; one that spent exactly its share was not). */
  get numRefused(): number {
    return this.numRefusedNow
  }

  /** Requests that ended when the running probe's time was up ({@link remainingMs} 0): cut by
   *  their deadline, or answered just then; either way the time, not the probe, may have ended
   *  them. A probe whose count did not rise while it ran was not cut by its time, even when its
   *  time was up as it returned (the first probe's share is a fraction of a second, which
   *  discovery on a busy host can spend before it starts). */
  get numEndedOutOfTime(): number {
    return this.numEndedOutOfTimeNow
  }

  get remainingRequests(): number {
    return Math.max(0, this.limits.maxRequests - this.numSent - this.heldRequests)
  }

  /** Requests left in the whole budget, held back or not. */
  get unspentRequests(): number {
    return this.limits.maxRequests - this.numSent
  }

  /** Milliseconds the running probe has left: to the deadline, less what is held back for the
   *  probes after it (never negative; 0 once stopped). */
  get remainingMs(): number {
    return this.isStopped ? 0 : Math.max(0, this.deadline - this.heldMs - Date.now())
  }

  /** Milliseconds left before the whole budget's deadline (0 once stopped). */
  get unspentMs(): number {
    return this.isStopped ? 0 : Math.max(0, this.deadline - Date.now())
  }

  /** Holds `requests` and `ms` back from what {@link spend} lets the running probe use: the
   *  shares of the probes after it. `holdBack(0, 0)` releases everything. */
  holdBack(requests: number, ms: number): void {
    this.heldRequests = Math.max(0, requests)
    this.heldMs = Math.max(0, ms)
  }

  /** Runs `send` as one request: waits for a concurrency slot, then reserves one request and
   *  passes the time left (ms) so the request can be cut at the deadline, and the request's
   *  number (1 for the audit's first request; after an earlier run's requests when resumed). */
  async spend<T>(send: (remainingMs: number, requestNumber: number) => Promise<T>): Promise<T> {
    await this.acquireSlot()
    try {
      if (this.isStopped) throw new BudgetExhaustedError('stopped')
      if (this.isClosedNow) throw new BudgetExhaustedError('closed')
      if (this.numSent + this.heldRequests >= this.limits.maxRequests) {
        this.numRefusedNow++
        throw new BudgetExhaustedError('requests')
      }
      const remainingMs = this.remainingMs
      if (remainingMs <= 0) {
        this.numRefusedNow++
        throw new BudgetExhaustedError('seconds')
      }
      this.numSent++
      try {
        return await send(remainingMs, this.requestsBefore + this.numSent)
      } finally {
        if (this.remainingMs <= 0) this.numEndedOutOfTimeNow++
      }
    } finally {
      this.releaseSlot()
    }
  }

  private async acquireSlot(): Promise<void> {
    if (this.numInFlight < this.inFlightLimit) {
      this.numInFlight++
      this.mostInFlight = Math.max(this.mostInFlight, this.numInFlight)
      return
    }
    // The releasing request hands its slot over directly: numInFlight stays the same.
    await new Promise<void>((resolve) => this.waiting.push(resolve))
  }

  private releaseSlot(): void {
    const next = this.waiting.shift()
    if (next) next()
    else this.numInFlight--
  }
}
