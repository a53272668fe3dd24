/** The router's drain: on a stop request it refuses new work (503, `/health` 503 so a load
 *  balancer moves away), lets the generations already running finish for a bounded time, then
 *  ends what is left with an error the client sees (an SSE error event, or a 503 body).
 *  Knows how many generations run and the drain's phase; knows nothing of HTTP routes or workers.
 *
 *  Phases (only this file assigns them):
 *    serving ──drain()──▶ draining ──deadline or idle──▶ ended */
import { KvfenceError } from '../common/errors.js'

/** The error of a request refused or ended because the router is stopping (503, Retry-After). */
export class ShuttingDownError extends KvfenceError {
  constructor(message = 'The server is shutting down; retry the request on another instance.') {
    super('shutting_down', message)
  }
}

/** The drain's phase. */
export type DrainPhase = 'serving' | 'draining' | 'ended'

/** One router's drain state; see the module's header. */
export interface Drain {
  readonly phase: DrainPhase
  /** Generations running now. */
  readonly numRunning: number
  /** Counts a generation as running until the returned function is called (once); `end` is
   *  called with a {@link ShuttingDownError} if the drain's time runs out first. */
  enter(end: (reason: ShuttingDownError) => void): () => void
  /** Stops taking work; resolves once every running generation has ended, or `seconds` have
   *  passed and the rest were told to end (then once they have, or `graceMs` later). */
  drain(seconds: number, graceMs?: number): Promise<void>
  /** Stops taking work and tells every running generation to end now (a second stop signal), as
   *  the drain's deadline would; resolves once they have, or `graceMs` later. */
  endNow(graceMs?: number): Promise<void>
  /** Notes that a request arrived (any path): the drain ends only once none has arrived for
   *  {@link quietMs}, so that connections still queued in the listen backlog are answered (503)
   *  rather than reset when the server closes. */
  noteRequest(): void
}

/** The drain ends once no request has arrived for this long, ms... */
const quietMs = 300
/** ...but waits for that quiet at most this long after the last generation ended, ms. */
const maxQuietWaitMs = 3_000

/** How long ended generations get to write their error and close, after the deadline, ms. */
const defaultGraceMs = 2_000

/** A new drain in phase `serving`. */
export function createDrain(): Drain {
  let phase: DrainPhase = 'serving'
  // The running generations' `end`s (a set, not an AbortSignal every request listens to: a
  // long-lived signal keeps a trace of each `AbortSignal.any` made from it).
  const running = new Set<(reason: ShuttingDownError) => void>()
  let lastRequestMs = 0
  const idleWaiters: (() => void)[] = []
  const whenIdle = (): Promise<void> =>
    running.size === 0 ? Promise.resolve() : new Promise((resolve) => idleWaiters.push(resolve))
  const wait = (ms: number) =>
    new Promise<'timeout'>((resolve) => setTimeout(() => resolve('timeout'), ms).unref())
  return {
    get phase() {
      return phase
    },
    get numRunning() {
      return running.size
    },
    enter(end) {
      const entry = (reason: ShuttingDownError) => end(reason)
      running.add(entry)
      return () => {
        if (!running.delete(entry)) return
        if (running.size === 0) for (const resolve of idleWaiters.splice(0)) resolve()
      }
    },
    async drain(seconds, graceMs = defaultGraceMs) {
      if (phase !== 'serving') return whenIdle()
      phase = 'draining'
      const first = await Promise.race([
        whenIdle().then(() => 'idle' as const),
        wait(seconds * 1000),
      ])
      if (first === 'timeout') await endRunning(graceMs)
      const quietBy = Date.now() + maxQuietWaitMs
      while (Date.now() - lastRequestMs < quietMs && Date.now() < quietBy) await wait(quietMs / 3)
      phase = 'ended'
    },
    async endNow(graceMs = defaultGraceMs) {
      if (phase === 'serving') phase = 'draining'
      await endRunning(graceMs)
    },
    noteRequest() {
      lastRequestMs = Date.now()
    },
  }

  /** Tells every running generation to end; resolves once they have, or `graceMs` later. */
  async function endRunning(graceMs: number): Promise<void> {
    const reason = new ShuttingDownError('The server shut down before this request finished.')
    for (const end of [...running]) end(reason)
    await Promise.race([whenIdle(), wait(graceMs)])
  }
}
