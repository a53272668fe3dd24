/** Polling a condition in tests: the state a test waits for (a file re-read, a page released, a
 *  frame received) is reached by another process or a later turn of the event loop, with no
 *  event to await. The timeouts are bounds for a hang, never timing claims. */
import { setTimeout as sleep } from 'node:timers/promises'

/** Options of {@link pollUntil} and {@link waitUntil}. */
export interface PollOptions {
  /** Give up after this long (ms). */
  timeoutMs: number
  /** Pause between two polls (ms). */
  intervalMs: number
}

/** Polls `probe` until it holds: true then, false once `timeoutMs` has passed. A probe that
 *  throws or rejects (a worker not listening yet) counts as not holding. */
export async function pollUntil(
  probe: () => boolean | Promise<boolean>,
  opts: PollOptions,
): Promise<boolean> {
  const deadline = Date.now() + opts.timeoutMs
  for (;;) {
    if (
      await Promise.resolve()
        .then(probe)
        .catch(() => false)
    )
      return true
    if (Date.now() > deadline) return false
    await sleep(opts.intervalMs)
  }
}

/** Polls `probe` as {@link pollUntil} does, and throws `${what} not met within N ms` when it
 *  never holds. */
export async function waitUntil(
  probe: () => boolean | Promise<boolean>,
  opts: PollOptions & { what?: string },
): Promise<void> {
  if (!(await pollUntil(probe, opts)))
    throw new Error(`${opts.what ?? 'condition'} not met within ${opts.timeoutMs} ms`)
}
