/** Filler attributable to the request that sent it (issue #28: "everything the auditor sends must
 *  be attributable to the tenant that sent it, eviction and filler traffic included").
 *  abort-retry's prompts are mostly filler; it was the sizer's cycle "a b c … p" for every tenant,
 *  so an answer repeating another tenant's filler, no canary in it, named no one. Now each request
 *  has its own filler (random letters of the same alphabet, so its cost is unchanged: see
 *  bpe-sizing.test.ts) and an answer that repeats 12 of its words in a row is that request's
 *  material. Here: the matcher on its own (exact runs, properties), then a chunked-prefill
 *  stand-in that answers alice with words from the middle of bob's last prompt (words alone) is a
 *  content-leak naming bob; its twin, answering each request from its own prompt, is clean. */
import assert from 'node:assert/strict'
import { describe, test } from 'node:test'
import fc from 'fast-check'
import { runAudit, type AuditReport } from '../../src/audit/index.js'
import {
  findCrossings,
  findFillerRun,
  keyedFiller,
  minFillerWords,
  type Observed,
  type Planted,
} from '../../src/audit/probes/material.js'
import { createRng } from '../../src/audit/rng.js'
import { fillerAlphabet, fillerText } from '../../src/audit/sizer.js'
import { completionResult } from './completion-result.js'
import { standInTenants, startStandIn } from './standins.js'

describe('keyed filler and its matcher', () => {
  test('a keyed filler is letters of the sizer’s alphabet, one a word, drawn per request', () => {
    const a = keyedFiller(createRng(1, 'x'), 300)
    const b = keyedFiller(createRng(2, 'x'), 300)
    assert.equal(a.split(' ').length, 300)
    assert.ok(a.split(' ').every((w) => w.length === 1 && fillerAlphabet.includes(w)))
    assert.notEqual(a, b)
    // The sizer's own filler is the same words for everyone: not attributable.
    assert.equal(fillerText(32), fillerText(32))
  })

  test('exact runs: 12 words in a row found (the longest run, where it starts), 11 not', () => {
    const filler = 'a b c d e f g h i j k l m n o p'
    assert.deepEqual(findFillerRun(' x c d e f g h i j k l m n y', filler), {
      canary: 'c d e f g h i j k l m n',
      fragment: 'c d e f g h i j k l m n',
      index: 3,
    })
    assert.equal(findFillerRun('c d e f g h i j k l m', filler), null)
    assert.equal(minFillerWords, 12)
    // Words must follow in the filler's order and be whole words.
    assert.equal(findFillerRun('c d e f g h i j k l m o', filler), null)
    assert.equal(findFillerRun('cc d e f g h i j k l m n', filler), null)
  })

  test('any 12 to 16 words of a request’s filler are found wherever they sit; another request’s filler never matches (property)', () => {
    fc.assert(
      fc.property(
        fc.integer({ min: 0, max: 2 ** 32 - 1 }),
        fc.integer({ min: minFillerWords, max: 16 }),
        fc.nat(),
        fc.string({ maxLength: 20 }),
        (seed, numWords, at, before) => {
          const own = keyedFiller(createRng(seed, 'own'), 2000).split(' ')
          const other = keyedFiller(createRng(seed, 'other'), 2000)
          const start = at % (own.length - numWords)
          const run = own.slice(start, start + numWords).join(' ')
          const text = `${before.replace(/\S/g, 'Z')} ${run} Q`
          const hit = findFillerRun(text, own.join(' '))
          assert.ok(hit !== null && hit.fragment.split(' ').length >= numWords)
          assert.equal(text.slice(hit.index, hit.index + run.length), run)
          assert.equal(findFillerRun(text, other), null)
        },
      ),
    )
  })

  test('findCrossings names the request whose filler an answer repeats, not the observer’s own', () => {
    const rng = createRng(3, 'crossing')
    const [alice, bob] = standInTenants
    const plant = (id: string, tenant: (typeof standInTenants)[number]): Planted => {
      const filler = keyedFiller(rng, 200)
      return { id, tenant, canaries: [], prompt: `Nonce ${filler} key:`, filler }
    }
    const a = plant('a0', alice)
    const p = plant('p0', bob)
    const words = (f: Planted) => f.filler!.split(' ').slice(50, 66).join(' ')
    const answer = (planted: Planted, text: string): Observed => ({
      planted,
      label: 'retry',
      stream: false,
      result: completionResult({ text }),
    })
    const crossings = findCrossings([answer(a, words(p)), answer(p, words(p))], [a, p])
    assert.deepEqual(
      crossings.map((c) => [c.observed.planted.id, c.source.tenant.name, c.match.isFiller]),
      [['a0', 'bob', true]],
    )
  })
})

/** 128-token chunks of 20 ms, `cached_tokens` reported, only completed prefills published. */
async function audit(answerFrom: 'own' | 'other'): Promise<AuditReport> {
  const standIn = await startStandIn('safe', {
    chunkedPrefill: {
      chunkTokens: 128,
      stepMs: 20,
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
      probes: ['abort-retry'],
    })
  } finally {
    await standIn.close()
  }
}

describe('abort-retry: another tenant’s filler in an answer', () => {
  test('an engine answering alice with words of bob’s last prompt: content-leak, critical, naming bob', async () => {
    const report = await audit('other')
    const [first] = report.findings
    assert.deepEqual(
      [first.probe, first.verdict, first.severity, first.class],
      ['abort-retry', 'leak', 'critical', 'content-leak'],
    )
    assert.equal(first.evidence.victimTenant, 'bob')
    assert.equal(first.evidence.observerTenant, 'alice')
    assert.equal(first.evidence.canary, null)
    assert.equal(first.evidence.matchedFiller, true)
    // The stand-in answers 16 words (max_tokens) from the middle of bob's priming prompt.
    assert.equal((first.evidence.matchedFragment as string).split(' ').length, 16)
    assert.match(
      first.title,
      /^alice's retry \(same tenant, right after the cut\) answer \(HTTP 200\) carried 16 words in a row of filler planted by bob$/,
    )
    // The excerpt shows the auditor's own planted words, nothing else.
    assert.ok((first.evidence.excerpt as string).includes(first.evidence.matchedFragment as string))
  })

  test('its twin, answering each request from its own prompt: clean, the cache seen at work', async () => {
    const report = await audit('own')
    assert.deepEqual(
      report.findings.map((f) => [f.probe, f.verdict]),
      [['abort-retry', 'clean']],
    )
    const control = report.findings[0].evidence.cacheControl as { cachedTokens: number }
    assert.ok(control.cachedTokens > 0)
  })
})
