/** The two-sample Kolmogorov–Smirnov test, for the `prefix-timing` probe (Gu et al., ICML 2025,
 *  compare TTFT samples of prefix-cache hits and misses with it). No well-kept npm package offers
 *  the two-sample test (`@stdlib/stats-kstest` is one-sample only), so it is written here from
 *  the textbook definitions:
 *  - D = sup |F₁(x) − F₂(x)| over the pooled sample;
 *  - exact two-sided p-value P(D ≥ d) by counting the monotone lattice paths from (0,0) to (n,m)
 *    that stay strictly inside |i/n − j/m| < d (Hodges 1958), used while n·m ≤ 10 000; this is
 *    what `scipy.stats.ks_2samp(method='exact')` computes;
 *  - otherwise the asymptotic Kolmogorov distribution Q(λ) = 2 Σ (−1)^(k−1) e^(−2k²λ²) with
 *    λ = √(nm/(n+m))·d.
 *  Also the median, for TTFT summaries. Knows numbers only. */

export interface KsResult {
  /** The statistic D in [0, 1]. */
  readonly d: number
  /** Two-sided p-value P(D ≥ d) under "same distribution". */
  readonly p: number
  readonly method: 'exact' | 'asymptotic'
}

const maxExactCells = 10_000

/** Two-sided two-sample KS test. Throws RangeError when a sample is empty or holds a non-finite
 *  value. */
export function ksTwoSample(a: readonly number[], b: readonly number[]): KsResult {
  if (a.length === 0 || b.length === 0) throw new RangeError('ksTwoSample: a sample is empty')
  if (![...a, ...b].every(Number.isFinite))
    throw new RangeError('ksTwoSample: samples must be finite numbers')
  const d = ksStatistic(a, b)
  const n = a.length
  const m = b.length
  if (n * m <= maxExactCells) return { d, p: exactP(d, n, m), method: 'exact' }
  return { d, p: kolmogorovQ(Math.sqrt((n * m) / (n + m)) * d), method: 'asymptotic' }
}

/** D = sup over x of |F_a(x) − F_b(x)|, ties handled by stepping past equal values together. */
export function ksStatistic(a: readonly number[], b: readonly number[]): number {
  const x = [...a].sort((p, q) => p - q)
  const y = [...b].sort((p, q) => p - q)
  let i = 0
  let j = 0
  let d = 0
  while (i < x.length && j < y.length) {
    const v = Math.min(x[i], y[j])
    while (i < x.length && x[i] === v) i++
    while (j < y.length && y[j] === v) j++
    d = Math.max(d, Math.abs(i / x.length - j / y.length))
  }
  return d
}

/** P(D ≥ d) for sample sizes n and m: 1 − (paths staying inside)/(all paths). */
function exactP(d: number, n: number, m: number): number {
  // A lattice point (i, j) is outside when |i/n − j/m| ≥ d; compare in integers to avoid
  // rounding: |i·m − j·n| ≥ d·n·m (with a tolerance for d computed in floating point).
  const limit = d * n * m - 1e-7
  const row = new Float64Array(m + 1)
  for (let i = 0; i <= n; i++) {
    for (let j = 0; j <= m; j++) {
      if (Math.abs(i * m - j * n) >= limit && !(i === 0 && j === 0)) {
        row[j] = 0
      } else if (i === 0 && j === 0) {
        row[j] = 1
      } else {
        row[j] = (i > 0 ? row[j] : 0) + (j > 0 ? row[j - 1] : 0)
      }
    }
  }
  const inside = row[m]
  const total = binomial(n + m, n)
  return Math.min(1, Math.max(0, 1 - inside / total))
}

function binomial(n: number, k: number): number {
  let r = 1
  for (let i = 1; i <= k; i++) r = (r * (n - k + i)) / i
  return r
}

/** Q(λ) = P(K > λ) of the Kolmogorov distribution. */
function kolmogorovQ(lambda: number): number {
  if (lambda < 0.2) return 1
  let sum = 0
  for (let k = 1; k <= 100; k++) {
    const term = Math.exp(-2 * k * k * lambda * lambda)
    sum += (k % 2 === 1 ? 1 : -1) * term
    if (term < 1e-16) break
  }
  return Math.min(1, Math.max(0, 2 * sum))
}

/** Median of `xs`, or null when empty. */
export function median(xs: readonly number[]): number | null {
  if (xs.length === 0) return null
  const s = [...xs].sort((a, b) => a - b)
  const mid = Math.floor(s.length / 2)
  return s.length % 2 === 1 ? s[mid] : (s[mid - 1] + s[mid]) / 2
}
