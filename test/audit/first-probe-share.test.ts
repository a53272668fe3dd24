/** A probe whose time share was spent before it started, and that then sent nothing, was not cut
 *  by its time: kvfence as shipped drew "capacity: not run to the end (its time ran out), so not
 *  proven clean" on seeds 1 and 2 of the default audit on a busy host, since the first probe's
 *  share (a fraction of a second: it sends no request) is counted from the audit's start and
 *  discovery had spent it. Here every answer comes 300 ms late, so discovery's seven requests
 *  (~2.1 s) spend all of capacity's share (1 part in 12 of 20 s beside boundary's plan). */
import assert from 'node:assert/strict'
import { test } from 'node:test'
import { runAudit } from '../../src/audit/index.js'
import { standInTenants, startStandIn } from './standins.js'

test('capacity after a slow discovery spent its share: clean (it sent nothing the time could cut), not pending', async () => {
  const standIn = await startStandIn('safe', { delayMs: 300 })
  try {
    const report = await runAudit({
      target: standIn.url,
      tenants: standInTenants,
      seed: 1,
      probes: ['capacity', 'boundary'],
      maxSeconds: 20,
    })
    assert.deepEqual(
      report.findings.map((f) => [f.probe, f.verdict, f.title]),
      [
        ['capacity', 'clean', 'advertised context 384 tokens fits the KV pool of 384 tokens'],
        ['boundary', 'clean', 'rejected every prompt larger than 384 tokens with a 4xx'],
      ],
    )
    assert.deepEqual(report.pendingProbes, [])
    assert.equal(report.probeRuns[0].requestsSent, 0)
  } finally {
    await standIn.close()
  }
})
