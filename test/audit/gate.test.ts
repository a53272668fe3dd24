/** The audit as a CI gate cannot go green by mistake: a target that never answered a valid
 *  completion (a static file server, a wrong model, a wrong path prefix) is a tool error, not
 *  "no leak observed"; valid requests that fail are an availability finding; a `/health` that
 *  says 200 meanwhile is another; pages held while nothing runs are a page-leak warning even
 *  when earlier probes left them held. Real stand-in servers on loopback (test/audit/standins.ts). */
import assert from 'node:assert/strict'
import { describe, test } from 'node:test'
import {
  AuditError,
  exitCodeFor,
  formatJunitReport,
  runAudit,
  type AuditOptions,
  type AuditReport,
} from '../../src/audit/index.js'
import { standInTenants, startStandIn, type StandInKind, type StandInOptions } from './standins.js'

const tenants = standInTenants

async function withStandIn<T>(
  kind: StandInKind,
  standInOptions: StandInOptions,
  run: (url: string) => Promise<T>,
): Promise<T> {
  const standIn = await startStandIn(kind, standInOptions)
  try {
    return await run(standIn.url)
  } finally {
    await standIn.close()
  }
}

/** The AuditError `runAudit` throws (fails the test when it returns a report instead). */
async function toolError(options: Partial<AuditOptions> & { target: string }): Promise<AuditError> {
  const err = await runAudit({ tenants, seed: 1, ...options }).then(
    (report) => assert.fail(`the audit returned a report: ${JSON.stringify(report.findings)}`),
    (e: unknown) => e,
  )
  assert.ok(err instanceof AuditError, String(err))
  return err
}

// Every test here audits a stand-in of its own, mostly waiting on its delays: two groups run at
// once. Not more: the audits share this process's event loop, and with many at once their
// timers and reads ran late enough to change verdicts (a discovery read timing out, a cut not
// seen before the slot was given back).
describe('gate', { concurrency: 2 }, () => {
  describe('a target that answered no valid completion is a tool error', () => {
    test('a static file server (every POST 501): no_completion_answered, naming 501 and the cause', async () => {
      await withStandIn('static', {}, async (url) => {
        const err = await toolError({ target: url })
        assert.equal(err.code, 'no_completion_answered')
        assert.match(
          err.message,
          /^the target answered none of the \d+ valid completions sent to http:\/\/127\.0\.0\.1:\d+\/v1\/completions \(HTTP 501 ×\d+\); \/health answered 404: http:\/\/127\.0\.0\.1:\d+ does not serve POST \/v1\/completions: check that --target is an OpenAI-compatible endpoint, with its path prefix\. Nothing was audited$/,
        )
        assert.ok(!err.message.includes('\n'), 'one line')
        // The report it attaches: every completion failed with 501 or was cut by the auditor
        // (abort-race cuts on purpose), none answered; the per-probe counts say the same.
        const { completions, probeRuns } = err.report!
        assert.ok(
          completions.every((c) => (c.fate === 'failed' && c.status === 501) || c.fate === 'cut'),
        )
        const failed = completions.filter((c) => c.fate === 'failed').length
        assert.equal(
          probeRuns.reduce((n, r) => n + r.completions.failed, 0),
          failed,
        )
        assert.ok(probeRuns.every((r) => r.completions.answered === 0))
      })
    })

    // Was no_completion_answered after every probe had spent its requests on 404s: now one
    // completion naming the unlisted model decides before any probe runs.
    test('a wrong --model (404 model_not_found): model_not_served before any probe, naming the model and the models listed', async () => {
      await withStandIn('safe', {}, async (url) => {
        for (const probes of [undefined, ['capacity' as const]]) {
          const err = await toolError({ target: url, model: 'tiny-ecko', probes })
          assert.equal(err.code, 'model_not_served')
          assert.match(
            err.message,
            /^model "tiny-ecko" is not served by http:\/\/127\.0\.0\.1:\d+: \/v1\/models lists tiny-echo, and a completion naming it got HTTP 404 \(model_not_found\): check --model$/,
          )
          assert.equal(err.report, undefined, 'no probe ran')
        }
      })
    })

    test('a model /v1/models does not list but the endpoint serves (an alias): the audit goes on', async () => {
      await withStandIn('safe', { unlistedModels: ['tiny-alias'] }, async (url) => {
        const report = await runAudit({
          target: url,
          tenants,
          seed: 1,
          model: 'tiny-alias',
          probes: ['capacity'],
        })
        assert.equal(report.model, 'tiny-alias')
        assert.equal(report.state, 'finished')
        // The model check is the only completion: capacity sends none, so no second check.
        assert.deepEqual(
          report.completions.map((c) => [c.probe, c.status, c.fate]),
          [[null, 200, 'answered']],
        )
      })
    })

    // Probes that send no completion (capacity reads discovery only) used to let these exit 0.
    test('--probes capacity against a static file server: one check completion, 501, a tool error', async () => {
      await withStandIn('static', {}, async (url) => {
        const err = await toolError({ target: url, probes: ['capacity'] })
        assert.equal(err.code, 'no_completion_answered')
        assert.match(
          err.message,
          /^the target answered none of the 1 valid completions sent to http:\/\/127\.0\.0\.1:\d+\/v1\/completions \(HTTP 501 ×1\); \/health answered 404: http:\/\/127\.0\.0\.1:\d+ does not serve POST \/v1\/completions/,
        )
        assert.deepEqual(
          err.report!.completions.map((c) => [c.probe, c.status, c.fate]),
          [[null, 501, 'failed']],
        )
        assert.equal(err.report!.state, 'tool-error')
        assert.deepEqual(err.report!.pendingProbes, ['capacity'])
      })
    })

    test('--probes capacity with a wrong path prefix: the check completion gets 404, a tool error', async () => {
      await withStandIn('safe', {}, async (url) => {
        const err = await toolError({ target: `${url}/api`, probes: ['capacity'] })
        assert.equal(err.code, 'no_completion_answered')
        assert.match(err.message, /\(HTTP 404 ×1\).*\/api\/v1\/completions was asked/)
      })
    })

    test('--probes capacity against a served endpoint: the check completion is answered, the report stands', async () => {
      await withStandIn('safe', {}, async (url) => {
        const report = await runAudit({ target: url, tenants, seed: 1, probes: ['capacity'] })
        assert.deepEqual(
          report.findings.map((f) => [f.probe, f.verdict]),
          [['capacity', 'clean']],
        )
        assert.deepEqual(
          report.completions.map((c) => [c.probe, c.tenant, c.status, c.fate]),
          [[null, 'alice', 200, 'answered']],
        )
      })
    })

    test('a budget spent before any valid completion: a tool error saying so, not a report of inconclusives', async () => {
      await withStandIn('safe', {}, async (url) => {
        // Discovery's three reads and the two key checks take all five requests.
        const err = await toolError({ target: url, maxRequests: 5 })
        assert.equal(err.code, 'no_completion_answered')
        assert.match(
          err.message,
          /^no valid completion was sent to http:\/\/127\.0\.0\.1:\d+\/v1\/completions: the request budget \(--max-requests 5\) ran out before the first one\. Nothing was audited$/,
        )
      })
    })

    // Answers that never end were counted answered (200) or not counted (cut at the deadline):
    // exit 0 with "no leak observed".
    test('every valid answer endless, read to its size cap: truncated counts as not answered, a tool error', async () => {
      await withStandIn('safe', { isEndless: true }, async (url) => {
        const err = await toolError({ target: url, probes: ['determinism'], maxSeconds: 20 })
        assert.equal(err.code, 'no_completion_answered')
        assert.match(
          err.message,
          /\(HTTP 200 truncated ×\d+\); \/health answered 200: every answer went on past max_tokens until it was cut at its size cap: the endpoint does not end its answers\. Nothing was audited$/,
        )
        const report = err.report!
        assert.ok(report.completions.every((c) => c.fate === 'failed' && c.failure === 'truncated'))
        // Failing valid requests while /health says 200: the availability warnings stand beside it.
        assert.equal(report.findings.filter((f) => f.probe === 'availability').length, 2)
      })
    })

    test('a wrong path prefix (every path 404): says which URL was asked', async () => {
      await withStandIn('safe', {}, async (url) => {
        const err = await toolError({ target: `${url}/api` })
        assert.equal(err.code, 'no_completion_answered')
        assert.match(
          err.message,
          /check --model and the target's path prefix \(http:\/\/127\.0\.0\.1:\d+\/api\/v1\/completions was asked\)/,
        )
      })
    })

    test('every valid request failing with 502 while /health says 200: the line says both', async () => {
      await withStandIn('safe', { failValid: { status: 502, every: 1 } }, async (url) => {
        const err = await toolError({ target: url, probes: ['boundary', 'canary'] })
        assert.equal(err.code, 'no_completion_answered')
        assert.match(
          err.message,
          /\(HTTP 502 ×\d+\); \/health answered 200: the endpoint failed every one/,
        )
        const titles = err.report!.findings.filter((f) => f.probe === 'availability')
        assert.equal(titles.length, 2)
      })
    })
  })

  describe('valid requests that fail are an availability finding', () => {
    let report: AuditReport
    test('every third valid completion answered 500, /health 200: two warnings with counts and statuses', async () => {
      report = await withStandIn('safe', { failValid: { status: 500, every: 3 } }, (url) =>
        runAudit({ target: url, tenants, seed: 1, probes: ['boundary', 'canary', 'determinism'] }),
      )
      const availability = report.findings.filter((f) => f.probe === 'availability')
      assert.deepEqual(
        availability.map((f) => [f.verdict, f.severity]),
        [
          ['warning', 'high'],
          ['warning', 'high'],
        ],
      )
      const [failed, health] = availability
      const e = failed.evidence as {
        numValidSent: number
        numValidFailed: number
        failedBy: Record<string, number>
        health: { status: number }
      }
      // The stand-in fails the 1st, 4th, 7th… valid completion it sees: ⌈n / 3⌉ of n.
      assert.equal(e.numValidFailed, Math.ceil(e.numValidSent / 3))
      assert.deepEqual(e.failedBy, { 'HTTP 500': e.numValidFailed })
      assert.equal(
        failed.title,
        `${e.numValidFailed} of ${e.numValidSent} valid requests failed (HTTP 500 ×${e.numValidFailed})`,
      )
      assert.deepEqual(e.health, { endpoint: '/health', status: 200 })
      assert.equal(
        health.title,
        `/health answered 200 while ${e.numValidFailed} of ${e.numValidSent} valid requests failed`,
      )
      assert.equal(exitCodeFor(report, 'warning'), 1)
      // The JUnit report fails exactly when the exit code is 1: the availability case too.
      assert.match(
        formatJunitReport(report, 'warning'),
        /<testcase classname="kvfence\.audit" name="availability" time="0\.000">\n {6}<failure type="availability" message="\d+ of \d+ valid requests failed/,
      )
      // Per probe: the counts add up to what the ledger recorded.
      const sum = report.probeRuns.reduce((n, r) => n + r.completions.failed, 0)
      assert.equal(sum, report.completions.filter((c) => c.fate === 'failed').length)
      assert.ok(sum >= e.numValidFailed)
    })
  })

  describe('page-leak takes its baseline before any probe runs', () => {
    test('pages an earlier abort holds (released only after 14 s), 0 running: a warning', async () => {
      const report = await withStandIn('safe', { abortHoldMs: 14_000, tokenDelayMs: 3 }, (url) =>
        runAudit({ target: url, tenants, seed: 1, probes: ['abort-race', 'page-leak'] }),
      )
      const finding = report.findings.find((f) => f.probe === 'page-leak')!
      assert.deepEqual([finding.verdict, finding.severity], ['warning', 'high'])
      const e = finding.evidence as { preAuditUsage: number; held: number; numRunning: number }
      assert.equal(e.preAuditUsage, 0)
      assert.equal(e.numRunning, 0)
      assert.ok(e.held > 0)
      assert.match(
        finding.title,
        new RegExp(
          `^KV pages held while the endpoint reports 0 requests running: ${e.held} pages in use before the workload, 0 pages before the audit, still after \\d+\\.\\d s$`,
        ),
      )
    })
  })

  /** Against an endpoint whose every answer is cut at the deadline, the audit is a tool error
   *  (no valid completion answered: exit 2); the report it attaches still titles each inconclusive
   *  with its reason, which is what these tests hold. */
  describe('every inconclusive says why in its title', () => {
    const endless = { isEndless: true, tokenDelayMs: 20 }
    const cutAtDeadline =
      /^the target answered none of the (\d+) valid completions sent to \S+ \(cut at the deadline ×\1\): none ended before the time budget's deadline/

    test('error-handling whose control was cut at the deadline: says so, and its log line is not empty', async () => {
      const logs: string[] = []
      const err = await withStandIn('safe', endless, (url) =>
        toolError({
          target: url,
          probes: ['error-handling'],
          maxSeconds: 2,
          onProgress: (e) => void (e.type === 'probe-log' && logs.push(e.message)),
        }),
      )
      assert.equal(err.code, 'no_completion_answered')
      assert.match(err.message, cutAtDeadline)
      const report = err.report!
      assert.deepEqual(
        report.findings.map((f) => [f.probe, f.verdict, f.title]),
        [
          [
            'error-handling',
            'inconclusive',
            "the valid control request was not answered (no answer before its time limit), so answers to invalid ones would prove nothing (time budget exhausted; 1 cut at the time budget's deadline)",
          ],
        ],
      )
      assert.deepEqual(logs, ['no invalid request sent (time budget exhausted)'])
      assert.deepEqual(report.probeRuns[0].inconclusiveReasons, [report.findings[0].title])
      assert.deepEqual(report.probeRuns[0].completions, {
        sent: 1,
        answered: 0,
        refused: 0,
        failed: 0,
        cut: 1,
      })
    })

    test('queueing with no unloaded answer: no "?" for the unloaded time, and the deadline named', async () => {
      const err = await withStandIn('safe', endless, (url) =>
        toolError({ target: url, probes: ['queueing'], maxSeconds: 2 }),
      )
      assert.match(err.message, cutAtDeadline)
      const [finding] = err.report!.findings
      assert.equal(finding.verdict, 'inconclusive')
      assert.doesNotMatch(finding.title, /\?/)
      assert.match(finding.title, /cut at the time budget's deadline/)
    })
  })
})
