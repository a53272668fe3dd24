/** One request's sampler: its validated {@link Sampling} parameters, its own seeded random stream,
 *  and the counts of the tokens it generated (for the penalties). The prefill worker samples the
 *  first token with the `prefill` stream, the decode worker every later one with the `decode`
 *  stream, and the single-process engine does exactly the same, so that a seed fixes the tokens
 *  whichever way the request runs.
 *  Knows token ids and logits; knows nothing of pools, transfers, HTTP or text. */
import { randomBytes } from 'node:crypto'
import { makeRandom, sample, tokenLogprobs, type TokenLogprobs } from '../model/sampling.js'
import type { Sampling } from '../control/messages.js'

/** Which side of a request draws: the prefill worker (first token) or the decode worker (the rest). */
export type SamplingPhase = 'prefill' | 'decode'

/** A sampled token, with its log-probabilities when the request asked for them. */
export interface SampledToken {
  tokenId: number
  /** Present iff `sampling.numLogprobs` is set (not null or absent). */
  logprobs?: TokenLogprobs
}

/** Seed of a phase's stream: the request's seed for prefill, seed + 1 for decode (two streams that
 *  never depend on how many draws the other made); a fresh random seed when the request has none. */
export function phaseSeed(sampling: Sampling, phase: SamplingPhase): number {
  if (sampling.seed === null) return randomBytes(4).readUInt32LE()
  return phase === 'prefill' ? sampling.seed : sampling.seed + 1
}

/** Samples one request's tokens of one phase. */
export class RequestSampler {
  private readonly random: () => number
  /** Token id → times generated so far in this request (the first token included). */
  private readonly counts = new Map<number, number>()

  constructor(
    private readonly sampling: Sampling,
    phase: SamplingPhase,
  ) {
    this.random = makeRandom(phaseSeed(sampling, phase))
  }

  /** Counts a token generated elsewhere (the decode side is told the first token). */
  record(tokenId: number): void {
    this.counts.set(tokenId, (this.counts.get(tokenId) ?? 0) + 1)
  }

  /** Samples the next token from `logits` (`[vocabSize]`) and counts it. Throws as `sample` does. */
  next(logits: Float32Array): SampledToken {
    const s = this.sampling
    const tokenId = sample(logits, {
      temperature: s.temperature,
      topP: s.topP,
      topK: s.topK,
      minP: s.minP,
      presencePenalty: s.presencePenalty,
      frequencyPenalty: s.frequencyPenalty,
      counts: this.counts,
      random: this.random,
    })
    this.record(tokenId)
    if (s.numLogprobs == null) return { tokenId }
    return { tokenId, logprobs: tokenLogprobs(logits, tokenId, s.numLogprobs) }
  }
}
