/** A small seeded pseudo-random generator (sfc32), so that `--seed` reproduces canaries, prompt
 *  sizes and order. Not for secrets: canaries only need to be unlikely to appear by chance. */

export interface Rng {
  /** Uniform in [0, 1). */
  next(): number
  /** Uniform integer in [lo, hi] (both inclusive). */
  int(lo: number, hi: number): number
  pick<T>(items: readonly T[]): T
}

/** 32-bit FNV-1a of a string: turns a stream label into seed material. */
function fnv1a(text: string): number {
  let hash = 0x811c9dc5
  for (let i = 0; i < text.length; i++) {
    hash ^= text.charCodeAt(i)
    hash = Math.imul(hash, 0x01000193) >>> 0
  }
  return hash
}

/** An independent stream per (seed, label): adding a probe does not shift another's numbers. */
export function createRng(seed: number, label: string): Rng {
  let a = seed >>> 0
  let b = fnv1a(label)
  let c = 0x9e3779b9
  let d = 1
  const nextU32 = (): number => {
    const t = (((a + b) >>> 0) + d) >>> 0
    d = (d + 1) >>> 0
    a = b ^ (b >>> 9)
    b = (c + (c << 3)) >>> 0
    c = ((c << 21) | (c >>> 11)) >>> 0
    c = (c + t) >>> 0
    return t
  }
  for (let i = 0; i < 15; i++) nextU32() // mix the seed in
  const next = (): number => nextU32() / 0x1_0000_0000
  return {
    next,
    int: (lo, hi) => lo + Math.floor(next() * (hi - lo + 1)),
    pick: (items) => {
      if (items.length === 0) throw new RangeError('pick from an empty list')
      return items[Math.floor(next() * items.length)]
    },
  }
}
