/** Probe `evict-then-return`: a tenant's cached prefix, pushed out of the KV pool by traffic,
 *  must come back as its own or not at all, and never to another tenant. Offload tiers (host
 *  memory, disk, a remote store) keep what the pool evicts and load it back on the next hit; a
 *  load that failed, or that read another entry (a slot the tier has since written over), counted
 *  as a hit serves KV that is not the prompt's (dynamo#15079, LMCache#4385); a tier keyed by
 *  tokens alone serves one tenant's evicted prefix to another (lmdeploy#4930).
 *
 *  The subject tenant sends 4 canary-bearing prompts (the first cold, then warm: it is cached),
 *  each ending with its own first words again, so that its answer depends on its first page.
 *  Then churn: distinct canary-bearing prompts, as large as the endpoint takes, sent by every
 *  audit tenant in turn, the subject included (a cache or tier split per tenant is churned only
 *  by its own tenant's traffic), until their answered prompt tokens add up to 4 times the largest
 *  KV pool the endpoint reports: past the pool and past a host tier of a few times the pool
 *  (SGLang's default host pool is twice the device pool), so that a bounded tier has wrapped. At
 *  1, 2 and 4 times the pool another tenant sends one of the subject's last 3 prefixes, evicted by
 *  then:
 *  its `cached_tokens` must not exceed what that tenant's own fresh churn prompts were served (a
 *  cross-tenant hit), and its temperature-0 answer must equal the subject's cold one. After the
 *  churn the subject sends its prefixes again: each answer must equal its cold one. Another
 *  tenant's canary in any answer is a leak; a cross-tenant hit is a leak; a changed answer
 *  without foreign material is a warning (KV that is not this prompt's, e.g. a failed or
 *  written-over load used as a hit). TTFT is kept as evidence only: one sample decides nothing
 *  (`prefix-timing` tests timing).
 *  When the endpoint reports no pool, or the budget cannot cover the churn, nothing is sent and
 *  the result is inconclusive with the reason; so is a churn that was not answered as far as the
 *  first stage.
 *  Knows the pool size discovery read and canaries; knows nothing of any engine's tiers. */
import { runUntilExhausted, type Budget } from '../budget.js'
import { makeCanaries } from '../canaries.js'
import type { Probe } from '../probe.js'
import { aisvsKvPartitioning, inconclusiveRemediation } from '../probe.js'
import { createRng, type Rng } from '../rng.js'
import type { PromptSizer } from '../sizer.js'
import { isAnsweredWhole, type CompletionResult, type Target } from '../target.js'
import type { Finding, Tenant } from '../types.js'
import {
  findCrossings,
  firstDifference,
  leakFindings,
  type Observed,
  type Planted,
} from './material.js'
import {
  headWords,
  markedPrompt,
  measureCanary,
  promptLimit,
  sizerOrNull,
  type TenantCanary,
} from './sized-material.js'

const maxTokens = 16
/** The subject's prompts: a few pages of any common page size. */
const subjectTokens = 96
/** The subject's prefixes: the first only ever sent by the subject, then one for each stage's
 *  cross-tenant check (another tenant's copy of a prefix is the same K/V: where a tier writes it
 *  over the subject's own copy, only the first prefix's return still shows the damage). */
const numPrefixes = 4
/** Stages of the churn, in multiples of the largest pool: another tenant checks one prefix at
 *  each. The last is {@link churnFactor}. */
const stageFactors = [1, 2, 4] as const
/** The churn must cover this many times the largest pool. */
const churnFactor = stageFactors[stageFactors.length - 1]
/** Churn requests at most: a pool that needs more is inconclusive, not an audit of its own. */
const maxChurnRequests = 120
/** A churn prompt is sized with room for its canary's cost ({@link boundedPrompt}), so it may
 *  come out shorter than planned: up to this share more requests are sent until the churn's
 *  answered prompts cover what is needed. */
const churnSlack = 0.5
/** Requests besides the churn: the prefixes cold, the first warm, a check per stage, the returns
 *  (and one per tenant measuring its mark, counted where the tenants are known). */
const numFixedRequests = numPrefixes + 1 + stageFactors.length + numPrefixes

const remediation =
  'A prefix loaded back from any tier (host memory, disk, a remote store) must be verified before ' +
  'use (its key with the tenant salt, the model and layout, token count and a checksum of the ' +
  'bytes, read from the memory as it is at load time), and a failed or unverified load must be a ' +
  "miss, recomputed, never a hit; a tier's key must include the tenant. Until fixed, turn the " +
  'offload tier off or partition it per tenant.'

/** How the churn is sized: prompts of `promptTokens` at most, `numRequests` of them if each
 *  came out at that size, and `maxRequests` at most. */
export interface ChurnSize {
  readonly poolTokens: number
  readonly promptTokens: number
  readonly numRequests: number
  readonly maxRequests: number
}

/** The churn that covers {@link churnFactor} × `poolTokens` with prompts of the largest size the
 *  endpoint takes (`limitTokens`), or null when either is unknown or no prompt fits. */
export function churnSize(poolTokens: number | null, limitTokens: number | null): ChurnSize | null {
  if (poolTokens === null || limitTokens === null || limitTokens < 2 * subjectTokens) return null
  const promptTokens = limitTokens
  const numRequests = Math.ceil((churnFactor * poolTokens) / promptTokens)
  return {
    poolTokens,
    promptTokens,
    numRequests,
    maxRequests: Math.ceil(numRequests * (1 + churnSlack)),
  }
}

export const evictThenReturnProbe: Probe = {
  name: 'evict-then-return',
  description: `a tenant caches canary-bearing prefixes; every tenant's traffic (its own included) of ${churnFactor} × the largest reported KV pool evicts them; at 1, 2 and ${churnFactor} × another tenant sends one (its cached_tokens must not show a hit, its answer must equal the cold one); then the tenant returns: temperature-0 answers equal to the cold ones, no other tenant's material`,
  class: 'integrity',
  // After eviction: a page loaded back from an offload tier must be verified before use (G4).
  controls: { aisvs: [aisvsKvPartitioning], guards: ['G4'] },
  isSizing: true,
  plan: (input) => {
    const churn = churnSize(input.largestPoolTokens ?? null, promptLimit(input, maxTokens))
    if (churn === null || churn.numRequests > maxChurnRequests) return []
    return [
      {
        what: `${numPrefixes} prefixes cold, one warm, ${stageFactors.length} cross-tenant checks, ${numPrefixes} returns`,
        numRequests: numFixedRequests,
        tokensEach: subjectTokens + maxTokens,
      },
      { what: "each tenant's canary cost", numRequests: input.numTenants, tokensEach: 48 },
      {
        what: `churn covering ${churnFactor} × the ${churn.poolTokens}-token pool`,
        numRequests: churn.maxRequests,
        tokensEach: churn.promptTokens + maxTokens,
      },
    ]
  },
  async run(target, budget, context): Promise<Finding[]> {
    const { discovery } = context
    const churn = churnSize(discovery.largestPoolTokens, promptLimit(discovery, maxTokens))
    const base = { churn, churnFactor, stageFactors: [...stageFactors], maxTokens }
    if (churn === null) {
      return [
        inconclusive(
          discovery.largestPoolTokens === null
            ? 'the endpoint reports no KV pool size, so the traffic that must evict a cached prefix cannot be sized'
            : "the endpoint's prompt limit leaves no room for traffic that evicts a cached prefix",
          base,
        ),
      ]
    }
    const needed = numFixedRequests + target.tenants.length + churn.numRequests
    if (churn.numRequests > maxChurnRequests || needed > budget.remainingRequests) {
      return [
        inconclusive(
          `evicting the cache takes ${churn.numRequests} requests of ${churn.promptTokens} tokens (${churnFactor} × the ${churn.poolTokens}-token pool) plus ${numFixedRequests}; ${churn.numRequests > maxChurnRequests ? `more than the probe's ${maxChurnRequests}` : `the budget has ${budget.remainingRequests} requests left`}`,
          base,
        ),
      ]
    }
    const sizer = await sizerOrNull(() => context.sizer())
    if (sizer === null)
      return [
        inconclusive('token counts could not be calibrated, so the churn could not be sized', base),
      ]
    const session = new Session(target, createRng(context.seed, 'evict-then-return'), sizer)
    const stoppedBy = await runUntilExhausted(() => session.run(churn, budget))
    context.log(
      `churn ${session.churnTokens} tokens in ${session.numChurnAnswered} answers; checks ${session.checks.map((c) => `${c.factor}×: cached ${c.result.cachedTokens ?? '?'}`).join(', ') || 'none'}; returns ${session.returns.map((r) => (r.result.text === r.prefix.cold.text ? 'equal' : 'differ')).join(', ') || 'none'}`,
    )
    return judge(session, churn, { ...base, stoppedBy })
  },
}

/** A prefix the subject cached, with its cold answer. */
interface Cached {
  readonly planted: Planted
  readonly cold: CompletionResult
}

/** Another tenant's request for a cached prefix, at a stage of the churn. */
interface Check {
  readonly factor: number
  readonly tenant: Tenant
  readonly prefix: Cached
  readonly result: CompletionResult
  /** Most `cached_tokens` that tenant's own fresh churn prompts were served until then. */
  readonly ownCachedTokens: number
}

/** One run of the protocol. */
class Session {
  readonly planted: Planted[] = []
  readonly observed: Observed[] = []
  readonly cached: Cached[] = []
  warm: CompletionResult | null = null
  readonly checks: Check[] = []
  readonly returns: { prefix: Cached; result: CompletionResult }[] = []
  churnTokens = 0
  numChurnAnswered = 0
  numChurnSent = 0
  /** Most `cached_tokens` served to each tenant's fresh churn prompts. */
  private readonly ownCached = new Map<string, number>()

  constructor(
    private readonly target: Target,
    private readonly rng: Rng,
    private readonly sizer: PromptSizer,
  ) {}

  async run(churn: ChurnSize, budget: Budget): Promise<void> {
    const { tenants } = this.target
    const [subject, ...others] = tenants
    const canaries = makeCanaries(this.rng, numPrefixes + churn.maxRequests + tenants.length)
    // Every prompt carries its canary end to end (markedPrompt), so that an answer replaying any
    // stretch of another request's traffic (the churn included) names whose it was; what a
    // canary costs is measured once per tenant.
    const calibrations = new Map<string, TenantCanary>()
    for (const [i, tenant] of tenants.entries()) {
      const canary = canaries[numPrefixes + churn.maxRequests + i]
      const measured = await measureCanary(this.target, this.rng, this.sizer, tenant, canary)
      calibrations.set(tenant.name, measured)
    }
    const marked = (tenant: Tenant, numTokens: number, canary: string): string =>
      markedPrompt(this.rng, this.sizer, numTokens, canary, calibrations.get(tenant.name)!)
    const materialOf = (_tenant: Tenant, canary: string) => [canary]
    for (let k = 0; k < numPrefixes; k++) {
      const prompt = recallPrompt(marked(subject, subjectTokens - 2 * headWords, canaries[k]))
      const planted = this.plant(`prefix${k}`, subject, prompt, materialOf(subject, canaries[k]))
      const cold = await this.send(planted, `prefix ${k + 1} cold`)
      if (!isAnsweredWhole(cold)) return
      this.cached.push({ planted, cold })
      if (k === 0) this.warm = await this.send(planted, 'warm (before eviction)')
    }
    const batch = Math.max(1, budget.limits.concurrency)
    let stage = 0
    for (let i = 0; stage < stageFactors.length && i < churn.maxRequests;) {
      const needed = stageFactors[stage] * churn.poolTokens
      // Only as many at once as the tokens still missing need, at prompts of the planned size.
      const numMissing = Math.ceil((needed - this.churnTokens) / churn.promptTokens)
      const sends = []
      for (const end = Math.min(i + batch, i + numMissing, churn.maxRequests); i < end; i++) {
        const canary = canaries[numPrefixes + i]
        const tenant = tenants[i % tenants.length]
        const prompt = marked(tenant, churn.promptTokens, canary)
        sends.push(
          this.churnOne(this.plant(`churn${i}`, tenant, prompt, materialOf(tenant, canary))),
        )
      }
      await Promise.all(sends)
      while (
        stage < stageFactors.length &&
        this.churnTokens >= stageFactors[stage] * churn.poolTokens
      ) {
        await this.check(stage, others[stage % others.length])
        stage++
      }
    }
    for (const prefix of this.cached) {
      const result = await this.send(prefix.planted, 'returning (after eviction)')
      this.returns.push({ prefix, result })
    }
  }

  /** Another tenant sends stage `stage`'s prefix: the same prompt, its own request. */
  private async check(stage: number, tenant: Tenant): Promise<void> {
    const prefix = this.cached[1 + (stage % (this.cached.length - 1))]
    // The same material under the same id: the subject's canary in this answer is the prompt's
    // own, not a crossing.
    const asked: Planted = { ...prefix.planted, tenant }
    const result = await this.send(asked, `${tenant.name}'s request for the evicted prefix`)
    this.checks.push({
      factor: stageFactors[stage],
      tenant,
      prefix,
      result,
      ownCachedTokens: this.ownCached.get(tenant.name) ?? 0,
    })
  }

  private async churnOne(planted: Planted): Promise<void> {
    this.numChurnSent++
    const r = await this.send(planted, 'churn')
    if (!isAnsweredWhole(r)) return
    this.numChurnAnswered++
    this.churnTokens += r.promptTokens ?? this.sizer.estimate(planted.prompt.split(' ').length)
    const name = planted.tenant.name
    this.ownCached.set(name, Math.max(this.ownCached.get(name) ?? 0, r.cachedTokens ?? 0))
  }

  private plant(id: string, tenant: Tenant, prompt: string, canaries: string[]): Planted {
    // The prompt's words are its own (head, canary, keyed filler), so the prompt is its filler:
    // an answer replaying a run of it names this request, the churn's included.
    const planted = { id, tenant, canaries, prompt, filler: prompt }
    this.planted.push(planted)
    return planted
  }

  private async send(planted: Planted, label: string): Promise<CompletionResult> {
    const result = await this.target.complete({
      tenant: planted.tenant,
      prompt: planted.prompt,
      maxTokens,
      stream: false,
    })
    if (isAnsweredWhole(result)) this.observed.push({ planted, label, stream: false, result })
    return result
  }
}

/** `prompt` followed by its first {@link headWords} words again: a cue that asks for its start,
 *  so that its answer depends on its first page (where an evicted prefix's KV lies) and not only
 *  on its last tokens, on a model that continues what followed an earlier occurrence of its last
 *  words as on any other. At most 2 tokens a word on any tokenizer the sizer knows. */
function recallPrompt(prompt: string): string {
  return `${prompt} ${prompt.split(' ').slice(0, headWords).join(' ')}`
}

const isWhole = (r: CompletionResult | null): r is CompletionResult =>
  r !== null && isAnsweredWhole(r)

/** Leak for foreign material or a cross-tenant hit, else a warning for a changed answer, else
 *  inconclusive for anything not seen, else clean. */
function judge(session: Session, churn: ChurnSize, base: Record<string, unknown>): Finding[] {
  const subject = session.planted[0]?.tenant.name ?? null
  const evidence = evidenceOf(session, base, subject)
  const crossings = findCrossings(session.observed, session.planted)
  const findings: Finding[] = []
  if (crossings.length > 0)
    findings.push(
      ...leakFindings('evict-then-return', crossings, session.planted, evidence, remediation),
    )
  const crossHits = session.checks.filter(
    (c) => isWhole(c.result) && (c.result.cachedTokens ?? 0) > c.ownCachedTokens,
  )
  for (const c of crossHits.slice(0, 1)) {
    findings.push({
      probe: 'evict-then-return',
      // Cached tokens of another tenant's prefix, without its words: a side channel.
      verdict: 'warning',
      class: 'side-channel',
      severity: 'high',
      title: `${c.tenant.name}'s request for ${subject}'s prefix, evicted by ${c.factor} × the ${churn.poolTokens}-token pool of traffic, was served ${c.result.cachedTokens} cached tokens (its own fresh prompts at most ${c.ownCachedTokens}): an evicted prefix is found by another tenant (a tier keyed without the tenant)`,
      evidence: at(c.result, { ...evidence, victimTenant: subject, observerTenant: c.tenant.name }),
      remediation,
    })
  }
  if (findings.length > 0) return findings
  const changedCheck = session.checks.find(
    (c) => isWhole(c.result) && c.result.text !== c.prefix.cold.text,
  )
  if (changedCheck !== undefined) {
    findings.push({
      probe: 'evict-then-return',
      verdict: 'warning',
      severity: 'high',
      title: `${changedCheck.tenant.name}'s request for ${subject}'s prefix, after ${changedCheck.factor} × the ${churn.poolTokens}-token pool of traffic, got a temperature-0 answer that differs from the cold one (reported cached_tokens ${changedCheck.result.cachedTokens ?? 'none'}): KV that is not this prompt's was used`,
      evidence: at(changedCheck.result, evidence),
      remediation,
    })
  }
  const changed = session.returns.filter(
    (r) => isWhole(r.result) && r.result.text !== r.prefix.cold.text,
  )
  if (changed.length > 0) {
    findings.push({
      probe: 'evict-then-return',
      verdict: 'warning',
      severity: 'high',
      title: `${changed.length} of ${subject}'s ${session.returns.length} prefixes, evicted by ${session.churnTokens} tokens of traffic and sent again, got temperature-0 answers that differ from their cold ones (reported cached_tokens ${changed.map((r) => r.result.cachedTokens ?? 'none').join(', ')}), without another tenant's material: KV that is not the prompt's was used`,
      evidence: at(changed[0].result, evidence),
      remediation,
    })
  }
  if (
    session.warm !== null &&
    isWhole(session.warm) &&
    session.warm.text !== session.cached[0]?.cold.text
  ) {
    findings.push({
      probe: 'evict-then-return',
      verdict: 'warning',
      severity: 'medium',
      title: `${subject}'s warm answer, before any eviction, already differed from its cold one (see warm-equals-cold)`,
      evidence: at(session.warm, evidence),
      remediation,
    })
  }
  if (findings.length > 0) return findings
  const firstStage = stageFactors[0] * churn.poolTokens
  const reason =
    session.cached.length < numPrefixes || !isWhole(session.warm)
      ? 'the prefixes were not answered cold and warm'
      : session.churnTokens < firstStage
        ? `the churn's answered prompts covered ${session.churnTokens} of the ${firstStage} tokens needed (${session.numChurnAnswered} of ${session.numChurnSent} answered${base.stoppedBy !== null ? `; ${String(base.stoppedBy)}` : ''})`
        : session.returns.length < numPrefixes || !session.returns.every((r) => isWhole(r.result))
          ? `the returning prefixes were not answered${base.stoppedBy !== null ? ` (${String(base.stoppedBy)})` : ''}`
          : null
  if (reason !== null)
    return [
      inconclusive(`could not tell whether an evicted prefix returns intact: ${reason}`, evidence),
    ]
  const reached = session.checks.length > 0 ? session.checks[session.checks.length - 1].factor : 0
  return [
    {
      probe: 'evict-then-return',
      verdict: 'clean',
      severity: 'info',
      title: `${subject}'s ${numPrefixes} prefixes returned intact after ${session.churnTokens} tokens of every tenant's traffic (≥ ${reached} × the ${churn.poolTokens}-token pool): the same temperature-0 answers as cold, no other tenant's material, and another tenant's requests for them were served no cached token of them`,
      evidence,
      remediation: 'None needed.',
    },
  ]
}

/** The evidence every finding of a run carries: answers summarized, never their text. */
function evidenceOf(
  session: Session,
  base: Record<string, unknown>,
  subject: string | null,
): Record<string, unknown> {
  const [first] = session.cached
  const firstReturn = session.returns[0]?.result ?? null
  return {
    ...base,
    subjectTenant: subject,
    churnTokensAnswered: session.churnTokens,
    numChurnSent: session.numChurnSent,
    numChurnAnswered: session.numChurnAnswered,
    cold: summary(first?.cold ?? null),
    warm: summary(session.warm),
    returned: summary(firstReturn),
    returns: session.returns.map((r) => ({
      ...summary(r.result),
      isEqual: isWhole(r.result) ? r.result.text === r.prefix.cold.text : null,
    })),
    crossTenantChecks: session.checks.map((c) => ({
      factor: c.factor,
      tenant: c.tenant.name,
      ...summary(c.result),
      ownCachedTokens: c.ownCachedTokens,
      ttftMs: c.result.ttftMs,
      coldTtftMs: c.prefix.cold.ttftMs,
      isEqual: isWhole(c.result) ? c.result.text === c.prefix.cold.text : null,
    })),
    isWarmEqual:
      isWhole(first?.cold ?? null) && isWhole(session.warm)
        ? session.warm.text === first.cold.text
        : null,
    isReturnEqual:
      isWhole(firstReturn) && first !== undefined ? firstReturn.text === first.cold.text : null,
    returnFirstDifferenceAt:
      isWhole(firstReturn) && first !== undefined && firstReturn.text !== first.cold.text
        ? firstDifference(firstReturn.text, first.cold.text)
        : null,
  }
}

/** `evidence` with where `r` was seen: its request number and time (the first alarm's). */
function at(r: CompletionResult, evidence: Record<string, unknown>): Record<string, unknown> {
  return { ...evidence, requestNumber: r.requestNumber, atMs: r.atMs }
}

/** An answer without its text: status and reported token counts. */
function summary(r: CompletionResult | null): Record<string, unknown> | null {
  if (r === null) return null
  return {
    status: r.status,
    failure: r.failure,
    requestNumber: r.requestNumber,
    promptTokens: r.promptTokens,
    cachedTokens: r.cachedTokens,
  }
}

function inconclusive(title: string, evidence: Record<string, unknown>): Finding {
  return {
    probe: 'evict-then-return',
    verdict: 'inconclusive',
    severity: 'medium',
    title,
    evidence,
    remediation: inconclusiveRemediation,
  }
}
