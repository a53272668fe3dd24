import assert from 'node:assert/strict'
import { readFileSync } from 'node:fs'
import { join } from 'node:path'
import { describe, it } from 'node:test'
import { forward, makeRope } from '../../src/model/forward.js'
import { argmax } from '../../src/model/sampling.js'
import { loadModel } from '../../src/model/weights.js'
import { echoModelDir } from '../helpers/paths.js'
import { maxAbsDiff, scatteredSequence } from './helpers.js'
import { referenceLogits } from './reference-forward.js'

interface Reference {
  prompts: { text: string; ids: number[]; logits_first: number[]; logits_last: number[] }[]
  greedy: { ids: number[]; tokens: number[]; decoded: string }
}
const reference = JSON.parse(
  readFileSync(join(echoModelDir, 'reference.json'), 'utf8'),
) as Reference
const model = loadModel(echoModelDir)
const rope = makeRope(model)
const c = model.config

describe('forward pass', () => {
  it('matches the PyTorch reference logits written by the training script (≤ 1e-4)', () => {
    for (const p of reference.prompts) {
      const { pool, seq } = scatteredSequence(model, 16, p.ids.length)
      const logits = forward(model, rope, pool, seq, p.ids, 0, true)
      const first = logits.subarray(0, c.vocabSize)
      const last = logits.subarray((p.ids.length - 1) * c.vocabSize)
      assert.ok(
        maxAbsDiff(first, p.logits_first) <= 1e-4,
        `first: ${maxAbsDiff(first, p.logits_first)}`,
      )
      assert.ok(maxAbsDiff(last, p.logits_last) <= 1e-4, `last: ${maxAbsDiff(last, p.logits_last)}`)
    }
  })

  it('over scattered pages, token by token, equals one pass over one contiguous page (≤ 1e-5)', () => {
    const ids = reference.prompts[1].ids.slice(0, 40)
    // The same engine over a single page that holds the whole sequence: one contiguous cache.
    const contiguous = scatteredSequence(model, 64, ids.length)
    const whole = forward(model, rope, contiguous.pool, contiguous.seq, ids, 0, true)
    const { pool, seq } = scatteredSequence(model, 4, ids.length)
    // Prefill the first 25 tokens in one step, then decode the rest one token at a time.
    const logits = forward(model, rope, pool, seq, ids.slice(0, 25), 0, true)
    const rowOf = (all: Float32Array, t: number) =>
      all.subarray(t * c.vocabSize, (t + 1) * c.vocabSize)
    for (let t = 0; t < 25; t++) {
      const diff = maxAbsDiff(rowOf(logits, t), rowOf(whole, t))
      assert.ok(diff <= 1e-5, `position ${t}: ${diff}`)
    }
    for (let t = 25; t < ids.length; t++) {
      const diff = maxAbsDiff(forward(model, rope, pool, seq, [ids[t]], t), rowOf(whole, t))
      assert.ok(diff <= 1e-5, `position ${t}: ${diff}`)
    }
    pool.check()
  })

  it('equals an independent float64 forward written from the HF equations (≤ 1e-4)', () => {
    const ids = reference.prompts[1].ids.slice(0, 40)
    const oracle = referenceLogits(model, ids)
    const { pool, seq } = scatteredSequence(model, 4, ids.length)
    const logits = forward(model, rope, pool, seq, ids, 0, true)
    for (let t = 0; t < ids.length; t++) {
      const row = logits.subarray(t * c.vocabSize, (t + 1) * c.vocabSize)
      assert.ok(maxAbsDiff(row, oracle[t]) <= 1e-4, `position ${t}: ${maxAbsDiff(row, oracle[t])}`)
    }
    pool.check()
  })

  it('greedy decoding of the fixed prompt gives the golden tokens', () => {
    const { ids, tokens } = reference.greedy
    const { pool, seq } = scatteredSequence(model, 16, ids.length + tokens.length)
    let logits = forward(model, rope, pool, seq, ids, 0)
    const out: number[] = []
    for (let i = 0; i < tokens.length; i++) {
      out.push(argmax(logits))
      logits = forward(model, rope, pool, seq, [out[i]], ids.length + i)
    }
    assert.deepEqual(out, tokens)
  })

  it('builds RoPE tables only up to a cap, equal to the full tables there, and refuses beyond', () => {
    const capped = makeRope(model, 24)
    assert.equal(capped.positions, 24)
    assert.equal(rope.positions, c.maxPositionEmbeddings)
    assert.equal(capped.cos.length, 24 * rope.half)
    assert.deepEqual(capped.cos, rope.cos.subarray(0, 24 * rope.half))
    assert.deepEqual(capped.sin, rope.sin.subarray(0, 24 * rope.half))
    // A cap above the model's positions changes nothing.
    assert.equal(makeRope(model, c.maxPositionEmbeddings + 5).positions, c.maxPositionEmbeddings)
    assert.throws(() => makeRope(model, 0), /RoPE positions must be a positive integer, got 0/)
    const ids = reference.prompts[1].ids.slice(0, 30)
    const { pool, seq } = scatteredSequence(model, 4, ids.length)
    const full = forward(model, rope, pool, seq, ids.slice(0, 24), 0)
    assert.deepEqual(forward(model, capped, pool, seq, ids.slice(0, 24), 0), full)
    assert.throws(
      () => forward(model, capped, pool, seq, ids.slice(24, 25), 24),
      /positions up to 25 exceed the RoPE table \(24\)/,
    )
  })
})
