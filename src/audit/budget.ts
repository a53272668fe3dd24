/** The audit's budget: at most `maxRequests` requests, `concurrency` of them in flight, all within
 *  `maxSeconds`. Every request the auditor sends goes through `Budget.spend`, which reserves the
 *  request before it is sent, so no limit is ever exceeded, even by one.
 *  Knows nothing of HTTP. */
import type { BudgetLimits } from './types.js'

/** Thrown instead of sending a request the budget does not allow. */
export class BudgetExhaustedError extends Error {
  constructor(readonly reason: 'requests' | 'seconds') {
    super(reason === 'requests' ? 'request budget exhausted' : 'time budget exhausted')
    this.name = 'BudgetExhaustedError'
  }
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
  private numSent = 0
  private numInFlight = 0
  private mostInFlight = 0
  /** Requests in flight at most now: `limits.concurrency`, raised up to `limits.maxConcurrency`
   *  by {@link withInFlightLimit} for a probe that ramps. */
  private inFlightLimit: number
  private readonly waiting: (() => void)[] = []

  constructor(limits: BudgetLimits, now: number = Date.now()) {
    this.limits = Object.freeze({ ...limits })
    this.startedAt = now
    this.deadline = now + limits.maxSeconds * 1000
    this.inFlightLimit = limits.concurrency
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

  get remainingRequests(): number {
    return this.limits.maxRequests - this.numSent
  }

  /** Milliseconds left before the deadline (never negative). */
  get remainingMs(): number {
    return Math.max(0, this.deadline - Date.now())
  }

  /** Runs `send` as one request: waits for a concurrency slot, then reserves one request and
   *  passes the time left (ms) so the request can be cut at the deadline, and the request's
   *  number (1 for the audit's first request). */
  async spend<T>(send: (remainingMs: number, requestNumber: number) => Promise<T>): Promise<T> {
    await this.acquireSlot()
    try {
      if (this.numSent >= this.limits.maxRequests) throw new BudgetExhaustedError('requests')
      const remainingMs = this.remainingMs
      if (remainingMs <= 0) throw new BudgetExhaustedError('seconds')
      this.numSent++
      return await send(remainingMs, this.numSent)
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
