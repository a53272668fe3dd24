/** The CI gate (`--fail-on`, gate.ts) over findings that carry a class: a gate can fail on a
 *  content leak and not on a side channel, or the other way round; severities count from the one
 *  named up; the default fails on a content leak and on the incident's precondition (a prompt over
 *  the reported KV pool accepted with 200). Real audits of stand-ins over loopback. */
import assert from 'node:assert/strict'
import { before, describe, test } from 'node:test'
import { AuditError, exitCodeFor, runAudit, type AuditReport } from '../../src/audit/index.js'
import { classTable, findingClasses } from '../../src/audit/classes.js'
import { defaultFailOn, parseFailOn } from '../../src/audit/gate.js'
import { formatJunitReport } from '../../src/audit/reporters/junit.js'
import { standInTenants, startStandIn, type StandInKind, type StandInOptions } from './standins.js'

async function auditOf(
  kind: StandInKind,
  options: StandInOptions,
  probes: AuditReport['probeRuns'][number]['probe'][],
): Promise<AuditReport> {
  const standIn = await startStandIn(kind, options)
  try {
    return await runAudit({ target: standIn.url, tenants: standInTenants, seed: 3, probes })
  } finally {
    await standIn.close()
  }
}

describe('--fail-on', () => {
  const reports: Record<string, AuditReport> = {}
  before(async () => {
    // A prefix cache shared by every tenant: bob is served cached tokens of alice's prefix.
    reports.shared = await auditOf('safe', { prefixCache: 'shared' }, ['cache-fields'])
    // The incident: a prompt over the 384-token pool is taken with 200 and decoded over stale
    // pages (boundary: the precondition; canary: the content leak).
    reports.overPool = await auditOf('leaky', {}, ['boundary'])
    reports.leaky = await auditOf('leaky', { tokenDelayMs: 1 }, ['canary'])
  })

  test('a shared prefix cache is a side channel: the default gate passes it, a side-channel gate fails it', () => {
    const f = reports.shared.findings[0]
    assert.deepEqual(
      [f.verdict, f.class, f.severity, f.cwe],
      ['warning', 'side-channel', 'high', ['CWE-208', 'CWE-203']],
    )
    assert.equal(exitCodeFor(reports.shared), 0)
    assert.equal(exitCodeFor(reports.shared, parseFailOn('content-leak')), 0)
    assert.equal(exitCodeFor(reports.shared, parseFailOn('side-channel')), 1)
    assert.equal(exitCodeFor(reports.shared, parseFailOn('high')), 1)
    assert.equal(exitCodeFor(reports.shared, parseFailOn('critical')), 0)
    assert.equal(exitCodeFor(reports.shared, parseFailOn('content-leak, availability')), 0)
    // JUnit fails exactly when the exit code is 1, naming the class.
    assert.match(
      formatJunitReport(reports.shared, ['side-channel']),
      /<failure type="side-channel"/,
    )
    assert.doesNotMatch(formatJunitReport(reports.shared), /<failure/)
  })

  test('a prompt over the reported pool accepted with 200 fails the default gate (the precondition), not a content-leak gate', () => {
    const f = reports.overPool.findings.find((x) => x.tags?.includes('over-pool-accepted'))
    assert.ok(f, JSON.stringify(reports.overPool.findings.map((x) => x.title)))
    assert.deepEqual([f.verdict, f.class], ['warning', 'misconfiguration'])
    assert.deepEqual(defaultFailOn, ['content-leak', 'credential-exposure', 'over-pool-accepted'])
    assert.equal(exitCodeFor(reports.overPool), 1)
    assert.equal(exitCodeFor(reports.overPool, parseFailOn('content-leak')), 0)
    assert.equal(exitCodeFor(reports.overPool, parseFailOn('misconfiguration')), 1)
  })

  test('a content leak fails every gate, whatever it names', () => {
    const leak = reports.leaky.findings.find((f) => f.verdict === 'leak')
    assert.ok(leak)
    assert.deepEqual([leak.class, leak.cwe], ['content-leak', ['CWE-488', 'CWE-226', 'CWE-200']])
    for (const gate of ['side-channel', 'info', 'availability', 'inconclusive'])
      assert.equal(exitCodeFor(reports.leaky, parseFailOn(gate)), 1, gate)
  })

  test('every finding carries its class and that class’s CWE ids', () => {
    for (const report of Object.values(reports))
      for (const f of report.findings) {
        assert.ok(f.class !== undefined && findingClasses.includes(f.class), f.title)
        assert.deepEqual(f.cwe, classTable[f.class].cwe)
        // `leak` is the verdict of a content leak only.
        assert.equal(f.verdict === 'leak', f.verdict === 'leak' && f.class === 'content-leak')
      }
  })

  test('an unknown term is one clear error naming the known ones', () => {
    assert.throws(
      () => parseFailOn('content-leak,never'),
      (err: unknown) =>
        err instanceof AuditError &&
        err.code === 'invalid_options' &&
        /unknown term "never" \(known: content-leak, side-channel, /.test(err.message),
    )
    assert.throws(() => parseFailOn(' , '), AuditError)
    assert.deepEqual(parseFailOn('high, content-leak,high'), ['high', 'content-leak'])
  })
})
