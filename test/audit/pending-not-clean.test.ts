/** A probe the budget stopped before its end is never reported clean: against `transformers
 *  serve` the concurrency probe's time share ran out in its burst of 8 (0 of 8 answered) and the
 *  report said `clean` beside "pending" (trial). Here a stand-in answers each completion 25 ms a
 *  generated token late and the audit has 4 s: the small bursts are answered, the time runs out
 *  in the larger ones. */
import assert from 'node:assert/strict'
import { test } from 'node:test'
import { runAudit } from '../../src/audit/index.js'
import { standInTenants, startStandIn } from './standins.js'

test('a probe cut by its time is inconclusive, pending, and keeps what it saw before the cut', async () => {
  const standIn = await startStandIn('safe', { tokenDelayMs: 25 })
  try {
    const report = await runAudit({
      target: standIn.url,
      tenants: standInTenants,
      seed: 1,
      probes: ['concurrency'],
      maxSeconds: 4,
    })
    const findings = report.findings.filter((f) => f.probe === 'concurrency')
    assert.deepEqual(report.pendingProbes, ['concurrency'])
    assert.ok(findings.length > 0)
    for (const f of findings) assert.notEqual(f.verdict, 'clean', f.title)
    assert.match(
      findings[0].title,
      /^not run to the end \(its time ran out\), so not proven clean; before the cut: /,
    )
  } finally {
    await standIn.close()
  }
})
