/** Sampling: greedy is argmax (lowest index among ties); temperature and nucleus (top-p, Holtzman
 *  et al. 2020) follow softmax(logits / T) restricted to the smallest prefix of tokens, most
 *  probable first, whose mass reaches top_p. Frequencies are checked against probabilities worked
 *  out by hand, over many draws from fixed seeds (so the checks are deterministic). */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import { KvfenceError } from '../../src/errors.js'
import { argmax, makeRandom, sample, type SampleOptions } from '../../src/model/sampling.js'

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
