/** Option parsers shared by the sub-commands: bad values become a one-line commander error. */
import { InvalidArgumentError } from 'commander'

/** Parse a non-negative integer flag value. */
export function intOption(value: string): number {
  if (!/^\d+$/.test(value))
    throw new InvalidArgumentError(`expected a non-negative integer, got "${value}"`)
  return Number(value)
}

/** Collect a repeatable flag into an array. */
export function collect(value: string, previous: string[]): string[] {
  return [...previous, value]
}
