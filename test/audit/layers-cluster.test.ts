/** `operational-endpoints`, `near-duplicates` and `request-ids` against the real kvfence cluster
 *  as shipped (router, prefill and decode workers as OS processes, KV pages over TCP, the bundled
 *  model), on 3 seeds: each says clean, with its positive control (endpoints read with 200; a
 *  cache hit on the victim's own repeat; both streams of every arm in flight at once). */
import assert from 'node:assert/strict'
import { rmSync } from 'node:fs'
import { join } from 'node:path'
import { after, before, test } from 'node:test'
import { runAudit, type AuditReport } from '../../src/audit/index.js'
import { startCluster } from '../../src/config/launch.js'
import { incidentShape, twoTenants } from '../helpers/cluster.js'
import { echoModelDir } from '../helpers/paths.js'

const { dir, tenants, tenantsFile } = twoTenants('kvfence-audit-layers-')
const seeds = [1, 2, 3]
const reports: AuditReport[] = []

before(async () => {
  const cluster = await startCluster({
    modelDir: echoModelDir,
    ...incidentShape,
    contextWindow: 1024,
    clampContext: true,
    tenantsFile,
    logDir: join(dir, 'logs'),
    logLevel: 'warn',
  })
  try {
    for (const seed of seeds)
      reports.push(
        await runAudit({
          target: cluster.routerUrl,
          tenants,
          seed,
          probes: ['operational-endpoints', 'near-duplicates', 'request-ids'],
        }),
      )
  } finally {
    await cluster.stop()
  }
})
after(() => rmSync(dir, { recursive: true, force: true }))

test('kvfence as shipped: the three layer probes are clean on 3 seeds', () => {
  for (const report of reports)
    assert.deepEqual(
      report.findings.map((f) => `${f.probe} ${f.verdict}`),
      ['operational-endpoints clean', 'near-duplicates clean', 'request-ids clean'],
      `seed ${report.seed}: ${report.findings.map((f) => f.title).join(' | ')}`,
    )
})

test("the endpoints kvfence serves were read, and a tenant's key shows no other tenant's prompt in them", () => {
  const read = reports[0].findings[0].evidence.endpointsRead as string[]
  for (const path of ['/metrics', '/health', '/v1/models']) assert.ok(read.includes(path), path)
})
