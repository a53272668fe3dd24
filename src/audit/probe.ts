/** What every probe is given and returns. A probe sends requests only through its `Target`
 *  (which spends the `Budget`) and always returns at least one finding. */
import type { Budget } from './budget.js'
import type { Discovery } from './discovery.js'
import type { PlanInput, PlannedRequests } from './plan.js'
import type { PromptCeiling } from './prompt-ceiling.js'
import type { PromptSizer } from './sizer.js'
import type { Target } from './target.js'
import type { FindingClass } from './classes.js'
import type { Finding, FindingControls, ProbeName } from './types.js'

export interface ProbeContext {
  readonly seed: number
  /** How many over-capacity prompts the canary probe sends. */
  readonly overCapacityAttempts: number
  /** What the endpoint said about itself (read once before the probes run). */
  readonly discovery: Discovery
  /** How large a request may be where the endpoint reports no limit (prompt-ceiling.ts); absent
   *  (watch): {@link PromptCeiling}'s first step. */
  readonly ceiling?: PromptCeiling | null
  /** Token calibration, done once on first use; null when the endpoint gave no token counts. */
  sizer(): Promise<PromptSizer | null>
  /** `--aggressive`: probes may send bodies that could disturb a shared engine (cache-fields'
   *  engine-internal fields). Absent: false. */
  readonly isAggressive?: boolean
  /** One progress line for the console. */
  log(line: string): void
}

/** A probe, as registered in probes/index.ts (the one registry: see there how to add one). Its
 *  `run` sends, then judges what came back, in separate functions of its module. */
export interface Probe {
  readonly name: ProbeName
  /** One line for `--list-probes`: what it sends and what it concludes. */
  readonly description: string
  /** The class of its findings (classes.ts) unless a finding names its own: for a clean or
   *  inconclusive finding, the kind of harm it looks for. */
  readonly class: FindingClass
  /** The controls its findings map to (controls.ts): OWASP AISVS ids and kvfence's guards. */
  readonly controls: FindingControls
  /** True when it sizes prompts in tokens: the audit then calibrates token counts before it runs
   *  (the calibration completions count in the plan). Absent: false. */
  readonly isSizing?: boolean
  /** Throws `BudgetExhaustedError` only when it has nothing at all to report. */
  run(target: Target, budget: Budget, context: ProbeContext): Promise<Finding[]>
  /** What `run` would send at most (`kvfence audit --plan` and its budget share), from the flags
   *  and discovery's numbers alone. */
  plan(input: PlanInput): PlannedRequests[]
}

/** OWASP AISVS 5.5.5: KV-cache partitioning by authenticated session/tenant identity (the
 *  requirement probes about one tenant's KV-cache data reaching another name in `controls`). */
export const aisvsKvPartitioning = '5.5.5'

/** Advice shared by findings that concern the rejection path. */
export const rejectionRemediation =
  'Reject every prompt whose token count (plus max_tokens) exceeds the context window or the ' +
  'smallest KV pool of any prefill or decode worker with HTTP 400 context_length_exceeded at ' +
  'admission; never substitute a placeholder or forward a rejected request to decode. ' +
  'Disaggregated SGLang: upgrade to v0.5.22 or later.'

export const inconclusiveRemediation =
  'Re-run with a larger budget (--max-requests, --max-seconds); where the endpoint does not ' +
  'report its limits, give them (--context-window, --kv-pool-tokens); check that both tenant ' +
  'keys are valid and that the endpoint serves POST /v1/completions with usage.prompt_tokens, ' +
  'or pass --model. Until then isolation is not proven.'
