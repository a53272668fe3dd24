/** A cluster for the soak: tenants with fresh keys in a temporary tenants file, then
 *  {@link startCluster} with the soak's pool shape (the prefill pool bounds the context, the decode
 *  pool holds several requests at once). Knows files and the cluster launcher. */
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { newApiKey, tenantsYaml } from '../router/tenant-keys.js'
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

/** Start a cluster of `numTenants` tenants serving `modelDir`. Parts' logs go to a temporary
 *  folder (kept only when `keepLogsIn` names one). */
export async function startSoakCluster(opts: {
  modelDir: string
  numTenants: number
  keepLogsIn?: string
}): Promise<SoakCluster> {
  const dir = mkdtempSync(join(tmpdir(), 'kvfence-soak-'))
  const tenants = Array.from({ length: opts.numTenants }, (_, i) => ({
    name: `soak-tenant-${i}`,
    key: newApiKey(),
  }))
  const tenantsFile = join(dir, 'tenants.yaml')
  writeFileSync(tenantsFile, tenantsYaml(tenants))
  let cluster: Cluster
  try {
    cluster = await startCluster({
      modelDir: opts.modelDir,
      ...soakShape,
      tenantsFile,
      logDir: opts.keepLogsIn ?? join(dir, 'logs'),
      logLevel: 'warn',
    })
  } catch (err) {
    rmSync(dir, { recursive: true, force: true })
    throw err
  }
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
    },
    async stop() {
      await cluster.stop()
      rmSync(dir, { recursive: true, force: true })
    },
  }
}
