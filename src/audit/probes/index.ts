/** The probes, by name, in the order they run. */
import type { Probe } from '../probe.js'
import type { ProbeName } from '../types.js'
import { boundaryProbe } from './boundary.js'
import { canaryProbe } from './canary.js'
import { capacityProbe } from './capacity.js'

export const probes: Readonly<Record<ProbeName, Probe>> = {
  capacity: capacityProbe,
  boundary: boundaryProbe,
  canary: canaryProbe,
}
