/** Probe `near-duplicates`: a response or semantic cache in front of the engine keyed without
 *  the tenant (semantic-router#2134, LiteLLM PR #26992, bifrost PR #5769). The victim (first
 *  tenant) sends a prompt of a few sentences with its canary in the second, then repeats it
 *  exactly (the positive control: a cache, if any, hits for the victim's own repeat: same answer
 *  id, or cached tokens). The observer (second tenant) sends near-duplicates that hold no
 *  fragment of the victim's canary: recased (every letter's case flipped, the canary with it),
 *  whitespace changed, sentences reordered, a word added or dropped, the canary replaced by the
 *  observer's own. Any of the observer's answers carrying the victim's canary, or the victim's
 *  answer itself (its id and text), is a `content-leak`.
 *  Knows the auditor's requests and canaries; knows nothing of how a cache keys its entries. */
import { findCanaries, makeCanaries, plantingPrompt } from '../canaries.js'
import type { Probe } from '../probe.js'
import { inconclusiveRemediation } from '../probe.js'
import { createRng, type Rng } from '../rng.js'
import { isAnsweredWhole, type CompletionResult } from '../target.js'
import type { Finding, Tenant } from '../types.js'
import { materialPromptTokens } from '../plan.js'

/** Tokens each answer may have. */
export const answerMaxTokens = 48
/** Answers this long or longer that are equal are not equal by chance at temperature 0 when they
 *  also carry the same answer id. */
const minVerbatimChars = 16

/** One near-duplicate the observer sends. */
export interface NearDuplicate {
  readonly label: string
  readonly prompt: string
}

/** Filler words in the victim's prompt: short enough that its recased and respaced copies (which
 *  tokenize to more tokens) fit the smallest context an engine serves. */
const numFillerWords = 16

/** The victim's prompt: four sentences of {@link numFillerWords} filler words, the canary the
 *  fourth word (so that an answer echoing the start of its prompt carries it). */
export function victimPrompt(rng: Rng, canary: string): string {
  const filler = plantingPrompt(rng, [canary])
    .split(' ')
    .filter((w) => w !== canary)
    .slice(0, numFillerWords)
  const words = [...filler.slice(0, 3), canary, ...filler.slice(3)]
  const sentences: string[] = []
  for (let i = 0; i < words.length; i += Math.ceil(words.length / 4))
    sentences.push(words.slice(i, i + Math.ceil(words.length / 4)).join(' ') + '.')
  return sentences.join(' ')
}

/** Every letter's case flipped. */
export function swapCase(text: string): string {
  return [...text].map((c) => (c === c.toUpperCase() ? c.toLowerCase() : c.toUpperCase())).join('')
}

function reorder(text: string): string {
  return text
    .split(/(?<=\.) /)
    .reverse()
    .join(' ')
}

/** The near-duplicates of `prompt` (which holds `canary`) the observer sends: none holds a
 *  fragment of `canary` (those that would are left out). */
export function nearDuplicates(prompt: string, canary: string, ownCanary: string): NearDuplicate[] {
  const own = prompt.split(canary).join(ownCanary)
  const words = own.split(' ')
  const added = [...words.slice(0, 3), 'quiet', ...words.slice(3)].join(' ')
  const dropAt = words.findIndex((w, i) => i > 0 && !w.includes(ownCanary))
  const dropped = words.filter((_, i) => i !== dropAt).join(' ')
  const all: NearDuplicate[] = [
    { label: 'recased', prompt: swapCase(prompt) },
    {
      label: 'recased, whitespace changed',
      prompt: swapCase(prompt)
        .replace(/ /g, '  ')
        .replace(/\. {2}/g, '.\n'),
    },
    { label: 'sentences reordered, recased', prompt: swapCase(reorder(prompt)) },
    { label: 'sentences reordered, own canary', prompt: reorder(own) },
    { label: 'a word added, own canary', prompt: added },
    { label: 'a word dropped, own canary', prompt: dropped },
  ]
  return all.filter((d) => findCanaries(d.prompt, [canary]).length === 0)
}

export const nearDuplicatesProbe: Probe = {
  name: 'near-duplicates',
  class: 'content-leak',
  // Layers beside and in front of the engine: no KV page is involved, no guard applies.
  controls: { aisvs: [], guards: [] },
  description:
    "tenant A sends a canary prompt and repeats it (a cache's positive control); tenant B sends near-duplicates without A's canary (recased, reordered, a word added or dropped): A's canary or A's answer in B's answer is a content-leak (a response or semantic cache keyed without the tenant)",
  plan: () => [
    {
      what: "the victim's prompt and its exact repeat",
      numRequests: 2,
      tokensEach: materialPromptTokens + answerMaxTokens,
    },
    {
      what: "the observer's near-duplicates",
      numRequests: 6,
      tokensEach: materialPromptTokens + answerMaxTokens,
    },
  ],
  async run(target, _budget, context): Promise<Finding[]> {
    const [victim, observer] = target.tenants
    const rng = createRng(context.seed, 'near-duplicates')
    const [canary, ownCanary] = makeCanaries(rng, 2)
    const prompt = victimPrompt(rng, canary)
    const send = (tenant: Tenant, p: string) =>
      target.complete({ tenant, prompt: p, maxTokens: answerMaxTokens, stream: false })
    const first = await send(victim, prompt)
    const repeat = await send(victim, prompt)
    const answers: { duplicate: NearDuplicate; result: CompletionResult }[] = []
    for (const duplicate of nearDuplicates(prompt, canary, ownCanary))
      answers.push({ duplicate, result: await send(observer, duplicate.prompt) })
    context.log(
      `${answers.length} near-duplicates sent; the victim's repeat ${isCacheHit(first, repeat) ? 'hit a cache' : 'showed no cache hit'}`,
    )
    return judgeNearDuplicates({ victim, observer, canary, first, repeat, answers })
  },
}

/** The victim's exact repeat was served from a cache: the same answer id, or cached tokens. */
export function isCacheHit(first: CompletionResult, repeat: CompletionResult): boolean {
  const isSameId = first.responseId != null && first.responseId === repeat.responseId
  return isAnsweredWhole(repeat) && (isSameId || (repeat.cachedTokens ?? 0) > 0)
}

export function judgeNearDuplicates(seen: {
  readonly victim: Tenant
  readonly observer: Tenant
  readonly canary: string
  readonly first: CompletionResult
  readonly repeat: CompletionResult
  readonly answers: readonly { duplicate: NearDuplicate; result: CompletionResult }[]
}): Finding[] {
  const { victim, observer, canary, first, repeat, answers } = seen
  const summary = {
    victimTenant: victim.name,
    observerTenant: observer.name,
    controlCacheHit: isCacheHit(first, repeat),
    nearDuplicates: answers.map((a) => ({
      label: a.duplicate.label,
      status: a.result.status,
      errorCode: a.result.errorCode,
      sameAnswerIdAsVictim: first.responseId != null && a.result.responseId === first.responseId,
    })),
  }
  const leaks: Finding[] = []
  for (const { duplicate, result } of answers) {
    const [match] = findCanaries(result.text, [canary])
    const isVictimAnswer =
      first.responseId != null &&
      result.responseId === first.responseId &&
      first.text.length >= minVerbatimChars &&
      result.text === first.text
    if (!match && !isVictimAnswer) continue
    leaks.push({
      probe: 'near-duplicates',
      verdict: 'leak',
      severity: 'critical',
      title: `${observer.name}'s near-duplicate (${duplicate.label}) of ${victim.name}'s prompt was answered with ${match ? `${victim.name}'s canary` : `${victim.name}'s answer verbatim (same id)`}: a response or semantic cache keyed without the tenant`,
      evidence: {
        ...summary,
        nearDuplicate: duplicate.label,
        requestNumber: result.requestNumber,
        ...(match
          ? { canary: match.canary, matchedFragment: match.fragment }
          : { answerId: '[same as the victim’s]' }),
      },
      remediation:
        'Key every response and semantic cache by tenant (and by the exact prompt, parameters and model) before any similarity lookup; a gateway cache shared by tenants returns one tenant’s answers to another. Treat answers served from it as disclosed.',
    })
  }
  if (leaks.length > 0) return leaks
  const isAnswered =
    isAnsweredWhole(first) && answers.length > 0 && answers.every((a) => isAnsweredWhole(a.result))
  if (!isAnswered)
    return [
      {
        probe: 'near-duplicates',
        verdict: 'inconclusive',
        severity: 'info',
        title: `not every request of the near-duplicate test was answered whole (${victim.name}: HTTP ${first.status}; ${observer.name}: ${answers.map((a) => a.result.status).join(', ')})`,
        evidence: summary,
        remediation: inconclusiveRemediation,
      },
    ]
  if (!summary.controlCacheHit)
    return [
      {
        probe: 'near-duplicates',
        verdict: 'inconclusive',
        severity: 'info',
        title: `${victim.name}'s exact repeat showed no cache hit (a new answer id, no cached tokens): no cache was seen to answer, so whether one shared by tenants would answer ${observer.name}'s near-duplicates could not be told (none carried ${victim.name}'s material)`,
        evidence: summary,
        remediation:
          'If a response or semantic cache sits in front of the engine, make sure it is enabled for these requests and re-run; otherwise nothing here needs fixing.',
      },
    ]
  return [
    {
      probe: 'near-duplicates',
      verdict: 'clean',
      severity: 'info',
      title: `${victim.name}'s exact repeat hit a cache, and none of ${answers.length} near-duplicates from ${observer.name} (${answers.map((a) => a.duplicate.label).join('; ')}) was answered with ${victim.name}'s material`,
      evidence: summary,
      remediation: 'None needed.',
    },
  ]
}
