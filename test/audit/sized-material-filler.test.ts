/** Filler of sized prompts attributable to the tenant that sent it (issue #28: "everything the
 *  auditor sends must be attributable to the tenant that sent it, eviction and filler traffic
 *  included"). `warm-equals-cold`, `stall` and `evict-then-return` size their prompts in
 *  sized-material.ts; their filler was the sizer's cycle "a b c … p", the same for every tenant, so
 *  an answer replaying another tenant's filler, no canary in it, named no one. Now every prompt
 *  has its own keyed filler (random letters of the same alphabet): under a real byte-level BPE
 *  (Qwen3's) each prompt costs exactly what the same prompt with the cycle costs, and
 *  `warm-equals-cold` records each tenant's fillers, so a chunked-prefill stand-in that answers a
 *  tenant with words from the middle of another tenant's prompt is a content-leak naming that
 *  tenant; its twin, answering each request from its own prompt, is clean. */
import assert from 'node:assert/strict'
import { before, describe, test } from 'node:test'
import { Budget } from '../../src/audit/budget.js'
import { makeCanary } from '../../src/audit/canaries.js'
import { runAudit, type AuditReport } from '../../src/audit/index.js'
import { findFillerRun, keyedFiller } from '../../src/audit/probes/material.js'
import {
  boundedPrompt,
  markedPrompt,
  markEveryWords,
  measureCanary,
  sizedPrompt,
} from '../../src/audit/probes/sized-material.js'
import { createRng } from '../../src/audit/rng.js'
import { calibrate, fillerAlphabet, fillerText, type PromptSizer } from '../../src/audit/sizer.js'
import { createTarget } from '../../src/audit/target.js'
import { loadTokenizer, type Tokenizer } from '../../src/model/tokenizer.js'
import { qwen3TokenizerDir } from '../helpers/qwen3.js'
import { standInTenants, startStandIn } from './standins.js'

let tokenizer: Tokenizer
const countTokens = (prompt: string): number => tokenizer.encode(prompt).length

before(() => {
  const dir = qwen3TokenizerDir()
  try {
    tokenizer = loadTokenizer(dir.dir)
  } finally {
    dir.remove()
  }
})

/** `prompt` with every single-letter word after its first `skip` words replaced by the sizer's
 *  cycle: the prompt as it was sent before filler was keyed. */
function withCycle(prompt: string, skip: number): string {
  const words = prompt.split(' ')
  let n = 0
  const cycle = fillerText(words.length).split(' ')
  return words
    .map((w, i) => (i >= skip && w.length === 1 && fillerAlphabet.includes(w) ? cycle[n++] : w))
    .join(' ')
}

describe('keyed filler in sized prompts costs what the cycle did under a real BPE', () => {
  let sizer: PromptSizer
  let target: ReturnType<typeof createTarget>
  let measured: Awaited<ReturnType<typeof measureCanary>>
  before(async () => {
    const standIn = await startStandIn('safe', { countTokens })
    try {
      target = createTarget({
        baseUrl: standIn.url,
        model: null,
        tenants: standInTenants,
        budget: new Budget({ maxRequests: 20, maxSeconds: 60, concurrency: 2 }),
        requestTimeoutMs: 10_000,
      })
      sizer = (await calibrate(target)) as PromptSizer
      const rng = createRng(11, 'measure')
      measured = await measureCanary(target, rng, sizer, standInTenants[0], makeCanary(rng))
    } finally {
      await standIn.close()
    }
  })

  test('sizedPrompt: its own filler (returned), at the same token count as with the cycle', () => {
    assert.equal(measured.canaryTokens, countTokens(` ${measured.canary}`))
    const rng = createRng(7, 'sized')
    const seen = new Set<string>()
    for (const numTokens of [16, 17, 31, 32, 33, 64, 127, 128, 129, 256, 383]) {
      for (const canary of [measured, null]) {
        const { prompt, filler, hasCanary } = sizedPrompt(rng, sizer, numTokens, canary)
        assert.equal(hasCanary, canary !== null)
        assert.ok(prompt.endsWith(` ${filler}`))
        assert.ok(filler.split(' ').every((w) => w.length === 1 && fillerAlphabet.includes(w)))
        assert.ok(!seen.has(filler), 'no two prompts share a filler')
        seen.add(filler)
        // Skip the head (6 letters) and the canary: only the filler is swapped.
        const cycle = withCycle(prompt, canary === null ? 6 : 7)
        assert.notEqual(cycle, prompt)
        assert.equal(countTokens(prompt), countTokens(cycle), `${numTokens} tokens`)
        if (prompt.includes(measured.canary)) assert.equal(countTokens(prompt), numTokens)
      }
    }
  })

  test('boundedPrompt and markedPrompt: keyed filler, never over, the same count as the cycle', () => {
    const rng = createRng(8, 'bounded')
    const { canary } = measured
    for (const numTokens of [64, 128, 383, 1000]) {
      const bounded = boundedPrompt(rng, sizer, numTokens, canary)
      assert.equal(countTokens(bounded), countTokens(withCycle(bounded, 7)))
      assert.ok(countTokens(bounded) <= numTokens)
      assert.notEqual(withCycle(bounded, 7), bounded)
      const marked = markedPrompt(rng, sizer, numTokens, canary, measured)
      assert.ok(countTokens(marked) <= numTokens)
      const segments = marked.split(` ${canary}`).slice(1, -1)
      // At 64 tokens not even one repeat fits: boundedPrompt's shape, the canary once.
      assert.equal(segments.length === 0, numTokens === 64)
      for (const s of segments) assert.equal(s.trim().split(' ').length, markEveryWords)
      assert.equal(countTokens(marked), countTokens(withCycle(marked, 0)))
      assert.equal(new Set(segments).size, segments.length, 'each segment its own filler')
    }
  })

  test('several fillers kept newline-separated: a run inside one is found, one across two never', () => {
    const rng = createRng(9, 'runs')
    const a = keyedFiller(rng, 40).split(' ')
    const b = keyedFiller(rng, 40).split(' ')
    const fillers = `${a.join(' ')}\n${b.join(' ')}`
    const startOfB = b.slice(0, 12).join(' ')
    assert.equal(findFillerRun(`x ${startOfB} y`, fillers)?.fragment, startOfB)
    const endOfA = a.slice(28).join(' ')
    assert.equal(findFillerRun(`${endOfA} q`, fillers)?.fragment, endOfA)
    const across = [...a.slice(34), ...b.slice(0, 6)].join(' ')
    assert.equal(findFillerRun(across, fillers), null)
  })
})

/** 128-token chunks, `cached_tokens` reported: the model answers 16 words from the middle of a
 *  prompt, the request's own or the last one another tenant sent. */
async function audit(answerFrom: 'own' | 'other'): Promise<AuditReport> {
  const standIn = await startStandIn('safe', {
    chunkedPrefill: {
      chunkTokens: 128,
      stepMs: 1,
      isPartialPublished: false,
      isCachedTokensReported: true,
      answerFrom,
    },
  })
  try {
    return await runAudit({
      target: standIn.url,
      tenants: standInTenants,
      seed: 5,
      probes: ['warm-equals-cold'],
    })
  } finally {
    await standIn.close()
  }
}

describe('warm-equals-cold: another tenant’s filler in an answer', () => {
  test('an engine answering a tenant with words of the other’s prompt (no canary among them): content-leak naming the other', async () => {
    const report = await audit('other')
    const [first] = report.findings
    assert.deepEqual(
      [first.probe, first.verdict, first.severity, first.class],
      ['warm-equals-cold', 'leak', 'critical', 'content-leak'],
    )
    // Each tenant's cold prompt follows the other's, so either may be the first named.
    assert.deepEqual([first.evidence.observerTenant, first.evidence.victimTenant].sort(), [
      'alice',
      'bob',
    ])
    for (const f of report.findings)
      assert.notEqual(f.evidence.victimTenant, f.evidence.observerTenant)
    // Every answer (another tenant's prompt, then the observer's cold and warm, per length) is
    // 16 words of the other tenant's latest prompt: every one is a crossing. Only the short
    // lengths' carry a canary; with the sizer's cycle as filler, 10 of the 45 were caught.
    const runs = first.evidence.runs as { outcome: string }[]
    assert.equal(runs.length, 15)
    assert.ok(runs.every((r) => r.outcome === 'compared'))
    assert.equal(first.evidence.numCrossings, 3 * runs.length)
    assert.equal(first.evidence.numCrossTenant, 3 * runs.length)
  })

  test('its twin, answering each request from its own prompt: clean', async () => {
    const report = await audit('own')
    assert.deepEqual(
      report.findings.map((f) => [f.probe, f.verdict]),
      [['warm-equals-cold', 'clean']],
    )
  })
})
