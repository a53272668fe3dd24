/** A cluster for the soak: tenants with fresh keys in a temporary tenants file, then
 *  {@link startCluster} with the soak's pool shape (the prefill pool bounds the context, the decode
 *  pool holds several requests at once). Knows files and the cluster launcher. */
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { startWatchChild, type WatchChild } from '../audit/watch/child.js'
import { newApiKey } from '../router/tenants/tenant-keys.js'
import { apiKeyDigest } from '../router/tenants/tenants.js'
import { startCluster, type Cluster } from '../config/launch.js'
import type { SoakTarget } from './run.js'

/** Pool shape of the soak's cluster: prefill 32 × 16 = 512 tokens (the context), decode 96 × 16. */
export const soakShape = Object.freeze({ pageSize: 16, prefillPages: 32, decodePages: 96 })

/** A started cluster and what the soak needs to drive it. `stop()` stops the processes and
 *  removes the temporary folder (tenants file and logs). */
export interface SoakCluster {
  cluster: Cluster
  target: SoakTarget
  stop(): Promise<void>
}

/** Start a cluster of `numTenants` tenants serving `modelDir` (the router's sentinel observing,
 *  its default), and, unless `watchCycleSeconds` is 0, `kvfence watch` against it at that cycle
 *  (default: the watch's 30 s) with two more tenants marked `canary: true` (`soak-watch-a`,
 *  `-b`), so that the sentinel knows their canaries. Parts' logs (and the watch's, `watch.log`)
 *  go to a temporary folder, kept only when `keepLogsIn` names one. */
export async function startSoakCluster(opts: {
  modelDir: string
  numTenants: number
  keepLogsIn?: string
  watchCycleSeconds?: number
  /** The router sentinel's window (`--sentinel-window-seconds`); default: the router's. */
  sentinelWindowSeconds?: number
}): Promise<SoakCluster> {
  const dir = mkdtempSync(join(tmpdir(), 'kvfence-soak-'))
  const removeDir = () => rmSync(dir, { recursive: true, force: true })
  // Removed also when this process exits without stop() (SIGINT/SIGTERM: src/cli/stop-children.ts).
  process.once('exit', removeDir)
  const tenants = Array.from({ length: opts.numTenants }, (_, i) => ({
    name: `soak-tenant-${i}`,
    key: newApiKey(),
  }))
  const watchCycleSeconds = opts.watchCycleSeconds ?? 30
  const watchTenants: Record<string, string> =
    watchCycleSeconds > 0 ? { 'soak-watch-a': newApiKey(), 'soak-watch-b': newApiKey() } : {}
  const tenantsFile = join(dir, 'tenants.yaml')
  writeFileSync(
    tenantsFile,
    'tenants:\n' +
      tenants.map((t) => `  - { name: ${t.name}, keySha256: ${apiKeyDigest(t.key)} }\n`).join('') +
      Object.entries(watchTenants)
        .map(([n, key]) => `  - { name: ${n}, keySha256: ${apiKeyDigest(key)}, canary: true }\n`)
        .join(''),
  )
  let cluster: Cluster
  try {
    cluster = await startCluster({
      modelDir: opts.modelDir,
      ...soakShape,
      tenantsFile,
      logDir: opts.keepLogsIn ?? join(dir, 'logs'),
      logLevel: 'warn',
      ...(opts.sentinelWindowSeconds === undefined
        ? {}
        : { routerArgs: ['--sentinel-window-seconds', String(opts.sentinelWindowSeconds)] }),
    })
  } catch (err) {
    process.off('exit', removeDir)
    removeDir()
    throw err
  }
  const logDir = opts.keepLogsIn ?? join(dir, 'logs')
  const watch: WatchChild | null =
    watchCycleSeconds > 0
      ? startWatchChild({
          target: cluster.routerUrl,
          tenants: watchTenants,
          cycleSeconds: watchCycleSeconds,
          logFile: join(logDir, 'watch.log'),
        })
      : null
  const pids: Record<string, number> = {}
  for (const [name, child] of Object.entries(cluster.processes))
    if (child.pid !== undefined) pids[name] = child.pid
  return {
    cluster,
    target: {
      routerUrl: cluster.routerUrl,
      prefillUrl: cluster.prefillUrl,
      decodeUrl: cluster.decodeUrl,
      pids,
      tenants,
      modelDir: opts.modelDir,
      pageSize: soakShape.pageSize,
      oraclePages: Math.max(soakShape.prefillPages, soakShape.decodePages),
      ...(watch === null ? {} : { watch }),
    },
    async stop() {
      await watch?.stop()
      await cluster.stop()
      process.off('exit', removeDir)
      removeDir()
    },
  }
}
