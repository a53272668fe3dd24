/** Probe `canary`: the incident, reproduced from outside with two tenants.
 *  The victim (first tenant) plants unique canaries in short prompts; the observer (second
 *  tenant) sends normal prompts with canaries of its own and over-capacity prompts (between the
 *  KV pool and the advertised context when the pool is smaller, else just over the context).
 *  Before the over-capacity prompts the victim covers the largest KV pool the endpoint reports
 *  with canary-dense prompts sent together (so that they hold distinct pages at once): a pool
 *  that hands out its most recently freed pages first would otherwise have seen only the few
 *  pages the short plants keep reusing, and an over-capacity request that reads stale pages would
 *  read pages last written by other traffic (an earlier probe's filler) or never written, with
 *  no canary to give away.
 *  Rounds interleave the two — observer normal, victim re-plant, observer over-capacity — so the
 *  pages an over-capacity request might wrongly read were last written by the victim.
 *  Any victim canary (or ≥ 8-character fragment) in any observer output, or the other way
 *  round, is a leak. Outputs are kept only redacted: canaries and runs of the victim's planted
 *  prompts stay readable, everything else becomes `·`. */
import { materialPromptTokens } from '../plan.js'
import { runUntilExhausted, type Budget } from '../budget.js'
import { findCanaries, plantingMaterial, redact, type CanaryMatch } from '../canaries.js'
import type { Discovery } from '../discovery.js'
import type { Probe, ProbeContext } from '../probe.js'
import { aisvsKvPartitioning, inconclusiveRemediation, rejectionRemediation } from '../probe.js'
import { createRng } from '../rng.js'
import { outcomeOf, type CompletionResult, type Outcome, type Target } from '../target.js'
import type { Finding, Tenant } from '../types.js'
import { denseMaterial } from './material.js'
import { promptLimit } from './sized-material.js'

const numPlantingPrompts = 3
const plantMaxTokens = 32
const observerMaxTokens = 64
/** Leak findings listed one by one; the rest are counted. */
const maxLeakFindings = 10
/** Shortest pool-covering plant worth sending (prompt tokens): shorter ones are mostly the
 *  request's own overhead. */
const minCoverTokens = 16
/** Headroom on the measured tokens per character when sizing pool-covering plants: random
 *  strings of one length tokenize to a few percent more or fewer tokens on a subword tokenizer. */
const coverTokenMargin = 1.03

type Kind = 'plant' | 'normal' | 'over-capacity'

interface Exchange {
  readonly tenant: Tenant
  readonly kind: Kind
  /** The size we aimed at (over-capacity), else the size the server reported. */
  readonly promptTokens: number | null
  readonly stream: boolean
  readonly result: CompletionResult
}

interface Leak {
  readonly victim: Tenant
  readonly observer: Exchange
  readonly matches: readonly CanaryMatch[]
}

const leakRemediation =
  'Stop serving several tenants from this deployment until it is fixed, and treat the outputs ' +
  'of affected requests as disclosed. Make the advertised context window no larger than the ' +
  'smallest KV pool, reject longer prompts with a 4xx at admission and never forward a rejected ' +
  'request to decode; verify that every KV page a request reads was written for that request ' +
  '(transfer manifests, checksums, page ownership), scrub freed pages, and for disaggregated ' +
  'SGLang upgrade to v0.5.22 or later.'

export const canaryProbe: Probe = {
  name: 'canary',
  description:
    "tenant A plants unique canaries; tenant B sends normal and over-capacity prompts, streamed and not; any A canary fragment in B's output is a leak",
  class: 'content-leak',
  controls: { aisvs: [aisvsKvPartitioning], guards: ['G1', 'G2', 'G3', 'G4', 'G5', 'G6'] },
  isSizing: true,
  plan: (input) => {
    const { overCapacityAttempts, poolTokens, contextTokens } = input
    const sizes = overCapacitySizes(
      { poolTokens, contextTokens },
      overCapacityAttempts,
      (_, hi) => hi,
    )
    const cover =
      sizes.length > 0
        ? poolCover(
            { ...input, pageSizes: input.pageSizes ?? [] },
            Math.max(input.limits.concurrency, input.limits.maxConcurrency ?? 0),
          )
        : null
    return [
      {
        what: 'planting prompts',
        numRequests: numPlantingPrompts + overCapacityAttempts,
        tokensEach: materialPromptTokens + plantMaxTokens,
      },
      {
        what: 'pool-covering plants, sent together',
        numRequests: cover?.numPlants ?? 0,
        tokensEach: cover === null ? 0 : cover.promptTokens + plantMaxTokens,
      },
      {
        what: 'normal prompts of the observer',
        numRequests: overCapacityAttempts,
        tokensEach: materialPromptTokens + observerMaxTokens,
      },
      {
        what: 'over-capacity prompts',
        numRequests: sizes.length,
        tokensEach: Math.max(0, ...sizes) + observerMaxTokens,
      },
    ]
  },
  async run(target, budget, context): Promise<Finding[]> {
    const [victim, observer] = target.tenants
    const material = drawMaterial(context, victim, observer)
    const sent = await sendTraffic(target, budget, context, material)
    const summary = summarize(material, sent)
    context.log(
      `${observer.name}: ${summary.observerRequests.map((r) => `${r.kind === 'normal' ? 'n' : 'o'}${r.status ?? r.failure}`).join(' ')}`,
    )
    const leaks = findLeaks(material, sent.exchanges)
    if (leaks.length > 0) return leakFindings(leaks, material, sent, summary)
    return judgeRefusals(material, sent, summary, context.discovery)
  },
}

/** What the probe sends, drawn before anything is sent, so the seed alone fixes canaries,
 *  prompts and sizes. The pool-covering plants' canaries and prompts are added as they are sent. */
interface Material {
  readonly victim: Tenant
  readonly observer: Tenant
  readonly victimCanaries: string[][]
  readonly plantPrompts: readonly string[]
  readonly coverPrompts: string[]
  readonly observerCanaries: readonly string[][]
  readonly normalPrompts: readonly string[]
  /** Over-capacity prompt sizes (tokens). */
  readonly sizes: readonly number[]
  readonly rounds: number
}

function drawMaterial(context: ProbeContext, victim: Tenant, observer: Tenant): Material {
  const rounds = context.overCapacityAttempts
  const rng = createRng(context.seed, 'canary')
  const victimCanaries: string[][] = []
  const plantPrompts: string[] = []
  for (let i = 0; i < numPlantingPrompts; i++) {
    const material = plantingMaterial(rng, victimCanaries.flat())
    victimCanaries.push(material.canaries)
    plantPrompts.push(material.prompt)
  }
  const observerCanaries: string[][] = []
  const normalPrompts: string[] = []
  for (let i = 0; i < rounds; i++) {
    const material = plantingMaterial(rng, [...victimCanaries.flat(), ...observerCanaries.flat()])
    observerCanaries.push(material.canaries)
    normalPrompts.push(material.prompt)
  }
  const sizes = overCapacitySizes(context.discovery, rounds, (lo, hi) => rng.int(lo, hi))
  return {
    victim,
    observer,
    victimCanaries,
    plantPrompts,
    coverPrompts: [],
    observerCanaries,
    normalPrompts,
    sizes,
    rounds,
  }
}

/** What was sent and how it went. */
interface Sent {
  readonly exchanges: readonly Exchange[]
  readonly overCapacityPlan: string
  readonly coverSummary: Record<string, unknown>
  /** Why the budget stopped the probe, or null. */
  readonly stoppedBy: string | null
}

/** Sends the plants, the pool-covering plants (when token counts are known), then per round the
 *  observer's normal prompt, a plant again and the observer's over-capacity prompt. */
async function sendTraffic(
  target: Target,
  budget: Budget,
  context: ProbeContext,
  material: Material,
): Promise<Sent> {
  const { victim, observer, plantPrompts, normalPrompts, sizes } = material
  const exchanges: Exchange[] = []
  const send = async (
    tenant: Tenant,
    kind: Kind,
    prompt: string,
    stream: boolean,
    aimedTokens: number | null,
  ): Promise<void> => {
    const maxTokens = tenant === victim ? plantMaxTokens : observerMaxTokens
    const isValid = kind !== 'over-capacity'
    const result = await target.complete({ tenant, prompt, maxTokens, stream, isValid })
    exchanges.push({
      tenant,
      kind,
      promptTokens: aimedTokens ?? result.promptTokens,
      stream,
      result,
    })
  }
  let overCapacityPlan = 'none'
  // Replaced once the plants are sent; stays when no over-capacity prompt is (or the budget ran
  // out first).
  let coverSummary: Record<string, unknown> = { sent: false, why: 'no over-capacity prompt sent' }
  const stoppedBy = await runUntilExhausted(async () => {
    const sizer = sizes.length > 0 ? await context.sizer() : null
    overCapacityPlan =
      sizes.length === 0
        ? 'KV pool and context window unknown'
        : sizer === null
          ? 'token counts could not be calibrated'
          : sizes.join(', ')
    for (const prompt of plantPrompts) await send(victim, 'plant', prompt, false, null)
    const numRounds = sizer === null ? Math.min(material.rounds, 2) : material.rounds
    if (sizer !== null) {
      coverSummary = await coverPool({
        budget,
        discovery: context.discovery,
        // The plants above cost what their answers say: the rate the covering ones are sized by.
        plants: exchanges.map((e, i) => ({
          numChars: plantPrompts[i].length,
          promptTokens: outcomeOf(e.result) === 'accepted' ? e.result.promptTokens : null,
        })),
        reserveRequests: 3 * numRounds,
        material: denseMaterial(createRng(context.seed, 'canary-cover'), [
          ...material.victimCanaries.flat(),
          ...material.observerCanaries.flat(),
        ]),
        plant: async (cover) => {
          material.victimCanaries.push(cover.canaries)
          material.coverPrompts.push(cover.prompt)
          await send(victim, 'plant', cover.prompt, false, null)
        },
      })
    }
    for (let r = 0; r < numRounds; r++) {
      await send(observer, 'normal', normalPrompts[r], r % 2 === 1, null)
      await send(victim, 'plant', plantPrompts[r % plantPrompts.length], r % 2 === 0, null)
      if (sizer !== null) {
        await send(observer, 'over-capacity', sizer.build(sizes[r], 'up'), r % 2 === 0, sizes[r])
      }
    }
  })
  return { exchanges, overCapacityPlan, coverSummary, stoppedBy }
}

/** Every answer that carried the other tenant's canaries. */
function findLeaks(material: Material, exchanges: readonly Exchange[]): Leak[] {
  const { victim, observer } = material
  const leaks: Leak[] = []
  for (const exchange of exchanges) {
    const isVictim = exchange.tenant === victim
    const foreign = isVictim ? material.observerCanaries.flat() : material.victimCanaries.flat()
    const matches = findCanaries(exchange.result.text, foreign)
    if (matches.length > 0) {
      leaks.push({ victim: isVictim ? observer : victim, observer: exchange, matches })
    }
  }
  return leaks
}

/** The evidence every finding carries. */
type Summary = ReturnType<typeof summarize>

function summarize(material: Material, sent: Sent) {
  const { victim, observer } = material
  const observerRequests = sent.exchanges
    .filter((e) => e.tenant === observer)
    .map((e) => ({
      kind: e.kind,
      promptTokens: e.promptTokens,
      stream: e.stream,
      status: e.result.status,
      outcome: outcomeOf(e.result),
      errorCode: e.result.errorCode,
      failure: e.result.failure,
    }))
  const plants = sent.exchanges.filter((e) => e.kind === 'plant')
  return {
    plantingTenant: victim.name,
    probingTenant: observer.name,
    numCanaries: {
      victim: material.victimCanaries.flat().length,
      observer: material.observerCanaries.flat().length,
    },
    numVictimPromptsAccepted: plants.filter((e) => outcomeOf(e.result) === 'accepted').length,
    victimStatuses: plants.map((e) => e.result.status ?? e.result.failure),
    overCapacityPlan: sent.overCapacityPlan,
    poolCover: sent.coverSummary,
    stoppedBy: sent.stoppedBy,
    observerRequests,
  }
}

/** A leak finding per leaking answer (at most {@link maxLeakFindings}; each names them all). */
function leakFindings(
  leaks: readonly Leak[],
  material: Material,
  sent: Sent,
  summary: Summary,
): Finding[] {
  const knownCanaries = [...material.victimCanaries.flat(), ...material.observerCanaries.flat()]
  // Every leaking answer (the findings list at most maxLeakFindings), for the HTML matrix.
  const crossings = leaks.map((leak) => ({
    observer: leak.observer.tenant.name,
    source: leak.victim.name,
    requestNumber: leak.observer.result.requestNumber,
  }))
  return leaks.slice(0, maxLeakFindings).map((leak) => {
    const [first, ...others] = leak.matches
    const { result, kind, promptTokens, stream, tenant } = leak.observer
    const planted =
      leak.victim === material.victim
        ? [...material.plantPrompts, ...material.coverPrompts]
        : material.normalPrompts
    return {
      probe: 'canary',
      verdict: 'leak',
      severity: 'critical',
      title: `${tenant.name}'s output contained a canary planted by ${leak.victim.name} (${kind} prompt, HTTP ${result.status})`,
      evidence: {
        victimTenant: leak.victim.name,
        observerTenant: tenant.name,
        request: { kind, promptTokens, stream, status: result.status },
        requestNumber: result.requestNumber,
        atMs: result.atMs,
        canary: first.canary,
        matchedFragment: first.fragment,
        excerpt: redact(result.text, knownCanaries, first.index, 160, planted),
        otherCanariesMatched: others.map((m) => m.canary),
        numLeakingRequests: leaks.length,
        crossings,
        ...summary,
      },
      remediation: leakRemediation,
    }
  })
}

/** With no canary crossed: what the over-capacity prompts' answers say. Clean only when every
 *  one was refused with a 4xx while the observer's normal prompts, sent the same way, were
 *  answered (the positive control that the 4xx is about size). */
function judgeRefusals(
  material: Material,
  sent: Sent,
  summary: Summary,
  discovery: Discovery,
): Finding[] {
  const { victim, observer } = material
  const { exchanges } = sent
  const overCapacity = exchanges.filter((e) => e.kind === 'over-capacity')
  const outcomes: Outcome[] = overCapacity.map((e) => outcomeOf(e.result))
  const numAccepted = outcomes.filter((o) => o === 'accepted').length
  const finding = (verdict: 'inconclusive' | 'clean', title: string): Finding[] => [
    {
      probe: 'canary',
      verdict,
      severity: verdict === 'clean' ? 'info' : 'medium',
      title,
      evidence: summary,
      remediation: verdict === 'clean' ? 'None needed.' : inconclusiveRemediation,
    },
  ]
  if (summary.numVictimPromptsAccepted === 0) {
    return finding('inconclusive', `${victim.name}'s canaries could not be planted`)
  }
  if (overCapacity.length === 0) {
    return finding(
      'inconclusive',
      `no over-capacity prompt was sent (${sent.stoppedBy ?? sent.overCapacityPlan})`,
    )
  }
  if (numAccepted > 0) {
    return [
      {
        probe: 'canary',
        verdict: 'warning',
        class: 'misconfiguration',
        // Sized over the reported pool whenever one is reported (overCapacitySizes).
        ...(discovery.poolTokens === null ? {} : { tags: ['over-pool-accepted' as const] }),
        severity: 'high',
        title: `accepted ${numAccepted} of ${overCapacity.length} over-capacity prompts; no canary seen in ${exchanges.length} outputs`,
        evidence: summary,
        remediation: rejectionRemediation,
      },
    ]
  }
  const isControlled = overCapacity.every((o) =>
    exchanges.some(
      (e) =>
        e.tenant === observer &&
        e.kind === 'normal' &&
        e.stream === o.stream &&
        outcomeOf(e.result) === 'accepted',
    ),
  )
  const numRejected = outcomes.filter((o) => o === 'rejected').length
  if (numRejected === outcomes.length && !isControlled) {
    return finding(
      'inconclusive',
      `${observer.name}'s normal prompts were refused too, so the 4xx for over-capacity ones proves nothing`,
    )
  }
  if (numRejected === outcomes.length) {
    return finding(
      'clean',
      `rejected all ${overCapacity.length} over-capacity prompts with a 4xx; no canary crossed tenants`,
    )
  }
  return finding(
    'inconclusive',
    `${overCapacity.length - numRejected} of ${overCapacity.length} over-capacity prompts failed without a 4xx (server error or timeout)`,
  )
}

/** Prompt sizes (tokens) for the over-capacity attempts: between the pool and the context when
 *  the pool is smaller (the incident's range; the first attempt just over the pool), else just
 *  over the smallest known limit. Leaves room for `max_tokens` under the context. */
function overCapacitySizes(
  discovery: { readonly poolTokens: number | null; readonly contextTokens: number | null },
  count: number,
  randomInt: (lo: number, hi: number) => number,
): number[] {
  const { poolTokens, contextTokens } = discovery
  if (poolTokens !== null && contextTokens !== null && poolTokens < contextTokens) {
    const lo = poolTokens + 1
    const hi = Math.max(lo, contextTokens - observerMaxTokens)
    return Array.from({ length: count }, (_, i) => (i === 0 ? lo : randomInt(lo, hi)))
  }
  const known = [poolTokens, contextTokens].filter((n) => n !== null)
  if (known.length === 0) return []
  const limit = Math.min(...known)
  return Array.from({ length: count }, () => limit + randomInt(1, 16))
}

/** Pool-covering plants: how many, and the prompt tokens of each. */
export interface PoolCover {
  readonly numPlants: number
  /** Prompt tokens of each plant (each also asks for `plantMaxTokens`). */
  readonly promptTokens: number
  /** The pool they are meant to cover (tokens): the largest reported. */
  readonly poolTokens: number
  /** Plants needed to cover it whole; more than `numPlants` when the in-flight limit is lower. */
  readonly numNeeded: number
}

/** The plants that cover the largest KV pool the endpoint reports (the smallest when it reports
 *  one), all in flight at once: each plant's prompt plus `plantMaxTokens` fits the smallest pool,
 *  the context and the input limit, and their leases together fit the largest pool, each rounded
 *  down to the largest page size reported (a page is leased whole). At most `maxInFlight` plants.
 *  Null when no pool is reported or a plant would be shorter than {@link minCoverTokens}. */
export function poolCover(
  limits: {
    readonly poolTokens: number | null
    readonly largestPoolTokens?: number | null
    readonly contextTokens: number | null
    readonly inputLimitTokens: number | null
    readonly pageSizes: readonly number[]
  },
  maxInFlight: number,
): PoolCover | null {
  const poolTokens = limits.largestPoolTokens ?? limits.poolTokens
  const largestPrompt = promptLimit(limits, plantMaxTokens)
  if (poolTokens === null || largestPrompt === null || largestPrompt < minCoverTokens) return null
  const numNeeded = Math.ceil(poolTokens / (largestPrompt + plantMaxTokens))
  const pageSize = Math.max(1, ...limits.pageSizes)
  const leaseTokens = Math.floor(poolTokens / numNeeded / pageSize) * pageSize
  const promptTokens = Math.min(largestPrompt, leaseTokens - plantMaxTokens)
  if (promptTokens < minCoverTokens) return null
  return { numPlants: Math.min(numNeeded, maxInFlight), promptTokens, poolTokens, numNeeded }
}

/** Sends the pool-covering plants ({@link poolCover}) together and says what was sent, for the
 *  evidence. A plant's characters come from the tokens per character the earlier plants cost
 *  (their `usage.prompt_tokens`; one token a character, what a byte-level tokenizer spends at most
 *  on ASCII, when none said), with {@link coverTokenMargin} of headroom. Fewer plants when the
 *  request budget left, less `reserveRequests`, is short. Throws `BudgetExhaustedError`. */
async function coverPool(input: {
  readonly budget: Budget
  readonly discovery: Pick<
    Discovery,
    'poolTokens' | 'largestPoolTokens' | 'contextTokens' | 'inputLimitTokens' | 'pageSizes'
  >
  readonly plants: readonly { readonly numChars: number; readonly promptTokens: number | null }[]
  readonly reserveRequests: number
  readonly material: ReturnType<typeof denseMaterial>
  plant(material: { canaries: string[]; prompt: string }): Promise<void>
}): Promise<Record<string, unknown>> {
  const { budget, discovery } = input
  const cover = poolCover(
    { ...discovery, pageSizes: discovery.pageSizes.map((s) => s.tokens) },
    budget.maxInFlightLimit,
  )
  if (cover === null) return { sent: false, why: 'no KV pool reported, or too small a plant' }
  const rates = input.plants
    .filter((p) => p.promptTokens !== null && p.numChars > 0)
    .map((p) => (p.promptTokens as number) / p.numChars)
  const tokensPerChar = rates.length > 0 ? Math.max(...rates) : 1
  const numChars = Math.floor(cover.promptTokens / (tokensPerChar * coverTokenMargin))
  const numPlants = Math.min(
    cover.numPlants,
    Math.max(0, budget.remainingRequests - input.reserveRequests),
  )
  if (numPlants === 0) return { sent: false, why: 'the request budget leaves none for them' }
  const materials = Array.from({ length: numPlants }, () => input.material.next(numChars))
  // Every plant ends before the rounds start (settled, not raced): a plant still in flight would
  // hold pages the over-capacity prompt is meant to read.
  const settled = await budget.withInFlightLimit(numPlants, () =>
    Promise.allSettled(materials.map(input.plant)),
  )
  const failure = settled.find((r) => r.status === 'rejected')
  if (failure !== undefined) throw failure.reason
  return {
    sent: true,
    poolTokens: cover.poolTokens,
    numNeeded: cover.numNeeded,
    numPlants,
    promptTokensEach: cover.promptTokens,
    charsEach: numChars,
    tokensPerChar: Number(tokensPerChar.toFixed(3)),
  }
}
