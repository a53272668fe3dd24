/** Sampling: greedy is argmax (lowest index among ties); temperature and nucleus (top-p, Holtzman
 *  et al. 2020) follow softmax(logits / T) restricted to the smallest prefix of tokens, most
 *  probable first, whose mass reaches top_p. Frequencies are checked against probabilities worked
 *  out by hand, over many draws from fixed seeds (so the checks are deterministic).
 *  The later steps (penalties, top-k, min-p, their order) are checked exactly: `sample` draws one
 *  uniform number u and walks the kept tokens, most probable first, so sweeping u over a fine grid
 *  of [0, 1) gives each kept token a share equal to its probability (to the grid's resolution),
 *  and a removed token none. Log-probabilities are compared with log-softmax computed here in
 *  float64 without the max shift. */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import { RequestSampler, phaseSeed } from '../../src/engine/request-sampler.js'
import { KvfenceError } from '../../src/common/errors.js'
import {
  applyPenalties,
  argmax,
  makeRandom,
  minLogprob,
  sample,
  tokenLogprobs,
  type SampleOptions,
} from '../../src/model/sampling.js'

const noRandom = () => assert.fail('greedy sampling must not draw a random number')

/** How often each id comes out of `numDraws` samples. */
function frequencies(logits: number[], opts: SampleOptions, numDraws: number): number[] {
  const counts = new Array<number>(logits.length).fill(0)
  const l = new Float32Array(logits)
  for (let i = 0; i < numDraws; i++) counts[sample(l, opts)] += 1
  return counts.map((c) => c / numDraws)
}

describe('sampling', () => {
  it('greedy (temperature 0) is the argmax, the lowest index among ties', () => {
    const logits = new Float32Array([0.5, 2, 2, -1, 1.999])
    assert.equal(argmax(logits), 1)
    assert.equal(sample(logits, { temperature: 0, topP: 1, random: noRandom }), 1)
    assert.equal(argmax(new Float32Array([-3, -2, -2.5])), 1)
    assert.equal(argmax(new Float32Array([7, 7, 7])), 0)
    assert.equal(
      sample(new Float32Array([-Infinity, -5, -Infinity]), {
        temperature: 0,
        topP: 1,
        random: noRandom,
      }),
      1,
    )
  })

  it('the same seed gives the same random stream and the same samples; another seed does not', () => {
    const stream = (seed: number) => Array.from({ length: 1000 }, makeRandom(seed))
    assert.deepEqual(stream(7), stream(7))
    assert.notDeepEqual(stream(7), stream(8))
    for (const x of stream(7)) assert.ok(x >= 0 && x < 1, `${x} outside [0, 1)`)

    const logits = new Float32Array([0.1, 1.2, -0.3, 0.8, 0.0, 1.1, -2, 0.5])
    const draw = (seed: number) => {
      const opts = { temperature: 0.8, topP: 0.95, random: makeRandom(seed) }
      return Array.from({ length: 200 }, () => sample(logits, opts))
    }
    assert.deepEqual(draw(42), draw(42))
    assert.notDeepEqual(draw(42), draw(43))
    assert.ok(new Set(draw(42)).size >= 4, 'a spread of tokens, not one')
  })

  it('with temperature 1 and logits [ln 1, ln 3], id 1 comes out 3/4 of the time', () => {
    // softmax([0, ln 3]) = [1/4, 3/4]; 20,000 draws: standard error √(3/16 / 20000) ≈ 0.003.
    const freq = frequencies(
      [Math.log(1), Math.log(3)],
      { temperature: 1, topP: 1, random: makeRandom(1234) },
      20_000,
    )
    assert.ok(Math.abs(freq[1] - 0.75) <= 0.01, `frequency of id 1: ${freq[1]}`)
  })

  it('temperature 2 flattens: logits [0, ln 3] give id 1 with probability √3 / (1 + √3)', () => {
    // exp(ln 3 / 2) = √3, so P(1) = √3 / (1 + √3) ≈ 0.6340.
    const freq = frequencies(
      [0, Math.log(3)],
      { temperature: 2, topP: 1, random: makeRandom(99) },
      20_000,
    )
    assert.ok(
      Math.abs(freq[1] - Math.sqrt(3) / (1 + Math.sqrt(3))) <= 0.01,
      `frequency of id 1: ${freq[1]}`,
    )
  })

  it('top_p = 0.5 on probabilities [0.3, 0.6, 0.1] always returns the top token', () => {
    // Most probable first: 0.6 alone reaches 0.5, so the nucleus is {id 1}.
    const logits = [Math.log(0.3), Math.log(0.6), Math.log(0.1)]
    assert.deepEqual(
      frequencies(logits, { temperature: 1, topP: 0.5, random: makeRandom(5) }, 2_000),
      [0, 1, 0],
    )
  })

  it('top_p = 0.7 on probabilities [0.3, 0.6, 0.1] keeps {0.6, 0.3}, renormalised to 2/3 and 1/3', () => {
    // 0.6 < 0.7, 0.6 + 0.3 = 0.9 ≥ 0.7: the nucleus is ids 1 and 0; id 2 never comes out.
    const logits = [Math.log(0.3), Math.log(0.6), Math.log(0.1)]
    const freq = frequencies(logits, { temperature: 1, topP: 0.7, random: makeRandom(6) }, 20_000)
    assert.equal(freq[2], 0)
    assert.ok(Math.abs(freq[1] - 2 / 3) <= 0.01, `frequency of id 1: ${freq[1]}`)
  })

  it('a tiny top_p always returns the argmax (lowest index among ties)', () => {
    const logits = [1, 3, 2, 3, -1]
    for (const temperature of [0.5, 1, 4]) {
      assert.deepEqual(
        frequencies(
          logits,
          { temperature, topP: 1e-9, random: makeRandom(temperature * 10) },
          1_000,
        ),
        [0, 1, 0, 0, 0],
      )
    }
  })

  it('top_p = 0 (which OpenAI accepts) keeps the top token instead of none', () => {
    const logits = new Float32Array([1, 3, 2])
    for (let seed = 0; seed < 50; seed++)
      assert.equal(sample(logits, { temperature: 1, topP: 0, random: makeRandom(seed) }), 1)
  })

  it('masked tokens (−∞ logits) never come out', () => {
    const freq = frequencies(
      [-Infinity, 0, -Infinity, 0],
      { temperature: 1, topP: 1, random: makeRandom(3) },
      4_000,
    )
    assert.equal(freq[0] + freq[2], 0)
    assert.ok(Math.abs(freq[1] - 0.5) <= 0.03, `frequency of id 1: ${freq[1]}`)
  })

  it('refuses to turn NaN logits (read from poisoned KV) into a token, greedy or not', () => {
    const logits = new Float32Array([0.5, 1, Number.NaN, 0.25])
    for (const temperature of [0, 1]) {
      assert.throws(
        () => sample(logits, { temperature, topP: 1, random: makeRandom(1) }),
        (err: unknown) =>
          err instanceof KvfenceError &&
          err.code === 'internal_error' &&
          err.message === 'logit 2 of 4 is NaN; refusing to sample',
      )
    }
    assert.throws(
      () =>
        sample(new Float32Array(4).fill(Number.NaN), {
          temperature: 0.7,
          topP: 0.9,
          random: makeRandom(1),
        }),
      { message: 'logit 0 of 4 is NaN; refusing to sample' },
    )
  })
})

/** Share of each id over a grid of `numPoints` uniform draws u = (i + ½) / numPoints. */
function shares(
  logits: number[],
  opts: Omit<SampleOptions, 'random'>,
  numPoints = 20_000,
): number[] {
  const out = new Array<number>(logits.length).fill(0)
  const l = new Float32Array(logits)
  for (let i = 0; i < numPoints; i++) {
    const u = (i + 0.5) / numPoints
    out[sample(l, { ...opts, random: () => u })] += 1
  }
  return out.map((n) => n / numPoints)
}

/** `got` equals `want` element-wise within `tolerance`. */
function assertClose(got: ArrayLike<number>, want: number[], tolerance: number, what = ''): void {
  assert.equal(got.length, want.length, what)
  for (let i = 0; i < want.length; i++) {
    assert.ok(
      Math.abs(got[i] - want[i]) <= tolerance,
      `${what}[${i}]: got ${got[i]}, want ${want[i]} (±${tolerance}); all: ${Array.from(got)}`,
    )
  }
}

/** Grid resolution plus float32 rounding of ln p. */
const gridTolerance = 2e-4
const ln = Math.log

describe('sampling: top-k, min-p, penalties and their order', () => {
  it('top_k = 2 on probabilities [0.1, 0.2, 0.3, 0.4] keeps {0.4, 0.3}: 4/7 and 3/7', () => {
    const logits = [ln(0.1), ln(0.2), ln(0.3), ln(0.4)]
    assertClose(
      shares(logits, { temperature: 1, topP: 1, topK: 2 }),
      [0, 0, 3 / 7, 4 / 7],
      gridTolerance,
    )
    // k = 1 is the argmax; k at or above the vocabulary (or null) keeps every token.
    assertClose(shares(logits, { temperature: 1, topP: 1, topK: 1 }), [0, 0, 0, 1], 0)
    assertClose(
      shares(logits, { temperature: 1, topP: 1, topK: 4 }),
      [0.1, 0.2, 0.3, 0.4],
      gridTolerance,
    )
    assertClose(
      shares(logits, { temperature: 1, topP: 1, topK: 99 }),
      [0.1, 0.2, 0.3, 0.4],
      gridTolerance,
    )
    assertClose(
      shares(logits, { temperature: 1, topP: 1, topK: null }),
      [0.1, 0.2, 0.3, 0.4],
      gridTolerance,
    )
  })

  it('min_p keeps the tokens with p ≥ min_p × p_max, renormalized', () => {
    const logits = [ln(0.5), ln(0.3), ln(0.15), ln(0.05)]
    // 0.25 × 0.5 = 0.125: 0.05 goes; 0.5, 0.3, 0.15 over their sum 0.95.
    assertClose(
      shares(logits, { temperature: 1, topP: 1, minP: 0.25 }),
      [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0],
      gridTolerance,
    )
    // 0.4 × 0.5 = 0.2: only 0.5 and 0.3 stay, 5/8 and 3/8.
    assertClose(
      shares(logits, { temperature: 1, topP: 1, minP: 0.4 }),
      [5 / 8, 3 / 8, 0, 0],
      gridTolerance,
    )
    // min_p 1 keeps the top token only; 0 keeps all.
    assertClose(shares(logits, { temperature: 1, topP: 1, minP: 1 }), [1, 0, 0, 0], 0)
    assertClose(
      shares(logits, { temperature: 1, topP: 1, minP: 0 }),
      [0.5, 0.3, 0.15, 0.05],
      gridTolerance,
    )
  })

  it('min_p applies to the probabilities after temperature', () => {
    // T = 2: p ∝ √p₀ = [0.7071, 0.5477, 0.3873, 0.2236]; min_p 0.5 → threshold 0.3536 keeps three.
    const logits = [ln(0.5), ln(0.3), ln(0.15), ln(0.05)]
    const w = [0.5, 0.3, 0.15].map(Math.sqrt)
    const sum = w[0] + w[1] + w[2]
    assertClose(
      shares(logits, { temperature: 2, topP: 1, minP: 0.5 }),
      [w[0] / sum, w[1] / sum, w[2] / sum, 0],
      gridTolerance,
    )
  })

  it('order: top_k, then top_p over the top-k renormalized, then min_p', () => {
    const logits = [ln(0.4), ln(0.3), ln(0.2), ln(0.1)]
    // top_p 0.75 alone: 0.4 + 0.3 = 0.7 < 0.75, so three tokens stay.
    assertClose(
      shares(logits, { temperature: 1, topP: 0.75 }),
      [0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0],
      gridTolerance,
    )
    // After top_k 3 the masses are 4/9, 3/9, 2/9: 4/9 + 3/9 = 7/9 ≥ 0.75, so two stay.
    assertClose(
      shares(logits, { temperature: 1, topP: 0.75, topK: 3 }),
      [4 / 7, 3 / 7, 0, 0],
      gridTolerance,
    )
    // Then min_p 0.8: 0.3 < 0.8 × 0.4 = 0.32, so only the top token.
    assertClose(shares(logits, { temperature: 1, topP: 0.75, topK: 3, minP: 0.8 }), [1, 0, 0, 0], 0)
  })

  it('penalties subtract presence·[count > 0] + frequency·count from the logits', () => {
    const logits = new Float32Array([1, 2, 3, 0])
    const counts = new Map([
      [2, 3],
      [1, 1],
    ])
    // id 2: 3 − 0.5 − 0.4·3 = 1.3; id 1: 2 − 0.5 − 0.4 = 1.1; ids 0 and 3 never generated.
    assertClose(applyPenalties(logits, counts, 0.5, 0.4), [1, 1.1, 1.3, 0], 1e-12)
    assertClose(applyPenalties(logits, counts, 0, 0), [1, 2, 3, 0], 0)
    // Negative penalties favour repeats: id 1 at 2 + 2 + 1 = 5.
    assertClose(applyPenalties(logits, counts, -2, -1), [1, 5, 8, 0], 1e-12)
    // Greedy takes the argmax after the penalties.
    const greedy = (presencePenalty: number, frequencyPenalty: number) =>
      sample(logits, {
        temperature: 0,
        topP: 1,
        presencePenalty,
        frequencyPenalty,
        counts,
        random: noRandom,
      })
    assert.equal(greedy(0, 0), 2)
    assert.equal(greedy(0.5, 0.4), 2) // [1, 1.1, 1.3, 0]
    assert.equal(greedy(0.5, 0.6), 0) // [1, 0.9, 0.7, 0]
    assert.equal(greedy(2, 0), 0) // [1, 0, 1, 0]: the lower id among ties
  })

  it('penalties come before temperature: softmax((logits − penalty) / T)', () => {
    const counts = new Map([
      [2, 3],
      [1, 1],
    ])
    const penalized = [1, 1.1, 1.3, 0]
    const w = penalized.map((l) => Math.exp(l / 0.5))
    const sum = w.reduce((a, b) => a + b)
    assertClose(
      shares([1, 2, 3, 0], {
        temperature: 0.5,
        topP: 1,
        presencePenalty: 0.5,
        frequencyPenalty: 0.4,
        counts,
      }),
      w.map((x) => x / sum),
      gridTolerance,
    )
  })

  it('the same seed gives the same tokens with every option on; another seed does not', () => {
    const logits = new Float32Array([0.1, 1.2, -0.3, 0.8, 0.0, 1.1, -2, 0.5, 0.9, 0.7])
    const run = (seed: number) => {
      const sampler = new RequestSampler(
        {
          temperature: 0.9,
          topP: 0.95,
          topK: 6,
          minP: 0.05,
          presencePenalty: 0.3,
          frequencyPenalty: 0.2,
          seed,
          numLogprobs: null,
        },
        'decode',
      )
      return Array.from({ length: 200 }, () => sampler.next(logits).tokenId)
    }
    assert.deepEqual(run(42), run(42))
    assert.notDeepEqual(run(42), run(43))
    assert.ok(new Set(run(42)).size >= 4, 'a spread of tokens, not one')
  })

  it('refuses to sample when no logit is finite', () => {
    assert.throws(
      () =>
        sample(new Float32Array([-Infinity, -Infinity]), {
          temperature: 1,
          topP: 1,
          random: makeRandom(1),
        }),
      { message: 'no logit of 2 is finite; refusing to sample' },
    )
  })
})

describe('request sampler', () => {
  const base = {
    temperature: 0,
    topP: 1,
    topK: null,
    minP: 0,
    seed: 7,
    numLogprobs: null,
  }
  const greedyRun = (presencePenalty: number, frequencyPenalty: number, steps: number) => {
    const sampler = new RequestSampler({ ...base, presencePenalty, frequencyPenalty }, 'prefill')
    const logits = new Float32Array([3, 2.5, 0])
    return Array.from({ length: steps }, () => sampler.next(logits).tokenId)
  }

  it('counts its own tokens for the penalties (frequency: alternates; presence: once)', () => {
    // frequency 1: [3, 2.5] → 0; [2, 2.5] → 1; [2, 1.5] → 0; [1, 1.5] → 1; [1, 0.5] → 0.
    assert.deepEqual(greedyRun(0, 1, 5), [0, 1, 0, 1, 0])
    // presence 1: [3, 2.5] → 0; [2, 2.5] → 1; then [2, 1.5] for good → 0, 0, 0.
    assert.deepEqual(greedyRun(1, 0, 5), [0, 1, 0, 0, 0])
    assert.deepEqual(greedyRun(0, 0, 3), [0, 0, 0])
  })

  it('record() counts a token sampled elsewhere (the first token, on the decode side)', () => {
    const sampler = new RequestSampler(
      { ...base, presencePenalty: 1, frequencyPenalty: 0 },
      'decode',
    )
    sampler.record(0)
    assert.equal(sampler.next(new Float32Array([3, 2.5, 0])).tokenId, 1)
  })

  it('prefill draws with the seed, decode with seed + 1, both fixed by it', () => {
    assert.equal(phaseSeed({ ...base, seed: 41 }, 'prefill'), 41)
    assert.equal(phaseSeed({ ...base, seed: 41 }, 'decode'), 42)
  })

  it('reports the raw model log-probabilities, not the penalized ones', () => {
    const sampler = new RequestSampler(
      { ...base, presencePenalty: 0, frequencyPenalty: 1, numLogprobs: 2 },
      'prefill',
    )
    const logits = new Float32Array([3, 2.5, 0])
    const lse = Math.log(Math.exp(3) + Math.exp(2.5) + Math.exp(0))
    sampler.next(logits)
    const second = sampler.next(logits) // id 1, chosen because of the penalty
    assert.equal(second.tokenId, 1)
    assertClose([second.logprobs!.logprob], [2.5 - lse], 1e-12)
    assert.deepEqual(
      second.logprobs!.top.map((t) => t.tokenId),
      [0, 1],
    )
    assertClose(
      second.logprobs!.top.map((t) => t.logprob),
      [3 - lse, 2.5 - lse],
      1e-12,
    )
  })
})

describe('log-probabilities', () => {
  /** log-softmax in float64, the textbook way (no max shift: fine for small logits). */
  const logSoftmax = (logits: number[]) => {
    const lse = Math.log(logits.reduce((s, l) => s + Math.exp(l), 0))
    return logits.map((l) => l - lse)
  }

  it('equal log-softmax of the logits; top-N most likely first', () => {
    const raw = [1, 2, 3, 0.5, -1.25]
    const want = logSoftmax(raw)
    const got = tokenLogprobs(new Float32Array(raw), 3, 3)
    assertClose([got.logprob], [want[3]], 1e-12)
    assert.deepEqual(
      got.top.map((t) => t.tokenId),
      [2, 1, 0],
    )
    assertClose(
      got.top.map((t) => t.logprob),
      [want[2], want[1], want[0]],
      1e-12,
    )
    // The probabilities they stand for sum to 1.
    const all = tokenLogprobs(new Float32Array(raw), 0, raw.length)
    assertClose([all.top.reduce((s, t) => s + Math.exp(t.logprob), 0)], [1], 1e-12)
  })

  it('stay finite for large logits (max shift) and report −∞ as −9999', () => {
    const got = tokenLogprobs(new Float32Array([1000, 1000, -Infinity]), 2, 3)
    assertClose([got.top[0].logprob, got.top[1].logprob], [-Math.LN2, -Math.LN2], 1e-12)
    assert.equal(got.logprob, minLogprob)
    assert.equal(got.top[2].logprob, -9999)
  })

  it('break ties by the lower id, and give no alternatives for N = 0', () => {
    const got = tokenLogprobs(new Float32Array([2, 5, 5, 1, 5]), 0, 2)
    assert.deepEqual(
      got.top.map((t) => t.tokenId),
      [1, 2],
    )
    assert.deepEqual(tokenLogprobs(new Float32Array([2, 5]), 1, 0).top, [])
  })

  it('pick the same top 20 as a full sort over a large vocabulary', () => {
    const random = makeRandom(2024)
    const raw = Float32Array.from({ length: 5000 }, () => Math.round(random() * 400) / 10)
    const order = Array.from(raw.keys()).sort((a, b) => raw[b] - raw[a] || a - b)
    assert.deepEqual(
      tokenLogprobs(raw, 0, 20).top.map((t) => t.tokenId),
      order.slice(0, 20),
    )
  })
})
