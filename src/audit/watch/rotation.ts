/** The watch's rotation: besides its cheap triggers (cycle.ts), each cycle runs one cheap arm of
 *  an audit probe, the next in {@link rotation} (cycle 1 the first, cycle 2 the second, …), when
 *  its cost bound fits what the cycle's allowance has left; else it is skipped and named in the
 *  cycle's log line. An arm checks every answer it reads for other requests' canaries (its own
 *  and the cycle's plant) with the audit's detector.
 *  Adding a probe's arm: write a {@link RotationArm} (a name, the probe whose findings it gives,
 *  a cost bound from discovery alone, and `run`, which sends only through the target it is given
 *  and returns findings keyed as the cycle's are: `leak:<probe>:<victim>-><observer>` for a
 *  crossing), then add it to {@link createRotation}. The cycle charges an arm what it spent
 *  (requests sent, tokens the endpoint reported), not its bound. `watch --plan` lists the rotation with each arm's
 *  bound.
 *  Knows the audit's material and targets; knows nothing of any engine. */
import { createEntrypointArm } from './arms/entrypoint.js'
import { createNearDuplicateArm } from './arms/near-duplicate.js'
import { operationalArm } from './arms/operational.js'
import { raceArm } from './arms/race.js'
import { createRequestIdsArm } from './arms/request-ids.js'
import type { RotationArm } from './arms/arm.js'

export type { ArmContext, ArmDiscovery, ArmFinding, ArmResult, RotationArm } from './arms/arm.js'
export { raceArm } from './arms/race.js'

/** A fresh rotation, in the order cycles take its arms: one per watch, since the entrypoint,
 *  near-duplicate and request-ids arms remember what they did in earlier cycles (the entrypoints
 *  served, whose turn it is, the id fields taken). */
export function createRotation(): readonly RotationArm[] {
  return [
    raceArm,
    createEntrypointArm(),
    operationalArm,
    createNearDuplicateArm(),
    createRequestIdsArm(),
  ]
}

/** The rotation as `watch --plan` and the cost bound describe it (no arm has run). */
export const rotation: readonly RotationArm[] = createRotation()

/** The arm of cycle `cycle` (1-based) in `arms`, or null when it is empty. */
export function armOf(cycle: number, arms: readonly RotationArm[] = rotation): RotationArm | null {
  return arms.length === 0 ? null : arms[(cycle - 1) % arms.length]
}
