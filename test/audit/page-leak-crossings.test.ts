/** page-leak's workload is checked too: its requests are tenants' canary prompts, half of them
 *  cut after their first chunk, and before, nothing checked their answers: an engine handing a
 *  cut request's words to the next request drew no finding from this probe. Now that is a leak
 *  (`content-leak`) beside the usage verdict; the twin (pages freed and never handed on) stays
 *  clean. */
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
      probes: ['page-leak'],
    })
  } finally {
    await standIn.close()
  }
}

test('a cut request’s words served to the next request: content-leak, beside the clean usage verdict', async () => {
  const report = await audit({ isAbortLeak: true, tokenDelayMs: 3 })
  const leaks = report.findings.filter((f) => f.verdict === 'leak')
  assert.ok(leaks.length > 0, JSON.stringify(report.findings.map((f) => [f.verdict, f.title])))
  for (const f of leaks) assert.deepEqual([f.probe, f.class], ['page-leak', 'content-leak'])
  assert.match(leaks[0].title, /answer .*carried (a canary planted by|another of its requests)/)
  assert.deepEqual(
    report.findings.filter((f) => f.verdict !== 'leak').map((f) => [f.probe, f.verdict]),
    [['page-leak', 'clean']],
  )
})

test('its twin, nothing handed on: clean only', async () => {
  const report = await audit({ tokenDelayMs: 3 })
  assert.deepEqual(
    report.findings.map((f) => [f.probe, f.verdict]),
    [['page-leak', 'clean']],
  )
})
