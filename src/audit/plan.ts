/** `kvfence audit --plan`: what an audit would send, per probe, before anything is sent. Each
 *  probe states its own requests (its constants live beside its code); this module adds them up,
 *  caps the total by the request budget and prices the tokens.
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

/** Adds the probes' plans up, caps the requests by the budget and prices the tokens. */
export function totalPlan(
  base: Omit<
    AuditPlan,
    'numRequests' | 'numRequestsCapped' | 'numTokens' | 'cost' | 'pricePerMillionTokens'
  >,
  pricePerMillionTokens: number,
): AuditPlan {
  const numRequests = base.probes.reduce((s, p) => s + p.numRequests, 0)
  const numTokens = base.probes.reduce((s, p) => s + p.numTokens, 0)
  return {
    ...base,
    numRequests,
    numRequestsCapped: Math.min(numRequests, base.limits.maxRequests),
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
  const rows = plan.probes.map(
    (p) =>
      `${p.probe.padEnd(16)}${String(p.numRequests).padStart(9)}${String(p.numTokens).padStart(11)}${price(p.numTokens)}`,
  )
  const read = plan.endpoints.map((e) => `${e.endpoint} ${e.status}`).join(', ')
  const size = (n: number | null): string => (n === null ? 'unknown' : `${n} tokens`)
  const kept = plan.kept ?? []
  return [
    `plan for ${plan.target}: upper estimates; no completion was sent`,
    ...(kept.length === 0
      ? []
      : [`resumed: kept from the report, not sent again: ${kept.join(', ')}`]),
    `read from the flags and from discovery (${read}): context ${size(plan.contextTokens)}, KV pool ${size(plan.poolTokens)}`,
    `${'probe'.padEnd(16)}${'requests'.padStart(9)}${'tokens'.padStart(11)}${isPriced ? 'cost'.padStart(10) : ''}`,
    ...rows,
    `${'total'.padEnd(16)}${String(plan.numRequests).padStart(9)}${String(plan.numTokens).padStart(11)}${price(plan.numTokens)}`,
    plan.numRequests > plan.limits.maxRequests
      ? `the plan's ${plan.numRequests} requests exceed --max-requests ${plan.limits.maxRequests}: if every one is sent, the audit stops after ${plan.numRequestsCapped} and the probes it does not reach are inconclusive`
      : `within the request budget (--max-requests ${plan.limits.maxRequests})`,
    isPriced
      ? `at ${plan.pricePerMillionTokens} per million tokens`
      : 'tokens only: give --price-per-million-tokens to price them',
  ].join('\n')
}
