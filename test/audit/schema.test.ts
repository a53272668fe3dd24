/** The JSON report against its published schema (docs/report-schema.json, JSON Schema 2020-12):
 *  real reports of real audits over loopback validate, the schema's names are the code's, and a
 *  report that drifts from it (a field added without the schema, a verdict it does not know, a
 *  count missing) does not. */
import assert from 'node:assert/strict'
import { before, describe, test } from 'node:test'
import {
  AuditError,
  formatJsonReport,
  probeNames,
  runAudit,
  type AuditReport,
} from '../../src/audit/index.js'
import { jsonFieldOrder } from '../../src/audit/reporters/json.js'
import { findingClasses, findingTags } from '../../src/audit/classes.js'
import { readReportSchema, reportValidator } from './schema-validator.js'
import { standInTenants, startStandIn, type StandInKind, type StandInOptions } from './standins.js'

async function reportOf(
  kind: StandInKind,
  standInOptions: StandInOptions = {},
  probes?: AuditReport['probeRuns'][number]['probe'][],
): Promise<AuditReport> {
  const standIn = await startStandIn(kind, standInOptions)
  try {
    const report = await runAudit({ target: standIn.url, tenants: standInTenants, seed: 3, probes })
    // As the file holds it: what readers parse.
    return JSON.parse(formatJsonReport(report)) as AuditReport
  } catch (err) {
    if (err instanceof AuditError && err.report) return err.report
    throw err
  } finally {
    await standIn.close()
  }
}

// Every test here audits a stand-in of its own, mostly waiting on its delays: two groups run at
// once. Not more: the audits share this process's event loop, and with many at once their
// timers and reads ran late enough to change verdicts (a discovery read timing out, a cut not
// seen before the slot was given back).
describe('schema', { concurrency: 2 }, () => {
  describe('docs/report-schema.json', () => {
    const { validate, errorsOf } = reportValidator()
    const reports: Record<string, AuditReport> = {}
    // The audits are independent (a stand-in each): they run at once.
    const interruptedAndResumed = async (): Promise<void> => {
      // Interrupted as the first probe ends, then resumed: both as the files hold them.
      const standIn = await startStandIn('safe')
      try {
        const stop = new AbortController()
        const options = {
          target: standIn.url,
          tenants: standInTenants,
          seed: 3,
          probes: ['boundary', 'canary'] as const,
        }
        const interrupted = await runAudit({
          ...options,
          probes: [...options.probes],
          signal: stop.signal,
          onProgress: (e) => void (e.type === 'probe-end' && stop.abort('SIGINT')),
        })
        reports.interrupted = JSON.parse(formatJsonReport(interrupted)) as AuditReport
        const resumed = await runAudit({
          ...options,
          probes: [...options.probes],
          resume: { report: reports.interrupted, source: 'interrupted.json' },
        })
        reports.resumed = JSON.parse(formatJsonReport(resumed)) as AuditReport
      } finally {
        await standIn.close()
      }
    }
    before(async () => {
      const [leaky, availability, toolError] = await Promise.all([
        reportOf('leaky', { tokenDelayMs: 1 }),
        reportOf('safe', { failValid: { status: 500, every: 4 } }, ['boundary', 'canary']),
        reportOf('static'),
        interruptedAndResumed(),
      ])
      Object.assign(reports, { leaky, availability, toolError })
    })

    test('names the probes, verdicts and fates the code uses', () => {
      const defs = readReportSchema().$defs as Record<string, { enum?: string[] }>
      assert.deepEqual(defs.probeName.enum, [...probeNames])
      assert.deepEqual(defs.fate.enum, ['answered', 'refused', 'failed', 'cut'])
    })

    for (const name of ['leaky', 'availability', 'toolError', 'interrupted', 'resumed']) {
      test(`a real report validates: ${name}`, () => {
        const report = reports[name]
        assert.ok(validate(report), errorsOf())
        // What the schema cannot say: per probe, the counts add up, and to the timeline.
        for (const run of report.probeRuns) {
          const c = run.completions
          assert.equal(c.sent, c.answered + c.refused + c.failed + c.cut, run.probe)
          assert.equal(c.sent, report.completions.filter((e) => e.probe === run.probe).length)
          const inconclusive = report.findings.filter(
            (f) => f.probe === run.probe && f.verdict === 'inconclusive',
          )
          assert.deepEqual(
            run.inconclusiveReasons,
            inconclusive.map((f) => f.title),
          )
        }
      })
    }

    // Each object's fields in the order the schema lists them, whatever order the code built it in
    // (a finding's controls came after its remediation, a completion's isValid before its status).
    test('every real report, as the file holds it, lists its fields in the order of the schema', () => {
      const schema = readReportSchema() as {
        properties: Record<string, { properties?: Record<string, unknown> }>
        $defs: Record<string, { properties: Record<string, unknown> }>
      }
      const defs = schema.$defs
      const inOrder = (value: object, properties: Record<string, unknown>, where: string): void => {
        const keys = Object.keys(value)
        assert.deepEqual(
          keys,
          Object.keys(properties).filter((k) => keys.includes(k)),
          where,
        )
      }
      for (const [name, raw] of Object.entries(reports)) {
        const report = JSON.parse(formatJsonReport(raw)) as AuditReport
        inOrder(report, schema.properties, `${name}: the report`)
        inOrder(report.budget, schema.properties.budget.properties!, `${name}: budget`)
        for (const run of report.probeRuns) {
          inOrder(run, defs.probeRun.properties, `${name}: probe run ${run.probe}`)
          inOrder(run.completions, defs.counts.properties, `${name}: counts of ${run.probe}`)
        }
        for (const f of report.findings) inOrder(f, defs.finding.properties, `${name}: a finding`)
        for (const c of report.completions)
          inOrder(c, defs.completion.properties, `${name}: a completion`)
        if (report.toolError)
          inOrder(report.toolError, schema.properties.toolError.properties!, name)
        if (report.resumed) inOrder(report.resumed, schema.properties.resumed.properties!, name)
      }
      // The classes and their CWE ids are the code's (classes.ts).
      const findingSchema = defs.finding.properties as {
        class: { enum: string[] }
        tags: { items: { enum: string[] } }
      }
      assert.deepEqual(findingSchema.class.enum, [...findingClasses])
      assert.deepEqual(findingSchema.tags.items.enum, [...findingTags])
      // The code's list is the schema's (so a field added to one is added to the other).
      assert.deepEqual(jsonFieldOrder.report, Object.keys(schema.properties))
      assert.deepEqual(jsonFieldOrder.finding, Object.keys(defs.finding.properties))
      assert.deepEqual(jsonFieldOrder.completion, Object.keys(defs.completion.properties))
      assert.deepEqual(jsonFieldOrder.probeRun, Object.keys(defs.probeRun.properties))
      assert.deepEqual(jsonFieldOrder.counts, Object.keys(defs.counts.properties))
    })

    test('the real reports hold what the schema allows: a leak, an availability warning, inconclusive', () => {
      assert.ok(reports.leaky.findings.some((f) => f.verdict === 'leak'))
      assert.ok(reports.availability.findings.some((f) => f.probe === 'availability'))
      assert.ok(reports.toolError.probeRuns.some((r) => r.inconclusiveReasons.length > 0))
      assert.equal(reports.toolError.state, 'tool-error')
      assert.deepEqual(
        [reports.interrupted.state, reports.interrupted.interruptedBy],
        ['interrupted', 'SIGINT'],
      )
      assert.deepEqual(reports.interrupted.pendingProbes, ['canary'])
      assert.deepEqual(reports.resumed.resumed?.probes, ['boundary'])
      assert.equal(reports.resumed.state, 'finished')
    })

    test('a report that drifts from the schema does not validate', () => {
      const base = reports.leaky
      const bad: [string, unknown][] = [
        ['an unknown top-level field', { ...base, extra: 1 }],
        ['no completions', { ...base, completions: undefined }],
        ['schema version 3', { ...base, schemaVersion: 3 }],
        [
          'a finding without its class',
          { ...base, findings: [{ ...base.findings[0], class: undefined }] },
        ],
        ["a class 'leak'", { ...base, findings: [{ ...base.findings[0], class: 'leak' }] }],
        ["a verdict 'pass'", { ...base, findings: [{ ...base.findings[0], verdict: 'pass' }] }],
        [
          'a probe run without its counts',
          { ...base, probeRuns: [{ ...base.probeRuns[0], completions: undefined }] },
        ],
        ['a start time that is not a date', { ...base, startedAt: 'yesterday' }],
        ["a state 'done'", { ...base, state: 'done' }],
        ['a pending probe it does not know', { ...base, pendingProbes: ['nope'] }],
      ]
      for (const [what, report] of bad) {
        const json = JSON.parse(JSON.stringify(report)) as unknown
        assert.equal(validate(json), false, what)
      }
    })
  })
})
