/** The auditor against a stand-in for Hugging Face `transformers serve` (hf-standin.ts): an
 *  endpoint that says nothing of its context or pool, validates no `max_tokens`, keeps
 *  generating after its client leaves, dies on a prompt over its pool, shares cache pages only
 *  after a second generated token and reports no `cached_tokens`. Each test reproduces what the
 *  auditor got wrong on the real server: it must not harm the endpoint, must say when it went
 *  down, and must call clean only what it exercised. */
import assert from 'node:assert/strict'
import { after, describe, test } from 'node:test'
import { exitCodeFor, planAudit, runAudit, type AuditReport } from '../../src/audit/index.js'
import { formatSummary } from '../../src/audit/reporters/console.js'
import { unknownLimitTokens } from '../../src/audit/prompt-ceiling.js'
import { outageMinRequests } from '../../src/audit/outage.js'
import { startHfStandIn, type HfStandIn } from './hf-standin.js'
import { standInTenants, startStandIn } from './standins.js'

const tenants = [
  { name: 'alice', key: 'any-key-alice' },
  { name: 'bob', key: 'any-key-bob' },
]
const opened: HfStandIn[] = []
after(async () => {
  await Promise.all(opened.map((s) => s.close()))
})
async function standIn(options: Parameters<typeof startHfStandIn>[0]): Promise<HfStandIn> {
  const s = await startHfStandIn(options)
  opened.push(s)
  return s
}
const verdictOf = (report: AuditReport, probe: string) =>
  report.findings.filter((f) => f.probe === probe).map((f) => f.verdict)

// Every test here audits a stand-in of its own, mostly waiting on its delays: two groups run at
// once. Not more: the audits share this process's event loop, and with many at once their
// timers and reads ran late enough to change verdicts (a discovery read timing out, a cut not
// seen before the slot was given back).
describe('hf-standin', { concurrency: 2 }, () => {
  test('no limit known: error-handling sends no max_tokens past what is known, so a server that never validates it is not wedged', async () => {
    const s = await standIn({ maxBatch: 1 })
    const report = await runAudit({ target: s.url, tenants, seed: 1, probes: ['error-handling'] })
    // The control's max_tokens 1 and the malformed cases' (4 with no prompt, refused before
    // generating; −1): nothing past them.
    assert.equal(s.stats.maxMaxTokens, 1)
    assert.equal(s.stats.numTokensAfterLeaving, 0)
    assert.equal(s.stats.numGenerating, 0)
    const finding = report.findings.find((f) => f.probe === 'error-handling')!
    assert.match(JSON.stringify(finding.evidence.notSent), /max_tokens over the context/)
  })

  test('--plan prices the over-context max_tokens it would send: none by default, 2^20 + 1 with --aggressive, the context + 1 with --context-window', async () => {
    const s = await standIn({})
    const row = async (extra: Record<string, unknown>) => {
      const plan = await planAudit({ target: s.url, tenants, probes: ['error-handling'], ...extra })
      const probe = plan.probes.find((p) => p.probe === 'error-handling')!
      return probe.requests.find((r) => r.what === 'max_tokens over the context') ?? null
    }
    assert.equal(await row({}), null)
    assert.deepEqual(await row({ isAggressive: true }), {
      what: 'max_tokens over the context',
      numRequests: 1,
      tokensEach: 2 ** 20 + 1 + 2,
    })
    assert.deepEqual(await row({ contextWindow: 1024 }), {
      what: 'max_tokens over the context',
      numRequests: 1,
      tokensEach: 1024 + 1 + 2,
    })
    const plan = await planAudit({
      target: s.url,
      tenants,
      contextWindow: 1024,
      kvPoolTokens: 4096,
    })
    assert.equal(plan.contextTokens, 1024)
    assert.equal(plan.poolTokens, 4096)
  })

  test('no limit known: the sizing probes grow prompts from answered ones and stay under the cap, so a 2,048-token pool survives; warm-equals-cold and abort-retry, with no cache hit seen, are inconclusive', async () => {
    const s = await standIn({ poolTokens: 2048, maxBatch: 4, tokenDelayMs: 0 })
    const report = await runAudit({
      target: s.url,
      tenants,
      seed: 3,
      probes: ['canary', 'abort-retry', 'warm-equals-cold', 'error-handling'],
    })
    assert.equal(s.stats.deathCause, null)
    assert.ok(
      s.stats.maxPromptTokens <= unknownLimitTokens,
      `largest prompt ${s.stats.maxPromptTokens} tokens`,
    )
    assert.deepEqual(verdictOf(report, 'warm-equals-cold'), ['inconclusive'])
    assert.deepEqual(verdictOf(report, 'abort-retry'), ['inconclusive'])
    assert.match(
      report.findings.find((f) => f.probe === 'abort-retry')!.title,
      /no request was seen served from a prefix cache|no cut landed during prefill/,
    )
    assert.deepEqual(verdictOf(report, 'availability'), [])
  })

  test('an endpoint that goes down during the audit is a high availability finding naming when, and the gate fails', async () => {
    const s = await standIn({ dieAfterCompletions: 30, maxBatch: 4, tokenDelayMs: 0 })
    const report = await runAudit({
      target: s.url,
      tenants,
      seed: 5,
      probes: ['canary', 'concurrency', 'determinism', 'queueing'],
    })
    const down = report.findings.filter((f) => f.probe === 'availability' && f.evidence.outage)
    assert.equal(down.length, 1)
    assert.equal(down[0].severity, 'high')
    // The first valid completion answered 503, from the report's own timeline.
    const first503 = report.completions.find((c) => c.status === 503 && c.isValid !== false)!
    const outage = down[0].evidence.outage as {
      firstFailure: { requestNumber: number }
      numFailedInARow: number
      health: { before: number; after: number }
    }
    assert.equal(outage.firstFailure.requestNumber, first503.requestNumber)
    assert.ok(outage.numFailedInARow >= outageMinRequests)
    assert.deepEqual(outage.health, { before: 200, after: 503 })
    assert.match(down[0].title, new RegExp(`at request #${first503.requestNumber} `))
    assert.equal(exitCodeFor(report), 1)
    assert.doesNotMatch(formatSummary(report), /no leak observed/)
  })

  test('queueing compares streamed with streamed: an engine with no queue at all is not called clean', async () => {
    const s = await standIn({ maxBatch: 64, tokenDelayMs: 20 })
    const report = await runAudit({ target: s.url, tenants, seed: 9, probes: ['queueing'] })
    assert.equal(s.stats.numWaiting, 0)
    const finding = report.findings.find((f) => f.probe === 'queueing')!
    assert.equal(finding.verdict, 'inconclusive', finding.title)
  })

  test("after eviction, an answer replaying the eviction traffic names whose traffic it was: another tenant's material, a leak", async () => {
    const s = await standIn({ poolTokens: 1024, staleReturn: true, maxBatch: 4, tokenDelayMs: 0 })
    const report = await runAudit({
      target: s.url,
      tenants,
      seed: 11,
      probes: ['evict-then-return'],
      kvPoolTokens: 1024,
    })
    assert.equal(s.stats.deathCause, null)
    const leaks = report.findings.filter(
      (f) => f.probe === 'evict-then-return' && f.verdict === 'leak',
    )
    assert.ok(leaks.length > 0, JSON.stringify(report.findings.map((f) => f.title)))
    assert.ok(
      leaks.some((f) => /carried a canary planted by (alice|bob)/.test(f.title)),
      leaks.map((f) => f.title).join('\n'),
    )
  })

  test('500 on /v1/models and streams without [DONE]: the audit runs and reads the streamed answers', async () => {
    const s = await standIn({ isModelsBroken: true, maxBatch: 4, tokenDelayMs: 0 })
    const report = await runAudit({ target: s.url, tenants, seed: 13, probes: ['canary'] })
    const run = report.probeRuns.find((r) => r.probe === 'canary')!
    assert.equal(run.completions.failed, 0)
    assert.ok(run.completions.answered > 0)
    assert.deepEqual(verdictOf(report, 'canary').includes('leak'), false)
  })

  test('--kv-pool-tokens is used over the pool the endpoint reports, and the capacity finding names the difference', async () => {
    const s = await startStandIn('safe')
    try {
      const report = await runAudit({
        target: s.url,
        tenants: standInTenants,
        seed: 1,
        probes: ['capacity'],
        kvPoolTokens: 512,
      })
      const finding = report.findings.find((f) => f.probe === 'capacity')!
      assert.deepEqual(finding.evidence.givenDisagreements, [
        {
          flag: '--kv-pool-tokens',
          givenTokens: 512,
          reported: (finding.evidence.poolSources as { endpoint: string }[]).filter(
            (p) => p.endpoint !== '--kv-pool-tokens',
          ),
        },
      ])
      assert.equal(finding.evidence.effectivePoolTokens, 512)
      assert.match(finding.title, /--kv-pool-tokens 512 used where the endpoint reports 384/)
    } finally {
      await s.close()
    }
  })
})

// Decided by TTFT: run alone, after the group above, so that no other audit in this process
// delays the answers it times.
test('prefix-timing finds a prefix cache shared by every tenant whose pages are shared only after a second generated token', async () => {
  const s = await standIn({ sharedPrefixCache: true, prefillMsPerToken: 0.2, tokenDelayMs: 0 })
  const report = await runAudit({ target: s.url, tenants, seed: 7, probes: ['prefix-timing'] })
  const finding = report.findings.find((f) => f.probe === 'prefix-timing')!
  // Observable reuse of another tenant's prefix is a side channel, not text that crossed.
  assert.equal(finding.verdict, 'warning', finding.title)
  assert.equal(finding.class, 'side-channel')
  assert.match(finding.title, /timing side channel/)
  assert.ok(s.stats.numCachedTokensServed > 0)
})
