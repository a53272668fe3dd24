/** The two-sample Kolmogorov–Smirnov test against values computed by SciPy 1.17
 *  (`scipy.stats.ks_2samp(a, b, method='exact')`, and `scipy.special.kolmogorov` for the
 *  asymptotic branch), an independent implementation. */
import assert from 'node:assert/strict'
import { test } from 'node:test'
import { ksStatistic, ksTwoSample } from '../../src/audit/stats.js'

const close = (actual: number, expected: number, tolerance = 1e-12) =>
  assert.ok(
    Math.abs(actual - expected) <= tolerance * Math.max(1, Math.abs(expected)),
    `${actual} != ${expected}`,
  )

test('exact two-sided p-values match SciPy (disjoint, overlapping, interleaved, tied samples)', () => {
  const cases: [number[], number[], number, number][] = [
    [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], 1.0, 0.007936507936507936],
    [[1, 2, 3, 4, 5, 6], [3.5, 4.5, 7, 8], 0.5, 0.5523809523809524],
    [
      [0.1, 0.5, 0.9, 1.3, 2.2, 3.1, 0.7],
      [0.2, 0.6, 0.8, 1.0, 1.5, 2.5, 3.5, 4.0],
      0.25,
      0.9104895104895104,
    ],
    [[1, 1, 2, 2, 3], [2, 2, 3, 3, 4, 4], 0.4666666666666667, 0.474025974025974],
  ]
  for (const [a, b, d, p] of cases) {
    const r = ksTwoSample(a, b)
    assert.equal(r.method, 'exact')
    close(r.d, d)
    close(r.p, p, 1e-9)
  }
})

test('large samples use the asymptotic Kolmogorov distribution, matching SciPy', () => {
  const a = Array.from({ length: 120 }, (_, i) => ((i * 7) % 120) / 100)
  const b = Array.from({ length: 150 }, (_, j) => ((j * 11) % 150) / 100 + 0.35)
  const r = ksTwoSample(a, b)
  assert.equal(r.method, 'asymptotic')
  close(r.d, 0.43499999999999994)
  close(r.p, 2.2068876140787948e-11, 1e-6)
})

test('identical samples give D = 0 and p = 1; bad input is a RangeError', () => {
  assert.equal(ksStatistic([1, 2, 3], [3, 2, 1]), 0)
  assert.equal(ksTwoSample([1, 2, 3], [1, 2, 3]).p, 1)
  assert.throws(() => ksTwoSample([], [1]), RangeError)
  assert.throws(() => ksTwoSample([1, NaN], [1]), RangeError)
})
