/** `kvfence audit --plan`, and each probe's share of the budget: what an audit would send, per
 *  probe, before anything is sent. Each probe states its own requests (its constants live beside
 *  its code); this module adds them up, gives each probe its share of the budget (requests,
 *  tokens, seconds: {@link shareBudget}), so that no probe starves the ones after it, and prices
 *  the tokens. The audit computes the same shares from the same discovery before its first probe
 *  and holds each later probe's share back while one runs (budget.ts).
 *  The plan is read from the flags and from discovery's reads (`GET /v1/models`, server info,
 *  `/metrics`): the sizes of `boundary`, `canary`, `error-handling` and `prefix-timing` follow the
 *  pool and the context the endpoint reports. No completion is ever sent.
 *  Knows the probes' plans and the budget; knows nothing of HTTP. */
import type { BudgetLimits, ProbeName } from './types.js'

/** What a probe's plan is computed from. */
export interface PlanInput {
  readonly limits: BudgetLimits
  readonly numTenants: number
  readonly overCapacityAttempts: number
  /** Smallest KV pool discovery read (tokens), or null. */
  readonly poolTokens: number | null
  /** Largest advertised context window (tokens), or null. */
  readonly contextTokens: number | null
  /** The largest prompt the engine says it accepts (SGLang), or null. */
  readonly inputLimitTokens: number | null
  /** Largest KV pool discovery read (tokens), or null (what churn must cover to evict). */
  readonly largestPoolTokens?: number | null
  /** Page sizes the endpoint reports (tokens per page); empty when none. */
  readonly pageSizes?: readonly number[]
  /** Prefill chunk sizes the endpoint reports (tokens); empty when none. */
  readonly chunkSizes?: readonly number[]
  /** `--aggressive`: bodies that could disturb a shared engine are sent too. */
  readonly isAggressive: boolean
  /** Prompt tokens per prefill step the engine reports (chunked prefill), or null. Absent:
   *  null. */
  readonly chunkedPrefillTokens?: number | null
}

/** One kind of request a probe sends: how many at most, and the tokens of each at most (prompt
 *  estimate plus `max_tokens`; 0 for a read such as `GET /metrics`). */
export interface PlannedRequests {
  readonly what: string
  readonly numRequests: number
  readonly tokensEach: number
}

/** One probe's plan, summed. */
export interface ProbePlan {
  readonly probe: ProbeName | 'audit'
  readonly requests: readonly PlannedRequests[]
  readonly numRequests: number
  readonly numTokens: number
}

/** A probe's share of the budget: requests it may send whatever the probes before it spent,
 *  the tokens those carry at most, and seconds held for it. */
export interface BudgetShare {
  readonly probe: ProbeName
  readonly numRequests: number
  readonly numTokens: number
  readonly seconds: number
}

/** The whole plan. `numRequestsCapped`: what the request budget lets through of `numRequests`
 *  (the audit stops there; later probes are then inconclusive). Cost is in the unit of
 *  `pricePerMillionTokens` (0: not priced). */
export interface AuditPlan {
  readonly target: string
  readonly limits: BudgetLimits
  readonly poolTokens: number | null
  readonly contextTokens: number | null
  /** Discovery's reads and what each answered. */
  readonly endpoints: readonly { readonly endpoint: string; readonly status: number | string }[]
  readonly probes: readonly ProbePlan[]
  /** Each probe's share (the `audit` row's requests come first, off the top); absent in plans
   *  built before shares. */
  readonly shares?: readonly BudgetShare[]
  /** With `--resume`: the probes the report ran to their end, kept, not planned (absent: none). */
  readonly kept?: readonly ProbeName[]
  readonly numRequests: number
  readonly numRequestsCapped: number
  readonly numTokens: number
  readonly pricePerMillionTokens: number
  readonly cost: number
}

/** Upper estimate of the tokens of a prompt of canaries or filler words (canaries.ts builds them
 *  of at most 330 characters; random canaries tokenize at about two characters a token). */
export const materialPromptTokens = 165

/** Sums `requests` into a probe's plan. */
export function probePlan(
  probe: ProbeName | 'audit',
  requests: readonly PlannedRequests[],
): ProbePlan {
  const kept = requests.filter((r) => r.numRequests > 0)
  return {
    probe,
    requests: kept,
    numRequests: kept.reduce((s, r) => s + r.numRequests, 0),
    numTokens: kept.reduce((s, r) => s + r.numRequests * r.tokensEach, 0),
  }
}

/** Adds the probes' plans up, gives each probe its share (the `audit` row's requests off the
 *  top), caps the requests by the budget and prices the tokens. */
export function totalPlan(
  base: Omit<
    AuditPlan,
    'numRequests' | 'numRequestsCapped' | 'numTokens' | 'cost' | 'pricePerMillionTokens' | 'shares'
  >,
  pricePerMillionTokens: number,
): AuditPlan {
  const numRequests = base.probes.reduce((s, p) => s + p.numRequests, 0)
  const numTokens = base.probes.reduce((s, p) => s + p.numTokens, 0)
  const own = base.probes.find((p) => p.probe === 'audit')?.numRequests ?? 0
  const shares = shareBudget(base.probes, base.limits, own)
  return {
    ...base,
    shares,
    numRequests,
    numRequestsCapped: Math.min(
      numRequests,
      base.limits.maxRequests,
      own + shares.reduce((s, p) => s + p.numRequests, 0),
    ),
    numTokens,
    pricePerMillionTokens,
    cost: (numTokens / 1_000_000) * pricePerMillionTokens,
  }
}

/** The plan as the console prints it: a row per probe, then the total and what it was read from. */
export function formatPlan(plan: AuditPlan): string {
  const isPriced = plan.pricePerMillionTokens > 0
  const price = (tokens: number): string =>
    isPriced ? ((tokens / 1_000_000) * plan.pricePerMillionTokens).toFixed(4).padStart(10) : ''
  const shares = new Map((plan.shares ?? []).map((s) => [s.probe as string, s]))
  const shareCells = (probe: string): string => {
    const share = shares.get(probe)
    return share === undefined
      ? ''.padStart(30)
      : `${String(share.numRequests).padStart(11)}${String(share.numTokens).padStart(10)}${share.seconds.toFixed(1).padStart(9)}`
  }
  // The name column holds the longest probe name (operational-endpoints is 21) and a space.
  const nameWidth = Math.max(16, ...plan.probes.map((p) => p.probe.length + 1))
  const rows = plan.probes.map(
    (p) =>
      `${p.probe.padEnd(nameWidth)}${String(p.numRequests).padStart(9)}${String(p.numTokens).padStart(11)}${price(p.numTokens)}${shareCells(p.probe)}`,
  )
  const numShared = (plan.shares ?? []).reduce((s, p) => s + p.numTokens, 0)
  const read = plan.endpoints.map((e) => `${e.endpoint} ${e.status}`).join(', ')
  const size = (n: number | null): string => (n === null ? 'unknown' : `${n} tokens`)
  const kept = plan.kept ?? []
  return [
    `plan for ${plan.target}: upper estimates; no completion was sent`,
    ...(kept.length === 0
      ? []
      : [`resumed: kept from the report, not sent again: ${kept.join(', ')}`]),
    `read from the flags and from discovery (${read}): context ${size(plan.contextTokens)}, KV pool ${size(plan.poolTokens)}`,
    `${'probe'.padEnd(nameWidth)}${'requests'.padStart(9)}${'tokens'.padStart(11)}${isPriced ? 'cost'.padStart(10) : ''}${'share: req'.padStart(11)}${'tokens'.padStart(10)}${'seconds'.padStart(9)}`,
    ...rows,
    `${'total'.padEnd(nameWidth)}${String(plan.numRequests).padStart(9)}${String(plan.numTokens).padStart(11)}${price(plan.numTokens)}${String(plan.numRequestsCapped).padStart(11)}${String(numShared + (plan.probes.find((p) => p.probe === 'audit')?.numTokens ?? 0)).padStart(10)}${plan.limits.maxSeconds.toFixed(1).padStart(9)}`,
    ...(plan.numRequests > plan.limits.maxRequests
      ? [
          `the plan's ${plan.numRequests} requests exceed --max-requests ${plan.limits.maxRequests}: each probe gets its share (every probe runs; none starves the ones after it), and these get less than they ask:`,
          ...formatShortfalls(plan).map((line) => `  ${line}`),
        ]
      : [`within the request budget (--max-requests ${plan.limits.maxRequests})`]),
    isPriced
      ? `at ${plan.pricePerMillionTokens} per million tokens`
      : 'tokens only: give --price-per-million-tokens to price them',
  ].join('\n')
}

/** Each probe's share of the budget, in the probes' order. The rules (a test recomputes them):
 *  - requests: `available` = `maxRequests` less the audit's own requests (its `audit` row),
 *    shared max-min fairly: taken from the smallest need up, each probe gets its whole need while
 *    that is at most an equal split of what is left among it and the larger ones; the rest split
 *    what is left equally (the remainder, one each, to the first in the probes' order). So a
 *    probe that needs little always gets it, and the largest need is cut first.
 *  - tokens: the plan's tokens times share ÷ need (rounded down; all of them when the share is
 *    the need).
 *  - seconds: `maxSeconds` split in proportion to share + 1 + its tokens ÷
 *    {@link tokensWorthARequest} (a probe that sends no completion still has time for its reads;
 *    one whose prompts are long has time to prefill them), rounded down to the millisecond.
 *  A probe's share is held back for it while earlier probes run; what a probe leaves unspent
 *  passes to the ones after it. */
export function shareBudget(
  plans: readonly ProbePlan[],
  limits: BudgetLimits,
  ownRequests: number,
): BudgetShare[] {
  const probes = plans.filter((p): p is ProbePlan & { probe: ProbeName } => p.probe !== 'audit')
  const shares = new Map<ProbeName, number>()
  let available = Math.max(0, limits.maxRequests - ownRequests)
  const bySize = [...probes].sort((a, b) => a.numRequests - b.numRequests)
  let left = bySize.length
  for (const p of bySize) {
    const level = Math.floor(available / left)
    if (p.numRequests > level) break
    shares.set(p.probe, p.numRequests)
    available -= p.numRequests
    left--
  }
  const cut = probes.filter((p) => !shares.has(p.probe))
  const level = cut.length === 0 ? 0 : Math.floor(available / cut.length)
  let extra = available - level * cut.length
  for (const p of cut) {
    shares.set(p.probe, level + (extra > 0 ? 1 : 0))
    extra--
  }
  const given = probes.map((p) => {
    const numRequests = shares.get(p.probe)!
    const numTokens =
      numRequests >= p.numRequests
        ? p.numTokens
        : Math.floor((p.numTokens * numRequests) / p.numRequests)
    return { probe: p.probe, numRequests, numTokens }
  })
  const timeWeight = (g: { numRequests: number; numTokens: number }) =>
    g.numRequests + 1 + g.numTokens / tokensWorthARequest
  const weight = given.reduce((s, g) => s + timeWeight(g), 0)
  return given.map((g) => ({
    ...g,
    seconds: Math.floor((limits.maxSeconds * 1000 * timeWeight(g)) / weight) / 1000,
  }))
}

/** Tokens that weigh as much as one request in the split of `maxSeconds`: an engine's time
 *  follows the tokens it prefills as well as the requests it answers. Split by requests alone,
 *  canary's 16 pool-covering prompts of ~1,000 tokens got 14 s of a 300 s audit against
 *  transformers serve and were cut, while the audit ended after 62 s (trial). */
export const tokensWorthARequest = 256

/** What each probe's plan asks beyond its share, one line each ('' when every plan fits). */
export function formatShortfalls(plan: AuditPlan): string[] {
  const shares = new Map((plan.shares ?? []).map((s) => [s.probe, s]))
  return plan.probes.flatMap((p) => {
    const share = p.probe === 'audit' ? undefined : shares.get(p.probe)
    if (share === undefined || share.numRequests >= p.numRequests) return []
    return [
      `${p.probe} needs up to ${p.numRequests} requests (${p.numTokens} tokens); its share is ${share.numRequests} (${share.numTokens} tokens): it runs what fits its share and says inconclusive for what does not (raise --max-requests to ${plan.numRequests} for every plan in full)`,
    ]
  })
}
