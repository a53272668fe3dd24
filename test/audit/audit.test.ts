/** `runAudit` against stand-in endpoints over real HTTP: the verdicts the auditor must reach, its
 *  budget, its reproducibility, and that it fails closed. */
import assert from 'node:assert/strict'
import { before, describe, test } from 'node:test'
import {
  AuditError,
  probeNames,
  runAudit,
  type AuditOptions,
  type AuditReport,
  type Finding,
} from '../../src/audit/index.js'
import { redactionMark } from '../../src/audit/canaries.js'
import {
  standInTenants,
  startStandIn,
  tenantKeys,
  unreachableUrl,
  type StandIn,
  type StandInKind,
} from './standins.js'

const tenants = standInTenants

async function auditStandIn(
  kind: StandInKind,
  options: Partial<AuditOptions> = {},
  standInOptions: Parameters<typeof startStandIn>[1] = {},
): Promise<{ report: AuditReport; standIn: StandIn }> {
  const standIn = await startStandIn(kind, standInOptions)
  try {
    const report = await runAudit({ target: standIn.url, tenants, seed: 1234, ...options })
    return { report, standIn }
  } finally {
    await standIn.close()
  }
}

const verdicts = (report: AuditReport, probe: string): [string, string][] =>
  report.findings.filter((f) => f.probe === probe).map((f) => [f.verdict, f.severity])

function assertNoKeys(report: AuditReport): void {
  const json = JSON.stringify(report)
  for (const key of Object.values(tenantKeys))
    assert.ok(!json.includes(key), 'a key is in the report')
}

// Every test here audits a stand-in of its own, mostly waiting on its delays: two groups run at
// once. Not more: the audits share this process's event loop, and with many at once their
// timers and reads ran late enough to change verdicts (a discovery read timing out, a cut not
// seen before the slot was given back).
describe('audit', { concurrency: 2 }, () => {
  describe('audit of a leaky endpoint (the incident: context 1024, KV pool 384)', () => {
    let report: AuditReport
    let standIn: StandIn
    before(async () => ({ report, standIn } = await auditStandIn('leaky')))

    test('capacity warns that the advertised context exceeds the KV pool, with both numbers', () => {
      assert.deepEqual(verdicts(report, 'capacity'), [['warning', 'high']])
      const [finding] = report.findings
      assert.match(finding.title, /1024.*384/)
      assert.equal(finding.evidence.advertisedContextTokens, 1024)
      assert.equal(finding.evidence.effectivePoolTokens, 384)
    })

    test('boundary warns that a prompt larger than the KV pool was accepted, with status per size', () => {
      assert.deepEqual(verdicts(report, 'boundary'), [['warning', 'high']])
      const finding = report.findings.find((f) => f.probe === 'boundary') as Finding
      assert.match(finding.title, /accepted a prompt larger than the KV pool/)
      const sizes = finding.evidence.sizes as {
        promptTokens: number
        status: number
        errorCode: string | null
      }[]
      assert.deepEqual(
        sizes.map((s) => [s.promptTokens, s.status]),
        [
          [383, 200],
          [384, 200],
          [385, 200],
          [1023, 200],
          [1024, 400],
          [1025, 400],
        ],
      )
      assert.equal(sizes[5].errorCode, 'context_length_exceeded')
    })

    test("canary finds alice's canary in bob's over-capacity output: leak, critical", () => {
      const leaks = report.findings.filter((f) => f.probe === 'canary')
      assert.ok(leaks.length >= 1)
      for (const leak of leaks) {
        assert.deepEqual([leak.verdict, leak.severity], ['leak', 'critical'])
        const e = leak.evidence as Record<string, unknown> & {
          request: Record<string, unknown>
          canary: string
        }
        assert.equal(e.victimTenant, 'alice')
        assert.equal(e.observerTenant, 'bob')
        assert.equal(e.request.status, 200)
        assert.ok((e.request.promptTokens as number) > 384)
        assert.match(e.canary, /^[A-Za-z0-9]{16,24}$/)
        assert.ok(e.canary.includes(e.matchedFragment as string))
        assert.ok((e.matchedFragment as string).length >= 8)
      }
    })

    test("the excerpt is redacted: only canaries and words of alice's planted prompts survive", () => {
      const leak = report.findings.find((f) => f.verdict === 'leak') as Finding
      const excerpt = leak.evidence.excerpt as string
      const canary = leak.evidence.canary as string
      assert.ok(excerpt.includes(canary), 'the excerpt shows the leaked canary')
      assert.ok(excerpt.length <= 160)
      // The stand-in echoes alice's stale words after its placeholder: a run of her prompt, longer
      // than the canary alone, is shown.
      const runs = excerpt.split(redactionMark).filter((r) => r !== '')
      assert.ok(
        runs.some((r) => r.length > canary.length + 8 && r.includes(canary)),
        `no run of alice's words around the canary: ${excerpt}`,
      )
      for (const run of runs) {
        assert.ok(run.length >= 8, `run shorter than 8 characters: ${run}`)
        assert.match(run, /^[A-Za-z0-9 ]+$/, `kept text that no planted prompt holds: ${run}`)
      }
    })

    test('the report has the documented shape and holds no key', () => {
      assert.equal(report.schemaVersion, 2)
      assert.equal(report.tool, 'kvfence audit')
      assert.equal(report.target, standIn.url)
      assert.equal(report.model, 'tiny-echo')
      assert.equal(report.seed, 1234)
      assert.equal(report.requestsSent, standIn.stats.numRequests)
      assertNoKeys(report)
    })
  })

  describe('audit verdicts', () => {
    test('a safe endpoint (context = pool, over-capacity → 400) is clean on every probe that can tell', async () => {
      const { report } = await auditStandIn('safe', {
        probes: [
          'capacity',
          'boundary',
          'canary',
          'abort-race',
          'concurrency',
          'determinism',
          'error-handling',
        ],
      })
      assert.deepEqual(
        report.findings.map((f) => [f.probe, f.verdict, f.severity]),
        [
          ['capacity', 'clean', 'info'],
          ['boundary', 'clean', 'info'],
          ['canary', 'clean', 'info'],
          ['abort-race', 'clean', 'info'],
          ['concurrency', 'clean', 'info'],
          ['determinism', 'clean', 'info'],
          ['error-handling', 'clean', 'info'],
        ],
      )
      const canary = report.findings[2].evidence.observerRequests as {
        kind: string
        status: number
        errorCode: string
      }[]
      const overCapacity = canary.filter((r) => r.kind === 'over-capacity')
      assert.equal(overCapacity.length, 6)
      assert.ok(
        overCapacity.every((r) => r.status === 400 && r.errorCode === 'context_length_exceeded'),
      )
    })

    // Neither endpoint answers a valid completion, so the audit is a tool error (a CI gate must not
    // pass on it); the report it attaches still says inconclusive, never clean, for every probe.
    const reportOfToolError = async (kind: StandInKind): Promise<AuditReport> => {
      const err = await auditStandIn(kind).then(
        () => assert.fail('the audit returned a report'),
        (e: unknown) => e,
      )
      assert.ok(err instanceof AuditError && err.code === 'no_completion_answered', String(err))
      assert.ok(err.report)
      return err.report
    }

    test('a broken endpoint (always 500) is inconclusive on every probe, never clean', async () => {
      const report = await reportOfToolError('broken')
      assert.deepEqual(
        report.findings.filter((f) => f.probe !== 'availability').map((f) => [f.probe, f.verdict]),
        probeNames.map((p) => [p, 'inconclusive']),
      )
    })

    test('an endpoint that refuses every completion (not for size) is inconclusive, never clean', async () => {
      const report = await reportOfToolError('refusing')
      assert.deepEqual(
        report.findings.filter((f) => f.probe !== 'availability').map((f) => [f.probe, f.verdict]),
        probeNames.map((p) => [p, p === 'capacity' ? 'clean' : 'inconclusive']),
      )
    })

    for (const [flavour, endpoint] of [
      ['kvfence', '/server_info'],
      ['sglang', '/get_server_info'],
      ['vllm', '/metrics'],
    ] as const) {
      test(`reads the KV pool the way ${flavour} reports it (${endpoint})`, async () => {
        const { report } = await auditStandIn('leaky', { probes: ['capacity'] }, { flavour })
        assert.deepEqual(verdicts(report, 'capacity'), [['warning', 'high']])
        const { evidence } = report.findings[0]
        assert.equal(evidence.effectivePoolTokens, 384)
        assert.equal(evidence.advertisedContextTokens, 1024)
        const pools = evidence.poolSources as { endpoint: string; tokens: number }[]
        assert.ok(
          pools.length > 0 && pools.every((p) => p.endpoint === endpoint && p.tokens === 384),
        )
      })
    }

    test('an unreachable endpoint is a tool error, not a verdict', async () => {
      const url = await unreachableUrl()
      await assert.rejects(runAudit({ target: url, tenants }), (err: unknown) => {
        assert.ok(err instanceof AuditError)
        assert.equal(err.code, 'target_unreachable')
        assert.match(err.message, /ECONNREFUSED/)
        return true
      })
    })

    test('fewer than two tenants, or a bad URL, is a tool error naming no key', async () => {
      await assert.rejects(
        runAudit({ target: 'http://127.0.0.1:1', tenants: tenants.slice(0, 1) }),
        /at least two tenants/,
      )
      await assert.rejects(runAudit({ target: 'ftp://x', tenants }), AuditError)
      await assert.rejects(
        runAudit({
          target: 'http://127.0.0.1:1',
          tenants: [tenants[0], { name: 'alice', key: 'k2' }],
        }),
        (err: Error) => err instanceof AuditError && !err.message.includes(tenantKeys.alice),
      )
    })

    test('token counts are calibrated from /tokenize when the server reports no usage', async () => {
      const { report } = await auditStandIn(
        'leaky',
        { probes: ['boundary'] },
        { isTokenizeOnly: true },
      )
      assert.deepEqual(verdicts(report, 'boundary'), [['warning', 'high']])
      const calibration = report.findings[0].evidence.calibration as Record<string, unknown>
      assert.deepEqual(calibration, {
        method: 'tokenize',
        overheadTokens: 1,
        tokensPerWord: 1,
        observations: [
          { words: 16, tokens: 17 },
          { words: 64, tokens: 65 },
        ],
      })
    })
  })

  describe('audit budget', () => {
    /** The report, whether the audit returned it or attached it to its tool error. */
    async function reportOrToolError(
      kind: StandInKind,
      options: Partial<AuditOptions>,
      standInOptions: Parameters<typeof startStandIn>[1] = {},
    ): Promise<{ report: AuditReport; standIn: StandIn; error: AuditError | null }> {
      const standIn = await startStandIn(kind, standInOptions)
      try {
        const report = await runAudit({ target: standIn.url, tenants, seed: 1234, ...options })
        return { report, standIn, error: null }
      } catch (err) {
        if (!(err instanceof AuditError) || err.report === undefined) throw err
        return { report: err.report, standIn, error: err }
      } finally {
        await standIn.close()
      }
    }

    // 1 and 5 requests are spent by discovery and the key checks before any valid completion: the
    // audit audited nothing, a tool error (it was a report of inconclusives, exit 0); 12 and 20
    // leave room for some.
    for (const maxRequests of [1, 5, 12, 20]) {
      test(`never sends more than --max-requests ${maxRequests}, and what it could not test is not clean`, async () => {
        const { report, standIn, error } = await reportOrToolError('leaky', { maxRequests })
        assert.ok(
          standIn.stats.numRequests <= maxRequests,
          `${standIn.stats.numRequests} > ${maxRequests}`,
        )
        assert.equal(report.requestsSent, standIn.stats.numRequests)
        assert.ok(report.findings.every((f) => f.verdict !== 'clean'))
        assert.deepEqual([...new Set(report.findings.map((f) => f.probe))], probeNames)
        if (maxRequests <= 5) {
          assert.equal(error?.code, 'no_completion_answered')
          assert.match(
            error.message,
            new RegExp(
              `the request budget \\(--max-requests ${maxRequests}\\) ran out before the first one`,
            ),
          )
        } else assert.equal(error, null)
      })
    }

    for (const concurrency of [1, 2]) {
      test(`never has more than --concurrency ${concurrency} requests in flight`, async () => {
        // 5 ms a request: long enough for requests sent together to overlap in the stand-in, and
        // the whole audit's few hundred requests one at a time still take only a second or two.
        const { standIn } = await auditStandIn('leaky', { concurrency }, { delayMs: 5 })
        assert.ok(
          standIn.stats.maxInFlight <= concurrency,
          `${standIn.stats.maxInFlight} in flight`,
        )
        if (concurrency === 2)
          assert.equal(standIn.stats.maxInFlight, 2, 'independent requests do overlap')
      })
    }

    test('stops at --max-seconds, cutting a slow request, and reports the rest inconclusive', async () => {
      // With 500 ms per request a whole audit takes well over 20 s; a 1 s budget must stop it. The
      // bound is loose on purpose: the machine may be busy, and what matters is that it stopped.
      // Discovery alone takes the second: no valid completion ends in time, so the audit is a tool
      // error (it was exit 0 with every probe inconclusive); its report still says what it saw.
      const started = Date.now()
      const { report, error } = await reportOrToolError('safe', { maxSeconds: 1 }, { delayMs: 500 })
      const elapsedMs = Date.now() - started
      assert.ok(elapsedMs < 10_000, `took ${elapsedMs} ms`)
      assert.equal(error?.code, 'no_completion_answered')
      assert.ok(report.durationMs < 10_000, `report says ${report.durationMs} ms`)
      const canary = report.findings.filter((f) => f.probe === 'canary')
      assert.deepEqual(
        canary.map((f) => f.verdict),
        ['inconclusive'],
      )
    })
  })

  describe('audit reproducibility', () => {
    const leakedCanaries = (report: AuditReport): string[] =>
      report.findings.filter((f) => f.verdict === 'leak').map((f) => f.evidence.canary as string)
    const sizes = (report: AuditReport): unknown =>
      report.findings.find((f) => f.probe === 'canary')?.evidence.overCapacityPlan

    let first: AuditReport
    before(
      async () =>
        ({ report: first } = await auditStandIn('leaky', { seed: 42, probes: ['canary'] })),
    )

    test('the same seed plants the same canaries and sends the same sizes in the same order', async () => {
      const { report: second } = await auditStandIn('leaky', { seed: 42, probes: ['canary'] })
      assert.ok(leakedCanaries(first).length > 0)
      assert.deepEqual(leakedCanaries(second), leakedCanaries(first))
      assert.deepEqual(sizes(second), sizes(first))
      assert.deepEqual(
        second.findings.map((f) => f.evidence.excerpt),
        first.findings.map((f) => f.evidence.excerpt),
      )
    })

    test('another seed plants other canaries', async () => {
      const { report: other } = await auditStandIn('leaky', { seed: 43, probes: ['canary'] })
      const firstSet = new Set(leakedCanaries(first))
      assert.ok(leakedCanaries(other).length > 0)
      assert.ok(leakedCanaries(other).every((c) => !firstSet.has(c)))
    })
  })
})
