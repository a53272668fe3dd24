/** The canary probe's pool-covering plants: how many and how long, from the pools, context, input
 *  limit and page size an endpoint reports (each expected value worked by hand), and the
 *  canary-dense prompts they are made of. */
import assert from 'node:assert/strict'
import { describe, test } from 'node:test'
import { findFragment } from '../../src/audit/canaries.js'
import { poolCover } from '../../src/audit/probes/canary.js'
import { denseMaterial } from '../../src/audit/probes/material.js'
import { createRng } from '../../src/audit/rng.js'

describe('poolCover', () => {
  const demo = {
    poolTokens: 384,
    largestPoolTokens: 1024,
    contextTokens: 1024,
    inputLimitTokens: null,
    pageSizes: [16],
  }

  test("kvfence's demo (prefill 384, decode 1,024, pages of 16): 3 plants of 304 tokens", () => {
    // A lease (prompt + 32) fits the 384-token pool: ⌈1,024 / 384⌉ = 3 leases of ⌊1,024 / 3⌋ =
    // 341 tokens, 336 in whole pages, 304 of them prompt.
    assert.deepEqual(poolCover(demo, 16), {
      numPlants: 3,
      promptTokens: 304,
      poolTokens: 1024,
      numNeeded: 3,
    })
  })

  test('--max-concurrency lower than the plants needed: only as many as may be in flight', () => {
    assert.deepEqual(poolCover(demo, 2), {
      numPlants: 2,
      promptTokens: 304,
      poolTokens: 1024,
      numNeeded: 3,
    })
  })

  test('one pool, no page size: one plant that fills it, less max_tokens', () => {
    assert.deepEqual(poolCover({ ...demo, largestPoolTokens: 384, pageSizes: [] }, 16), {
      numPlants: 1,
      promptTokens: 352,
      poolTokens: 384,
      numNeeded: 1,
    })
  })

  test('an SGLang-like endpoint: the input limit bounds each plant, the pool their number', () => {
    // min(100,000, 8,192, 8,185) − 32 = 8,153 a prompt; ⌈100,000 / 8,185⌉ = 13 leases of
    // ⌊100,000 / 13⌋ = 7,692 tokens, 7,660 of them prompt.
    assert.deepEqual(
      poolCover(
        {
          poolTokens: 100_000,
          largestPoolTokens: 100_000,
          contextTokens: 8192,
          inputLimitTokens: 8185,
          pageSizes: [1],
        },
        16,
      ),
      { numPlants: 13, promptTokens: 7660, poolTokens: 100_000, numNeeded: 13 },
    )
  })

  test('no pool reported, or too small a one for a plant: none', () => {
    assert.equal(poolCover({ ...demo, poolTokens: null, largestPoolTokens: null }, 16), null)
    assert.equal(poolCover({ ...demo, poolTokens: 40, largestPoolTokens: 40 }, 16), null)
  })
})

describe('denseMaterial', () => {
  const taken = ['Ab3dEf9hIjKl0nOp', 'Zz81yXw2VuTs']

  test('prompts of exactly the length asked, every character part of a canary', () => {
    const material = denseMaterial(createRng(7, 'test'), taken)
    for (const numChars of [1000, 301, 8]) {
      const { canaries, prompt } = material.next(numChars)
      assert.equal(prompt.length, numChars)
      // Canaries joined by single spaces; the last one may be cut.
      const words = prompt.split(' ')
      assert.equal(words.length, canaries.length)
      words.forEach((w, i) => assert.ok(canaries[i].startsWith(w), `${w} of ${canaries[i]}`))
      assert.ok(canaries.every((c) => /^[A-Za-z0-9]{16,24}$/.test(c)))
    }
  })

  test('no canary shares an 8-character fragment with another or with those taken', () => {
    const material = denseMaterial(createRng(8, 'test'), taken)
    const all = [...material.next(2000).canaries, ...material.next(2000).canaries]
    const others = [...taken, ...all]
    for (const [i, canary] of all.entries()) {
      for (const [j, other] of others.entries()) {
        if (j === taken.length + i) continue
        assert.equal(findFragment(other, canary), null, `${canary} in ${other}`)
      }
    }
  })

  test('the same seed gives the same prompts', () => {
    const a = denseMaterial(createRng(9, 'test'), taken).next(500)
    const b = denseMaterial(createRng(9, 'test'), taken).next(500)
    assert.deepEqual(a, b)
  })
})
