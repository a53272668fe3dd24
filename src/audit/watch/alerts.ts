/** Alert state across cycles: a finding fires once when its key is first seen and resolves after
 *  `resolveAfterCycles` completed cycles without it, so an operator is told once per incident,
 *  not every 30 seconds. Only this module changes an alert's state.
 *  Knows finding keys and cycle numbers; knows nothing of HTTP. */
import type { Finding } from '../types.js'
import type { WatchFinding } from './cycle.js'

/** An alert that is firing: its first and latest sighting. */
export interface ActiveAlert {
  readonly key: string
  readonly finding: Finding
  /** When it was first seen (epoch ms) and in which cycle. */
  readonly startedAt: number
  readonly firstCycle: number
  lastCycle: number
  numSightings: number
}

/** What changed in one cycle. */
export interface AlertChanges {
  readonly fired: readonly ActiveAlert[]
  readonly resolved: readonly ActiveAlert[]
}

export class AlertTracker {
  private readonly active = new Map<string, ActiveAlert>()

  constructor(private readonly resolveAfterCycles: number) {}

  /** Records completed cycle `cycle`'s findings (at `now`, epoch ms). */
  observe(
    cycle: number,
    findings: readonly WatchFinding[],
    now: number = Date.now(),
  ): AlertChanges {
    const fired: ActiveAlert[] = []
    for (const { key, finding } of findings) {
      const alert = this.active.get(key)
      if (alert) {
        alert.lastCycle = cycle
        alert.numSightings++
        continue
      }
      const created: ActiveAlert = {
        key,
        finding,
        startedAt: now,
        firstCycle: cycle,
        lastCycle: cycle,
        numSightings: 1,
      }
      this.active.set(key, created)
      fired.push(created)
    }
    const resolved: ActiveAlert[] = []
    for (const alert of this.active.values()) {
      if (cycle - alert.lastCycle >= this.resolveAfterCycles) resolved.push(alert)
    }
    for (const alert of resolved) this.active.delete(alert.key)
    return { fired, resolved }
  }

  /** Alerts firing now. */
  list(): readonly ActiveAlert[] {
    return [...this.active.values()]
  }
}
