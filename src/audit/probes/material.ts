/** Material: what each request of a probe planted (its canaries, inside a whole synthetic prompt),
 *  and the check shared by `abort-race`, `concurrency`, `queueing`, `warm-equals-cold` and
 *  `evict-then-return`: every output may carry only its own request's material. Another
 *  tenant's canary is a leak (critical); another request's of the same tenant is a leak too
 *  (high): requests crossed, and the next time the other request may belong to someone else.
 *  Outputs are kept only redacted (where two answers part, `firstDifference`, instead of their
 *  text).
 *  Knows canaries and completion results; knows nothing of how they were sent. */
import {
  findCanaries,
  makeCanary,
  minFragmentLength,
  plantingMaterial,
  redact,
  type CanaryMatch,
} from '../canaries.js'
import type { Rng } from '../rng.js'
import { fillerAlphabet } from '../sizer.js'
import { outcomeOf, type CompletionResult } from '../target.js'
import type { Finding, ProbeName, Tenant } from '../types.js'

/** One request's planted material. `id` is unique within a probe run, e.g. `b3-alice`. */
export interface Planted {
  readonly id: string
  readonly tenant: Tenant
  readonly canaries: readonly string[]
  readonly prompt: string
  /** The request's own filler ({@link keyedFiller}), when its prompt has filler: an answer
   *  repeating {@link minFillerWords} of its words in a row carries this request's material.
   *  Several fillers (one per prompt, where the id stands for a tenant's several prompts) are
   *  separated by newlines: a run never spans two of them. */
  readonly filler?: string
}

/** One request's answer, with the material it was sent with. */
export interface Observed {
  readonly planted: Planted
  /** What kind of request it was, e.g. `burst 2, streamed`. */
  readonly label: string
  readonly stream: boolean
  readonly result: CompletionResult
}

/** An output that carried another request's canary: where it was seen and whose it was. */
export interface Crossing {
  readonly observed: Observed
  readonly source: Planted
  /** `isFiller`: the match is a run of the source's filler words, not a canary fragment. */
  readonly match: CanaryMatch & { readonly isFiller?: boolean }
}

/** Leak findings listed one by one; the rest are counted. */
const maxLeakFindings = 10

/** Material for one request per id (tenants taken in turn): a ~200–330-character prompt made
 *  only of canaries, no canary fragment shared with any other request's. */
export function plantMaterial(
  rng: Rng,
  tenants: readonly Tenant[],
  ids: readonly string[],
): Planted[] {
  const taken: string[] = []
  return ids.map((id, i) => {
    const { canaries, prompt } = plantingMaterial(rng, taken)
    taken.push(...canaries)
    return {
      id,
      tenant: tenants[i % tenants.length],
      canaries,
      prompt,
    }
  })
}

/** A source of canary-dense prompts as long as asked: `next(numChars)` gives a prompt of exactly
 *  `numChars` characters made only of canaries (space-separated, the last one cut to fit: every
 *  character belongs to a canary, so any stretch an engine replays is one), sharing no fragment of
 *  {@link minFragmentLength} characters with `taken` or with each other. Meant for prompts as long
 *  as a KV pool: uniqueness is checked against a set of the pieces taken, not by scanning every
 *  earlier canary (thousands of them for a pool of 10^5 tokens). */
export function denseMaterial(
  rng: Rng,
  taken: readonly string[],
): { next(numChars: number): { canaries: string[]; prompt: string } } {
  const pieces = new Set<string>()
  const piecesOf = (canary: string): string[] =>
    Array.from({ length: canary.length - minFragmentLength + 1 }, (_, i) =>
      canary.slice(i, i + minFragmentLength),
    )
  for (const canary of taken) for (const piece of piecesOf(canary)) pieces.add(piece)
  return {
    next(numChars) {
      const canaries: string[] = []
      let length = -1 // the joined prompt's, without a leading space
      while (length < numChars) {
        const canary = makeCanary(rng)
        const own = piecesOf(canary)
        if (own.some((piece) => pieces.has(piece))) continue
        for (const piece of own) pieces.add(piece)
        canaries.push(canary)
        length += canary.length + 1
      }
      return { canaries, prompt: canaries.join(' ').slice(0, numChars) }
    },
  }
}

/** Filler words an answer must repeat in a row to be matched to a request's filler: 12 letters
 *  drawn from 16 (16^12 ≈ 2.8·10^14 sequences) do not recur by chance in an audit's filler (a
 *  few 10^5 words in all), while an audit's 16-token answers hold 12 of them. */
export const minFillerWords = 12

/** Filler of `numWords` words for one request alone: single letters drawn from the sizer's
 *  alphabet (sizer.ts), so that it costs the sizer's tokens per word as its own filler does (a
 *  letter after a space is one token in common tokenizers, BPE ones included, whatever letter
 *  precedes it), yet unlike that filler it is the request's own: {@link findFillerRun} tells
 *  which request's filler an answer repeats, and so whose. */
export function keyedFiller(rng: Rng, numWords: number): string {
  const words = new Array<string>(numWords)
  for (let i = 0; i < numWords; i++)
    words[i] = fillerAlphabet[rng.int(0, fillerAlphabet.length - 1)]
  return words.join(' ')
}

/** The longest run of at least `minWords` whitespace-separated words of `text` that occurs, in
 *  order, in `filler` (single-space separated words; newlines separate fillers, which a run never
 *  spans); null when none does. `index`: where the run's
 *  first word starts in `text`. */
export function findFillerRun(
  text: string,
  filler: string,
  minWords: number = minFillerWords,
): CanaryMatch | null {
  const words: { word: string; index: number }[] = []
  for (const m of text.matchAll(/\S+/g)) words.push({ word: m[0], index: m.index })
  const haystack = ` ${filler.split('\n').join(' \n ')} `
  const occurs = (from: number, to: number): boolean =>
    haystack.includes(
      ` ${words
        .slice(from, to)
        .map((w) => w.word)
        .join(' ')} `,
    )
  let best: { from: number; to: number } | null = null
  for (let from = 0; from + minWords <= words.length; from++) {
    if (!occurs(from, from + minWords)) continue
    let to = from + minWords
    while (to < words.length && occurs(from, to + 1)) to++
    if (best === null || to - from > best.to - best.from) best = { from, to }
  }
  if (best === null) return null
  const run = words
    .slice(best.from, best.to)
    .map((w) => w.word)
    .join(' ')
  return { canary: run, fragment: run, index: words[best.from].index }
}

/** Every output that holds another request's canary (or a ≥ 8-character fragment of one), or a
 *  run of its filler ({@link findFillerRun}). */
export function findCrossings(
  observed: readonly Observed[],
  planted: readonly Planted[],
): Crossing[] {
  const out: Crossing[] = []
  for (const o of observed) {
    for (const source of planted) {
      if (source.id === o.planted.id) continue
      const [match] = findCanaries(o.result.text, source.canaries)
      if (match) {
        out.push({ observed: o, source, match })
        continue
      }
      const run = source.filler === undefined ? null : findFillerRun(o.result.text, source.filler)
      if (run !== null) out.push({ observed: o, source, match: { ...run, isFiller: true } })
    }
  }
  return out
}

/** Leak findings for `crossings` (cross-tenant ones first), at most {@link maxLeakFindings}. */
export function leakFindings(
  probe: ProbeName,
  crossings: readonly Crossing[],
  planted: readonly Planted[],
  summary: Record<string, unknown>,
  remediation: string,
): Finding[] {
  const allCanaries = planted.flatMap((p) => p.canaries)
  const sorted = [...crossings].sort((a, b) => Number(isSameTenant(a)) - Number(isSameTenant(b)))
  // Every crossing (the findings list at most maxLeakFindings), for the HTML matrix.
  const all = crossings.map((c) => ({
    observer: c.observed.planted.tenant.name,
    source: c.source.tenant.name,
    requestNumber: c.observed.result.requestNumber,
  }))
  return sorted.slice(0, maxLeakFindings).map((c) => {
    const { observed, source, match } = c
    const sameTenant = isSameTenant(c)
    const what = match.isFiller
      ? `${match.fragment.split(' ').length} words in a row of filler`
      : 'a canary'
    return {
      probe,
      verdict: 'leak',
      severity: sameTenant ? 'high' : 'critical',
      title: sameTenant
        ? `a ${observed.label} answer to ${observed.planted.tenant.name} carried ${match.isFiller ? `${what} another of its requests sent` : "another of its requests' canary"} (requests crossed)`
        : `${observed.planted.tenant.name}'s ${observed.label} answer (HTTP ${observed.result.status}) carried ${what} planted by ${source.tenant.name}`,
      evidence: {
        victimTenant: source.tenant.name,
        observerTenant: observed.planted.tenant.name,
        request: { label: observed.label, stream: observed.stream, status: observed.result.status },
        requestNumber: observed.result.requestNumber,
        atMs: observed.result.atMs,
        canary: match.isFiller ? null : match.canary,
        matchedFragment: match.fragment,
        ...(match.isFiller ? { matchedFiller: true } : {}),
        excerpt: redact(observed.result.text, allCanaries, match.index, 160, [source.prompt]),
        numCrossings: crossings.length,
        numCrossTenant: crossings.filter((x) => !isSameTenant(x)).length,
        crossings: all,
        ...summary,
      },
      remediation,
    }
  })
}

function isSameTenant(c: Crossing): boolean {
  return c.source.tenant.name === c.observed.planted.tenant.name
}

/** A compact, output-free record of each request for the evidence. */
export function requestLog(observed: readonly Observed[]): Record<string, unknown>[] {
  return observed.map((o) => ({
    tenant: o.planted.tenant.name,
    label: o.label,
    stream: o.stream,
    status: o.result.status,
    outcome: outcomeOf(o.result),
    failure: o.result.failure,
    ttftMs: o.result.ttftMs,
  }))
}

/** Advice for requests that crossed (abort, batching, queueing paths). */
export const crossingRemediation =
  'Stop serving several tenants from this deployment until it is fixed and treat the affected ' +
  'outputs as disclosed. Check that every KV page, batch slot and response buffer is bound to ' +
  'one request (request and transfer ids checked at every hop, including the first token), ' +
  'that an abort frees pages only after every in-flight write into them has ended (deferred ' +
  'release), that freed pages are scrubbed, and that pooled connections are reset after an abort.'

/** Index of the first character where `a` and `b` differ (the shorter one's length when one is a
 *  prefix of the other): where two answers to one prompt part, kept instead of their text. */
export function firstDifference(a: string, b: string): number {
  let i = 0
  while (i < a.length && i < b.length && a[i] === b[i]) i++
  return i
}
