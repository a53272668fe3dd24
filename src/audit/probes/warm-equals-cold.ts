/** Probe `warm-equals-cold`: a prompt answered from the cache must get the answer it got cold.
 *  Prefix caches are cut into pages and prefills into chunks, and the warm path's bugs sit on
 *  those edges: a prompt of exactly k pages is cached whole and its last token must be recomputed;
 *  a chunk edge splits a prefill between steps (LMCache#5151, #4991: a warm answer that was not the
 *  cold one). Prompts are sent on each edge the endpoint reports (page size, prefill chunk size;
 *  powers of two from 16 to 1,024 where it reports no page size) and one token either side.
 *
 *  Per length: another tenant first sends a prompt of that same length (material a wrong key
 *  could serve), then the observer sends its own prompt twice at temperature 0, cold then warm.
 *  The warm answer must equal the cold one. Any answer that carries another tenant's canary, or
 *  a run of the keyed filler one of its prompts carried, is a leak naming that tenant; a
 *  difference without is a warning. Where answers differ, a fresh `cache_salt` is the control
 *  (vLLM takes one; where the endpoint refuses or ignores it, the cause stays undetermined): the
 *  same prompt under a key nothing else shares, twice. If the difference goes away, the cache
 *  served an entry it should not have matched (a key bug); if it stays, the warm path computes
 *  wrongly from the prompt's own entry (a content bug).
 *  Could not tell (no token counts, an edge no prompt landed on, a length not answered, the budget)
 *  is inconclusive, never clean. Outputs stay out of the report; only positions and counts. */
import { runUntilExhausted } from '../budget.js'
import { makeCanaries } from '../canaries.js'
import type { Probe, ProbeContext } from '../probe.js'
import { aisvsKvPartitioning, inconclusiveRemediation } from '../probe.js'
import { createRng, type Rng } from '../rng.js'
import { firstCeilingTokens, unknownLimitTokens } from '../prompt-ceiling.js'
import type { PromptSizer } from '../sizer.js'
import { isAnsweredWhole, outcomeOf, type CompletionResult, type Target } from '../target.js'
import type { Finding, Tenant } from '../types.js'
import {
  findCrossings,
  firstDifference,
  leakFindings,
  type Observed,
  type Planted,
} from './material.js'
import {
  cacheEdges,
  measureCanary,
  promptLimit,
  sizedPrompt,
  type SizedPrompt,
  sizerOrNull,
  type CacheEdge,
  type TenantCanary,
} from './sized-material.js'

const maxTokens = 16
/** Differing lengths that get the fresh-salt control, at most (two requests each). */
const maxSaltControls = 2
/** Edges whose prompt missed its length and are sent again, re-aimed by the miss, at most
 *  (three requests each). */
const maxResizes = 2
const offsets = [-1, 0, 1] as const
/** Tokens of a canary-measuring prompt at most: head, a 24-character canary, 16 filler words. */
const measureTokens = 6 + 24 + 16 + 1

/** What a fresh `cache_salt` showed about a difference (see the module's header). */
export type DifferenceCause =
  'key' | 'content' | 'salt refused' | 'salt ignored' | 'undetermined' | 'not tried'

/** One length's comparison, without any text. */
interface LengthRun {
  readonly targetTokens: number
  readonly edge: number
  readonly why: string
  readonly observer: string
  readonly source: string
  readonly hasCanary: boolean
  /** The cold answer's `usage.prompt_tokens` (the length that was actually sent), or null. */
  readonly promptTokens: number | null
  readonly outcome: 'compared' | 'refused' | 'failed'
  readonly isEqual: boolean | null
  readonly firstDifferenceAt: number | null
  readonly warmCachedTokens: number | null
  cause: DifferenceCause | null
}

const causeText: Readonly<Record<DifferenceCause, string>> = {
  key: 'under a fresh cache_salt the warm answer equals the cold one: the cache served an entry under a key it should not have matched (a key bug)',
  content:
    "under a fresh cache_salt the warm answer still differs: the warm path computes wrongly from the prompt's own entry (a content bug)",
  'salt refused':
    'the endpoint refused cache_salt, so key and content bugs could not be told apart',
  'salt ignored':
    'the endpoint ignored cache_salt (a fresh salt hit the cache), so key and content bugs could not be told apart',
  undetermined: 'the fresh-salt control was not conclusive',
  'not tried': 'no fresh-salt control was sent for this length',
}

const remediation =
  "A cached answer must be the cold answer: check the prefix cache's key (every token and the " +
  "tenant's salt of each page, the last partial page included), that a prompt cached whole still " +
  'recomputes its last token, that a page loaded from any tier is verified (identity, tokens, ' +
  'checksum) before use and that prefill chunks resume at the right position. Until fixed, turn ' +
  'the prefix cache off or partition it per tenant. A difference without foreign material may ' +
  'also be a warm path whose kernels add up in another order than the cold one (not ' +
  'bitwise-identical): then it changes few tokens, late, and stays under a fresh cache_salt.'

export const warmEqualsColdProbe: Probe = {
  name: 'warm-equals-cold',
  description:
    'prompts on the page and chunk sizes the endpoint reports (else powers of two 16–1,024) and ±1, sent cold then warm at temperature 0 after another tenant sent the same length; a warm answer must equal the cold one (with foreign material a leak, without a warning; a fresh cache_salt tells a key bug from a content bug)',
  class: 'integrity',
  // A warm answer that is not the cold one: a cache entry served under the wrong key or a page
  // reused without its checks (G4: checksums and identities of every page loaded; G5: epochs).
  controls: { aisvs: [aisvsKvPartitioning], guards: ['G4', 'G5'] },
  isSizing: true,
  plan: (input) => {
    const edges = cacheEdges(
      input.pageSizes ?? [],
      input.chunkSizes ?? [],
      promptLimit(input, maxTokens) ?? (input.isAggressive ? null : unknownLimitTokens - maxTokens),
    )
    const longest = Math.max(0, ...edges.map((e) => e.tokens + 1)) + maxTokens
    return [
      {
        what: "each tenant's canary cost",
        numRequests: input.numTenants,
        tokensEach: measureTokens,
      },
      {
        what: `${edges.length} edges × 3 lengths × 3 prompts (another tenant's, cold, warm)`,
        numRequests: 9 * edges.length,
        tokensEach: longest,
      },
      {
        what: 'edges re-sent re-aimed by the tokens they missed by (only where one missed)',
        numRequests: 3 * maxResizes,
        tokensEach: longest,
      },
      {
        what: 'fresh cache_salt controls (only where warm differs)',
        numRequests: 2 * maxSaltControls,
        tokensEach: longest,
      },
    ]
  },
  async run(target, _budget, context): Promise<Finding[]> {
    const rng = createRng(context.seed, 'warm-equals-cold')
    const { discovery } = context
    // With no limit known, the prompt ceiling's (grown from what was answered) bounds the edges.
    const ceiling = context.ceiling?.maxRequestTokens() ?? firstCeilingTokens
    const edges = cacheEdges(
      discovery.pageSizes.map((s) => s.tokens),
      discovery.chunkSizes.map((s) => s.tokens),
      promptLimit(discovery, maxTokens) ?? ceiling - maxTokens,
    )
    const base = { edges, maxTokens, ceiling: context.ceiling?.describe() ?? null }
    const sizer = await sizerOrNull(() => context.sizer())
    if (sizer === null)
      return [
        inconclusive(
          'token counts could not be calibrated, so no prompt could be sized to a cache edge',
          base,
        ),
      ]
    if (edges.length === 0)
      return [inconclusive("no cache edge fits under the endpoint's prompt limit", base)]
    const session = new Session(target, rng, sizer)
    const stoppedBy = await runUntilExhausted(() => session.run(edges))
    return judge(session, edges, { ...base, stoppedBy }, context)
  },
}

/** One run of the protocol: the requests sent and what they showed. */
class Session {
  readonly canaries: TenantCanary[] = []
  readonly planted: Planted[] = []
  readonly observed: Observed[] = []
  readonly runs: LengthRun[] = []
  /** Each tenant's prompts' keyed fillers: what an answer to another tenant must not replay. */
  private readonly fillers = new Map<string, string[]>()
  private readonly colds = new Map<LengthRun, { tenant: Tenant; prompt: string; text: string }>()

  constructor(
    private readonly target: Target,
    private readonly rng: Rng,
    private readonly sizer: PromptSizer,
  ) {}

  async run(edges: readonly CacheEdge[]): Promise<void> {
    const { tenants } = this.target
    const canaries = makeCanaries(this.rng, tenants.length)
    for (const [i, tenant] of tenants.entries()) {
      this.planted.push({ id: tenant.name, tenant, canaries: [canaries[i]], prompt: canaries[i] })
      this.canaries.push(
        await measureCanary(this.target, this.rng, this.sizer, tenant, canaries[i]),
      )
    }
    let turn = 0
    let resizes = 0
    for (const edge of edges) {
      for (const offset of offsets) {
        const observer = turn % tenants.length
        turn++
        const numTokens = edge.tokens + offset
        let run = await this.compareAt(edge, numTokens, observer, numTokens)
        // The sizer is an estimate (a tokenizer may merge across a join it did not see): an edge
        // missed by d tokens, as the cold answer's usage says, is sent once more aimed d lower.
        const miss = run.promptTokens === null ? 0 : run.promptTokens - numTokens
        if (offset === 0 && run.outcome === 'compared' && miss !== 0 && resizes < maxResizes) {
          resizes++
          run = await this.compareAt(edge, numTokens, observer, numTokens - miss)
        }
        this.runs.push(run)
      }
    }
    const differing = this.runs.filter((r) => r.isEqual === false)
    for (const run of differing.slice(0, maxSaltControls)) run.cause = await this.saltControl(run)
    for (const run of differing.slice(maxSaltControls)) run.cause = 'not tried'
  }

  /** Another tenant's prompt of `numTokens`, then the observer's own, cold and warm; both sized
   *  for `aim` tokens (`numTokens`, or less or more where an earlier try missed it). */
  private async compareAt(
    edge: CacheEdge,
    numTokens: number,
    observerIndex: number,
    aim: number,
  ): Promise<LengthRun> {
    const { tenants } = this.target
    const observer = this.canaries[observerIndex]
    const source = this.canaries[(observerIndex + 1) % tenants.length]
    const label = `${numTokens}-token (${edge.why}${numTokens === edge.tokens ? '' : ` ${numTokens > edge.tokens ? '+' : '−'} 1`})`
    const other = this.sized(aim, source)
    await this.send(source.tenant, other.prompt, `another tenant's ${label}`)
    const own = this.sized(aim, observer)
    const cold = await this.send(observer.tenant, own.prompt, `cold ${label}`)
    const common = {
      targetTokens: numTokens,
      edge: edge.tokens,
      why: edge.why,
      observer: observer.tenant.name,
      source: source.tenant.name,
      hasCanary: own.hasCanary,
      promptTokens: cold.promptTokens,
      cause: null,
    }
    if (!isAnsweredWhole(cold)) {
      const outcome: LengthRun['outcome'] = outcomeOf(cold) === 'rejected' ? 'refused' : 'failed'
      return { ...common, outcome, isEqual: null, firstDifferenceAt: null, warmCachedTokens: null }
    }
    const warm = await this.send(observer.tenant, own.prompt, `warm ${label}`)
    const isCompared = isAnsweredWhole(warm)
    const run: LengthRun = {
      ...common,
      outcome: isCompared ? 'compared' : 'failed',
      isEqual: isCompared ? warm.text === cold.text : null,
      firstDifferenceAt:
        isCompared && warm.text !== cold.text ? firstDifference(warm.text, cold.text) : null,
      warmCachedTokens: isCompared ? warm.cachedTokens : null,
    }
    this.colds.set(run, { tenant: observer.tenant, prompt: own.prompt, text: cold.text })
    return run
  }

  /** A prompt of `aim` tokens for `canary`'s tenant, its filler recorded as the tenant's. */
  private sized(aim: number, canary: TenantCanary): SizedPrompt {
    const sized = sizedPrompt(this.rng, this.sizer, aim, canary)
    const name = canary.tenant.name
    this.fillers.set(name, [...(this.fillers.get(name) ?? []), sized.filler])
    return sized
  }

  /** Each tenant's material: its canary and every filler its prompts carried. */
  material(): Planted[] {
    return this.planted.map((p) => {
      const fillers = this.fillers.get(p.tenant.name) ?? []
      return fillers.length === 0 ? p : { ...p, filler: fillers.join('\n') }
    })
  }

  /** The same prompt under a fresh `cache_salt`, twice (see the module's header). */
  private async saltControl(run: LengthRun): Promise<DifferenceCause> {
    const cold = this.colds.get(run)
    if (cold === undefined) return 'undetermined'
    const salt = `kvfence-audit-${makeCanaries(this.rng, 1)[0]}`
    const send = (label: string) => this.send(cold.tenant, cold.prompt, label, { cache_salt: salt })
    const first = await send(`fresh-salt cold ${run.targetTokens}-token`)
    if (outcomeOf(first) === 'rejected') return 'salt refused'
    if (!isAnsweredWhole(first)) return 'undetermined'
    if ((first.cachedTokens ?? 0) > 0) return 'salt ignored'
    const second = await send(`fresh-salt warm ${run.targetTokens}-token`)
    if (!isAnsweredWhole(second) || first.text !== cold.text) return 'undetermined'
    return second.text === cold.text ? 'key' : 'content'
  }

  private async send(
    tenant: Tenant,
    prompt: string,
    label: string,
    extraFields?: Record<string, unknown>,
  ): Promise<CompletionResult> {
    const result = await this.target.complete({
      tenant,
      prompt,
      maxTokens,
      stream: false,
      ...(extraFields ? { extraFields, isValid: false } : {}),
    })
    const planted = this.planted.find((p) => p.tenant.name === tenant.name)
    if (planted && isAnsweredWhole(result))
      this.observed.push({ planted, label, stream: false, result })
    return result
  }
}

/** The findings: leaks for foreign material, else a warning for differences, else inconclusive
 *  for anything not seen, else clean. */
function judge(
  session: Session,
  edges: readonly CacheEdge[],
  base: Record<string, unknown>,
  context: ProbeContext,
): Finding[] {
  const { runs } = session
  const compared = runs.filter((r) => r.outcome === 'compared')
  const differing = compared.filter((r) => r.isEqual === false)
  const landed = new Set(compared.map((r) => r.promptTokens))
  // An edge every prompt of which was refused is past what the endpoint takes: not missed.
  // Refused: sent, and every one refused (an edge the budget stopped before it is not refused).
  const refusedEdges = edges.filter((e) => {
    const sent = runs.filter((r) => r.edge === e.tokens)
    return sent.length > 0 && sent.every((r) => r.outcome === 'refused')
  })
  const missedEdges = edges.filter((e) => !landed.has(e.tokens) && !refusedEdges.includes(e))
  const evidence = {
    ...base,
    canaryTokens: session.canaries.map((c) => ({
      tenant: c.tenant.name,
      tokens: c.canaryTokens,
    })),
    numLengths: runs.length,
    numCompared: compared.length,
    numDiffering: differing.length,
    missedEdges: missedEdges.map((e) => e.tokens),
    refusedEdges: refusedEdges.map((e) => e.tokens),
    runs,
  }
  // Says which edges a prompt landed on, so the line never reads as covering an edge the verdict
  // then calls missed.
  const edgeList = (list: readonly CacheEdge[]) =>
    list.length === 0 ? 'none' : list.map((e) => e.tokens).join(', ')
  const landedEdges = edges.filter((e) => landed.has(e.tokens))
  context.log(
    `${compared.length} of ${edges.length * offsets.length} lengths compared (${runs.length} sent), ${differing.length} differ; edges landed on ${edgeList(landedEdges)}` +
      (missedEdges.length > 0 ? `; missed ${edgeList(missedEdges)}` : '') +
      (refusedEdges.length > 0 ? `; refused ${edgeList(refusedEdges)}` : ''),
  )
  const material = session.material()
  const crossings = findCrossings(session.observed, material)
  if (crossings.length > 0) {
    const causes = [...new Set(differing.map((r) => r.cause ?? 'not tried'))]
    return leakFindings(
      'warm-equals-cold',
      crossings,
      material,
      { ...evidence, causes: causes.map((c) => `${c}: ${causeText[c]}`) },
      remediation,
    )
  }
  if (differing.length > 0) {
    const causes = [...new Set(differing.map((r) => r.cause ?? 'not tried'))]
    const lengths = differing.map((r) => r.promptTokens ?? r.targetTokens).join(', ')
    return [
      {
        probe: 'warm-equals-cold',
        verdict: 'warning',
        severity: 'medium',
        title: `a temperature-0 warm answer differed from its cold one at ${differing.length} of ${compared.length} lengths (${lengths} tokens), without another tenant's material; ${causes.map((c) => causeText[c]).join('; ')}`,
        evidence: { ...evidence, causes },
        remediation,
      },
    ]
  }
  const failed = runs.filter((r) => r.outcome === 'failed')
  const reason =
    base.stoppedBy !== null
      ? `${String(base.stoppedBy)} after ${compared.length} of ${edges.length * offsets.length} lengths`
      : failed.length > 0
        ? `${failed.length} of ${runs.length} lengths were not answered`
        : compared.length === 0
          ? 'no length was answered cold and warm'
          : missedEdges.length > 0
            ? `no prompt landed exactly on ${missedEdges.map((e) => e.tokens).join(', ')} tokens (usage.prompt_tokens ${compared.some((r) => r.promptTokens !== null) ? 'differed' : 'not reported'})`
            : null
  if (reason !== null)
    return [inconclusive(`warm and cold answers not compared on every edge: ${reason}`, evidence)]
  // The positive control: a warm answer the endpoint says came from its cache. Without one, the
  // warm path was never shown taken, and equal answers prove nothing about it.
  const mostCached = Math.max(0, ...compared.map((r) => r.warmCachedTokens ?? 0))
  if (mostCached === 0) {
    const isReported = compared.some((r) => r.warmCachedTokens !== null)
    return [
      inconclusive(
        `warm answers equalled cold ones at ${compared.length} lengths, but no warm request was seen served from a cache (cached_tokens ${isReported ? 'always 0' : 'not reported'}): the warm path was not exercised`,
        evidence,
      ),
    ]
  }
  return [
    {
      probe: 'warm-equals-cold',
      verdict: 'clean',
      severity: 'info',
      title: `warm answers equalled cold ones at ${compared.length} lengths on and ±1 around ${edges.map((e) => `${e.tokens} (${e.why})`).join(', ')} (positive control: warm requests were served up to ${mostCached} cached tokens)`,
      evidence,
      remediation: 'None needed.',
    },
  ]
}

function inconclusive(title: string, evidence: Record<string, unknown>): Finding {
  return {
    probe: 'warm-equals-cold',
    verdict: 'inconclusive',
    severity: 'medium',
    title,
    evidence,
    remediation: inconclusiveRemediation,
  }
}
