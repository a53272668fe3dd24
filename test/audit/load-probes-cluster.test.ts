/** `race-load` and `stall` against the real kvfence cluster as shipped (router, prefill and
 *  decode workers as OS processes, KV pages over TCP, the bundled model), on 3 seeds: no leak, no
 *  warning, and race-load clean (its load measured in flight). */
import assert from 'node:assert/strict'
import { rmSync } from 'node:fs'
import { join } from 'node:path'
import { after, before, test } from 'node:test'
import { runAudit } from '../../src/audit/index.js'
import { startCluster, type Cluster } from '../../src/config/launch.js'
import { incidentShape, twoTenants } from '../helpers/cluster.js'
import { echoModelDir } from '../helpers/paths.js'

const { dir, tenants, tenantsFile } = twoTenants('kvfence-load-probes-cluster-')
let cluster: Cluster

before(async () => {
  cluster = await startCluster({
    modelDir: echoModelDir,
    ...incidentShape,
    contextWindow: 1024,
    clampContext: true,
    tenantsFile,
    logDir: join(dir, 'logs'),
  })
})
after(async () => {
  await cluster?.stop()
  rmSync(dir, { recursive: true, force: true })
})

for (const seed of [1, 2, 3]) {
  test(`seed ${seed}: race-load clean with its load reached, stall neither a warning nor a leak`, async () => {
    const report = await runAudit({
      target: cluster.routerUrl,
      tenants,
      seed,
      probes: ['race-load', 'stall'],
      maxConcurrency: 8,
    })
    const alarming = report.findings.filter((f) => f.verdict === 'leak' || f.verdict === 'warning')
    assert.deepEqual(
      alarming.map((f) => `${f.probe}: ${f.title}`),
      [],
    )
    const race = report.findings.find((f) => f.probe === 'race-load')!
    assert.equal(race.verdict, 'clean', race.title)
    assert.ok((race.evidence.maxInFlight as number) >= 2)
    const stall = report.findings.find((f) => f.probe === 'stall')!
    assert.equal(stall.verdict, 'clean', stall.title)
  })
}
