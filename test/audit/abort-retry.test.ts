/** Probe `abort-retry` against stand-ins over real HTTP: a chunked prefill over a per-tenant
 *  prefix cache that publishes an aborted prefill's half-written pages (sglang#38319) must be
 *  found, on the kvfence, SGLang and vLLM surfaces (the chunk size reported by kvfence's
 *  `prefillChunkTokens`, SGLang's `chunked_prefill_size`, or, for vLLM, not at all); its twin
 *  that publishes only completed prefills must be clean; an endpoint where no cut can be timed,
 *  or a budget that ends first, is inconclusive with the reason, never clean. */
import assert from 'node:assert/strict'
import { describe, test } from 'node:test'
import { AuditError, runAudit, type AuditOptions, type AuditReport } from '../../src/audit/index.js'
import { defaultChunkTokens } from '../../src/audit/probes/abort-retry.js'
import { standInTenants, startStandIn, type StandInOptions } from './standins.js'

async function audit(
  options: StandInOptions,
  extra: Partial<AuditOptions> = {},
): Promise<AuditReport> {
  const standIn = await startStandIn('safe', options)
  try {
    return await runAudit({
      target: standIn.url,
      tenants: standInTenants,
      seed: 5,
      probes: ['abort-retry'],
      ...extra,
    })
  } finally {
    await standIn.close()
  }
}

const verdicts = (report: AuditReport): string[][] =>
  report.findings.map((f) => [f.probe, f.verdict, f.severity])

/** 128-token chunks of 20 ms: the stand-in's prompt (pool 384) spans two of them. */
const chunked = (isPartialPublished: boolean) => ({
  chunkTokens: 128,
  stepMs: 20,
  isPartialPublished,
})

// Every test here audits a stand-in of its own, mostly waiting on its delays: two groups run at
// once. Not more: the audits share this process's event loop, and with many at once their
// timers and reads ran late enough to change verdicts (a discovery read timing out, a cut not
// seen before the slot was given back).
describe('abort-retry', { concurrency: 2 }, () => {
  describe('abort-retry', () => {
    // The chunk the probe sizes by: reported (128), or the default when vLLM reports none. It
    // wants 128 + 3 × 128 = 512 filler tokens (more for the default), but the stand-in's pool
    // (384) − max_tokens 16 − 8 spare − the 96-token bound of the first word and the canary tail
    // leaves 264; SGLang's input limit, min(384 − 1, 384 − 1) − 5 = 378, refusing 378 and more,
    // leaves 377 − 24 − 96 = 257. Tokens: BOS + the first word + (filler − 1) words + 5 tail words.
    const cases = [
      { flavour: 'kvfence', chunkTokens: 128, isChunkReported: true, promptTokens: 269 },
      { flavour: 'sglang', chunkTokens: 128, isChunkReported: true, promptTokens: 262 },
      {
        flavour: 'vllm',
        chunkTokens: defaultChunkTokens,
        isChunkReported: false,
        promptTokens: 269,
      },
    ] as const
    for (const c of cases) {
      test(`${c.flavour}: an aborted prefill's pages published, the retry reads the priming tenant's words: leak, critical, bob → alice`, async () => {
        const report = await audit({ flavour: c.flavour, chunkedPrefill: chunked(true) })
        const [first] = report.findings
        assert.deepEqual(verdicts(report)[0], ['abort-retry', 'leak', 'critical'])
        assert.equal(first.evidence.victimTenant, 'bob')
        assert.equal(first.evidence.observerTenant, 'alice')
        assert.match(first.title, /^alice's retry \(same tenant, right after the cut\) answer/)
        assert.equal(first.evidence.chunkTokens, c.chunkTokens)
        assert.equal(first.evidence.isChunkReported, c.isChunkReported)
        // 1 BOS + the fresh first word + filler + "key:" c1 "c2." "key:" c1[:8] (5 words).
        assert.equal(first.evidence.promptTokens, c.promptTokens)
        assert.deepEqual(first.controls, { aisvs: ['5.5.5'], guards: ['G5'] })
      })

      test(`${c.flavour}: only completed prefills published, cached_tokens reported: clean, with cuts during prefill and a cache hit seen`, async () => {
        const report = await audit({
          flavour: c.flavour,
          chunkedPrefill: { ...chunked(false), isCachedTokensReported: true },
        })
        assert.deepEqual(verdicts(report), [['abort-retry', 'clean', 'info']])
        const attempts = report.findings[0].evidence.attempts as { isCutInPrefill: boolean }[]
        assert.equal(attempts.length, 6)
        assert.ok(attempts.some((a) => a.isCutInPrefill))
        // The positive control: the last prompt answered whole, sent again, served from the cache.
        const control = report.findings[0].evidence.cacheControl as { cachedTokens: number }
        assert.equal(control.cachedTokens, c.promptTokens)
      })

      test(`${c.flavour}: only completed prefills published, no cached_tokens: inconclusive, no cache hit seen`, async () => {
        const report = await audit({ flavour: c.flavour, chunkedPrefill: chunked(false) })
        assert.deepEqual(verdicts(report), [['abort-retry', 'inconclusive', 'medium']])
        // No cached_tokens to steer by: the six fixed cut points, one after the other.
        assert.equal((report.findings[0].evidence.attempts as unknown[]).length, 6)
        assert.match(report.findings[0].title, /no request was seen served from a prefix cache/)
      })
    }

    test('unwritten pages published blank: the retry differs with no canary: warning, high', async () => {
      const report = await audit({
        chunkedPrefill: { ...chunked(true), isUnwrittenBlank: true },
      })
      assert.deepEqual(verdicts(report), [['abort-retry', 'warning', 'high']])
      const e = report.findings[0].evidence as {
        differing: { tenant: string; label: string }[]
        requestNumber: number
      }
      // Only the cut tenant's own retry reads the published pages; the other tenant's is cold.
      assert.deepEqual(
        e.differing.map((d) => [d.tenant, d.label]),
        [['alice', 'retry (same tenant, right after the cut)']],
      )
      assert.equal(typeof e.requestNumber, 'number')
    })

    test('answers that never end: a tool error, the probe inconclusive in its report (no cut can be timed), never clean', async () => {
      // No valid answer ended, so the audit as a whole is a tool error (exit 2): see gate.test.ts.
      const err = await audit({ isEndless: true }, { maxSeconds: 20, requestTimeoutMs: 3000 }).then(
        () => assert.fail('the audit returned a report'),
        (e: unknown) => e,
      )
      assert.ok(err instanceof AuditError, String(err))
      assert.equal(err.code, 'no_completion_answered')
      const report = err.report!
      const own = { ...report, findings: report.findings.filter((f) => f.probe === 'abort-retry') }
      assert.deepEqual(verdicts(own), [['abort-retry', 'inconclusive', 'medium']])
      assert.match(own.findings[0].title, /no token counts|no cut could be timed/)
    })

    test('a request budget that ends after the cold run: inconclusive, naming the budget', async () => {
      // Discovery (3 GETs), key checks (2), calibration (2), then attempt 0's cold run and priming.
      const report = await audit({ chunkedPrefill: chunked(false) }, { maxRequests: 9 })
      assert.deepEqual(verdicts(report), [['abort-retry', 'inconclusive', 'medium']])
      assert.match(report.findings[0].title, /no cut could be timed|request budget exhausted/)
      assert.match(report.findings[0].title, /request budget exhausted/)
    })

    test('a pool that cannot hold a prompt over one reported chunk: inconclusive, nothing sent', async () => {
      const standIn = await startStandIn('safe', {
        flavour: 'sglang',
        chunkedPrefill: { chunkTokens: 512, stepMs: 1, isPartialPublished: true },
      })
      try {
        const report = await runAudit({
          target: standIn.url,
          tenants: standInTenants,
          seed: 5,
          probes: ['abort-retry'],
        })
        assert.deepEqual(verdicts(report), [['abort-retry', 'inconclusive', 'medium']])
        assert.match(report.findings[0].title, /not a prompt over one prefill chunk \(512 tokens\)/)
        // The probe sent none: the one completion is the audit's own check that the target
        // answers (sent when no probe sent a valid one; see gate.test.ts).
        assert.equal(standIn.stats.paths.filter((p) => p === 'POST /v1/completions').length, 1)
      } finally {
        await standIn.close()
      }
    })
  })
})
