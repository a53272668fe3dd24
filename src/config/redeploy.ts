/** A redeploy of a running {@link startCluster} cluster with other options — e.g. the incident's
 *  fault switched on at a known moment while clients and `kvfence watch` keep their URL: the old
 *  parts are stopped, the new ones started, the router on the same port. This is how a fault
 *  reaches production in real life (the incident was a redeploy with a larger advertised context),
 *  and the watch must survive it anyway (a target restart is "unreachable", not a crash).
 *  Knows the order of the two steps and the opt-in check that must come before the first; knows
 *  nothing of requests. Faults and guards off need KVFENCE_ALLOW_FAULTS=1 in the new options' `env`
 *  exactly as at start (`--inject-fault`, with the same banner in the parts' logs). */
import { buildFaultConfig } from '../engine/faults.js'
import { type Cluster, type ClusterOptions, startCluster } from './launch.js'

/** What {@link redeployCluster} did: the new cluster, and when it was stopped and serving again
 *  (`Date.now()` ms). */
export interface Redeployed {
  readonly cluster: Cluster
  /** When the old parts had all exited. */
  readonly stoppedAtMs: number
  /** When the new router reported itself listening (the moment the new options took effect). */
  readonly servingAtMs: number
}

/** Stops `old` and starts a cluster of `options` whose router listens on `old`'s router port
 *  (`options.routerPort` is ignored). The opt-in is checked first: faults or guards off without
 *  KVFENCE_ALLOW_FAULTS=1 in `options.env` (default: this process's) throw the one-line Error of
 *  {@link buildFaultConfig} and `old` keeps serving untouched. A failure to start the new parts
 *  throws as {@link startCluster} does, with `old` already stopped (as a failed rollout leaves it). */
export async function redeployCluster(old: Cluster, options: ClusterOptions): Promise<Redeployed> {
  const env = options.env ?? process.env
  for (const faults of [options.prefillFaults ?? [], options.decodeFaults ?? []]) {
    buildFaultConfig(faults, options.disableGuards ?? false, env, options.disabledGuards ?? [])
  }
  const routerPort = Number(new URL(old.routerUrl).port)
  await old.stop()
  const stoppedAtMs = Date.now()
  const cluster = await startCluster({ ...options, routerPort })
  return { cluster, stoppedAtMs, servingAtMs: Date.now() }
}
