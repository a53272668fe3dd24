/** The `prefix-timing` probe's eviction arm against the real kvfence cluster (router, prefill and
 *  decode workers as OS processes, the incident's pools: a 24-page prefill pool, so a default
 *  prefix cache of 6 pages of 16 tokens). The observer's prefixes run to 192 tokens, so a cache
 *  holds as many of their pages as the observer's share allows. With the default (each tenant
 *  its own partition, 6 / 2 = 3 pages) the observer's reuse is served 48 tokens, and still 48
 *  after the other tenant's 4 distinct 192-token prefixes: no finding of the arm, its rounds in
 *  the membership finding's evidence. With `--prefix-cache-shared` the reuse is served the whole
 *  cache (96 tokens) and 0 after the flood: a `leak` of severity medium (the load side channel),
 *  beside the membership arms' clean finding. */
import assert from 'node:assert/strict'
import { rmSync } from 'node:fs'
import { join } from 'node:path'
import { after, describe, it } from 'node:test'
import { runAudit, type AuditReport } from '../../src/audit/index.js'
import { startCluster } from '../../src/config/launch.js'
import { incidentShape, twoTenants } from '../helpers/cluster.js'
import { echoModelDir } from '../helpers/paths.js'

const { dir, tenants, tenantsFile } = twoTenants('kvfence-audit-eviction-')
after(() => rmSync(dir, { recursive: true, force: true }))

/** `prefix-timing` alone against a fresh cluster whose prefill worker gets `prefillArgs`. */
async function audit(prefillArgs: string[], name: string): Promise<AuditReport> {
  const cluster = await startCluster({
    modelDir: echoModelDir,
    ...incidentShape,
    contextWindow: 1024,
    clampContext: true,
    prefillArgs,
    tenantsFile,
    logDir: join(dir, `logs-${name}`),
  })
  try {
    return await runAudit({
      target: cluster.routerUrl,
      tenants,
      seed: 17,
      probes: ['prefix-timing'],
    })
  } finally {
    await cluster.stop()
  }
}

const round = (reuse: number, flooded: number) => ({ reuse, quiet: reuse, flooded })

describe('prefix-timing’s eviction arm on a real cluster', () => {
  it('default partitions: quiet (the observer’s 48 cached tokens survive the flood)', async () => {
    const report = await audit([], 'default')
    const findings = report.findings.filter((f) => f.probe === 'prefix-timing')
    assert.deepEqual(
      findings.map((f) => [f.verdict, f.severity]),
      [['clean', 'info']],
    )
    assert.deepEqual(findings[0].evidence.eviction, {
      numFlood: 4,
      rounds: [round(48, 48), round(48, 48)],
    })
  })

  it('--prefix-cache-shared: finds the load side channel (96 cached tokens, 0 after the flood)', async () => {
    const report = await audit(['--prefix-cache-shared'], 'shared')
    const findings = report.findings.filter((f) => f.probe === 'prefix-timing')
    assert.deepEqual(
      findings.map((f) => [f.verdict, f.severity]),
      [
        ['clean', 'info'],
        ['warning', 'medium'],
      ],
    )
    assert.equal(findings[1].class, 'side-channel')
    assert.match(findings[1].title, /^load side channel: tenant-a's 4 distinct prefixes evicted/)
    assert.deepEqual(findings[1].evidence.rounds, [round(96, 0), round(96, 0)])
  })
})
