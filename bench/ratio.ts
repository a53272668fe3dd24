/** Stable ratios for the benchmarks: a ratio is measured as interleaved pairs (numerator and
 *  denominator back to back, the order alternating pair by pair: A B, B A, A B, …) so that drift
 *  in the machine's load weighs on both sides alike, and is reported as the median of the
 *  per-pair ratios with its spread (min, quartiles, max, n) — never as a ratio of two medians
 *  taken at different times. A bound (a figure the measured one cannot exceed if the bound is
 *  right) is checked here too: a measured figure above its bound is a defect of the bench, said in
 *  a field of its own, not a ratio above 1 to be read as a result.
 *  Knows numbers and promises; knows nothing of what is measured. */

/** The spread of a set of per-pair ratios (or of any sample): its median, quartiles (nearest
 *  rank), extremes and size. Every figure rounded to `digits` decimals. */
export interface Spread {
  readonly median: number
  readonly min: number
  readonly q1: number
  readonly q3: number
  readonly max: number
  readonly n: number
}

/** The `q` quantile of `values` (nearest rank: the smallest value with at least q·n values at or
 *  below it). Throws on an empty sample. */
export function quantile(values: readonly number[], q: number): number {
  if (values.length === 0) throw new Error('quantile of an empty sample')
  const sorted = [...values].sort((a, b) => a - b)
  return sorted[Math.min(sorted.length - 1, Math.max(0, Math.ceil(q * sorted.length) - 1))]
}

/** The {@link Spread} of `values`, rounded to `digits` decimals. Throws on an empty sample or a
 *  value that is not finite (a ratio over a zero denominator must not pass as a figure). */
export function spreadOf(values: readonly number[], digits = 3): Spread {
  if (values.length === 0) throw new Error('spread of an empty sample')
  const bad = values.find((v) => !Number.isFinite(v))
  if (bad !== undefined) throw new Error(`spread of a sample holding ${bad}`)
  const r = (x: number) => Number(x.toFixed(digits))
  return {
    median: r(quantile(values, 0.5)),
    min: r(Math.min(...values)),
    q1: r(quantile(values, 0.25)),
    q3: r(quantile(values, 0.75)),
    max: r(Math.max(...values)),
    n: values.length,
  }
}

/** One pair's two measurements. */
export interface Pair<T> {
  readonly numerator: T
  readonly denominator: T
}

/** Runs `numPairs` pairs of `numerator` and `denominator`, one after the other (never at once),
 *  the numerator first in even pairs and the denominator first in odd ones. */
export async function interleavedPairs<T>(
  numPairs: number,
  numerator: () => Promise<T>,
  denominator: () => Promise<T>,
): Promise<Pair<T>[]> {
  const pairs: Pair<T>[] = []
  for (let i = 0; i < numPairs; i++) {
    if (i % 2 === 0) {
      const n = await numerator()
      pairs.push({ numerator: n, denominator: await denominator() })
    } else {
      const d = await denominator()
      pairs.push({ numerator: await numerator(), denominator: d })
    }
  }
  return pairs
}

/** {@link interleavedPairs} for code that is not asynchronous (kernels timed in the same thread). */
export function interleavedPairsSync<T>(
  numPairs: number,
  numerator: () => T,
  denominator: () => T,
): Pair<T>[] {
  const pairs: Pair<T>[] = []
  for (let i = 0; i < numPairs; i++) {
    if (i % 2 === 0) {
      const n = numerator()
      pairs.push({ numerator: n, denominator: denominator() })
    } else {
      const d = denominator()
      pairs.push({ numerator: numerator(), denominator: d })
    }
  }
  return pairs
}

/** The per-pair ratios numerator ÷ denominator of `pairs`, each side read by `value`. */
export function pairRatios<T>(pairs: readonly Pair<T>[], value: (x: T) => number): number[] {
  return pairs.map((p) => value(p.numerator) / value(p.denominator))
}

/** The JSON fields of a ratio named `name`: `name` is the median of the per-pair ratios (so that
 *  readers of the figure alone read what they read before) and `name_spread` its
 *  {@link Spread}. */
export function ratioFields(
  name: string,
  ratios: readonly number[],
  digits = 3,
): Record<string, number | Spread> {
  const spread = spreadOf(ratios, digits)
  return { [name]: spread.median, [`${name}_spread`]: spread }
}

/** The JSON fields of a measured figure held against a bound it must not exceed, per pair: the
 *  ratio's fields ({@link ratioFields}) and `name_bound_holds` — false when the median ratio is
 *  above 1, i.e. the measured figure beats its "bound", which is then no bound: a defect of the
 *  bench to fix, said in `name_defect`, not a result to read. */
export function boundFields(
  name: string,
  ratios: readonly number[],
  digits = 3,
): Record<string, number | boolean | string | Spread> {
  const fields: Record<string, number | boolean | string | Spread> = ratioFields(
    name,
    ratios,
    digits,
  )
  const median = quantile(ratios, 0.5)
  fields[`${name}_bound_holds`] = median <= 1
  if (median > 1) {
    fields[`${name}_defect`] =
      `the measured figure is ${median.toFixed(3)}× its bound: the bound is not an upper bound as measured, so this ratio says nothing`
  }
  return fields
}
