/** `warm-equals-cold` and `evict-then-return` against stand-ins over real HTTP: each catches a
 *  stand-in with the warm-path bug it looks for and passes its correct twin, on vLLM-, SGLang- and
 *  kvfence-shaped surfaces; plus the edges and churn they size from what discovery read. */
import assert from 'node:assert/strict'
import { describe, test } from 'node:test'
import {
  planAudit,
  runAudit,
  type AuditOptions,
  type AuditReport,
  type ProbeName,
} from '../../src/audit/index.js'
import { Budget } from '../../src/audit/budget.js'
import { discover } from '../../src/audit/discovery.js'
import { churnSize } from '../../src/audit/probes/evict-then-return.js'
import {
  cacheEdges,
  headWords,
  randomHead,
  sizedPrompt,
} from '../../src/audit/probes/sized-material.js'
import { makeCanaries } from '../../src/audit/canaries.js'
import { loadTokenizer } from '../../src/model/tokenizer.js'
import { echoModelDir } from '../helpers/paths.js'
import { createRng } from '../../src/audit/rng.js'
import { createSizer, fillerText } from '../../src/audit/sizer.js'
import { createTarget } from '../../src/audit/target.js'
import { standInTenants, startStandIn, type StandInOptions } from './standins.js'

async function audit(
  probe: ProbeName,
  standInOptions: StandInOptions,
  options: Partial<AuditOptions> = {},
): Promise<AuditReport> {
  const standIn = await startStandIn('safe', standInOptions)
  try {
    return await runAudit({
      target: standIn.url,
      tenants: standInTenants,
      seed: 21,
      probes: [probe],
      ...options,
    })
  } finally {
    await standIn.close()
  }
}

const rows = (report: AuditReport): string[][] =>
  report.findings.map((f) => [f.probe, f.verdict, f.severity])

interface Run {
  targetTokens: number
  promptTokens: number | null
  outcome: string
  isEqual: boolean | null
  cause: string | null
}

describe('cache edges and churn, from what the endpoint reports', () => {
  test('page 16: its multiples 16, 32, 64, 128; a prompt limit of 100 keeps those whose edge + 1 fits', () => {
    assert.deepEqual(
      cacheEdges([16], [], 368).map((e) => [e.tokens, e.why]),
      [
        [16, '1 × page 16'],
        [32, '2 × page 16'],
        [64, '4 × page 16'],
        [128, '8 × page 16'],
      ],
    )
    assert.deepEqual(
      cacheEdges([16], [], 100).map((e) => e.tokens),
      [16, 32, 64],
    )
  })

  test('SGLang page 1 with chunk 512: 16, 32, 64, 128 and the chunk; 2 × chunk past the limit', () => {
    assert.deepEqual(
      cacheEdges([1], [512], 1000).map((e) => [e.tokens, e.why]),
      [
        [16, '16 × page 1'],
        [32, '32 × page 1'],
        [64, '64 × page 1'],
        [128, '128 × page 1'],
        [512, 'chunk 512'],
      ],
    )
  })

  test('no page size reported: powers of two 16 to 1,024 (a chunk of 8,192 past the limit adds none)', () => {
    assert.deepEqual(
      cacheEdges([], [8192], 368).map((e) => e.tokens),
      [16, 32, 64, 128, 256],
    )
    assert.deepEqual(
      cacheEdges([], [], null).map((e) => e.tokens),
      [16, 32, 64, 128, 256, 512, 1024],
    )
  })

  test('a short prompt carries the longest leading piece of its canary (≥ 8 characters) that leaves room for a filler word', () => {
    // One token per word plus BOS, a 20-character canary measured at 20 tokens (1 per character).
    const sizer = createSizer('usage', [
      { words: 16, tokens: 17 },
      { words: 64, tokens: 65 },
    ])!
    const canary = { tenant: standInTenants[0], canary: 'AbCdEfGh12IjKlMnOp34', canaryTokens: 20 }
    const words = (p: string) => p.split(' ')
    // 16 tokens: BOS + 6 head letters + 8 characters of canary + 1 filler word.
    const at16 = sizedPrompt(createRng(1, 't'), sizer, 16, canary)
    assert.equal(at16.hasCanary, true)
    assert.deepEqual(words(at16.prompt).slice(6), ['AbCdEfGh', at16.filler])
    assert.equal(at16.filler.length, 1)
    // 15 tokens: a piece of 7 characters would be too short to find; head and 8 filler words.
    const at15 = sizedPrompt(createRng(1, 't'), sizer, 15, canary)
    assert.equal(at15.hasCanary, false)
    // The filler is the prompt's own (keyed): 8 letters of the sizer's alphabet.
    assert.deepEqual(words(at15.prompt).slice(6), at15.filler.split(' '))
    assert.equal(at15.filler.split(' ').length, 8)
    assert.ok(at15.filler.split(' ').every((w) => 'abcdefghijklmnop'.includes(w)))
    // 40 tokens: the whole canary and 13 filler words (1 + 6 + 20 + 13).
    const at40 = sizedPrompt(createRng(1, 't'), sizer, 40, canary)
    assert.equal(words(at40.prompt)[6], canary.canary)
    assert.equal(words(at40.prompt).length, 6 + 1 + 13)
  })

  test('on the bundled character-level tokenizer (2 tokens a filler word) a prompt lands exactly on every edge and ±1 from 32 to 512, for canaries of every length 16–24', () => {
    // Before: an even-length canary put every even target one token over (filler words come in
    // pairs of tokens), so seed 2522790461 missed 32…512 against kvfence. The count is the real
    // tokenizer's, BOS included, not the sizer's estimate.
    const tokenizer = loadTokenizer(echoModelDir)
    const count = (text: string) => tokenizer.encode(text).length
    const sizer = createSizer(
      'usage',
      [16, 64].map((words) => ({ words, tokens: count(fillerText(words)) })),
    )!
    assert.deepEqual([sizer.overheadTokens, sizer.tokensPerWord], [0, 2])
    const misses: string[] = []
    for (const seed of [2522790461, 3068662099, 1, 2, 3]) {
      const rng = createRng(seed, 'warm-equals-cold')
      for (let length = 16; length <= 24; length++) {
        const text = makeCanaries(rng, 1)[0].padEnd(24, 'Z7').slice(0, length)
        // As measureCanary does: head, canary, 16 filler words, minus the words' estimate.
        const measured = count(`${randomHead(rng)} ${text} ${fillerText(16)}`)
        const canary = {
          tenant: standInTenants[0],
          canary: text,
          canaryTokens: measured - sizer.estimate(headWords + 16),
        }
        for (const edge of [32, 64, 128, 256, 512]) {
          for (const n of [edge - 1, edge, edge + 1]) {
            const sized = sizedPrompt(rng, sizer, n, canary)
            const got = count(sized.prompt)
            if (got !== n || !sized.hasCanary)
              misses.push(`seed ${seed} length ${length}: ${n} → ${got}`)
          }
        }
      }
    }
    assert.deepEqual(misses, [])
  })

  test('churn: ⌈4 × pool / prompt⌉ requests of the largest prompt, half as many more at most; none without a pool', () => {
    // 4 × 1,024 = 4,096 tokens in prompts of 368: ⌈11.1⌉ = 12, and ⌈12 × 1.5⌉ = 18 at most.
    assert.deepEqual(churnSize(1024, 368), {
      poolTokens: 1024,
      promptTokens: 368,
      numRequests: 12,
      maxRequests: 18,
    })
    assert.equal(churnSize(null, 368), null)
    assert.equal(churnSize(1024, null), null)
  })

  test('--plan: both probes priced from the vLLM stand-in’s block size and pool', async () => {
    const standIn = await startStandIn('safe', { flavour: 'vllm' })
    try {
      const plan = await planAudit({
        target: standIn.url,
        tenants: standInTenants,
        probes: ['warm-equals-cold', 'evict-then-return'],
      })
      const byProbe = new Map(plan.probes.map((p) => [p.probe, p]))
      // 2 canary measurements + 4 edges × 9 + 2 re-aimed edges × 3 + 4 salt controls.
      assert.equal(byProbe.get('warm-equals-cold')?.numRequests, 2 + 36 + 6 + 4)
      // Pool 384 (24 blocks × 16), context 384: prompts of 368; ⌈1,536 / 368⌉ = 5, ⌈5 × 1.5⌉ = 8
      // at most, plus 4 prefixes, a warm one, 3 checks and 4 returns.
      // 12 fixed, one canary measurement per tenant, 8 churn at most.
      assert.equal(byProbe.get('evict-then-return')?.numRequests, 12 + 2 + 8)
      assert.equal(standIn.stats.paths.filter((p) => p.startsWith('POST')).length, 0)
    } finally {
      await standIn.close()
    }
  })
})

describe('warm-equals-cold', () => {
  test("vLLM surface, a whole-page prompt's warm hit served from another tenant's entry: leak, critical; the fresh cache_salt says key bug", async () => {
    const report = await audit('warm-equals-cold', {
      flavour: 'vllm',
      kvCache: { bug: 'page-multiple-cross' },
    })
    assert.ok(report.findings.length >= 1)
    assert.deepEqual(
      [...new Set(rows(report).map((r) => r.join(' ')))],
      ['warm-equals-cold leak critical'],
    )
    const e = report.findings[0].evidence as { runs: Run[]; causes: string[]; edges: unknown[] }
    const differing = e.runs.filter((r) => r.isEqual === false)
    // Exactly the page multiples differ: 16, 32, 64, 128 tokens.
    assert.deepEqual(
      differing.map((r) => r.promptTokens),
      [16, 32, 64, 128],
    )
    assert.deepEqual(
      differing.map((r) => r.cause),
      ['key', 'key', 'not tried', 'not tried'],
    )
    assert.match(e.causes[0], /^key: under a fresh cache_salt the warm answer equals the cold one/)
    assert.match(
      report.findings[0].title,
      /'s warm 16-token \(1 × page 16\) answer \(HTTP 200\) carried a canary planted by /,
    )
    assert.deepEqual(report.findings[0].controls, { aisvs: ['5.5.5'], guards: ['G4', 'G5'] })
  })

  test('its correct twin: clean, 12 lengths on and ±1 around the page multiples', async () => {
    const report = await audit('warm-equals-cold', { flavour: 'vllm', kvCache: {} })
    assert.deepEqual(
      report.findings.map((f) => [f.verdict, f.title]),
      [
        [
          'clean',
          // The positive control: the stand-in serves a warm prompt whole from its cache, the
          // longest being 129 tokens.
          'warm answers equalled cold ones at 12 lengths on and ±1 around 16 (1 × page 16), 32 (2 × page 16), 64 (4 × page 16), 128 (8 × page 16) (positive control: warm requests were served up to 129 cached tokens)',
        ],
      ],
    )
    const e = report.findings[0].evidence as { runs: Run[] }
    assert.deepEqual(
      e.runs.map((r) => r.promptTokens),
      [15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129],
    )
  })

  test('an edge its prompt missed by a token the sizer could not foresee is re-aimed once by the miss and lands', async () => {
    // Prompts past 100 words count one token more: the 128-token edge first lands on 129, is
    // re-sent aimed at 127 and lands; its ±1 lengths are not re-sent (127 → 128, 129 → 130).
    const report = await audit('warm-equals-cold', {
      flavour: 'vllm',
      kvCache: {},
      contextTokens: 1024,
      extraTokenPastWords: 100,
    })
    const e = report.findings[0].evidence as { runs: Run[]; missedEdges: number[] }
    assert.equal(report.findings[0].verdict, 'clean', report.findings[0].title)
    assert.deepEqual(e.missedEdges, [])
    assert.deepEqual(
      e.runs.map((r) => r.promptTokens),
      [15, 16, 17, 31, 32, 33, 63, 64, 65, 128, 128, 130],
    )
  })

  test('a whole-page warm hit answered one position late: warning (no foreign material), content bug', async () => {
    const report = await audit('warm-equals-cold', {
      flavour: 'vllm',
      kvCache: { bug: 'page-multiple-shift' },
    })
    assert.deepEqual(rows(report), [['warm-equals-cold', 'warning', 'medium']])
    assert.match(
      report.findings[0].title,
      /^a temperature-0 warm answer differed from its cold one at 4 of 12 lengths \(16, 32, 64, 128 tokens\), without another tenant's material; under a fresh cache_salt the warm answer still differs: .* \(a content bug\); no fresh-salt control was sent for this length$/,
    )
  })

  test('kvfence surface (cache_salt refused, no page size reported): powers of two, the cause stays open', async () => {
    const report = await audit('warm-equals-cold', {
      kvCache: { bug: 'page-multiple-shift' },
      clientSalt: 'refused',
    })
    assert.deepEqual(rows(report), [['warm-equals-cold', 'warning', 'medium']])
    const e = report.findings[0].evidence as { runs: Run[]; edges: { tokens: number }[] }
    assert.deepEqual(
      e.edges.map((x) => x.tokens),
      [16, 32, 64, 128, 256],
    )
    assert.match(report.findings[0].title, /the endpoint refused cache_salt/)
  })

  test('SGLang surface, correct: clean on powers of two (its chunk of 8,192 is past the pool)', async () => {
    const report = await audit('warm-equals-cold', { flavour: 'sglang', kvCache: {} })
    assert.deepEqual(rows(report), [['warm-equals-cold', 'clean', 'info']])
    assert.equal((report.findings[0].evidence.runs as Run[]).length, 15)
  })

  test('a budget that runs out part-way: inconclusive with the reason, never clean', async () => {
    const report = await audit(
      'warm-equals-cold',
      { flavour: 'vllm', kvCache: {} },
      { maxRequests: 20 },
    )
    assert.deepEqual(rows(report), [['warm-equals-cold', 'inconclusive', 'medium']])
    assert.match(
      report.findings[0].title,
      /^warm and cold answers not compared on every edge: request budget exhausted after \d+ of 12 lengths$/,
    )
  })
})

describe('evict-then-return', () => {
  test('an offload tier that counts a failed load as a hit (serving what it offloaded last): leak, critical, bob → alice', async () => {
    const report = await audit('evict-then-return', {
      kvCache: { isOffloaded: true, bug: 'offload-load-any' },
    })
    const [first] = report.findings
    assert.deepEqual(
      [first.probe, first.verdict, first.severity],
      ['evict-then-return', 'leak', 'critical'],
    )
    assert.equal(first.evidence.observerTenant, 'alice')
    assert.equal(first.evidence.victimTenant, 'bob')
    assert.deepEqual(first.evidence.request, {
      label: 'returning (after eviction)',
      stream: false,
      status: 200,
    })
    assert.deepEqual(first.controls, { aisvs: ['5.5.5'], guards: ['G4'] })
  })

  test('its correct twin: clean, the returning prefixes loaded back from the offload tier', async () => {
    const report = await audit('evict-then-return', { kvCache: { isOffloaded: true } })
    assert.deepEqual(rows(report), [['evict-then-return', 'clean', 'info']])
    const e = report.findings[0].evidence as {
      returns: { promptTokens: number; cachedTokens: number; isEqual: boolean }[]
      warm: { cachedTokens: number; promptTokens: number }
      crossTenantChecks: { factor: number; cachedTokens: number; isEqual: boolean }[]
      numChurnAnswered: number
      churnTokensAnswered: number
    }
    // Pool 384 (the largest the stand-in reports): ⌈4 × 384 / 368⌉ = 5 churn prompts if each
    // came out at 368 tokens; each carries its canary every 6 filler words, priced at 1.5 × its
    // measured cost, so each comes out shorter and 7 (of at most ⌈5 × 1.5⌉ = 8) are answered.
    assert.equal(e.numChurnAnswered, 7)
    assert.ok(e.churnTokensAnswered >= 4 * 384)
    assert.equal(e.warm.cachedTokens, e.warm.promptTokens)
    assert.deepEqual(
      e.returns.map((r) => [r.cachedTokens === r.promptTokens, r.isEqual]),
      [
        [true, true],
        [true, true],
        [true, true],
        [true, true],
      ],
    )
    assert.deepEqual(
      e.crossTenantChecks.map((c) => [c.factor, c.cachedTokens, c.isEqual]),
      [
        [1, 0, true],
        [2, 0, true],
        [4, 0, true],
      ],
    )
    assert.match(
      report.findings[0].title,
      /^alice's 4 prefixes returned intact after \d+ tokens of every tenant's traffic \(≥ 4 × the 384-token pool\)/,
    )
  })

  test('no offload tier: clean, the returning prefixes recomputed (cached_tokens 0)', async () => {
    const report = await audit('evict-then-return', { kvCache: {}, flavour: 'vllm' })
    assert.deepEqual(rows(report), [['evict-then-return', 'clean', 'info']])
    const e = report.findings[0].evidence as { returns: { cachedTokens: number }[] }
    assert.deepEqual(
      e.returns.map((r) => r.cachedTokens),
      [0, 0, 0, 0],
    )
  })

  test('SGLang surface, a tier keyed without the tenant under a pool split per tenant: bob is served alice’s evicted prefix: a side channel (no text crossed), not a leak', async () => {
    const report = await audit('evict-then-return', {
      flavour: 'sglang',
      kvCache: { isOffloaded: true, isPartitioned: true, bug: 'offload-key-without-tenant' },
    })
    assert.deepEqual(rows(report), [['evict-then-return', 'warning', 'high']])
    const f = report.findings[0]
    assert.deepEqual([f.class, f.cwe], ['side-channel', ['CWE-208', 'CWE-203']])
    assert.match(
      f.title,
      /^bob's request for alice's prefix, evicted by 1 × the 384-token pool of traffic, was served \d+ cached tokens \(its own fresh prompts at most 0\)/,
    )
    const checks = f.evidence.crossTenantChecks as { cachedTokens: number; promptTokens: number }[]
    assert.equal(checks[0].cachedTokens, checks[0].promptTokens)
    assert.equal(f.evidence.requestNumber, (checks[0] as { requestNumber?: number }).requestNumber)
  })

  test('its correct twin (the tier keyed by tenant, the pool split per tenant): clean', async () => {
    const report = await audit('evict-then-return', {
      flavour: 'sglang',
      kvCache: { isOffloaded: true, isPartitioned: true },
    })
    assert.deepEqual(rows(report), [['evict-then-return', 'clean', 'info']])
  })

  test('vLLM surface, a ring tier whose written-over slot is loaded as a hit: the returns carry the churn’s canaries, leak, critical', async () => {
    const report = await audit('evict-then-return', {
      flavour: 'vllm',
      kvCache: { isOffloaded: true, offloadSlots: 4, bug: 'offload-stale-slot' },
    })
    // The 4-slot ring wrapped under the churn: alice's slots now hold churn prompts, bob's first.
    // Every churn prompt carries its canary end to end, so each replayed one is named.
    assert.deepEqual(rows(report), [
      ['evict-then-return', 'leak', 'critical'],
      ['evict-then-return', 'leak', 'critical'],
      ['evict-then-return', 'leak', 'high'],
      ['evict-then-return', 'leak', 'high'],
    ])
    assert.equal(report.findings[0].evidence.victimTenant, 'bob')
  })

  test('its correct twin (a written-over slot is a miss): clean, the returns recomputed', async () => {
    const report = await audit('evict-then-return', {
      flavour: 'vllm',
      kvCache: { isOffloaded: true, offloadSlots: 4 },
    })
    assert.deepEqual(rows(report), [['evict-then-return', 'clean', 'info']])
    const e = report.findings[0].evidence as { returns: { cachedTokens: number }[] }
    assert.deepEqual(
      e.returns.map((r) => r.cachedTokens),
      [0, 0, 0, 0],
    )
  })

  test('a pool split per tenant with a tier that serves what it offloaded last: alice’s own churn evicts her share, leak, critical', async () => {
    const report = await audit('evict-then-return', {
      kvCache: { isOffloaded: true, isPartitioned: true, bug: 'offload-load-any' },
    })
    assert.deepEqual(rows(report)[0], ['evict-then-return', 'leak', 'critical'])
    assert.ok(report.findings.every((f) => f.verdict === 'leak'))
  })

  test('a budget that cannot cover the churn: inconclusive with the reason, no completion sent', async () => {
    const report = await audit(
      'evict-then-return',
      { kvCache: { isOffloaded: true, bug: 'offload-load-any' } },
      { maxRequests: 10 },
    )
    assert.deepEqual(rows(report), [['evict-then-return', 'inconclusive', 'medium']])
    assert.match(
      report.findings[0].title,
      /^evicting the cache takes 5 requests of 368 tokens \(4 × the 384-token pool\) plus 12; the budget has \d+ requests left/,
    )
    assert.equal(report.probeRuns[0].completions.sent, 0)
  })
})

describe('discovery reads page and chunk sizes', () => {
  const discoverOn = async (options: StandInOptions) => {
    const standIn = await startStandIn('safe', options)
    try {
      const budget = new Budget({ maxRequests: 10, maxSeconds: 30, concurrency: 1 })
      const target = createTarget({
        baseUrl: standIn.url,
        model: null,
        tenants: standInTenants,
        budget,
        requestTimeoutMs: 10_000,
      })
      const d = await discover(target, null)
      return { pageSizes: d.pageSizes, chunkSizes: d.chunkSizes, largest: d.largestPoolTokens }
    } finally {
      await standIn.close()
    }
  }

  test('SGLang: chunked_prefill_size of /get_server_info; vLLM: block_size of vllm:cache_config_info', async () => {
    assert.deepEqual(await discoverOn({ flavour: 'sglang' }), {
      pageSizes: [],
      chunkSizes: [{ endpoint: '/get_server_info', field: 'chunked_prefill_size', tokens: 8192 }],
      largest: 384,
    })
    assert.deepEqual(await discoverOn({ flavour: 'vllm' }), {
      pageSizes: [{ endpoint: '/metrics', field: 'vllm:cache_config_info block_size', tokens: 16 }],
      chunkSizes: [],
      largest: 384,
    })
  })
})
