/** The probe registry: the one place a probe is registered. Everything else derives from it: the
 *  probe names and their order (`probeNames`, `ProbeName`), `--list-probes` (each description),
 *  `--probes` and the config file's validation, `--plan` and each probe's budget share (each
 *  `plan`), the class and controls of its findings, and whether the audit calibrates token counts
 *  for it.
 *
 *  To add a probe:
 *    1. write `src/audit/probes/NAME.ts` exporting a `Probe` (probe.ts) whose `name` is NAME:
 *       its `description`, `class`, `controls`, `plan` (what it sends at most, from discovery's
 *       numbers alone) and `run`, which sends (a function of its own) and then judges what came
 *       back (another: a pure function of the answers, so a test can judge recorded answers);
 *    2. add one line `NAME: nameProbe,` to {@link probes} below, where in the order it should run.
 *  Nothing else: no list of names elsewhere, no table keyed by probe. test/audit/registry.test.ts
 *  checks that each key is its probe's name. */
import type { Probe } from '../probe.js'
import { abortRaceProbe } from './abort-race.js'
import { abortRetryProbe } from './abort-retry.js'
import { boundaryProbe } from './boundary.js'
import { cacheFieldsProbe } from './cache-fields.js'
import { canaryProbe } from './canary.js'
import { capacityProbe } from './capacity.js'
import { concurrencyProbe } from './concurrency.js'
import { determinismProbe } from './determinism.js'
import { entrypointsProbe } from './entrypoints.js'
import { errorHandlingProbe } from './error-handling.js'
import { evictThenReturnProbe } from './evict-then-return.js'
import { pageLeakProbe } from './page-leak.js'
import { prefixTimingProbe } from './prefix-timing.js'
import { queueingProbe } from './queueing.js'
import { raceLoadProbe } from './race-load.js'
import { stallProbe } from './stall.js'
import { warmEqualsColdProbe } from './warm-equals-cold.js'
import { nearDuplicatesProbe } from './near-duplicates.js'
import { operationalEndpointsProbe } from './operational-endpoints.js'
import { requestIdsProbe } from './request-ids.js'

/** Every probe by its name, in the order an audit runs them. */
export const probes = {
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
  'operational-endpoints': operationalEndpointsProbe,
  'near-duplicates': nearDuplicatesProbe,
  'request-ids': requestIdsProbe,
  entrypoints: entrypointsProbe,
  'error-handling': errorHandlingProbe,
  stall: stallProbe,
} as const satisfies Readonly<Record<string, Probe>>

/** A probe's name: a key of {@link probes}. */
export type ProbeName = keyof typeof probes

/** Every probe's name, in the order an audit runs them (the registry's order: string keys keep
 *  their insertion order). A non-empty tuple's type, as `z.enum` wants. */
export const probeNames = Object.keys(probes) as [ProbeName, ...ProbeName[]]
