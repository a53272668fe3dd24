/** One watch cycle: re-read what the endpoint says of its capacity, then run a randomized, cheap
 *  subset of the audit's triggers and check every answer for the other tenants' canaries with the
 *  audit's own detector (`findCrossings`, `leakFindings`).
 *  - one tenant (drawn each cycle) plants a prompt made only of canaries, so stale pages hold
 *    canaries wherever they land;
 *  - the others send, as far as the cycle's allowance goes: first an over-capacity prompt or a
 *    prompt one token over the pool boundary (or both, in random order), then, each drawn at
 *    random, the planter's stream cut mid-answer followed by a fresh request, and a small burst
 *    of concurrent requests; last, an ordinary request of another tenant (the look).
 *  Every request goes through a per-cycle audit `Budget` whose request count is what the hourly
 *  budget reserved, so nothing is sent past it.
 *  Knows the audit's targets, canaries and probes; knows nothing of how any engine works. */
import { Budget, BudgetExhaustedError } from '../budget.js'
import { discover, type Discovery, type GivenCapacity } from '../discovery.js'
import { rejectionRemediation } from '../probe.js'
import { readPoolUsage, type PoolUsage } from '../probes/page-leak.js'
import { makeCanaries } from '../canaries.js'
import {
  crossingRemediation,
  findCrossings,
  leakFindings,
  plantMaterial,
  type Observed,
  type Planted,
} from '../probes/material.js'
import type { Rng } from '../rng.js'
import { calibrate, type PromptSizer } from '../sizer.js'
import {
  createTarget,
  outcomeOf,
  isAnsweredWhole,
  type CompletionRequest,
  type CompletionResult,
  type Target,
} from '../target.js'
import { AuditError, type Finding, type ProbeName, type Tenant } from '../types.js'
import type { Spend } from './hourly.js'
import type { ArmResult, RotationArm } from './rotation.js'

/** The triggers a cycle may run besides the plant, and the audit probe each one imitates. */
export const triggerProbes = {
  plant: 'canary',
  'over-capacity': 'canary',
  boundary: 'boundary',
  'stream-cut': 'abort-race',
  burst: 'concurrency',
} as const satisfies Record<string, ProbeName>
export type TriggerName = keyof typeof triggerProbes

/** `max_tokens` of the plant. */
export const plantMaxTokens = 16
/** Enough for 8 characters of a canary on any tokenizer (the leak detector's fragment). */
export const observerMaxTokens = 16
/** `max_tokens` of a prompt that must be refused (over-capacity, boundary): an endpoint that
 *  wrongly takes it answers from whatever stale pages it read, and a longer answer gives a
 *  regurgitation that starts with other text the room to reach a canary (measured on the bundled
 *  echo model, plant and read in a quiet cluster: 10 of 12 reads carried a canary at 16 tokens,
 *  12 of 12 at 32). Costs nothing on an endpoint that refuses it. */
export const readerMaxTokens = 32
/** Follow-up rounds (a plant, then an over-capacity read at once) a cycle runs at most once a
 *  prompt over the limit was answered 200 and no leak was seen yet: the rejection path is broken,
 *  and under a workload one read finds the plant's pages only now and then (an engine that hands
 *  out the pages freed last gives them to whichever request it admits next, and the read is one
 *  of several contenders), so the cycle tries again while its allowance lasts, to turn the
 *  boundary warning into a leak alert within the cycle. Each round is an independent try: at
 *  the one in five a read wins under the bench's workload, 20 rounds and the cycle's own read
 *  miss together about once in 100 cycles (0.8²¹; with 12 rounds, once in 18, and the bench
 *  saw it: the cycles after such a one have only what the pacing bucket refilled). */
export const maxFollowUpRounds = 20
/** Requests a cycle's reads may take: /v1/models, /server_info, /get_server_info, /metrics, and
 *  up to three for pool usage. */
export const maxReadRequests = 7
/** The stream cut and the burst are each drawn with this probability; one rejection-path
 *  trigger runs in every cycle. */
const triggerProbability = 0.25
/** An over-capacity prompt is this many tokens over the limit at most: prompts just over the
 *  pool cost least and read the plant's pages best (a larger prompt reads more pages that are
 *  not the plant's). */
const maxOverTokens = 32

/** One completion a cycle sends. */
export interface Step {
  readonly trigger: TriggerName
  readonly planted: Planted
  readonly label: string
  readonly maxTokens: number
  readonly stream: boolean
  readonly abortAfterChunks?: number
  /** A prompt that cannot fit: it must be refused. */
  readonly mustReject: boolean
  /** The size aimed at (tokens), for filler prompts. */
  readonly aimedTokens: number | null
  /** Upper bound of the tokens this completion costs (prompt + max_tokens). */
  readonly tokenBound: number
}

/** A cycle's plan: groups run one after another, the steps of a group at once. */
export interface CyclePlan {
  readonly groups: readonly (readonly Step[])[]
  readonly triggers: readonly TriggerName[]
  readonly cost: Spend
  /** Why a trigger (or the whole cycle) was left out, one line each. */
  readonly skipped: readonly string[]
}

/** The plant is canaries joined by spaces (every token part of a canary), as many whole ones as
 *  fit in the most characters a prompt may have while it surely fits the limit (pool or context,
 *  whichever is smaller: {@link promptTokenBound} plus `max_tokens` at most the limit), capped
 *  at {@link plantMaxCharacters}; {@link plantDefaultCharacters} where the limit is unknown. A
 *  prompt just over the limit, wrongly admitted, reads about a limit's worth of stale pages: a
 *  plant that size fills them all with canaries where they are its pages (measured on the
 *  bundled echo model with its 384-token pool and no workload: a read carried a canary in 10 of
 *  12 tries after a 340-character plant, 6 of 12 after a 160-character one). */
export const plantMaxCharacters = 400
export const plantDefaultCharacters = 200
/** The cut stream (and its fresh request) are canaries too, this many characters long: the
 *  cut's pages are read by the next request of any size, not only by a prompt over the limit. */
export const cutMinCharacters = 120
export const cutMaxCharacters = 200

/** Characters of the plant for an endpoint whose smallest known limit is `limit` tokens. */
export function plantCharacters(limit: number | null): number {
  if (limit === null) return plantDefaultCharacters
  return Math.max(0, Math.min(plantMaxCharacters, limit - plantMaxTokens - promptTokenBound('')))
}

/** A prompt made only of canaries (sharing no fragment with `taken`), the most whole ones that
 *  fit in `maxChars` characters, two at least. */
export function canaryDensePrompt(
  rng: Rng,
  maxChars: number,
  taken: readonly string[] = [],
): { readonly canaries: string[]; readonly prompt: string } {
  const canaries: string[] = []
  let chars = -1
  for (;;) {
    const [canary] = makeCanaries(rng, 1, [...taken, ...canaries])
    if (canaries.length >= 2 && chars + 1 + canary.length > maxChars) break
    canaries.push(canary)
    chars += 1 + canary.length
  }
  return { canaries, prompt: canaries.join(' ') }
}

/** The first of `canaries` (two at least) whose joined length stays within `maxChars`. */
function upTo(canaries: readonly string[], maxChars: number): string[] {
  const out: string[] = []
  let chars = -1
  for (const c of canaries) {
    if (out.length >= 2 && chars + 1 + c.length > maxChars) break
    out.push(c)
    chars += 1 + c.length
  }
  return out
}

/** Upper bound of the tokens of a prompt: byte-level tokenizers never make more tokens than
 *  UTF-8 bytes, plus a few special tokens. */
export function promptTokenBound(prompt: string): number {
  return Buffer.byteLength(prompt, 'utf8') + 4
}

/** Bound for a filler prompt sized to `tokens` by a calibrated sizer (5 % + 8 tokens of slack for
 *  calibration error). */
function fillerTokenBound(tokens: number): number {
  return Math.ceil(tokens * 1.05) + 8
}

/** Plans a cycle within `allowance` (tokens and requests, reads already paid). Random draws come
 *  from `rng`; the plan is empty (with the reason in `skipped`) when even the plant does not fit. */
export function planCycle(
  rng: Rng,
  tenants: readonly Tenant[],
  discovery: Pick<Discovery, 'poolTokens' | 'contextTokens'>,
  sizer: PromptSizer | null,
  allowance: Spend,
): CyclePlan {
  const planter = rng.pick(tenants)
  const observers = tenants.filter((t) => t !== planter)
  const ids = ['plant', 'cut', 'fresh', 'burst0', 'burst1', 'burst2', 'look']
  const tenantsFor = [planter, planter, rng.pick(observers), rng.pick(observers), planter]
  tenantsFor.push(rng.pick(observers), rng.pick(observers))
  const { poolTokens, contextTokens } = discovery
  const known = [poolTokens, contextTokens].filter((n) => n !== null)
  const limit = known.length > 0 ? Math.min(...known) : null
  // The plant and the cut stream are canary-dense whole prompts (stale pages then hold canaries
  // wherever they land), the plant as large as surely fits; the observers' own prompts are two
  // canaries each, to keep cycles cheap.
  const base = plantMaterial(rng, tenants, ids)
  const others = base.filter((p) => p.id !== 'plant').flatMap((p) => p.canaries)
  const material = base.map((p, i) => {
    if (p.id === 'plant')
      return {
        ...p,
        tenant: tenantsFor[i],
        ...canaryDensePrompt(rng, plantCharacters(limit), others),
      }
    const canaries =
      p.id === 'cut'
        ? upTo(p.canaries, rng.int(cutMinCharacters, cutMaxCharacters))
        : p.canaries.slice(0, 2)
    return { ...p, tenant: tenantsFor[i], canaries, prompt: canaries.join(' ') }
  })
  const byId = new Map(material.map((p) => [p.id, p]))
  const canaryStep = (
    id: string,
    trigger: TriggerName,
    label: string,
    extra: Partial<Step> = {},
  ): Step => {
    const planted = byId.get(id)!
    const maxTokens = id === 'plant' || id === 'cut' ? plantMaxTokens : observerMaxTokens
    return {
      trigger,
      planted,
      label,
      maxTokens,
      stream: rng.next() < 0.5,
      mustReject: false,
      aimedTokens: null,
      tokenBound: promptTokenBound(planted.prompt) + maxTokens,
      ...extra,
    }
  }
  const fillerStep = (trigger: TriggerName, tokens: number, label: string): Step =>
    readStep(rng, trigger, rng.pick(observers), sizer!, tokens, label)

  const options: Record<OptionalTrigger, () => Step[][] | string> = {
    'over-capacity': () => {
      const tokens = overCapacityTokens(rng, discovery)
      if (tokens === null || sizer === null) return 'pool and context unknown, or no token counts'
      return [[fillerStep('over-capacity', tokens, `over-capacity ${tokens} tokens`)]]
    },
    boundary: () => {
      if (limit === null || sizer === null) return 'pool and context unknown, or no token counts'
      return [[fillerStep('boundary', limit + 1, `boundary ${limit + 1} tokens`)]]
    },
    'stream-cut': () => [
      [
        canaryStep('cut', 'stream-cut', 'stream cut', {
          stream: true,
          abortAfterChunks: rng.int(1, 3),
        }),
      ],
      [canaryStep('fresh', 'stream-cut', 'fresh after a cut')],
    ],
    burst: () => [['burst0', 'burst1', 'burst2'].map((id) => canaryStep(id, 'burst', 'burst'))],
  }
  const drawn = drawTriggers(rng)
  const plant = canaryStep('plant', 'plant', 'plant', { stream: false })
  // Last, another tenant's ordinary request (the canary probe's "normal" prompt): the cheapest
  // look at the pages the cycle left, so that no cycle proves nothing.
  const look = canaryStep('look', 'plant', 'normal after the plant')
  if (plant.tokenBound + look.tokenBound > allowance.tokens || allowance.requests < 2) {
    return {
      groups: [],
      triggers: [],
      cost: { tokens: 0, requests: 0 },
      skipped: [
        `cycle skipped: the plant and a look need ${plant.tokenBound + look.tokenBound} tokens and 2 requests, the budget allows ${allowance.tokens} tokens and ${allowance.requests} requests now`,
      ],
    }
  }
  return fitTriggers(plant, look, drawn, options, allowance)
}

type OptionalTrigger = Exclude<TriggerName, 'plant'>

/** The size of an over-capacity prompt (tokens): over the pool by 2 to {@link maxOverTokens},
 *  inside the advertised context when that is larger, or over the one limit known by as much;
 *  null when neither is known. */
function overCapacityTokens(
  rng: Rng,
  discovery: Pick<Discovery, 'poolTokens' | 'contextTokens'>,
): number | null {
  const { poolTokens, contextTokens } = discovery
  const known = [poolTokens, contextTokens].filter((n) => n !== null)
  if (known.length === 0) return null
  if (poolTokens !== null && contextTokens !== null && poolTokens < contextTokens) {
    const most = Math.min(poolTokens + maxOverTokens, contextTokens - readerMaxTokens)
    return rng.int(poolTokens + 2, Math.max(poolTokens + 2, most))
  }
  return Math.min(...known) + rng.int(2, maxOverTokens)
}

/** A prompt of filler sized to `tokens` that must be refused, sent by `tenant`. */
function readStep(
  rng: Rng,
  trigger: TriggerName,
  tenant: Tenant,
  sizer: PromptSizer,
  tokens: number,
  label: string,
): Step {
  return {
    trigger,
    planted: { id: trigger, tenant, canaries: [], prompt: sizer.build(tokens, 'up') },
    label,
    maxTokens: readerMaxTokens,
    stream: rng.next() < 0.5,
    mustReject: true,
    aimedTokens: tokens,
    tokenBound: fillerTokenBound(tokens) + readerMaxTokens,
  }
}

/** Follow-up round `round` (1, 2…): a plant by one tenant (drawn), then at once an
 *  over-capacity prompt by another, as groups; null when the pool and context are unknown or
 *  there is no sizer. Its canaries share no fragment with `taken`. */
export function planFollowUp(
  rng: Rng,
  tenants: readonly Tenant[],
  discovery: Pick<Discovery, 'poolTokens' | 'contextTokens'>,
  sizer: PromptSizer | null,
  round: number,
  taken: readonly string[],
): Step[][] | null {
  const tokens = overCapacityTokens(rng, discovery)
  if (tokens === null || sizer === null) return null
  const planter = rng.pick(tenants)
  const reader = rng.pick(tenants.filter((t) => t !== planter))
  const { canaries, prompt } = canaryDensePrompt(rng, plantCharacters(limitOf(discovery)), taken)
  const plant: Step = {
    trigger: 'plant',
    planted: { id: `plant-${round}`, tenant: planter, canaries, prompt },
    label: `plant (follow-up ${round})`,
    maxTokens: plantMaxTokens,
    stream: false,
    mustReject: false,
    aimedTokens: null,
    tokenBound: promptTokenBound(prompt) + plantMaxTokens,
  }
  const label = `over-capacity ${tokens} tokens (follow-up ${round})`
  return [[plant], [readStep(rng, 'over-capacity', reader, sizer, tokens, label)]]
}

/** The triggers of one cycle, in order: one rejection-path trigger, drawn (right after the
 *  plant: the pages a wrongly admitted prompt may then read are the plant's; in every cycle, so
 *  that the incident's path is tried every cycle), then the others, each drawn with probability
 *  {@link triggerProbability}, in random order. */
function drawTriggers(rng: Rng): OptionalTrigger[] {
  const first = rng.pick<OptionalTrigger>(['over-capacity', 'boundary'])
  const later = (['stream-cut', 'burst'] as const).filter(() => rng.next() < triggerProbability)
  if (later.length === 2 && rng.next() < 0.5) later.reverse()
  return [first, ...later]
}

/** The plan: the plant, each drawn trigger that still fits in `allowance` (the others are named
 *  in `skipped` with what they would cost), and the look last (its cost is set aside first). */
function fitTriggers(
  plant: Step,
  look: Step,
  drawn: readonly OptionalTrigger[],
  options: Record<OptionalTrigger, () => Step[][] | string>,
  allowance: Spend,
): CyclePlan {
  const groups: Step[][] = [[plant]]
  const triggers: TriggerName[] = ['plant']
  const skipped: string[] = []
  let cost = { tokens: plant.tokenBound + look.tokenBound, requests: 2 }
  for (const name of drawn) {
    const planned = options[name]()
    if (typeof planned === 'string') {
      skipped.push(`${name} skipped: ${planned}`)
      continue
    }
    const steps = planned.flat()
    const tokens = steps.reduce((n, s) => n + s.tokenBound, 0)
    if (
      cost.tokens + tokens > allowance.tokens ||
      cost.requests + steps.length > allowance.requests
    ) {
      skipped.push(
        `${name} skipped: it needs ~${tokens} tokens and ${steps.length} requests, this cycle has ${allowance.tokens - cost.tokens} tokens and ${allowance.requests - cost.requests} requests left (raise --max-tokens-per-hour / --max-requests-per-hour)`,
      )
      continue
    }
    groups.push(...planned)
    triggers.push(name)
    cost = { tokens: cost.tokens + tokens, requests: cost.requests + steps.length }
  }
  groups.push([look])
  return { groups, triggers, cost, skipped }
}

// ─── Running a cycle ─────────────────────────────────────────────────────────────────────────

/** A finding with the key that identifies it across cycles (one alert per key). */
export interface WatchFinding {
  readonly key: string
  readonly finding: Finding
}

export type CycleOutcome = 'clean' | 'finding' | 'inconclusive' | 'unreachable' | 'skipped'

/** What a cycle saw and spent. */
export interface CycleReport {
  readonly outcome: CycleOutcome
  readonly findings: readonly WatchFinding[]
  readonly spent: Spend
  readonly triggers: readonly TriggerName[]
  readonly skipped: readonly string[]
  /** One line on why the cycle is inconclusive or unreachable. */
  readonly reason: string | null
  readonly discovery: Discovery | null
  readonly poolUsage: PoolUsage | null
  /** Seconds each completion took, by trigger. */
  readonly latencies: readonly { readonly trigger: TriggerName; readonly seconds: number }[]
  /** The sizer learnt this cycle (or the one given). */
  readonly sizer: PromptSizer | null
  /** What became of each completion, in the order they ended (no text: tenant names, sizes and
   *  statuses only), for the debug log. */
  readonly steps: readonly StepSummary[]
  /** The token bounds of the prompts the endpoint refused (4xx), which `spent` leaves out. */
  readonly refusedTokens: number
  /** Follow-up rounds run (a plant and an over-capacity read each; see maxFollowUpRounds). */
  readonly followUps: number
  /** The rotating arm that ran this cycle (rotation.ts), or null. */
  readonly arm: string | null
}

/** One completion of a cycle, without its text. */
export interface StepSummary {
  readonly trigger: TriggerName
  readonly tenant: string
  readonly stream: boolean
  readonly status: number | null
  readonly outcome: 'accepted' | 'rejected' | 'failed'
  readonly errorCode: string | null
  readonly promptTokens: number | null
  readonly answerCharacters: number
  /** Whether the answer carried another request's canary (a leak). */
  readonly carriesCanary: boolean
}

/** What a cycle needs from the loop. */
export interface CycleInput {
  readonly baseUrl: string
  readonly tenants: readonly Tenant[]
  readonly model: string | null
  /** Sizes the operator gave (`--context-window`, `--kv-pool-tokens`); absent: none. */
  readonly given?: GivenCapacity
  readonly rng: Rng
  readonly sizer: PromptSizer | null
  /** The endpoint pool usage was read from before (asked first). */
  readonly usageEndpoint: string | undefined
  /** What the hourly budget reserved for this cycle. */
  readonly allowance: Spend
  readonly requestTimeoutMs: number
  readonly concurrency: number
  /** The cycle's requests are all cut by then (s). */
  readonly maxSeconds: number
  /** The cycle's rotating arm (rotation.ts); absent or null: none. */
  readonly arm?: RotationArm | null
  /** Called with every completion as it ends (the watch's outage check, as the audit's). */
  readonly onCompletion?: (request: CompletionRequest, result: CompletionResult) => void
}

const calibrationTokenBound = 2 * (promptTokenBound('a '.repeat(64)) + 1)

type Seen = Observed & { readonly step: Step }

/** What a cycle's completions left: every answer with its step, latencies, tokens settled and
 *  refused. Filled as the cycle's groups, follow-ups and arm run. */
interface CycleState {
  readonly target: Target
  readonly budget: Budget
  readonly observed: Seen[]
  readonly latencies: { trigger: TriggerName; seconds: number }[]
  tokens: number
  refusedTokens: number
}

/** Runs one cycle. Never throws for what it sees: an endpoint that does not answer is an
 *  `unreachable` report. */
export async function runCycle(input: CycleInput): Promise<CycleReport> {
  const budget = new Budget({
    maxRequests: Math.max(1, input.allowance.requests),
    maxSeconds: input.maxSeconds,
    concurrency: input.concurrency,
  })
  // Meters the rotating arm's completions (it runs alone, last): it is charged what it spent.
  const armMeter = { isOn: false, tokens: 0 }
  const targetOf = (model: string | null): Target =>
    createTarget({
      baseUrl: input.baseUrl,
      model,
      tenants: input.tenants,
      budget,
      requestTimeoutMs: input.requestTimeoutMs,
      onCompletion: (request, result) => {
        if (armMeter.isOn) armMeter.tokens += tokensCharged(request, result)
        input.onCompletion?.(request, result)
      },
    })
  const read = await readEndpoint(input, budget, targetOf)
  if ('outcome' in read) return read
  const { discovery, poolUsage } = read
  const state: CycleState = {
    target: targetOf(discovery.model),
    budget,
    observed: [],
    latencies: [],
    tokens: 0,
    refusedTokens: 0,
  }
  let sizer = input.sizer
  const needsSizer = discovery.poolTokens !== null || discovery.contextTokens !== null
  if (sizer === null && needsSizer && input.allowance.tokens > calibrationTokenBound) {
    sizer = await calibrate(state.target).catch(() => null)
    state.tokens += calibrationTokenBound
  }
  const plan = planCycle(input.rng, input.tenants, discovery, sizer, {
    tokens: input.allowance.tokens - state.tokens,
    requests: input.allowance.requests - budget.requestsSent,
  })
  const base = { ...emptyReport(input.sizer), discovery, poolUsage, sizer }
  const findings = capacityFindings(discovery)
  const skipped = [...plan.skipped]
  if (plan.groups.length === 0) {
    const spent = { tokens: state.tokens, requests: budget.requestsSent }
    return { ...base, findings, skipped, outcome: 'skipped', spent, reason: plan.skipped[0] }
  }
  for (const group of plan.groups) await runGroup(state, group)
  const followUps = await runFollowUps(input, state, discovery, sizer)
  const arm = await runArm(input, state, discovery, skipped, armMeter)
  findings.push(
    ...answerFindings(state.observed, plan, discovery),
    ...availabilityFindings(state.observed),
    ...(arm?.findings ?? []),
  )
  return concludeCycle(state, {
    ...base,
    findings,
    triggers: plan.triggers,
    skipped,
    followUps,
    arm: arm === null ? null : (input.arm?.name ?? null),
  })
}

/** A report with nothing seen and nothing spent. */
function emptyReport(sizer: PromptSizer | null) {
  return {
    findings: [] as WatchFinding[],
    triggers: [] as TriggerName[],
    skipped: [] as string[],
    discovery: null,
    poolUsage: null,
    latencies: [],
    sizer,
    steps: [],
    refusedTokens: 0,
    followUps: 0,
    arm: null,
  }
}

/** Discovery and pool usage, or the cycle's report when the endpoint could not be read. */
async function readEndpoint(
  input: CycleInput,
  budget: Budget,
  targetOf: (model: string | null) => Target,
): Promise<{ discovery: Discovery; poolUsage: PoolUsage | null } | CycleReport> {
  const spent = { tokens: 0, requests: 0 }
  try {
    const discovery = await discover(targetOf(null), input.model, input.given)
    const poolUsage = await readPoolUsage(targetOf(discovery.model), input.usageEndpoint)
    return { discovery, poolUsage }
  } catch (err) {
    const at = { ...emptyReport(input.sizer), spent: { ...spent, requests: budget.requestsSent } }
    if (err instanceof AuditError && err.code === 'target_unreachable')
      return { ...at, outcome: 'unreachable', reason: err.message }
    if (err instanceof BudgetExhaustedError)
      return { ...at, outcome: 'skipped', reason: err.message }
    throw err
  }
}

/** Sends a group's steps at once; each answer joins `state` (a step the budget refused is
 *  dropped). */
async function runGroup(state: CycleState, group: readonly Step[]): Promise<void> {
  await Promise.all(
    group.map(async (step) => {
      const startedAt = performance.now()
      let result
      try {
        result = await state.target.complete({
          tenant: step.planted.tenant,
          prompt: step.planted.prompt,
          maxTokens: step.maxTokens,
          stream: step.stream,
          abortAfterChunks: step.abortAfterChunks,
          isValid: !step.mustReject,
          estimatedPromptTokens: promptTokenBound(step.planted.prompt),
        })
      } catch (err) {
        if (err instanceof BudgetExhaustedError) return
        throw err
      }
      state.latencies.push({
        trigger: step.trigger,
        seconds: (performance.now() - startedAt) / 1000,
      })
      // Settle to the count the server reported when it took the prompt; else the bound. A
      // prompt refused with a 4xx before any token was computed costs the endpoint none (its
      // bound was reserved all the same, so the hourly limit held while it was in flight).
      const reported = isAnsweredWhole(result) ? result.promptTokens : null
      if (isRefused(result)) state.refusedTokens += step.tokenBound
      else
        state.tokens +=
          reported === null ? step.tokenBound : Math.min(step.tokenBound, reported + step.maxTokens)
      state.observed.push({
        planted: step.planted,
        label: step.label,
        stream: step.stream,
        result,
        step,
      })
    }),
  )
}

/** A prompt over the limit answered 200 and no leak seen: follow-up rounds while the allowance
 *  lasts, until one shows a leak (see maxFollowUpRounds). Resolves the rounds run. */
async function runFollowUps(
  input: CycleInput,
  state: CycleState,
  discovery: Discovery,
  sizer: PromptSizer | null,
): Promise<number> {
  const { observed, budget } = state
  let followUps = 0
  while (
    followUps < maxFollowUpRounds &&
    overLimitAnswered(observed, discovery).length > 0 &&
    findCrossings(
      observed,
      observed.map((o) => o.planted),
    ).length === 0
  ) {
    const taken = observed.flatMap((o) => o.planted.canaries)
    const groups = planFollowUp(input.rng, input.tenants, discovery, sizer, followUps + 1, taken)
    if (groups === null) break
    const round = groups.flat()
    const bound = round.reduce((n, step) => n + step.tokenBound, 0)
    if (
      state.tokens + bound > input.allowance.tokens ||
      budget.requestsSent + round.length > input.allowance.requests
    )
      break
    followUps++
    for (const group of groups) await runGroup(state, group)
  }
  return followUps
}

/** The cycle's rotating arm (rotation.ts), when it fits what the allowance has left; else a
 *  line in `skipped`. Null when none ran. */
async function runArm(
  input: CycleInput,
  state: CycleState,
  discovery: Discovery,
  skipped: string[],
  meter: { isOn: boolean; tokens: number },
): Promise<ArmResult | null> {
  const arm = input.arm
  if (arm === undefined || arm === null) return null
  const cost = arm.cost(discovery)
  const left = {
    tokens: input.allowance.tokens - state.tokens,
    requests: input.allowance.requests - state.budget.requestsSent,
  }
  if (cost.tokens > left.tokens || cost.requests > left.requests) {
    skipped.push(
      `${arm.name} arm skipped: it needs ~${cost.tokens} tokens and ${cost.requests} requests, this cycle has ${left.tokens} tokens and ${left.requests} requests left`,
    )
    return null
  }
  meter.isOn = true
  try {
    const result = await arm.run({
      target: state.target,
      rng: input.rng,
      discovery,
      planted: state.observed.map((o) => o.planted),
    })
    // What the arm could not tell is said in the log line, never passed over as clean.
    skipped.push(...(result.notes ?? []).map((note) => `${arm.name} arm could not tell: ${note}`))
    return result
  } catch (err) {
    if (!(err instanceof BudgetExhaustedError)) throw err
    skipped.push(`${arm.name} arm cut: ${err.message}`)
    return null
  } finally {
    meter.isOn = false
    state.tokens += Math.min(cost.tokens, meter.tokens)
  }
}

/** What one completion of an arm costs the hourly budget: a prompt the endpoint refused (4xx)
 *  none, as the cycle's own; else the prompt tokens it reported plus `max_tokens`, never more
 *  than the bound (UTF-8 bytes + 4, or the sender's estimate, plus `max_tokens`). */
export function tokensCharged(request: CompletionRequest, result: CompletionResult): number {
  if (isRefused(result)) return 0
  const bound =
    (request.estimatedPromptTokens ?? promptTokenBound(request.prompt)) + request.maxTokens
  const reported = result.status === 200 ? result.promptTokens : null
  return reported === null ? bound : Math.min(bound, reported + request.maxTokens)
}

/** The cycle's report from what it saw: its steps without text, and its outcome. */
function concludeCycle(
  state: CycleState,
  base: Omit<CycleReport, 'outcome' | 'reason' | 'spent' | 'latencies' | 'steps' | 'refusedTokens'>,
): CycleReport {
  const { observed } = state
  const carriers = new Set(
    findCrossings(
      observed,
      observed.map((o) => o.planted),
    ).map((c) => c.observed),
  )
  const steps = observed.map(({ step, result }, i): StepSummary => ({
    trigger: step.trigger,
    tenant: step.planted.tenant.name,
    stream: step.stream,
    status: result.status,
    outcome: outcomeOf(result),
    errorCode: result.errorCode,
    promptTokens: result.promptTokens,
    answerCharacters: result.text.length,
    carriesCanary: carriers.has(observed[i]),
  }))
  const spent = { tokens: state.tokens, requests: state.budget.requestsSent }
  const { latencies, refusedTokens } = state
  const result = { ...base, spent, latencies, steps, refusedTokens }
  const completions = observed.map((o) => o.result)
  if (
    completions.length > 0 &&
    completions.every((r) => r.status === null && r.failure === 'network')
  ) {
    const reason = completions[0].errorMessage ?? 'no answer to any completion'
    return { ...result, outcome: 'unreachable', reason }
  }
  const reason = inconclusiveReason(observed)
  const { findings } = base
  // Failing requests are a finding, but a cycle that could not check isolation stays
  // inconclusive (isolation was not checked: no successful cycle).
  if (
    findings.some((f) => f.finding.probe !== 'availability') ||
    (reason === null && findings.length > 0)
  )
    return { ...result, outcome: 'finding', reason: null }
  return { ...result, outcome: reason === null ? 'clean' : 'inconclusive', reason }
}

/** A cycle proves something only when the plant was taken and at least one other tenant's
 *  answer was read whole. A key the endpoint refused (401, 403) is named first: it explains
 *  whatever else is missing, and only the operator can fix it. */
function inconclusiveReason(
  observed: readonly (Observed & { readonly step: Step })[],
): string | null {
  const refused = observed.find((o) => o.result.status === 401 || o.result.status === 403)
  if (refused)
    return `${refused.planted.tenant.name}'s key was refused (HTTP ${refused.result.status}): check the key and that the endpoint has this tenant`
  const plant = observed.find((o) => o.step.trigger === 'plant')
  if (!plant || outcomeOf(plant.result) !== 'accepted')
    return `the plant was not accepted (${plant?.result.status ?? plant?.result.failure ?? 'not sent'})`
  const planter = plant.planted.tenant.name
  const isObserved = observed.some(
    (o) =>
      o.planted.tenant.name !== planter &&
      (isAnsweredWhole(o.result) || outcomeOf(o.result) === 'rejected'),
  )
  return isObserved ? null : "no other tenant's answer was read whole"
}

/** A refusal of the request itself (HTTP 4xx, not auth or rate limit): the endpoint computed no
 *  token of it. */
function isRefused(result: CompletionResult): boolean {
  return result.status !== null && result.status >= 400 && outcomeOf(result) === 'rejected'
}

/** Server errors: HTTP 500 and 502, or an error event inside a 200 stream that is not a
 *  refusal. Not 503 or 429 (an endpoint shedding load says so on purpose), not timeouts or
 *  connection errors (a busy or restarting endpoint: `unreachable` says that). */
function isServerError(result: CompletionResult): boolean {
  if (result.status === 500 || result.status === 502) return true
  return (
    result.status === 200 && result.failure === 'stream_error' && outcomeOf(result) === 'failed'
  )
}

/** Valid completions (every one but the prompts that must be refused) failing with server
 *  errors, or unanswered within the request timeout while the endpoint answered another request
 *  of the cycle (it is up: the valid path hangs): at least 2, and at least half of those sent in
 *  the cycle. An endpoint that fails valid requests is itself a finding (as the audit's
 *  `availability`): a failing decode or transfer path is where stale pages get read, and a fault
 *  may show as failures rather than leaks (`early-release` with guards off: the decode pool's
 *  free list breaks, and the bench's watch saw its plant and look time out, or one time out and
 *  one fail with 500, while the over-capacity prompt was refused with 400 at once). */
export function availabilityFindings(
  observed: readonly (Observed & { readonly step: Pick<Step, 'mustReject'> })[],
): WatchFinding[] {
  const valid = observed.filter((o) => !o.step.mustReject)
  const isAnswering = observed.some((o) => o.result.status !== null)
  const failed = valid.filter(
    (o) => isServerError(o.result) || (isAnswering && o.result.failure === 'timeout'),
  )
  if (failed.length < 2 || failed.length * 2 < valid.length) return []
  const byCause: Record<string, number> = {}
  for (const { result } of failed) {
    const cause =
      result.status === null
        ? 'no answer within the timeout'
        : `HTTP ${result.status}${result.errorCode === null ? '' : ` ${result.errorCode}`}`
    byCause[cause] = (byCause[cause] ?? 0) + 1
  }
  return [
    {
      key: 'warning:availability',
      finding: {
        probe: 'availability',
        verdict: 'warning',
        severity: 'high',
        title: `${failed.length} of ${valid.length} valid requests of a cycle failed (server errors, or no answer while the endpoint answered others)`,
        evidence: { numValidSent: valid.length, numFailed: failed.length, failedBy: byCause },
        remediation:
          "Find why the endpoint fails requests it should answer (its workers' logs at this time): " +
          'a failing decode or transfer path is where stale pages get read; run `kvfence audit` ' +
          'against it before trusting its answers again.',
      },
    },
  ]
}

/** Advertising more context than the pool holds: the incident's misconfiguration. */
function capacityFindings(discovery: Discovery): WatchFinding[] {
  const { contextTokens, poolTokens } = discovery
  if (contextTokens === null || poolTokens === null || contextTokens <= poolTokens) return []
  return [
    {
      key: 'warning:capacity',
      finding: {
        probe: 'capacity',
        verdict: 'warning',
        severity: 'high',
        title: `advertised context ${contextTokens} tokens > effective KV pool ${poolTokens} tokens`,
        evidence: {
          advertisedContextTokens: contextTokens,
          effectivePoolTokens: poolTokens,
          advertisedSources: discovery.advertised,
          poolSources: discovery.pools,
        },
        remediation:
          `Lower the advertised context window to at most ${poolTokens} tokens, or enlarge every ` +
          `prefill and decode pool to ${contextTokens}; this is the incident's misconfiguration.`,
      },
    },
  ]
}

/** Leaks (any answer carrying another request's canary, by the audit's detector) and prompts
 *  that cannot fit but were answered 200. */
function answerFindings(
  observed: readonly (Observed & { readonly step: Step })[],
  plan: CyclePlan,
  discovery: Discovery,
): WatchFinding[] {
  const planted = observed.map((o) => o.planted)
  const crossings = findCrossings(observed, planted)
  const out: WatchFinding[] = []
  const byTrigger = new Map<TriggerName, typeof crossings>()
  for (const c of crossings) {
    const trigger = (c.observed as Observed & { step: Step }).step.trigger
    byTrigger.set(trigger, [...(byTrigger.get(trigger) ?? []), c])
  }
  for (const [trigger, list] of byTrigger) {
    const probe = triggerProbes[trigger]
    const summary = { trigger, triggers: plan.triggers }
    for (const finding of leakFindings(probe, list, planted, summary, crossingRemediation)) {
      const e = finding.evidence
      out.push({
        key: `leak:${probe}:${String(e.victimTenant)}->${String(e.observerTenant)}`,
        finding,
      })
    }
  }
  const limit = limitOf(discovery)
  const accepted = overLimitAnswered(observed, discovery)
  if (accepted.length > 0) {
    out.push({
      key: 'warning:boundary',
      finding: {
        probe: 'boundary',
        verdict: 'warning',
        severity: 'high',
        title: `answered 200 to ${accepted.length} prompt(s) larger than the ${limit}-token limit`,
        evidence: {
          limitTokens: limit,
          requests: accepted.map((o) => ({
            label: o.label,
            aimedTokens: o.step.aimedTokens,
            reportedPromptTokens: o.result.promptTokens,
            status: o.result.status,
          })),
        },
        remediation: rejectionRemediation,
      },
    })
  }
  return out
}

/** The smallest of the pool and the context the endpoint reports (Infinity when neither). */
function limitOf(discovery: Pick<Discovery, 'poolTokens' | 'contextTokens'>): number {
  return Math.min(...[discovery.poolTokens, discovery.contextTokens].filter((n) => n !== null))
}

/** The prompts that must be refused but were answered 200. A reported count at the limit says
 *  our sizing was off by a few tokens, not that a prompt over it was taken (a placeholder's count
 *  would be far below). */
function overLimitAnswered(
  observed: readonly (Observed & { readonly step: Step })[],
  discovery: Pick<Discovery, 'poolTokens' | 'contextTokens'>,
): (Observed & { readonly step: Step })[] {
  const limit = limitOf(discovery)
  return observed.filter((o) => {
    if (!o.step.mustReject || outcomeOf(o.result) !== 'accepted') return false
    const reported = o.result.promptTokens
    return !(reported !== null && reported <= limit && reported >= limit - 4)
  })
}
