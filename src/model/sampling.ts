/** Next-token sampling from logits: greedy at temperature 0, else temperature + nucleus (top-p,
 *  Holtzman et al. 2020) with a seeded random stream so the same seed gives the same tokens. */
import { KvfenceError } from '../errors.js'

/** A deterministic random stream in [0, 1) (SplitMix32-style; seeded per request). */
export function makeRandom(seed: number): () => number {
  let state = seed >>> 0
  return () => {
    state = (state + 0x9e3779b9) >>> 0
    let z = state
    z = Math.imul(z ^ (z >>> 16), 0x85ebca6b) >>> 0
    z = Math.imul(z ^ (z >>> 13), 0xc2b2ae35) >>> 0
    z = (z ^ (z >>> 16)) >>> 0
    return z / 2 ** 32
  }
}

/** Options of {@link sample}. */
export interface SampleOptions {
  /** 0 = greedy. */
  temperature: number
  /** Nucleus mass in (0, 1]. */
  topP: number
  random: () => number
}

/** Index of the largest logit (the lowest index among ties). */
export function argmax(logits: Float32Array): number {
  let best = 0
  for (let i = 1; i < logits.length; i++) if (logits[i] > logits[best]) best = i
  return best
}

/** Pick the next token id from `logits` (`[vocabSize]`). */
export function sample(logits: Float32Array, opts: SampleOptions): number {
  // NaN logits come from reading poisoned (scrubbed) KV (G6): no token may be made of them.
  const badAt = logits.findIndex((l) => Number.isNaN(l) || l === Infinity)
  if (badAt >= 0)
    throw new KvfenceError(
      'internal_error',
      `logit ${badAt} of ${logits.length} is ${logits[badAt]}; refusing to sample`,
    )
  if (opts.temperature === 0) return argmax(logits)
  const max = logits[argmax(logits)]
  const probs = Array.from(logits, (l, id) => ({ id, p: Math.exp((l - max) / opts.temperature) }))
  const total = probs.reduce((s, e) => s + e.p, 0)
  probs.sort((a, b) => b.p - a.p || a.id - b.id)
  // Keep the smallest prefix whose mass reaches top_p, and always at least the top token.
  let kept = 0
  let mass = 0
  while (kept < probs.length && (kept === 0 || mass < opts.topP * total)) mass += probs[kept++].p
  let r = opts.random() * mass
  for (let i = 0; i < kept; i++) {
    r -= probs[i].p
    if (r <= 0) return probs[i].id
  }
  return probs[kept - 1].id
}
