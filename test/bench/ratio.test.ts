import { describe, it } from 'node:test'
import assert from 'node:assert/strict'
import fc from 'fast-check'
import {
  boundFields,
  interleavedPairs,
  interleavedPairsSync,
  pairRatios,
  quantile,
  ratioFields,
  spreadOf,
} from '../../bench/ratio.js'

describe('bench ratios', () => {
  it('interleaves numerator and denominator, alternating which goes first', async () => {
    const order: string[] = []
    let a = 0
    let d = 0
    const pairs = await interleavedPairs(
      4,
      async () => (order.push('A'), ++a),
      async () => (order.push('B'), ++d * 10),
    )
    assert.deepEqual(order, ['A', 'B', 'B', 'A', 'A', 'B', 'B', 'A'])
    // Each pair holds the numerator and denominator run beside each other.
    assert.deepEqual(
      pairs.map((p) => [p.numerator, p.denominator]),
      [
        [1, 10],
        [2, 20],
        [3, 30],
        [4, 40],
      ],
    )
    const syncOrder: string[] = []
    interleavedPairsSync(
      3,
      () => syncOrder.push('A'),
      () => syncOrder.push('B'),
    )
    assert.deepEqual(syncOrder, ['A', 'B', 'B', 'A', 'A', 'B'])
  })

  it('reports the median of per-pair ratios with quartiles, extremes and n (nearest rank)', () => {
    const ratios = pairRatios(
      [
        { numerator: 3, denominator: 4 }, // 0.75
        { numerator: 1, denominator: 2 }, // 0.5
        { numerator: 9, denominator: 10 }, // 0.9
        { numerator: 2, denominator: 5 }, // 0.4
        { numerator: 4, denominator: 5 }, // 0.8
      ],
      (x) => x,
    )
    // Sorted: 0.4 0.5 0.75 0.8 0.9; ranks ceil(q·5): q1 → 2nd, median → 3rd, q3 → 4th.
    assert.deepEqual(ratioFields('x_ratio', ratios), {
      x_ratio: 0.75,
      x_ratio_spread: { median: 0.75, min: 0.4, q1: 0.5, q3: 0.8, max: 0.9, n: 5 },
    })
  })

  it('says a bound that the measured figure beats is no bound, and nothing when it holds', () => {
    assert.deepEqual(boundFields('peak', [1.1, 1.2, 0.9]), {
      peak: 1.1,
      peak_spread: { median: 1.1, min: 0.9, q1: 0.9, q3: 1.2, max: 1.2, n: 3 },
      peak_bound_holds: false,
      peak_defect:
        'the measured figure is 1.100× its bound: the bound is not an upper bound as measured, so this ratio says nothing',
    })
    assert.deepEqual(boundFields('peak', [0.5, 1.0, 0.7]), {
      peak: 0.7,
      peak_spread: { median: 0.7, min: 0.5, q1: 0.5, q3: 1, max: 1, n: 3 },
      peak_bound_holds: true,
    })
  })

  it('refuses an empty sample or a ratio that is not a number', () => {
    assert.throws(() => spreadOf([]), /empty sample/)
    assert.throws(() => spreadOf([1, Infinity]), /holding Infinity/)
    assert.throws(() => spreadOf([NaN]), /holding NaN/)
  })

  it('orders min ≤ q1 ≤ median ≤ q3 ≤ max, each one of the sample (property)', () => {
    fc.assert(
      fc.property(
        fc.array(fc.double({ min: 0, max: 1e6, noNaN: true }), { minLength: 1, maxLength: 50 }),
        (values) => {
          const s = spreadOf(values, 12)
          assert.ok(s.min <= s.q1 && s.q1 <= s.median && s.median <= s.q3 && s.q3 <= s.max)
          assert.equal(s.n, values.length)
          assert.equal(s.median, Number(quantile(values, 0.5).toFixed(12)))
          for (const q of [0.25, 0.5, 0.75]) assert.ok(values.includes(quantile(values, q)))
        },
      ),
    )
  })
})
