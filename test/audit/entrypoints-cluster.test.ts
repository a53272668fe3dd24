/** Probe `entrypoints` against kvfence's own cluster as shipped (router, prefill and decode workers
 *  as OS processes, the bundled model): it serves completions, chat and Responses (streamed and
 *  not) and refuses function tools; every served entrypoint is clean with its positive control
 *  (the tenant's own repeat reused its prefix), on three seeds. */
import assert from 'node:assert/strict'
import { rmSync } from 'node:fs'
import { join } from 'node:path'
import { after, before, test } from 'node:test'
import { runAudit, type AuditReport } from '../../src/audit/index.js'
import { startCluster } from '../../src/config/launch.js'
import { incidentShape, twoTenants } from '../helpers/cluster.js'
import { echoModelDir } from '../helpers/paths.js'

const { dir, tenants, tenantsFile } = twoTenants('kvfence-audit-entrypoints-')
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
    for (const seed of [5, 6, 7])
      reports.push(
        await runAudit({ target: cluster.routerUrl, tenants, seed, probes: ['entrypoints'] }),
      )
  } finally {
    await cluster.stop()
  }
})
after(() => rmSync(dir, { recursive: true, force: true }))

test('kvfence as shipped: completions, chat and Responses (streamed and not) served and clean; the rest not served', () => {
  for (const report of reports) {
    const text = JSON.stringify(report.findings.map((f) => f.title))
    assert.deepEqual(
      report.findings.map((f) => [f.evidence.endpoint, f.verdict]),
      [
        ['POST /v1/completions', 'clean'],
        ['POST /v1/chat/completions', 'clean'],
        ['POST /v1/responses', 'clean'],
        ['POST /v1/responses (stream)', 'clean'],
      ],
      text,
    )
    const table = report.findings[0].evidence.entrypoints as {
      entrypoint: string
      status: number
      isServed: boolean
    }[]
    assert.deepEqual(
      table.filter((r) => !r.isServed).map((r) => [r.entrypoint, r.status]),
      [
        ['messages', 404],
        ['messages-stream', 404],
        ['generate', 404],
        ['generate-stream', 404],
        ['completion', 404],
        // kvfence accepts `tools` only empty: the round trip is not served.
        ['responses-tools', 400],
      ],
    )
  }
})
