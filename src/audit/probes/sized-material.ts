/** Canary-bearing prompts of a chosen token length, for the probes whose prompts must land on a
 *  cache's edges (`warm-equals-cold`) or fill its pool (`evict-then-return`).
 *
 *  A prompt is `head canary filler`: `head` is a few random single letters (unique per prompt,
 *  so that no two prompts share a first page and every first answer is cold), `canary` is the
 *  tenant's (what another tenant's answer must never carry), `filler` the prompt's own keyed
 *  filler (material.ts: random letters of the sizer's alphabet, so that an answer replaying it
 *  names the request, and so the tenant, that sent it). Letters and filler cost the sizer's
 *  tokens per word, as the sizer's own filler does; a canary's cost is measured once per tenant from
 *  `usage.prompt_tokens` (`measureCanary`), since no sizer knows how a random string tokenizes.
 *  Where the canary does not fit a short length, a piece of it does, or head and filler alone.
 *  Also the lengths where caches cut prompts: page and prefill-chunk sizes the endpoint reports,
 *  else powers of two from 16 to 1,024.
 *  Knows the sizer and canaries; knows nothing of any engine. */
import { BudgetExhaustedError } from '../budget.js'
import { minFragmentLength } from '../canaries.js'
import type { Rng } from '../rng.js'
import { type PromptSizer } from '../sizer.js'
import { outcomeOf, type Target } from '../target.js'
import type { Tenant } from '../types.js'
import { keyedFiller } from './material.js'

/** Random letters heading each prompt: 26^6 ≈ 3·10^8 heads, so two prompts of one audit share
 *  none by chance. */
export const headWords = 6

/** A tenant's canary and what it costs in tokens on this endpoint (null: not measured). */
export interface TenantCanary {
  readonly tenant: Tenant
  readonly canary: string
  readonly canaryTokens: number | null
}

/** A unique head: `headWords` random lowercase letters, space-separated. */
export function randomHead(rng: Rng): string {
  return Array.from({ length: headWords }, () => String.fromCharCode(97 + rng.int(0, 25))).join(' ')
}

/** A sized prompt: its text, whether it carries the canary (or a piece), and its keyed filler
 *  (the words after the canary; what {@link findFillerRun} matches an answer against). */
export interface SizedPrompt {
  readonly prompt: string
  readonly hasCanary: boolean
  readonly filler: string
}

/** A prompt estimated at `numTokens` tokens: a fresh head, the canary, then keyed filler. Where the
 *  whole canary leaves no room for a filler word, its longest leading piece of at least
 *  {@link minFragmentLength} characters that does (a piece that long is found in an answer as
 *  the canary is; its cost is taken in proportion to the measured whole's); where none does,
 *  head and filler alone. `hasCanary` says whether it carries the canary or a piece of it.
 *  A filler word may cost more than one token (two on a character-level tokenizer: the letter and
 *  its space), so filler alone cannot reach every count: the longest piece whose estimate lands
 *  exactly on `numTokens` is taken, and only where no piece does, the longest landing at most one
 *  token over. */
export function sizedPrompt(
  rng: Rng,
  sizer: PromptSizer,
  numTokens: number,
  canary: TenantCanary | null,
): SizedPrompt {
  const head = randomHead(rng)
  if (canary !== null && canary.canaryTokens !== null) {
    const { length } = canary.canary
    let nearly: { numChars: number; numFiller: number } | null = null
    for (let numChars = length; numChars >= minFragmentLength; numChars--) {
      const cost = Math.ceil((canary.canaryTokens * numChars) / length)
      const words = sizer.wordsFor(numTokens - cost, 'nearest')
      for (const numWords of [words, words - 1, words + 1]) {
        const numFiller = numWords - headWords
        if (numFiller < 1) continue
        const estimate = sizer.estimate(numWords) + cost
        if (estimate === numTokens) return withCanary(rng, head, canary.canary, numChars, numFiller)
        if (nearly === null && numWords === words && estimate <= numTokens + 1)
          nearly = { numChars, numFiller }
      }
    }
    if (nearly !== null)
      return withCanary(rng, head, canary.canary, nearly.numChars, nearly.numFiller)
  }
  const numFiller = Math.max(1, sizer.wordsFor(numTokens, 'nearest') - headWords)
  const filler = keyedFiller(rng, numFiller)
  return { prompt: `${head} ${filler}`, hasCanary: false, filler }
}

function withCanary(
  rng: Rng,
  head: string,
  canary: string,
  numChars: number,
  numFiller: number,
): SizedPrompt {
  const filler = keyedFiller(rng, numFiller)
  return { prompt: `${head} ${canary.slice(0, numChars)} ${filler}`, hasCanary: true, filler }
}

/** A prompt of at most `numTokens` tokens that always carries `canary` and keyed filler (its own,
 *  so that any stretch of it names whose it was), for traffic whose size only has to be large: the canary is counted at two tokens per character plus two (more than
 *  any tokenizer spends on a random string, its neighbours' merges included), so the prompt never
 *  passes `numTokens`. */
export function boundedPrompt(
  rng: Rng,
  sizer: PromptSizer,
  numTokens: number,
  canary: string,
): string {
  const canaryBound = 2 * canary.length + 2
  const numFiller = Math.max(1, sizer.wordsFor(numTokens - canaryBound, 'down') - headWords)
  const head = randomHead(rng)
  return `${head} ${canary} ${keyedFiller(rng, numFiller)}`
}

/** Filler words between two copies of a prompt's canary in a {@link markedPrompt}: fewer than
 *  the 16 tokens an audit's answer holds, so that any stretch of the prompt an engine replays
 *  into another request's answer carries its canary. */
export const markEveryWords = 6

/** A prompt of at most about `numTokens` tokens, for traffic whose size only has to be large
 *  (eviction, filler), attributable all along to the request (and so the tenant) that sent it:
 *  `head canary (filler×6 canary)…`, the canary repeated every {@link markEveryWords} filler words
 *  to the end. Its cost is estimated from `calibration` (a canary of the tenant's measured on
 *  this endpoint, see {@link measureCanary}): its tokens per character, half as much again, plus
 *  2 for merges at its joins; unmeasured, {@link boundedPrompt}'s bound. Where not even one
 *  repeat fits, {@link boundedPrompt}'s prompt. */
export function markedPrompt(
  rng: Rng,
  sizer: PromptSizer,
  numTokens: number,
  canary: string,
  calibration: TenantCanary,
): string {
  const measured = calibration.canaryTokens
  const canaryCost =
    measured === null
      ? 2 * canary.length + 2
      : Math.ceil((1.5 * canary.length * measured) / calibration.canary.length) + 2
  const cost = (numCopies: number, numWords: number): number =>
    sizer.estimate(headWords + numWords) + numCopies * canaryCost
  let numRepeats = 0
  while (cost(numRepeats + 2, (numRepeats + 1) * markEveryWords) <= numTokens) numRepeats++
  if (numRepeats === 0) return boundedPrompt(rng, sizer, numTokens, canary)
  const head = randomHead(rng)
  const segments = Array.from(
    { length: numRepeats },
    () => `${keyedFiller(rng, markEveryWords)} ${canary}`,
  ).join(' ')
  return `${head} ${canary} ${segments}`
}

/** Measures what `canary` costs in tokens: one completion (`max_tokens: 1`) of head, canary and
 *  16 filler words, minus the sizer's estimate for the words alone. Null when the endpoint did not
 *  answer it or gave no `usage.prompt_tokens`. Throws `BudgetExhaustedError`. */
export async function measureCanary(
  target: Target,
  rng: Rng,
  sizer: PromptSizer,
  tenant: Tenant,
  canary: string,
): Promise<TenantCanary> {
  const numFiller = 16
  const r = await target.complete({
    tenant,
    prompt: `${randomHead(rng)} ${canary} ${keyedFiller(rng, numFiller)}`,
    maxTokens: 1,
    stream: false,
  })
  const canaryTokens =
    outcomeOf(r) === 'accepted' && r.promptTokens !== null
      ? r.promptTokens - sizer.estimate(headWords + numFiller)
      : null
  return {
    tenant,
    canary,
    canaryTokens: canaryTokens !== null && canaryTokens >= 1 ? canaryTokens : null,
  }
}

/** The sizer, or null when the budget ran out during calibration (the caller is inconclusive). */
export async function sizerOrNull(
  sizer: () => Promise<PromptSizer | null>,
): Promise<PromptSizer | null> {
  return sizer().catch((err: unknown) => {
    if (err instanceof BudgetExhaustedError) return null
    throw err
  })
}

/** Where prompt lengths meet a cache's edges, and why. */
export interface CacheEdge {
  readonly tokens: number
  readonly why: string
}

/** Smallest edge a prompt is sent on: shorter prompts hold little more than their head. */
export const minEdgeTokens = 16
const defaultEdges = [16, 32, 64, 128, 256, 512, 1024]
/** Page multiples tried per reported page size: P·1, P·2, P·4, P·8 (from the first ≥ 16). */
const maxPageMultiples = 4

/** The edges to send prompts on: per reported page size P, its multiples P·2^k from the first
 *  one of at least {@link minEdgeTokens} (up to {@link maxPageMultiples} of them); with no page
 *  size reported, powers of two from 16 to 1,024; per reported chunk size C, C and 2C. Only edges
 *  whose `edge + 1` tokens fit under `maxPromptTokens` (null: no limit known) are kept; sorted. */
export function cacheEdges(
  pageSizes: readonly number[],
  chunkSizes: readonly number[],
  maxPromptTokens: number | null,
): CacheEdge[] {
  const edges = new Map<number, string>()
  const add = (tokens: number, why: string): void => {
    if (maxPromptTokens !== null && tokens + 1 > maxPromptTokens) return
    if (!edges.has(tokens)) edges.set(tokens, why)
  }
  for (const page of new Set(pageSizes)) {
    let multiple = page
    while (multiple < minEdgeTokens) multiple *= 2
    for (let i = 0; i < maxPageMultiples; i++, multiple *= 2)
      add(multiple, `${multiple / page} × page ${page}`)
  }
  if (pageSizes.length === 0) {
    for (const tokens of defaultEdges) add(tokens, 'power of two (no page size reported)')
  }
  for (const chunk of new Set(chunkSizes)) {
    if (chunk < minEdgeTokens) continue
    add(chunk, `chunk ${chunk}`)
    add(2 * chunk, `2 × chunk ${chunk}`)
  }
  return [...edges].map(([tokens, why]) => ({ tokens, why })).sort((a, b) => a.tokens - b.tokens)
}

/** The largest prompt (tokens) that leaves `maxTokens` to generate within the smallest of the
 *  pool, the context and the engine's input limit; null when the endpoint reports none. */
export function promptLimit(
  limits: {
    readonly poolTokens: number | null
    readonly contextTokens: number | null
    readonly inputLimitTokens: number | null
  },
  maxTokens: number,
): number | null {
  const known = [limits.poolTokens, limits.contextTokens, limits.inputLimitTokens].filter(
    (n) => n !== null,
  )
  return known.length === 0 ? null : Math.min(...known) - maxTokens
}
