/** Next-token sampling from logits, and the log-probabilities reported with a token.
 *
 *  One step of {@link sample}, in this order (vLLM's and SGLang's samplers apply the same
 *  transformations; SGLang filters top-k → top-p → min-p as here, vLLM v1 applies min-p before
 *  its top-k/top-p step):
 *  1. penalties (OpenAI semantics): `logit[t] -= presence·[count(t) > 0] + frequency·count(t)`,
 *     counts over the tokens GENERATED so far in this request (the prompt does not count, as in
 *     OpenAI's API; vLLM's and SGLang's penalties count the same);
 *  2. temperature: temperature 0 is greedy — the argmax of the penalized logits, no random draw;
 *     otherwise `softmax(logits / T)`;
 *  3. top-k: keep the k most probable tokens;
 *  4. top-p (nucleus, Holtzman et al. 2020): keep the smallest prefix of the rest, most probable
 *     first, whose mass reaches top_p of theirs (always at least the top token);
 *  5. min-p (Nguyen et al. 2024): keep the tokens whose probability is at least min_p × the top
 *     token's;
 *  6. one draw from the request's seeded random stream over what is left, renormalized.
 *  Ties are broken by the lower token id everywhere, so a seed fixes the tokens exactly.
 *
 *  Knows logits, token ids and random numbers; knows nothing of requests, HTTP or text. */
import { KvfenceError } from '../common/errors.js'

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

/** Options of {@link sample}. Defaults (absent fields) turn a step off. */
export interface SampleOptions {
  /** 0 = greedy; else in (0, 2]. */
  temperature: number
  /** Nucleus mass in (0, 1]; 1 = off. */
  topP: number
  /** Keep the k most probable tokens (k ≥ 1); null or absent = off. */
  topK?: number | null
  /** In [0, 1]; 0 or absent = off. */
  minP?: number
  /** In [-2, 2]; subtracted once from the logit of every token generated at least once. */
  presencePenalty?: number
  /** In [-2, 2]; subtracted once per earlier occurrence of the token among the generated ones. */
  frequencyPenalty?: number
  /** How often each token id was generated so far in this request (for the penalties). */
  counts?: ReadonlyMap<number, number>
  random: () => number
}

/** Index of the largest logit (the lowest index among ties). */
export function argmax(logits: ArrayLike<number>): number {
  let best = 0
  for (let i = 1; i < logits.length; i++) if (logits[i] > logits[best]) best = i
  return best
}

/** The logits after the presence and frequency penalties (`[vocabSize]`, float64); the input
 *  itself when no penalty applies. Counts of ids outside the vocabulary are ignored. */
export function applyPenalties(
  logits: Float32Array,
  counts: ReadonlyMap<number, number>,
  presencePenalty: number,
  frequencyPenalty: number,
): ArrayLike<number> {
  if ((presencePenalty === 0 && frequencyPenalty === 0) || counts.size === 0) return logits
  const out = Float64Array.from(logits)
  for (const [id, count] of counts) {
    if (count > 0 && id >= 0 && id < out.length)
      out[id] -= presencePenalty + frequencyPenalty * count
  }
  return out
}

/** Pick the next token id from `logits` (`[vocabSize]`) by the steps in this module's comment.
 *  Draws exactly one random number unless greedy. Throws `internal_error` for a NaN or +∞ logit
 *  (poisoned KV, G6): no token may be made of them. */
export function sample(logits: Float32Array, opts: SampleOptions): number {
  // NaN logits come from reading poisoned (scrubbed) KV (G6): no token may be made of them.
  const badAt = logits.findIndex((l) => Number.isNaN(l) || l === Infinity)
  if (badAt >= 0)
    throw new KvfenceError(
      'internal_error',
      `logit ${badAt} of ${logits.length} is ${logits[badAt]}; refusing to sample`,
    )
  const penalized = applyPenalties(
    logits,
    opts.counts ?? new Map(),
    opts.presencePenalty ?? 0,
    opts.frequencyPenalty ?? 0,
  )
  if (opts.temperature === 0) return argmax(penalized)
  const max = penalized[argmax(penalized)]
  // Unnormalized probabilities; tokens at −∞ (masked) have none and are never candidates.
  const probs: { id: number; p: number }[] = []
  for (let id = 0; id < penalized.length; id++) {
    const p = Math.exp((penalized[id] - max) / opts.temperature)
    if (p > 0) probs.push({ id, p })
  }
  if (probs.length === 0)
    throw new KvfenceError(
      'internal_error',
      `no logit of ${logits.length} is finite; refusing to sample`,
    )
  probs.sort((a, b) => b.p - a.p || a.id - b.id)
  // top-k
  let kept = opts.topK == null ? probs.length : Math.min(opts.topK, probs.length)
  // top-p over the top-k renormalized: the smallest prefix whose mass reaches top_p of theirs.
  let total = 0
  for (let i = 0; i < kept; i++) total += probs[i].p
  let numNucleus = 0
  let mass = 0
  while (numNucleus < kept && (numNucleus === 0 || mass < opts.topP * total))
    mass += probs[numNucleus++].p
  kept = numNucleus
  // min-p: a ratio to the top token's probability, so normalization does not matter.
  const minP = opts.minP ?? 0
  if (minP > 0) {
    const threshold = minP * probs[0].p
    while (kept > 1 && probs[kept - 1].p < threshold) mass -= probs[--kept].p
  }
  let r = opts.random() * mass
  for (let i = 0; i < kept; i++) {
    r -= probs[i].p
    if (r <= 0) return probs[i].id
  }
  return probs[kept - 1].id
}

/** The log-probability OpenAI (and vLLM) report for a token too unlikely to represent: −∞ is not
 *  JSON, so −9999.0 stands for it. */
export const minLogprob = -9999

/** One token and its log-probability. */
export interface TokenIdLogprob {
  tokenId: number
  /** Natural log; ≥ {@link minLogprob}. */
  logprob: number
}

/** The log-probabilities reported with a sampled token. */
export interface TokenLogprobs {
  /** Of the sampled token. */
  logprob: number
  /** The `numTop` most likely tokens, most likely first (lower id first among ties). */
  top: TokenIdLogprob[]
}

/** Log-probabilities of `tokenId` and of the `numTop` most likely tokens: `log_softmax` of the RAW
 *  model logits `[vocabSize]`, in float64 — before penalties, temperature and the top-k/top-p/
 *  min-p filters, as vLLM returns them by default (`logprobs_mode` "raw_logprobs"). A token at −∞
 *  is reported as {@link minLogprob}. */
export function tokenLogprobs(
  logits: Float32Array,
  tokenId: number,
  numTop: number,
): TokenLogprobs {
  const max = logits[argmax(logits)]
  let sum = 0
  for (let i = 0; i < logits.length; i++) sum += Math.exp(logits[i] - max)
  const logSum = max + Math.log(sum)
  const logprobOf = (id: number) => Math.max(minLogprob, logits[id] - logSum)
  // Partial selection: the numTop best so far, kept sorted (numTop ≤ 20).
  const top: number[] = []
  const isBetter = (a: number, b: number) =>
    logits[a] > logits[b] || (logits[a] === logits[b] && a < b)
  for (let id = 0; id < logits.length && numTop > 0; id++) {
    if (top.length === numTop && !isBetter(id, top[numTop - 1])) continue
    let at = top.length === numTop ? numTop - 1 : top.length
    top[at] = id
    while (at > 0 && isBetter(top[at], top[at - 1])) {
      ;[top[at - 1], top[at]] = [top[at], top[at - 1]]
      at--
    }
  }
  return {
    logprob: logprobOf(tokenId),
    top: top.map((id) => ({ tokenId: id, logprob: logprobOf(id) })),
  }
}
