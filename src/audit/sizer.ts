/** Token calibration: how many tokens a prompt of plain filler words costs on this endpoint, learnt
 *  from `usage.prompt_tokens` of tiny completions (or from `/tokenize` when usage is missing), so
 *  that probes can send prompts of a chosen size without knowing the tokenizer.
 *  Filler is the cycle "a b c ... p": single letters separated by spaces are one token each in
 *  common tokenizers, and since no token spans a space the count is linear in the number of
 *  words: tokens = overheadTokens + tokensPerWord × words. */
import type { Target } from './target.js'
import { tryJson } from './target.js'

export interface Observation {
  readonly words: number
  readonly tokens: number
}

export interface PromptSizer {
  readonly method: 'usage' | 'tokenize'
  readonly overheadTokens: number
  readonly tokensPerWord: number
  readonly observations: readonly Observation[]
  /** Number of filler words estimated to make `numTokens` prompt tokens (at least 1). When a word
   *  costs more than one token the exact count may be out of reach: `rounding` says whether to land
   *  at or below it (`down`, for prompts that must fit), at or above it (`up`, for prompts that must
   *  not), or nearest. */
  wordsFor(numTokens: number, rounding?: Rounding): number
  /** A filler prompt estimated at `numTokens` tokens (see {@link PromptSizer.wordsFor}). */
  build(numTokens: number, rounding?: Rounding): string
  /** Estimated token count of a filler prompt of `words` words. */
  estimate(words: number): number
  /** A new sizer that also fits a measured (words, tokens) pair. */
  refine(observation: Observation): PromptSizer
}

/** The filler's words: single letters, one token each after a space in common tokenizers. */
export const fillerAlphabet = 'abcdefghijklmnop'
/** Filler words of the calibration's completions (`max_tokens: 1` each). */
export const calibrationWords = [16, 64] as const

/** How {@link PromptSizer.wordsFor} rounds when the exact token count is out of reach. */
export type Rounding = 'nearest' | 'down' | 'up'

export function fillerText(words: number): string {
  const parts = new Array<string>(words)
  for (let i = 0; i < words; i++) parts[i] = fillerAlphabet[i % fillerAlphabet.length]
  return parts.join(' ')
}

/** Sizer from measured observations (least squares; exact for a linear tokenizer). */
export function createSizer(
  method: PromptSizer['method'],
  observations: readonly Observation[],
): PromptSizer | null {
  const n = observations.length
  if (n < 2) return null
  const meanW = observations.reduce((s, o) => s + o.words, 0) / n
  const meanT = observations.reduce((s, o) => s + o.tokens, 0) / n
  let num = 0
  let den = 0
  for (const o of observations) {
    num += (o.words - meanW) * (o.tokens - meanT)
    den += (o.words - meanW) ** 2
  }
  if (den === 0) return null
  const tokensPerWord = num / den
  if (!(tokensPerWord > 0)) return null
  const overheadTokens = meanT - tokensPerWord * meanW
  const roundings = { nearest: Math.round, down: Math.floor, up: Math.ceil }
  // A small epsilon keeps a least-squares fit like 1.9999999 from rounding the wrong way.
  const wordsFor = (numTokens: number, rounding: Rounding = 'nearest'): number => {
    const exact = (numTokens - overheadTokens) / tokensPerWord
    const nudge = rounding === 'down' ? 1e-9 : rounding === 'up' ? -1e-9 : 0
    return Math.max(1, roundings[rounding](exact + nudge))
  }
  const sizer: PromptSizer = {
    method,
    overheadTokens,
    tokensPerWord,
    observations,
    wordsFor,
    build: (numTokens, rounding) => fillerText(wordsFor(numTokens, rounding)),
    estimate: (words) => Math.round(overheadTokens + tokensPerWord * words),
    refine: (observation) =>
      createSizer(method, [
        ...observations.filter((o) => o.words !== observation.words),
        observation,
      ]) ?? sizer,
  }
  return Object.freeze(sizer)
}

/** Learns the sizer: two tiny completions with `max_tokens: 1`; when the server reports no usage,
 *  `/tokenize` instead. Null when neither works (the caller then cannot size prompts). */
export async function calibrate(target: Target): Promise<PromptSizer | null> {
  const tenant = target.tenants[0]
  const usage: Observation[] = []
  for (const words of calibrationWords) {
    const res = await target.complete({
      tenant,
      prompt: fillerText(words),
      maxTokens: 1,
      stream: false,
    })
    if (res.promptTokens === null) break
    usage.push({ words, tokens: res.promptTokens })
  }
  if (usage.length === calibrationWords.length) return createSizer('usage', usage)

  const counted: Observation[] = []
  for (const words of calibrationWords) {
    const body: Record<string, unknown> = { prompt: fillerText(words) }
    if (target.model !== null) body.model = target.model
    const res = await target.postJson('/tokenize', body, { tenant })
    const tokens = res.status === 200 ? tokenCount(tryJson(res.body)) : null
    if (tokens === null) return null
    counted.push({ words, tokens })
  }
  return createSizer('tokenize', counted)
}

/** vLLM: `{count, tokens}`; others: `{tokens}` or `{input_ids}`. */
function tokenCount(json: unknown): number | null {
  if (typeof json !== 'object' || json === null) return null
  const o = json as Record<string, unknown>
  if (typeof o.count === 'number' && Number.isInteger(o.count)) return o.count
  if (Array.isArray(o.tokens)) return o.tokens.length
  if (Array.isArray(o.input_ids)) return o.input_ids.length
  return null
}
