/** The probes, by name, in the order they run. */
import type { Probe } from '../probe.js'
import type { ProbeName } from '../types.js'
import { abortRaceProbe } from './abort-race.js'
import { abortRetryProbe } from './abort-retry.js'
import { boundaryProbe } from './boundary.js'
import { cacheFieldsProbe } from './cache-fields.js'
import { canaryProbe } from './canary.js'
import { capacityProbe } from './capacity.js'
import { concurrencyProbe } from './concurrency.js'
import { determinismProbe } from './determinism.js'
import { errorHandlingProbe } from './error-handling.js'
import { evictThenReturnProbe } from './evict-then-return.js'
import { pageLeakProbe } from './page-leak.js'
import { prefixTimingProbe } from './prefix-timing.js'
import { queueingProbe } from './queueing.js'
import { raceLoadProbe } from './race-load.js'
import { stallProbe } from './stall.js'
import { warmEqualsColdProbe } from './warm-equals-cold.js'

export const probes: Readonly<Record<ProbeName, Probe>> = {
  capacity: capacityProbe,
  boundary: boundaryProbe,
  canary: canaryProbe,
  'abort-race': abortRaceProbe,
  'abort-retry': abortRetryProbe,
  concurrency: concurrencyProbe,
  'race-load': raceLoadProbe,
  queueing: queueingProbe,
  'page-leak': pageLeakProbe,
  determinism: determinismProbe,
  'prefix-timing': prefixTimingProbe,
  'cache-fields': cacheFieldsProbe,
  'warm-equals-cold': warmEqualsColdProbe,
  'evict-then-return': evictThenReturnProbe,
  'error-handling': errorHandlingProbe,
  stall: stallProbe,
}
