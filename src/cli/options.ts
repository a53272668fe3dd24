/** Option parsers shared by the sub-commands: a bad value becomes commander's one-line error,
 *  which names the flag and the value (`error: option '--pages <n>' argument '-1' is invalid.
 *  expected a positive integer, got "-1"`), exit 2. Integers are digits only (no sign, fraction
 *  or exponent) and at most `Number.MAX_SAFE_INTEGER`: past it `Number()` rounds, so a value was
 *  taken as another one. */
import { InvalidArgumentError } from 'commander'
import { maxTimerMs, maxTimerSeconds } from '../common/timer-limit.js'
import { logLevels, workerOptions } from '../engine/worker-options.js'

export { maxTimerMs }

/** A parser of an integer flag in [min, max]; its error says the range (`what` replaces the
 *  default wording, e.g. "a port from 0 to 65535"). */
export function intRangeOption(
  min: number,
  max: number = Number.MAX_SAFE_INTEGER,
  what?: string,
): (value: string) => number {
  const expected = what ?? describeRange(min, max)
  return (value) => {
    const n = /^\d+$/.test(value) ? Number(value) : NaN
    if (!(Number.isSafeInteger(n) && n >= min && n <= max))
      throw new InvalidArgumentError(`expected ${expected}, got "${value}"`)
    return n
  }
}

function describeRange(min: number, max: number): string {
  if (max !== Number.MAX_SAFE_INTEGER) return `an integer from ${min} to ${max}`
  if (min === 0) return 'a non-negative integer'
  if (min === 1) return 'a positive integer'
  return `an integer ≥ ${min}`
}

/** Parse a non-negative integer flag value. */
export const intOption = intRangeOption(0)

/** Parse a count that must be at least 1 (pages, tokens per page, a context window). */
export const positiveIntOption = intRangeOption(1)

/** Parse a TCP port flag: an integer from 0 (the system picks one) to 65535. */
export const portOption = intRangeOption(0, 65535, 'a port from 0 to 65535')

/** Parse a timeout in whole seconds, 0 to what a Node.js timer can wait (`maxTimerMs`). */
export const secondsOption = intRangeOption(0, maxTimerSeconds)

/** Parse a timeout in milliseconds, 1 to what a Node.js timer can wait (`maxTimerMs`). */
export const msOption = intRangeOption(1, maxTimerMs)

/** pino's log levels, for `--log-level` (checked before any part starts). */
export { logLevels }

/** Parse `--threads N`: compute threads per model, in the workers' range. */
export const threadsOption = intRangeOption(workerOptions.threads.min, workerOptions.threads.max)

/** Help text of `--threads`, as the workers give it. */
export const threadsHelp = workerOptions.threads.doc

/** Cluster options that pass `--threads N` to both workers when given (else they use their
 *  default). */
export function threadArgs(threads: number | undefined): {
  prefillArgs?: string[]
  decodeArgs?: string[]
} {
  if (threads === undefined) return {}
  const args = ['--threads', String(threads)]
  return { prefillArgs: args, decodeArgs: args }
}

/** Collect a repeatable flag into an array. */
export function collect(value: string, previous: string[]): string[] {
  return [...previous, value]
}

/** Collect a repeatable URL flag (a worker's control URL) into an array, refusing a value that
 *  is not an http:// or https:// URL (it was first taken for a host to dial without TLS) or has a
 *  path, query or credentials. */
export function collectUrl(value: string, previous: string[]): string[] {
  let url: URL | null = null
  try {
    url = new URL(value)
  } catch {
    // not a URL: refused below
  }
  if (url === null || (url.protocol !== 'http:' && url.protocol !== 'https:'))
    throw new InvalidArgumentError(`expected an http:// or https:// URL, got "${value}"`)
  // The router dials the worker's own paths (/server_info, /internal/…) at its origin: a path
  // given here was dropped without a word.
  if (url.pathname !== '/' || url.search !== '' || url.hash !== '' || url.username !== '')
    throw new InvalidArgumentError(
      `expected a worker's base URL (scheme, host and port only), got "${value}"`,
    )
  return [...previous, value]
}
