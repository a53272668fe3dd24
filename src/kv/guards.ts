/** The safety guards of DESIGN.md §4: which are on, and what a trip looks like.
 *  Knows guard ids and counts trips; knows nothing of pools, transfers or HTTP. */
import { KvfenceError, type ErrorCode } from '../common/errors.js'

/** Guard ids, DESIGN.md §4. */
export const guardIds = ['G1', 'G2', 'G3', 'G4', 'G5', 'G6', 'G7', 'G8', 'G9', 'G10'] as const
export type GuardId = (typeof guardIds)[number]

/** Which guards are on. Built once per process and frozen; all on unless
 *  `--unsafe-disable-guards` (which needs KVFENCE_ALLOW_FAULTS=1). */
export type Guards = Readonly<Record<GuardId, boolean>>

/** All guards on (the shipped configuration) or all off (only for reproducing faults). */
export function makeGuards(isEnabled: boolean): Guards {
  return Object.freeze(
    Object.fromEntries(guardIds.map((id) => [id, isEnabled])) as Record<GuardId, boolean>,
  )
}

/** Counts guard trips per guard id (exported as `kvfence_guard_trips_total{guard}`). */
export class GuardTrips {
  readonly counts: Record<GuardId, number> = Object.fromEntries(
    guardIds.map((id) => [id, 0]),
  ) as Record<GuardId, number>

  private readonly listeners: ((guard: GuardId) => void)[] = []

  /** Call `listener` after every trip from now on (the metrics counter subscribes here). */
  onTrip(listener: (guard: GuardId) => void): void {
    this.listeners.push(listener)
  }

  /** Record a trip of `guard` and return the error to throw: the request fails, nothing is read. */
  trip(guard: GuardId, message: string, code: ErrorCode = 'guard_violation'): GuardError {
    this.counts[guard] += 1
    for (const listener of this.listeners) listener(guard)
    return new GuardError(guard, code, message)
  }
}

/** A guard refused an operation. `guard` says which; the request that caused it must end in an error. */
export class GuardError extends KvfenceError {
  constructor(
    readonly guard: GuardId,
    code: ErrorCode,
    message: string,
  ) {
    super(code, `${guard}: ${message}`)
    this.name = 'GuardError'
  }
}
