/** The queueing probe's holders fit the advertised context: asking 256 generated tokens on top of
 *  a canary prompt made kvfence's 384-token window refuse every holder with 400
 *  `context_length_exceeded`, so nothing held the batch and the verdict rested on noise. */
import assert from 'node:assert/strict'
import { test } from 'node:test'
import { runAudit } from '../../src/audit/index.js'
import { holderMaxTokensFor } from '../../src/audit/probes/queueing.js'
import { standInTenants as tenants, startStandIn } from './standins.js'

test('holders ask what the context leaves after their prompt, from the baseline tokens per character', () => {
  const prompt = 'x'.repeat(300)
  // No context known: the probe's own 256.
  assert.equal(holderMaxTokensFor(prompt, null, []), 256)
  // A wide context: 256 fits.
  assert.equal(holderMaxTokensFor(prompt, 4096, []), 256)
  // No token counts reported: one token per character, + 8: 384 − 308.
  assert.equal(holderMaxTokensFor(prompt, 384, [{ promptChars: 200, promptTokens: null }]), 76)
  // 0.5 tokens per character measured, + 10 %: ceil(300 × 0.55) + 8 = 173; 384 − 173.
  assert.equal(holderMaxTokensFor(prompt, 384, [{ promptChars: 200, promptTokens: 100 }]), 211)
  // The largest ratio of the baseline is the one used; never above one per character.
  assert.equal(
    holderMaxTokensFor(prompt, 384, [
      { promptChars: 200, promptTokens: 100 },
      { promptChars: 100, promptTokens: 120 },
    ]),
    76,
  )
  // A context the prompt alone fills: still a valid request of one token.
  assert.equal(holderMaxTokensFor(prompt, 100, []), 1)
})

test('a context of 200 tokens: every holder is answered and the queued requests are seen waiting: clean', async () => {
  // The safe stand-in's context is its pool: 200 tokens, a canary prompt ~40 of them; 256
  // generated tokens on top were refused with 400.
  // Tokens at 10 ms: a holder of ~150 tokens holds the batch for 1.5 s, a wait that stands out
  // from the unloaded time on a loaded machine.
  const standIn = await startStandIn('safe', { maxBatch: 1, tokenDelayMs: 10, poolTokens: 200 })
  try {
    const report = await runAudit({ target: standIn.url, tenants, seed: 77, probes: ['queueing'] })
    const finding = report.findings.find((f) => f.probe === 'queueing')!
    assert.equal(finding.evidence.holdersAnswered, finding.evidence.holders)
    assert.ok((finding.evidence.holders as number) >= 1)
    assert.deepEqual([finding.verdict, finding.severity], ['clean', 'info'])
    assert.ok((finding.evidence.numQueued as number) >= 1)
    const refusedForLength = report.completions.filter((c) => c.status === 400)
    assert.deepEqual(refusedForLength, [])
  } finally {
    await standIn.close()
  }
})
