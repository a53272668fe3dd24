/** A kvfence cluster with injected faults and the guards off, for the audit's fault tests
 *  (test/audit/faults*.test.ts): router, prefill and decode workers as OS processes, the bundled
 *  echo model, the demo's shape unless a test says otherwise. */
import { join } from 'node:path'
import { startCluster, type ClusterOptions } from '../../src/config/launch.js'
import { echoModelDir } from '../helpers/paths.js'

/** Returns a runner that starts such a cluster with `faults` (logs under `dir/NAME`), runs
 *  `audit` against its router URL, and stops the cluster whatever the audit did. */
export function faultyClusterRunner(dir: string, tenantsFile: string) {
  return async function withFaultyCluster<T>(
    name: string,
    faults: Partial<ClusterOptions>,
    audit: (url: string) => Promise<T>,
  ): Promise<T> {
    const cluster = await startCluster({
      modelDir: echoModelDir,
      pageSize: 16,
      prefillPages: 24,
      decodePages: 64,
      contextWindow: 1024,
      clampContext: true,
      tenantsFile,
      logDir: join(dir, name),
      logLevel: 'warn',
      disableGuards: true,
      env: { ...process.env, KVFENCE_ALLOW_FAULTS: '1' },
      ...faults,
    })
    try {
      return await audit(cluster.routerUrl)
    } finally {
      await cluster.stop()
    }
  }
}
