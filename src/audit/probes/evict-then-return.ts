/** Probe `evict-then-return`: a tenant's cached prefix, pushed out of the KV pool by other
 *  tenants' traffic, must come back as its own or not at all. Offload tiers (host memory, disk, a
 *  remote store) keep what the pool evicts and load it back on the next hit; a load that failed,
 *  or that read another entry, counted as a hit serves KV that is not the prompt's
 *  (dynamo#15079, LMCache#4385).
 *
 *  The subject tenant sends a canary-bearing prompt twice (cold, then warm: the prefix is cached);
 *  the other audit tenants then send distinct canary-bearing prompts, as large as the endpoint
 *  takes, adding up to at least twice the largest KV pool it reports (so the prefix has left every
 *  pool); the subject then sends its prompt again. At temperature 0 that answer must equal the
 *  cold one and carry no other tenant's material: another tenant's canary in any answer is a leak,
 *  a returning answer that differs without one is a warning (KV that is not this prompt's, e.g. a
 *  corrupt page loaded as a hit).
 *  When the endpoint reports no pool, or the budget cannot cover the churn, nothing is sent and
 *  the result is inconclusive with the reason; so is a churn that was not answered in full.
 *  Knows the pool size discovery read and canaries; knows nothing of any engine's tiers. */
import { runUntilExhausted, type Budget } from '../budget.js'
import { makeCanaries } from '../canaries.js'
import type { Probe } from '../probe.js'
import { inconclusiveRemediation } from '../probe.js'
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
import { boundedPrompt, promptLimit, sizerOrNull } from './sized-material.js'

const maxTokens = 16
/** The subject's prompt: a few pages of any common page size. */
const subjectTokens = 96
/** The churn must cover this many times the largest pool. */
const churnFactor = 2
/** Churn requests at most: a pool that needs more is inconclusive, not an audit of its own. */
const maxChurnRequests = 120
/** A churn prompt is sized with room for its canary's cost ({@link boundedPrompt}), so it may
 *  come out shorter than planned: up to this share more requests are sent until the churn's
 *  answered prompts cover what is needed. */
const churnSlack = 0.5

const remediation =
  'A prefix loaded back from any tier (host memory, disk, a remote store) must be verified before ' +
  'use (its key with the tenant salt, the model and layout, token count and a checksum of the ' +
  'bytes), and a failed or unverified load must be a miss, recomputed, never a hit. Until fixed, ' +
  'turn the offload tier off or partition it per tenant.'

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
  description:
    "a tenant caches a canary-bearing prefix, other tenants' traffic of at least twice the reported KV pool evicts it, the tenant returns; its temperature-0 answer must equal the cold one and carry no other tenant's material",
  plan: (input) => {
    const churn = churnSize(input.largestPoolTokens ?? null, promptLimit(input, maxTokens))
    if (churn === null || churn.numRequests > maxChurnRequests) return []
    return [
      {
        what: 'the prefix cold, warm, returning',
        numRequests: 3,
        tokensEach: subjectTokens + maxTokens,
      },
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
    const base = { churn, churnFactor, maxTokens }
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
    const needed = 3 + churn.numRequests
    if (churn.numRequests > maxChurnRequests || needed > budget.remainingRequests) {
      return [
        inconclusive(
          `evicting the cache takes ${churn.numRequests} requests of ${churn.promptTokens} tokens (${churnFactor} × the ${churn.poolTokens}-token pool) plus 3; ${churn.numRequests > maxChurnRequests ? `more than the probe's ${maxChurnRequests}` : `the budget has ${budget.remainingRequests} requests left`}`,
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
      `churn ${session.churnTokens} tokens in ${session.numChurnAnswered} answers; return ${session.returned === null ? 'not answered' : session.returned.text === session.cold?.text ? 'equal' : 'differs'}`,
    )
    return judge(session, churn, { ...base, stoppedBy })
  },
}

/** One run of the protocol. */
class Session {
  readonly planted: Planted[] = []
  readonly observed: Observed[] = []
  cold: CompletionResult | null = null
  warm: CompletionResult | null = null
  returned: CompletionResult | null = null
  churnTokens = 0
  numChurnAnswered = 0
  numChurnSent = 0

  constructor(
    private readonly target: Target,
    private readonly rng: Rng,
    private readonly sizer: PromptSizer,
  ) {}

  async run(churn: ChurnSize, budget: Budget): Promise<void> {
    const [subject, ...others] = this.target.tenants
    const canaries = makeCanaries(this.rng, 1 + churn.maxRequests)
    const mine = this.plant(
      'prefix',
      subject,
      boundedPrompt(this.rng, this.sizer, subjectTokens, canaries[0]),
      canaries[0],
    )
    this.cold = await this.send(mine, 'cold')
    if (!isAnsweredWhole(this.cold)) return
    this.warm = await this.send(mine, 'warm (before eviction)')
    const needed = churnFactor * churn.poolTokens
    const batch = Math.max(1, budget.limits.concurrency)
    for (let i = 0; this.churnTokens < needed && i < churn.maxRequests;) {
      // Only as many at once as the tokens still missing need, at prompts of the planned size.
      const numMissing = Math.ceil((needed - this.churnTokens) / churn.promptTokens)
      const sends = []
      for (const end = Math.min(i + batch, i + numMissing, churn.maxRequests); i < end; i++) {
        const canary = canaries[1 + i]
        const prompt = boundedPrompt(this.rng, this.sizer, churn.promptTokens, canary)
        const planted = this.plant(`churn${i}`, others[i % others.length], prompt, canary)
        sends.push(this.churnOne(planted))
      }
      await Promise.all(sends)
    }
    this.returned = await this.send(mine, 'returning (after eviction)')
  }

  private async churnOne(planted: Planted): Promise<void> {
    this.numChurnSent++
    const r = await this.send(planted, 'churn')
    if (!isAnsweredWhole(r)) return
    this.numChurnAnswered++
    this.churnTokens += r.promptTokens ?? this.sizer.estimate(planted.prompt.split(' ').length)
  }

  private plant(id: string, tenant: Tenant, prompt: string, canary: string): Planted {
    const planted = { id, tenant, canaries: [canary], prompt }
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

/** Leak for foreign material, else a warning for a changed answer, else inconclusive for
 *  anything not seen, else clean. */
function judge(session: Session, churn: ChurnSize, base: Record<string, unknown>): Finding[] {
  const { cold, warm, returned } = session
  const isWhole = (r: CompletionResult | null): r is CompletionResult =>
    r !== null && isAnsweredWhole(r)
  const subject = session.planted[0]?.tenant.name ?? null
  const evidence = {
    ...base,
    subjectTenant: subject,
    churnTokensAnswered: session.churnTokens,
    numChurnSent: session.numChurnSent,
    numChurnAnswered: session.numChurnAnswered,
    cold: summary(cold),
    warm: summary(warm),
    returned: summary(returned),
    isWarmEqual: isWhole(cold) && isWhole(warm) ? warm.text === cold.text : null,
    isReturnEqual: isWhole(cold) && isWhole(returned) ? returned.text === cold.text : null,
    returnFirstDifferenceAt:
      isWhole(cold) && isWhole(returned) && returned.text !== cold.text
        ? firstDifference(returned.text, cold.text)
        : null,
  }
  const crossings = findCrossings(session.observed, session.planted)
  if (crossings.length > 0)
    return leakFindings('evict-then-return', crossings, session.planted, evidence, remediation)
  const findings: Finding[] = []
  if (evidence.isReturnEqual === false) {
    findings.push({
      probe: 'evict-then-return',
      verdict: 'warning',
      severity: 'high',
      title: `${subject}'s prefix, evicted by ${session.churnTokens} tokens of other tenants' traffic and sent again, got a temperature-0 answer that differs from its cold one (reported cached_tokens ${returned?.cachedTokens ?? 'none'}), without another tenant's material: KV that is not this prompt's was used`,
      evidence,
      remediation,
    })
  }
  if (evidence.isWarmEqual === false) {
    findings.push({
      probe: 'evict-then-return',
      verdict: 'warning',
      severity: 'medium',
      title: `${subject}'s warm answer, before any eviction, already differed from its cold one (see warm-equals-cold)`,
      evidence,
      remediation,
    })
  }
  if (findings.length > 0) return findings
  const needed = churnFactor * churn.poolTokens
  const reason =
    !isWhole(cold) || !isWhole(warm)
      ? 'the prefix was not answered cold and warm'
      : session.churnTokens < needed
        ? `the churn's answered prompts covered ${session.churnTokens} of the ${needed} tokens needed (${session.numChurnAnswered} of ${session.numChurnSent} answered${base.stoppedBy !== null ? `; ${String(base.stoppedBy)}` : ''})`
        : !isWhole(returned)
          ? `the returning prefix was not answered${base.stoppedBy !== null ? ` (${String(base.stoppedBy)})` : ''}`
          : null
  if (reason !== null)
    return [
      inconclusive(`could not tell whether an evicted prefix returns intact: ${reason}`, evidence),
    ]
  return [
    {
      probe: 'evict-then-return',
      verdict: 'clean',
      severity: 'info',
      title: `${subject}'s prefix returned intact after ${session.churnTokens} tokens of other tenants' traffic (≥ ${churnFactor} × the ${churn.poolTokens}-token pool): the same temperature-0 answer as cold, no other tenant's material`,
      evidence,
      remediation: 'None needed.',
    },
  ]
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
