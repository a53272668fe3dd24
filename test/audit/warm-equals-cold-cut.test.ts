/** warm-equals-cold cut by its budget before some of its edges: an edge it never sent is not
 *  "refused" (every one of no requests was refused: the console said "refused 256, 512" against
 *  an engine that refused nothing, in a trial), and its line counts the planned lengths as the
 *  title does. */
import assert from 'node:assert/strict'
import { test } from 'node:test'
import { runAudit } from '../../src/audit/index.js'
import { standInTenants as tenants, startStandIn } from './standins.js'

test('cut by --max-requests: no edge refused by an engine that refused nothing; the line counts the planned lengths', async () => {
  const standIn = await startStandIn('safe', { prefixCache: 'per-tenant' })
  const lines: string[] = []
  try {
    const report = await runAudit({
      target: standIn.url,
      tenants,
      seed: 3,
      probes: ['warm-equals-cold'],
      maxRequests: 30,
      onProgress: (e) => {
        if (e.type === 'probe-log') lines.push(e.message)
      },
    })
    const finding = report.findings.find((f) => f.probe === 'warm-equals-cold')!
    assert.equal(
      report.completions.filter((c) => c.fate === 'refused').length,
      0,
      'the stand-in refused nothing',
    )
    assert.deepEqual(finding.evidence.refusedEdges, [])
    assert.ok(
      (finding.evidence.missedEdges as number[]).length > 0,
      JSON.stringify(finding.evidence.missedEdges),
    )
    const line = lines.find((l) => / lengths compared \(\d+ sent\)/.test(l))
    assert.ok(line !== undefined, lines.join('\n'))
    assert.doesNotMatch(line, /refused/)
  } finally {
    await standIn.close()
  }
})
