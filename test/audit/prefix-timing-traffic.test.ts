/** prefix-timing's traffic is attributable (issue #28: "everything the auditor sends must be
 *  attributable to the tenant that sent it, eviction and filler traffic included"): every prefix
 *  it sends, membership and eviction alike, is recorded as the material of the tenant that made
 *  it, and every answer is checked for another request's canary or letters. Before, the eviction
 *  arm's flood carried fresh canaries that nothing recorded or checked. Here a stand-in (a 2,048-
 *  token pool: 512-token prefixes, a flood of 8) answers a tenant with the first words of the
 *  other tenant's last prompt after 6 or more of that tenant's requests in a row: only the
 *  eviction arm's flood is that long (the membership arms send at most 4 of one tenant's in a
 *  row, and the observer's last 2 with its first 3 of the eviction arm make 5; at 5 the other
 *  tenant's first flood request was answered with the observer's prefix, found as well). */
import assert from 'node:assert/strict'
import { test } from 'node:test'
import { runAudit, type AuditReport } from '../../src/audit/index.js'
import { standInTenants, startStandIn, type StandInOptions } from './standins.js'

async function audit(options: StandInOptions): Promise<AuditReport> {
  const standIn = await startStandIn('safe', {
    poolTokens: 2048,
    prefixCache: 'per-tenant',
    ...options,
  })
  try {
    return await runAudit({
      target: standIn.url,
      tenants: standInTenants,
      seed: 4,
      probes: ['prefix-timing'],
    })
  } finally {
    await standIn.close()
  }
}

test('the flood’s last prompt served to the observer: content-leak, critical, naming the tenant that flooded', async () => {
  const report = await audit({ answerAfterFlood: 6 })
  const leaks = report.findings.filter((f) => f.verdict === 'leak')
  assert.ok(leaks.length >= 1)
  for (const f of leaks) {
    assert.deepEqual(
      [f.probe, f.class, f.severity, f.evidence.victimTenant, f.evidence.observerTenant],
      ['prefix-timing', 'content-leak', 'critical', 'alice', 'bob'],
    )
    const request = f.evidence.request as { label: string }
    assert.match(request.label, /^eviction round \d, after the flood$/)
  }
  // Every eviction round's answer after the flood (2 rounds), nothing else.
  assert.equal(leaks.length, 2)
  assert.equal(leaks[0].evidence.numCrossings, 2)
  // The membership arms' verdict stands beside it: per-tenant cache, control seen.
  const membership = report.findings.filter((f) => f.verdict !== 'leak')
  assert.deepEqual(
    membership.map((f) => [f.probe, f.verdict]),
    [['prefix-timing', 'clean']],
  )
})

test('its twin (no flood served across): no leak, the membership arms clean, the eviction arm quiet', async () => {
  const report = await audit({})
  assert.deepEqual(
    report.findings.map((f) => [f.probe, f.verdict]),
    [['prefix-timing', 'clean']],
  )
  const eviction = report.findings[0].evidence.eviction as { numFlood: number; rounds: unknown[] }
  assert.equal(eviction.numFlood, 8)
  assert.equal(eviction.rounds.length, 2)
})
