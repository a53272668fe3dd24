/** determinism's load is checked too: the requests beside its subject are other tenants' canary
 *  prompts (planted per request), and before, nothing checked their answers or the subject's for
 *  them: crossed slots showed only as "output changed under load" (a low warning). Now any answer
 *  carrying another request's canary is a leak (`content-leak`), as in the concurrency probe; the
 *  twin (no crossing) stays clean. */
import assert from 'node:assert/strict'
import { test } from 'node:test'
import { runAudit, type AuditReport } from '../../src/audit/index.js'
import { standInTenants, startStandIn, type StandInOptions } from './standins.js'

async function audit(options: StandInOptions): Promise<AuditReport> {
  const standIn = await startStandIn('safe', options)
  try {
    return await runAudit({
      target: standIn.url,
      tenants: standInTenants,
      seed: 77,
      probes: ['determinism'],
    })
  } finally {
    await standIn.close()
  }
}

test('crossed slots (a request begins with the words of one running beside it): content-leak, naming the tenant whose canary crossed', async () => {
  const report = await audit({ isCrossTalk: true, tokenDelayMs: 2 })
  const leaks = report.findings.filter((f) => f.verdict === 'leak')
  assert.ok(leaks.length > 0, JSON.stringify(report.findings.map((f) => [f.verdict, f.title])))
  for (const f of leaks) assert.deepEqual([f.probe, f.class], ['determinism', 'content-leak'])
  const crossTenant = leaks.filter((f) => f.severity === 'critical')
  assert.ok(crossTenant.length > 0)
  assert.notEqual(crossTenant[0].evidence.victimTenant, crossTenant[0].evidence.observerTenant)
  assert.match(
    crossTenant[0].title,
    / answer \(HTTP 200\) carried a canary planted by (alice|bob)$/,
  )
})

test('its twin, no crossing: clean', async () => {
  const report = await audit({ tokenDelayMs: 2 })
  assert.deepEqual(
    report.findings.map((f) => [f.probe, f.verdict]),
    [['determinism', 'clean']],
  )
})
