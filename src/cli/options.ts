/** Option parsers shared by the sub-commands: bad values become a one-line commander error. */
import { InvalidArgumentError } from 'commander'

/** Parse a non-negative integer flag value. */
export function intOption(value: string): number {
  if (!/^\d+$/.test(value))
    throw new InvalidArgumentError(`expected a non-negative integer, got "${value}"`)
  return Number(value)
}

/** Parse a count that must be at least 1 (pages, tokens per page, a context window). */
export function positiveIntOption(value: string): number {
  if (!/^[1-9]\d*$/.test(value))
    throw new InvalidArgumentError(`expected a positive integer, got "${value}"`)
  return Number(value)
}

/** Parse a TCP port flag: an integer from 0 (the system picks one) to 65535. */
export function portOption(value: string): number {
  const n = /^\d+$/.test(value) ? Number(value) : NaN
  if (!(n >= 0 && n <= 65535))
    throw new InvalidArgumentError(`expected a port from 0 to 65535, got "${value}"`)
  return n
}

/** pino's log levels, for `--log-level` (checked before any part starts). */
export const logLevels = ['fatal', 'error', 'warn', 'info', 'debug', 'trace', 'silent'] as const

/** Parse `--threads N`: compute threads per model, 1 to 64. */
export function threadsOption(value: string): number {
  const n = /^\d+$/.test(value) ? Number(value) : NaN
  if (!(n >= 1 && n <= 64))
    throw new InvalidArgumentError(`expected an integer from 1 to 64, got "${value}"`)
  return n
}

/** Help text of `--threads`. */
export const threadsHelp = 'compute threads per model (default: min(2, available cores))'

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
