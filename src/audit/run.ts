/** `runAudit`: validates options, reads what the endpoint says about itself, runs the chosen
 *  probes within the budget and returns the report. Never throws for what it finds; throws
 *  `AuditError` only when it cannot audit at all: bad options, target unreachable, a key refused,
 *  `--model` not served, a report that cannot be resumed, or a target that answered none of this
 *  run's valid completions whole (`no_completion_answered`, with the report of what was seen
 *  attached in state `tool-error`): then nothing was audited, and an audit that returned a report
 *  would read as "no leak observed". An interrupted audit (its `signal` aborted) returns its
 *  report in state `interrupted`; `resume` continues one from what it had established. */
import { randomInt } from 'node:crypto'
import { Budget, BudgetExhaustedError, maxAuditSeconds, minAuditSeconds } from './budget.js'
import { discover, type Discovery, type GivenCapacity } from './discovery.js'
import { controlsOf } from './controls.js'
import {
  availabilityFindings,
  checkModelServed,
  noAnswerMessage,
  NoAnswerWatch,
  isOutageFinding,
  readHealth,
  sendAnswerCheck,
  answerCheckTokens,
  type HealthReading,
  defaultFailOn,
  failsGate,
  asTerms,
  type FailOnTerm,
} from './gate.js'
import { withClass } from './classes.js'
import { Ledger } from './ledger.js'
import { OutageWatch, type SentRequest } from './outage.js'
import { PromptCeiling } from './prompt-ceiling.js'
import type { ProbeContext } from './probe.js'
import { inconclusiveRemediation } from './probe.js'
import { probes } from './probes/index.js'
import {
  checkResumedModel,
  resumedFrom,
  resumePoint,
  type ResumePoint,
  type ResumeSource,
} from './resume.js'
import { calibrate, calibrationWords, type PromptSizer } from './sizer.js'
import {
  probePlan,
  shareBudget,
  totalPlan,
  type AuditPlan,
  type PlanInput,
  type ProbePlan,
} from './plan.js'
import {
  createTarget,
  type CompletionRequest,
  type CompletionResult,
  type Target,
} from './target.js'
import {
  AuditError,
  probeNames,
  type AuditReport,
  type AuditState,
  type Finding,
  type ProbeName,
  type ProbeRun,
  type Tenant,
} from './types.js'

export interface AuditOptions {
  /** Base URL of any OpenAI-compatible endpoint (a trailing `/v1` is accepted). */
  readonly target: string
  /** At least two tenants with distinct names; the first is the victim, the second the observer. */
  readonly tenants: readonly Tenant[]
  /** Model id; default: the first one `/v1/models` lists. */
  readonly model?: string
  /** Default: all, in the order of `probeNames`. */
  readonly probes?: readonly ProbeName[]
  /** uint32; default: random (and reported, so a run can be repeated), or the resumed report's. */
  readonly seed?: number
  readonly maxRequests?: number // default 300
  readonly maxSeconds?: number // default 300
  readonly concurrency?: number // default 4
  /** In flight at most for probes that ramp (concurrency): default 16, or `concurrency` when that
   *  is given (an explicit cap is honoured everywhere unless this raises it). */
  readonly maxConcurrency?: number
  readonly requestTimeoutMs?: number // default 60_000, cut shorter by the deadline
  readonly overCapacityAttempts?: number // default 6
  /** Send bodies that could disturb a shared engine (cache-fields' engine-internal fields), and,
   *  where the endpoint reports no limit, requests past the prompt ceiling's fixed cap
   *  (prompt-ceiling.ts) and an unbounded `max_tokens` (error-handling); default false. */
  readonly isAggressive?: boolean
  /** `--context-window`: the endpoint's context window (tokens), used in place of what it reports
   *  (a disagreement is reported). */
  readonly contextWindow?: number
  /** `--kv-pool-tokens`: the endpoint's smallest KV pool (tokens), likewise. */
  readonly kvPoolTokens?: number
  /** Progress, one line at a time (probe started, probe details, probe finished). */
  readonly onProgress?: (event: ProgressEvent) => void
  /** Aborting it interrupts the audit (its reason, `'SIGINT'` or `'SIGTERM'`, is reported): no
   *  request is sent after, those in flight are cut, the probe running and those after it stay
   *  pending, and `runAudit` resolves with the report in state `interrupted` at once. */
  readonly signal?: AbortSignal
  /** Called with the report so far (state `running`) after each probe ends, and awaited: the CLI
   *  writes it, so that an audit killed outright leaves what it had established. */
  readonly onReport?: (report: AuditReport) => Promise<void>
  /** A report of an earlier run of this same audit to continue (`--resume`): its probes that ran
   *  to their end are kept, the others run (resume.ts). Its seed is used unless `seed` is given
   *  (then it must be the same). */
  readonly resume?: ResumeSource
}

export type ProgressEvent =
  | { readonly type: 'probe-start'; readonly probe: ProbeName }
  | { readonly type: 'probe-log'; readonly probe: ProbeName; readonly message: string }
  | { readonly type: 'probe-end'; readonly probe: ProbeName; readonly findings: readonly Finding[] }

export const auditDefaults = Object.freeze({
  maxRequests: 800,
  maxSeconds: 300,
  concurrency: 4,
  maxConcurrency: 16,
  requestTimeoutMs: 60_000,
  overCapacityAttempts: 6,
})

/** One probe's run and findings, and whether it ran to its end (see {@link runProbe}). */
interface ProbeOutcome {
  readonly run: ProbeRun
  readonly findings: Finding[]
  readonly isComplete: boolean
}

export async function runAudit(options: AuditOptions): Promise<AuditReport> {
  const session = await openSession(options)
  await runProbes(session)
  const { config, budget, outcomes } = session
  if (session.outage.isDown() && !budget.isStopped) {
    markNotRun(session, 'not run: the endpoint went down before it (availability)')
  }
  if (budget.isStopped) {
    const by = session.interruptedBy()
    markNotRun(session, `not run: the audit was interrupted${by ? ` (${by})` : ''} before it`)
    return reportOf(session, 'interrupted')
  }
  const healthReading = await checkAvailability(session)
  if (budget.isStopped) return reportOf(session, 'interrupted')
  const message = noAnswerMessage(
    session.ledger.answerSummary(),
    config.baseUrl,
    budget,
    healthReading,
  )
  if (message !== null) {
    // Nothing this run did was audited: its probes stay pending, so --resume runs them again.
    const kept = new Set(session.point?.kept ?? [])
    for (const [name, outcome] of outcomes)
      if (!kept.has(name)) outcomes.set(name, { ...outcome, isComplete: false })
    const failed = {
      ...reportOf(session, 'tool-error'),
      toolError: { code: 'no_completion_answered' as const, message },
    }
    throw new AuditError('no_completion_answered', message, failed)
  }
  return reportOf(session, 'finished')
}

/** One audit in progress: what it was given and read before its probes, and what they found. */
interface Session {
  readonly options: AuditOptions
  readonly config: AuditConfig
  readonly point: ResumePoint | null
  readonly seed: number
  readonly startedAt: Date
  readonly budget: Budget
  readonly ledger: Ledger
  readonly outage: OutageWatch
  readonly discovery: Discovery
  readonly target: Target
  readonly ceiling: PromptCeiling
  /** `/health` as read before any probe, so that one that turns bad during the audit is seen. */
  readonly healthBefore: HealthReading
  /** The read of `/health` the first failed valid completion asked for (null: none failed). */
  readonly healthOnFailure: { value: Promise<HealthReading> | null }
  readonly outcomes: Map<ProbeName, ProbeOutcome>
  /** Findings of the audit's own checks (availability), after the probes'. */
  readonly extraFindings: Finding[]
  interruptedBy(): 'SIGINT' | 'SIGTERM' | undefined
}

/** Validates the options, wires the budget, the ledger and the watches, reads what the endpoint
 *  says about itself, checks the keys and the model, and keeps what a resumed report
 *  established. */
async function openSession(options: AuditOptions): Promise<Session> {
  const startedAt = new Date()
  const config = validate(options)
  const point =
    options.resume === undefined
      ? null
      : resumePoint(options.resume, {
          baseUrl: config.baseUrl,
          tenants: config.tenants.map((t) => t.name),
          probes: config.probes,
          seed: options.seed ?? null,
          model: config.model,
        })
  const budget = new Budget(config.budget, startedAt.getTime(), point?.origin)
  const interruptedBy = (): 'SIGINT' | 'SIGTERM' | undefined => {
    const reason: unknown = options.signal?.reason
    return reason === 'SIGINT' || reason === 'SIGTERM' ? reason : undefined
  }
  if (options.signal?.aborted) budget.stop()
  options.signal?.addEventListener('abort', () => budget.stop(), { once: true })

  // The first valid completion that fails asks /health once: a health check that says all is
  // well while requests fail keeps a load balancer sending traffic here.
  const healthOnFailure: Session['healthOnFailure'] = { value: null }
  // A target seen to serve no completion (a static file server, a wrong path prefix, a closed
  // port) sends nothing more: the gate's tool error says why, after a few requests.
  const notServed = new NoAnswerWatch()
  const ledger = new Ledger({
    onRecord: (isValid, result) => {
      if (notServed.observe(isValid, result)) budget.close()
    },
    onFailure: () => {
      healthOnFailure.value ??= readHealth(target)
    },
  })
  ledger.addEarlier(point?.completions ?? [])
  // Requests grow only from answered ones where no limit is known, and an endpoint that goes
  // down for good stops the audit (prompt-ceiling.ts, outage.ts).
  let ceiling: PromptCeiling | null = null
  const outage = new OutageWatch()
  const targetOptions = {
    baseUrl: config.baseUrl,
    tenants: config.tenants,
    budget,
    requestTimeoutMs: config.requestTimeoutMs,
    ledger,
    onCompletion: (request: CompletionRequest, result: CompletionResult) => {
      const isValid = request.isValid ?? true
      const promptTokens = result.promptTokens ?? request.estimatedPromptTokens ?? null
      // With the time spent (as the ledger reads a cut: ledger.ts), a missing answer is ours.
      ceiling?.observe(isValid, promptTokens, result, budget.remainingMs === 0)
      const sent = sentRequest(request, result, promptTokens, ledger.currentProbe)
      if (outage.observe(isValid, sent, result)) budget.close()
    },
  }
  const discovery = await discover(
    createTarget({ ...targetOptions, model: null }),
    config.model,
    config.given,
  )
  if (point !== null) checkResumedModel(point, options.resume!.source, discovery.model)
  const target = createTarget({ ...targetOptions, model: discovery.model })
  ceiling = new PromptCeiling(knownLimitTokens(discovery), options.isAggressive === true)
  await checkKeys(target)
  await checkModelServed(target, discovery, config.model)
  const healthBefore = await readHealth(target)
  const outcomes = new Map<ProbeName, ProbeOutcome>()
  for (const run of point?.probeRuns ?? []) {
    // A version-1 report's findings have no class: they get it as this audit would give it.
    const findings = point!.findings.filter((f) => f.probe === run.probe).map((f) => withClass(f))
    outcomes.set(run.probe, { run, findings, isComplete: true })
  }
  return {
    options,
    config,
    point,
    seed: point?.seed ?? config.seed,
    startedAt,
    budget,
    ledger,
    outage,
    discovery,
    target,
    ceiling,
    healthBefore,
    healthOnFailure,
    outcomes,
    extraFindings: [],
    interruptedBy,
  }
}

/** The report as it stands, in `state`. */
function reportOf(session: Session, state: AuditState): AuditReport {
  const { config, outcomes, point, budget, startedAt } = session
  const findings = config.probes.flatMap((name) => outcomes.get(name)?.findings ?? [])
  const interruptedBy = session.interruptedBy()
  return {
    schemaVersion: 2,
    tool: 'kvfence audit',
    target: config.baseUrl,
    model: session.discovery.model,
    startedAt: point?.startedAt ?? startedAt.toISOString(),
    durationMs: Date.now() - budget.timeOrigin,
    seed: session.seed,
    budget: config.budget,
    requestsSent: budget.requestsSent + (point?.origin.requestsBefore ?? 0),
    probeRuns: config.probes.flatMap((name) => outcomes.get(name)?.run ?? []),
    findings: [...findings, ...session.extraFindings],
    completions: session.ledger.timeline(),
    tenants: config.tenants.map((t) => t.name),
    probes: config.probes,
    state,
    pendingProbes: config.probes.filter((name) => outcomes.get(name)?.isComplete !== true),
    ...(state === 'interrupted' && interruptedBy ? { interruptedBy } : {}),
    ...(point === null ? {} : { resumed: resumedFrom(point, startedAt) }),
  }
}

/** Runs the chosen probes not kept from a resumed report, in the registry's order, each with its
 *  share of the budget held back for the ones after it; a report after each. */
async function runProbes(session: Session): Promise<void> {
  const { config, discovery, budget, ledger, outcomes, options } = session
  let sizing: Promise<PromptSizer | null> | null = null
  const sizer = () => (sizing ??= calibrate(session.target))
  // Each probe's share, held back for it while the probes before it run.
  const toRun = config.probes.filter((name) => !outcomes.has(name))
  const shares = probeShares(config, discovery, toRun, options.isAggressive === true)
  for (const name of config.probes) {
    if (outcomes.has(name)) continue // kept from the resumed report
    if (budget.isStopped) break
    const later = toRun.slice(toRun.indexOf(name) + 1).map((n) => shares.get(n)!)
    budget.holdBack(
      later.reduce((s, x) => s + x.requests, 0),
      later.reduce((s, x) => s + x.ms, 0),
    )
    const outcome = await runProbe(name, session.target, budget, ledger, {
      seed: session.seed,
      overCapacityAttempts: config.overCapacityAttempts,
      isAggressive: options.isAggressive === true,
      discovery,
      ceiling: session.ceiling,
      sizer,
      emit: options.onProgress ?? (() => {}),
      interruptedBy: session.interruptedBy,
    })
    outcomes.set(name, outcome)
    if (budget.isStopped || budget.isClosed) break
    await options.onReport?.(reportOf(session, 'running'))
  }
  budget.holdBack(0, 0)
  ledger.setProbe(null)
}

/** Every chosen probe without an outcome gets an inconclusive one titled `title`. */
function markNotRun(session: Session, title: string): void {
  for (const name of session.config.probes) {
    if (session.outcomes.has(name)) continue
    const finding = notRunFinding(name, title)
    session.outcomes.set(name, {
      run: emptyRun(name, finding.title),
      findings: [finding],
      isComplete: false,
    })
  }
}

/** The audit's own availability checks after its probes: an answer check when no probe sent a
 *  valid completion, `/health` read again, and the outage and availability findings. Returns the
 *  health read the first failure asked for (null: none failed). */
async function checkAvailability(session: Session): Promise<HealthReading | null> {
  const { target, ledger, outage, healthBefore, healthOnFailure } = session
  // Probes that sent no valid completion (capacity reads discovery only) prove nothing about
  // whether the target answers one: one short completion of the audit's own does.
  if (ledger.answerSummary().numExpected === 0) await sendAnswerCheck(target)
  if (ledger.validSummary().numFailed > 0) healthOnFailure.value ??= readHealth(target)
  const healthReading = healthOnFailure.value === null ? null : await healthOnFailure.value
  if (session.budget.isStopped) return healthReading
  const healthAfter =
    healthBefore.status === 200 || outage.isDown() ? await readHealth(target) : null
  const outageFinding = outage.finding({
    before: healthBefore.status === 'budget' ? null : healthBefore.status,
    after: healthAfter === null || healthAfter.status === 'budget' ? null : healthAfter.status,
  })
  session.extraFindings.push(
    ...[
      ...(outageFinding === null ? [] : [outageFinding]),
      ...availabilityFindings(ledger, healthReading),
    ].map((f) => withClass({ ...f, controls: controlsOf(f.probe) })),
  )
  return healthReading
}

/** Runs one probe within the deadline (abandoned {@link probeGraceMs} after it, or at once when
 *  the audit is interrupted) and records its run. It ran to its end (`isComplete`) when it
 *  returned its findings with the budget not spent: a probe stopped by the budget, abandoned,
 *  interrupted or failed is run again by `--resume`. */
async function runProbe(
  name: ProbeName,
  target: Target,
  budget: Budget,
  ledger: Ledger,
  context: Omit<ProbeContext, 'log'> & {
    readonly emit: (event: ProgressEvent) => void
    readonly interruptedBy: () => string | undefined
  },
): Promise<ProbeOutcome> {
  const { emit } = context
  const probeStartedAt = performance.now()
  const requestsBefore = budget.requestsSent
  const refusedBefore = budget.numRefused
  const outOfTimeBefore = budget.numEndedOutOfTime
  budget.takeMostInFlight()
  emit({ type: 'probe-start', probe: name })
  ledger.setProbe(name)
  let isAbandoned = false
  const probeContext: ProbeContext = {
    seed: context.seed,
    overCapacityAttempts: context.overCapacityAttempts,
    isAggressive: context.isAggressive,
    discovery: context.discovery,
    ceiling: context.ceiling,
    sizer: context.sizer,
    log: (message) => {
      if (!isAbandoned) emit({ type: 'probe-log', probe: name, message })
    },
  }
  let findings: Finding[]
  let hasReturned = false
  try {
    const outcome = await withinDeadline(probes[name].run(target, budget, probeContext), budget)
    if (outcome === 'overran' || outcome === 'interrupted') {
      isAbandoned = true
      findings = [
        outcome === 'overran'
          ? overranProbe(name, budget)
          : notRunFinding(
              name,
              `not run to the end: the audit was interrupted${context.interruptedBy() ? ` (${context.interruptedBy()})` : ''}`,
            ),
      ]
    } else {
      findings = outcome
      if (findings.length === 0) throw new Error('probe returned no finding')
      hasReturned = true
    }
  } catch (err) {
    findings = [failedProbe(name, err)]
  }
  findings = findings.map((f) =>
    withClass({ ...withReason(f, ledger.unansweredReason(name)), controls: controlsOf(f.probe) }),
  )
  // Stopped by its share (a request of its was refused), a probe that could not tell is run again
  // by --resume; one that told, or that spent exactly its share and could not tell anyway, is
  // done. Its time was up only if a request of its ended then (capacity sends none, yet its
  // sliver of the time was often spent by discovery on a busy host: "not proven clean").
  const isComplete =
    hasReturned &&
    !budget.isStopped &&
    (budget.remainingMs > 0 || budget.numEndedOutOfTime === outOfTimeBefore) &&
    (budget.numRefused === refusedBefore || findings.every((f) => f.verdict !== 'inconclusive'))
  // A probe left pending (its time ran out, or the audit stopped) is not proven clean: what it
  // exercised before the cut is kept in the title, the verdict is inconclusive (a clean verdict
  // beside "pending" was reported against transformers serve: 0 of 8 in its last burst).
  if (hasReturned && !isComplete) findings = findings.map((f) => notProvenClean(f, budget))
  const run: ProbeRun = {
    probe: name,
    durationMs: Math.round(performance.now() - probeStartedAt),
    requestsSent: budget.requestsSent - requestsBefore,
    completions: ledger.counts(name),
    inconclusiveReasons: findings.filter((f) => f.verdict === 'inconclusive').map((f) => f.title),
    concurrencyReached: budget.takeMostInFlight(),
  }
  if (!budget.isStopped) emit({ type: 'probe-end', probe: name, findings })
  return { run, findings, isComplete }
}

/** The smallest limit the endpoint (or the operator) gave for one request's tokens, or null. */
export function knownLimitTokens(discovery: Discovery): number | null {
  const known = [discovery.contextTokens, discovery.poolTokens, discovery.inputLimitTokens].filter(
    (n): n is number => n !== null,
  )
  return known.length === 0 ? null : Math.min(...known)
}

/** One completion as the outage watch keeps it: sizes and fate, no text. */
function sentRequest(
  request: CompletionRequest,
  result: CompletionResult,
  promptTokens: number | null,
  probe: ProbeName | null,
): SentRequest {
  return {
    requestNumber: result.requestNumber,
    atMs: result.atMs,
    probe,
    tenant: request.tenant.name,
    promptTokens,
    promptChars: request.prompt.length,
    maxTokens: request.maxTokens,
    isStream: request.stream,
    status: result.status,
    failure: result.failure,
  }
}

/** The run of a probe that never started (the audit was interrupted before it). */
function emptyRun(probe: ProbeName, reason: string): ProbeRun {
  return {
    probe,
    durationMs: 0,
    requestsSent: 0,
    completions: { sent: 0, answered: 0, refused: 0, failed: 0, cut: 0 },
    inconclusiveReasons: [reason],
    concurrencyReached: 0,
  }
}

/** An inconclusive finding for a probe the audit did not let run (to its end). */
function notRunFinding(probe: ProbeName, title: string): Finding {
  return withClass({
    probe,
    verdict: 'inconclusive',
    severity: 'medium',
    title,
    evidence: {},
    remediation:
      'Continue the audit with --resume and its JSON report, or run it again. ' +
      inconclusiveRemediation,
    controls: controlsOf(probe),
  })
}

/** `kvfence audit --plan`: what {@link runAudit} with these options would send, per probe, and
 *  what its tokens cost at `pricePerMillionTokens` (default 0: not priced). With `resume`, what
 *  the resumed run would send: its pending probes only (the others are listed as kept); a report
 *  of another audit throws `cannot_resume` as `runAudit` does. Sends discovery's
 *  reads only (`GET /v1/models`, server info, `/metrics`: the sizes of several probes follow the
 *  pool and context they report), never a completion. Throws `AuditError` as `runAudit` does
 *  for bad options or an unreachable target. */
export async function planAudit(
  options: AuditOptions & { readonly pricePerMillionTokens?: number },
): Promise<AuditPlan> {
  const config = validate(options)
  const price = options.pricePerMillionTokens ?? 0
  if (!(Number.isFinite(price) && price >= 0))
    throw new AuditError('invalid_options', `price per million tokens must be ≥ 0, got ${price}`)
  // With --resume: the report must be of this audit (as runAudit checks), and only the probes
  // it did not run to their end are planned.
  const point =
    options.resume === undefined
      ? null
      : resumePoint(options.resume, {
          baseUrl: config.baseUrl,
          tenants: config.tenants.map((t) => t.name),
          probes: config.probes,
          seed: options.seed ?? null,
          model: config.model,
        })
  const kept = point?.kept ?? []
  const planned = config.probes.filter((p) => !kept.includes(p))
  const budget = new Budget(config.budget)
  const discoveryTarget = createTarget({
    baseUrl: config.baseUrl,
    tenants: config.tenants,
    budget,
    requestTimeoutMs: config.requestTimeoutMs,
    model: null,
  })
  const discovery = await discover(discoveryTarget, config.model, config.given)
  if (point !== null) checkResumedModel(point, options.resume!.source, discovery.model)
  // A plan of an audit that would end at once is the audit's tool error: a refused key as the
  // audit says it; a --model /v1/models does not list, without the check completion the audit
  // would send (a plan sends none).
  await checkKeys(discoveryTarget)
  const listed = discovery.modelsListed
  const isModelUnlisted =
    config.model !== null && listed.length > 0 && !listed.includes(config.model)
  if (isModelUnlisted) {
    throw new AuditError(
      'model_not_served',
      `model ${JSON.stringify(config.model)} is not listed by ${config.baseUrl}: /v1/models lists ` +
        `${listed.slice(0, 5).join(', ')}${listed.length > 5 ? ', …' : ''} (--plan sends no completion to try it): check --model`,
    )
  }
  const { own, probePlans } = planProbes(
    config,
    discovery,
    planned,
    options.isAggressive === true,
    isModelUnlisted,
  )
  return totalPlan(
    {
      target: config.baseUrl,
      limits: config.budget,
      poolTokens: discovery.poolTokens,
      contextTokens: discovery.contextTokens,
      endpoints: discovery.endpoints,
      probes: [own, ...probePlans],
      kept,
    },
    price,
  )
}

/** The plans of the `planned` probes from discovery's numbers, and the audit's own requests
 *  (discovery's reads, key checks, the answer check, token calibration): what `--plan` prints
 *  and what the audit shares its budget by. */
function planProbes(
  config: AuditConfig,
  discovery: Discovery,
  planned: readonly ProbeName[],
  isAggressive: boolean,
  isModelUnlisted: boolean,
): { own: ProbePlan; probePlans: ProbePlan[] } {
  const input: PlanInput = {
    limits: config.budget,
    numTenants: config.tenants.length,
    overCapacityAttempts: config.overCapacityAttempts,
    poolTokens: discovery.poolTokens,
    contextTokens: discovery.contextTokens,
    inputLimitTokens: discovery.inputLimitTokens,
    largestPoolTokens: discovery.largestPoolTokens,
    pageSizes: discovery.pageSizes.map((s) => s.tokens),
    chunkSizes: discovery.chunkSizes.map((s) => s.tokens),
    isAggressive,
    chunkedPrefillTokens: discovery.chunkedPrefillTokens,
  }
  // The audit's calibration completions are sent for the probes that size prompts in tokens.
  const isSized = planned.some((p) => probes[p].isSizing === true)
  const probePlans = planned.map((name) => probePlan(name, probes[name].plan(input)))
  const isCompletionSent =
    isSized || probePlans.some((p) => p.requests.some((r) => r.numRequests > 0 && r.tokensEach > 0))
  const own = probePlan('audit', [
    { what: 'discovery reads (GET)', numRequests: discovery.endpoints.length, tokensEach: 0 },
    { what: 'key checks (GET /v1/models)', numRequests: config.tenants.length, tokensEach: 0 },
    {
      what: 'answer check (--model not listed; or no probe sends a completion)',
      numRequests: (isModelUnlisted ? 1 : 0) + (isCompletionSent ? 0 : 1),
      tokensEach: answerCheckTokens,
    },
    ...calibrationWords.map((words) => ({
      what: `token calibration (${words} words)`,
      numRequests: isSized ? 1 : 0,
      tokensEach: 2 * words + 2,
    })),
  ])
  return { own, probePlans }
}

/** Each probe's share of the budget (plan.ts), from the same plans `--plan` prints: requests
 *  and milliseconds by probe. */
function probeShares(
  config: AuditConfig,
  discovery: Discovery,
  planned: readonly ProbeName[],
  isAggressive: boolean,
): Map<ProbeName, { requests: number; ms: number }> {
  const listed = discovery.modelsListed
  const isModelUnlisted =
    config.model !== null && listed.length > 0 && !listed.includes(config.model)
  const { own, probePlans } = planProbes(config, discovery, planned, isAggressive, isModelUnlisted)
  const shares = shareBudget(probePlans, config.budget, own.numRequests)
  return new Map(shares.map((s) => [s.probe, { requests: s.numRequests, ms: s.seconds * 1000 }]))
}

/** The exit code `kvfence audit` uses: 1 when the endpoint went down during the audit (an
 *  outage finding fails every gate), or when a finding fails the gate `failOn` (gate.ts: by
 *  class, severity, tag or verdict; a leak always fails), else 0. (2, for a tool error, is the
 *  caller's: `runAudit` then throws, e.g. for a target that answered none of the valid
 *  completions.) */
export function exitCodeFor(
  report: AuditReport,
  failOn: FailOnTerm | readonly FailOnTerm[] = defaultFailOn,
): 0 | 1 {
  if (report.findings.some(isOutageFinding)) return 1
  const terms = asTerms(failOn)
  return report.findings.some((f) => failsGate(f, terms)) ? 1 : 0
}

/** How long after the budget's deadline a probe may still take to conclude from what it saw
 *  (its requests are all cut at the deadline, so this is analysis and bookkeeping only). A probe
 *  still running then is abandoned: the audit ends within `maxSeconds` + this + the time to write
 *  the reports (docs/auditing.md promises a few seconds in all). */
export const probeGraceMs = 2_000

/** `run`'s findings, 'overran' when it has not ended {@link probeGraceMs} after the budget's
 *  deadline, or 'interrupted' as soon as the budget is stopped. An abandoned probe can send
 *  nothing more (every request is refused past the deadline); its late rejection is swallowed. */
async function withinDeadline(
  run: Promise<Finding[]>,
  budget: Budget,
): Promise<Finding[] | 'overran' | 'interrupted'> {
  let timer: ReturnType<typeof setTimeout> | undefined
  const overran = new Promise<'overran'>((resolve) => {
    timer = setTimeout(() => resolve('overran'), budget.remainingMs + probeGraceMs)
  })
  let onStop = (): void => {}
  const interrupted = new Promise<'interrupted'>((resolve) => {
    onStop = () => resolve('interrupted')
    if (budget.isStopped) onStop()
    else budget.stopped.addEventListener('abort', onStop, { once: true })
  })
  run.catch(() => {})
  try {
    return await Promise.race([run, overran, interrupted])
  } finally {
    clearTimeout(timer)
    budget.stopped.removeEventListener('abort', onStop)
  }
}

/** An inconclusive finding whose title does not yet say why: what stopped the probe (its
 *  evidence's `stoppedBy`, e.g. "time budget exhausted") and what became of its valid requests
 *  (`unanswered`, from the ledger) are added to the title. Other findings are returned as they are. */
export function withReason(
  finding: Finding,
  unanswered: { text: string; marks: readonly string[] } | null,
): Finding {
  if (finding.verdict !== 'inconclusive') return finding
  const stoppedBy = finding.evidence.stoppedBy
  const reasons: string[] = []
  if (typeof stoppedBy === 'string' && !finding.title.includes(stoppedBy)) reasons.push(stoppedBy)
  if (unanswered !== null && !unanswered.marks.every((m) => finding.title.includes(m)))
    reasons.push(unanswered.text)
  if (reasons.length === 0) return finding
  return { ...finding, title: `${finding.title} (${reasons.join('; ')})` }
}

/** A probe abandoned at the deadline: inconclusive, never clean. */
function overranProbe(probe: ProbeName, budget: Budget): Finding {
  const seconds = budget.limits.maxSeconds
  return {
    probe,
    verdict: 'inconclusive',
    severity: 'medium',
    title: `not run to the end: still running ${probeGraceMs / 1000} s after the ${seconds} s time budget`,
    evidence: { maxSeconds: seconds, graceMs: probeGraceMs },
    remediation: inconclusiveRemediation,
  }
}

/** A clean finding of a probe that did not run to its end, as inconclusive; other verdicts (a
 *  leak or a warning is evidence found, whatever stopped the probe after it) unchanged. */
function notProvenClean(finding: Finding, budget: Budget): Finding {
  if (finding.verdict !== 'clean') return finding
  const cut = budget.isStopped
    ? 'the audit stopped'
    : budget.remainingMs <= 0
      ? 'its time ran out'
      : 'its share of the budget ran out'
  return {
    ...finding,
    verdict: 'inconclusive',
    title: `not run to the end (${cut}), so not proven clean; before the cut: ${finding.title}`,
    remediation: inconclusiveRemediation,
  }
}

/** A probe that could not finish is inconclusive, never clean. */
function failedProbe(probe: ProbeName, err: unknown): Finding {
  const isBudget = err instanceof BudgetExhaustedError
  return {
    probe,
    verdict: 'inconclusive',
    severity: 'medium',
    title: isBudget
      ? `not run to the end: ${err.message}`
      : `probe failed: ${err instanceof Error ? err.message : String(err)}`,
    evidence: { error: err instanceof Error ? err.message : String(err) },
    remediation: inconclusiveRemediation,
  }
}

// ─── Options ─────────────────────────────────────────────────────────────────────────────────

interface AuditConfig {
  readonly baseUrl: string
  readonly tenants: readonly Tenant[]
  readonly model: string | null
  readonly probes: readonly ProbeName[]
  readonly seed: number
  readonly budget: {
    readonly maxRequests: number
    readonly maxSeconds: number
    readonly concurrency: number
    readonly maxConcurrency: number
  }
  readonly requestTimeoutMs: number
  readonly overCapacityAttempts: number
  readonly given: GivenCapacity
}

function validate(options: AuditOptions): AuditConfig {
  const fail = (message: string): never => {
    throw new AuditError('invalid_options', message)
  }
  const baseUrl = normalizeBaseUrl(options.target, fail)

  if (options.tenants.length < 2) {
    fail(`need at least two tenants (--tenant NAME=KEY twice), got ${options.tenants.length}`)
  }
  const names = new Set<string>()
  for (const tenant of options.tenants) {
    if (!/^[\w.@-]+$/.test(tenant.name))
      fail(`tenant name ${JSON.stringify(tenant.name)} is not a plain word`)
    if (names.has(tenant.name)) fail(`tenant ${tenant.name} is given twice`)
    if (tenant.key === '') fail(`tenant ${tenant.name} has an empty key`)
    names.add(tenant.name)
  }
  // Two names for one key are one tenant: nothing it sees of "the other" proves anything.
  const keys = new Set(options.tenants.map((t) => t.key))
  if (keys.size < options.tenants.length) fail('two tenants share one key: give each its own')

  const chosen = options.probes ?? probeNames
  if (chosen.length === 0) fail('no probe chosen')
  for (const name of chosen) {
    if (!probeNames.includes(name))
      fail(`unknown probe ${JSON.stringify(name)} (known: ${probeNames.join(', ')})`)
  }
  const probes = probeNames.filter((n) => chosen.includes(n))

  const intIn = (
    what: string,
    value: number | undefined,
    fallback: number,
    min: number,
    max: number,
  ): number => {
    const n = value ?? fallback
    if (!Number.isInteger(n) || n < min || n > max)
      fail(`${what} must be an integer from ${min} to ${max}, got ${n}`)
    return n
  }
  const maxSeconds = options.maxSeconds ?? auditDefaults.maxSeconds
  if (!(maxSeconds >= minAuditSeconds && maxSeconds <= maxAuditSeconds))
    fail(
      `max seconds must be a number from ${minAuditSeconds} to ${maxAuditSeconds}, got ${maxSeconds}`,
    )

  return Object.freeze({
    baseUrl,
    tenants: Object.freeze(options.tenants.map((t) => Object.freeze({ name: t.name, key: t.key }))),
    model: options.model ?? null,
    probes,
    seed: intIn('seed', options.seed, randomInt(0, 2 ** 32 - 1), 0, 2 ** 32 - 1),
    budget: Object.freeze({
      maxRequests: intIn(
        'max requests',
        options.maxRequests,
        auditDefaults.maxRequests,
        1,
        1_000_000,
      ),
      maxSeconds,
      concurrency: intIn('concurrency', options.concurrency, auditDefaults.concurrency, 1, 256),
      maxConcurrency: intIn(
        'max concurrency',
        options.maxConcurrency,
        options.concurrency ?? auditDefaults.maxConcurrency,
        1,
        256,
      ),
    }),
    requestTimeoutMs: intIn(
      'request timeout (ms)',
      options.requestTimeoutMs,
      auditDefaults.requestTimeoutMs,
      1,
      3_600_000,
    ),
    overCapacityAttempts: intIn(
      'over-capacity attempts',
      options.overCapacityAttempts,
      auditDefaults.overCapacityAttempts,
      1,
      100,
    ),
    given: Object.freeze({
      ...(options.contextWindow === undefined
        ? {}
        : { contextTokens: intIn('context window', options.contextWindow, 0, 2, 1e9) }),
      ...(options.kvPoolTokens === undefined
        ? {}
        : { poolTokens: intIn('KV pool tokens', options.kvPoolTokens, 0, 2, 1e12) }),
    }),
  })
}

/** `http(s)://host[:port][/prefix]`, without credentials, query, trailing slash or `/v1`. */
export function normalizeBaseUrl(raw: string, fail: (message: string) => never): string {
  let url: URL
  try {
    url = new URL(raw)
  } catch {
    return fail(`target ${JSON.stringify(raw)} is not a URL`)
  }
  if (url.protocol !== 'http:' && url.protocol !== 'https:')
    fail(`target must be an http(s) URL, got ${url.protocol}`)
  if (url.username || url.password)
    fail('target URL must not contain credentials; use --tenant NAME=KEY')
  const path = url.pathname.replace(/\/+$/, '').replace(/\/v1$/, '')
  return `${url.protocol}//${url.host}${path}`
}

/** The audit's key check ({@link checkKeys}) on its own, for `kvfence watch` before its first
 *  cycle: a watch with a refused key would spend the other tenants' budget on cycles that can see
 *  nothing. Its own budget: one request per tenant, each within `requestTimeoutMs`. Resolves with
 *  the number of requests sent (for the watch's hourly budget). Throws
 *  `AuditError('invalid_options')` naming the first tenant refused (401 or 403); a target that
 *  does not answer passes (the cycles say it is unreachable). */
export async function checkTenantKeys(
  baseUrl: string,
  tenants: readonly Tenant[],
  requestTimeoutMs: number,
): Promise<number> {
  const budget = new Budget({
    maxRequests: tenants.length,
    maxSeconds: (tenants.length * requestTimeoutMs) / 1000 + 1,
    concurrency: 1,
  })
  await checkKeys(createTarget({ baseUrl, tenants, budget, requestTimeoutMs, model: null }))
  return budget.requestsSent
}

/** Every tenant's key must be accepted: with a refused key each probe would only say
 *  "inconclusive", and a CI gate on leaks would pass without having tested anything. One
 *  `GET /v1/models` per tenant; a 401 or 403 is a tool error (exit 2) naming the tenant. */
async function checkKeys(target: Target): Promise<void> {
  for (const tenant of target.tenants) {
    let res
    try {
      res = await target.get('/v1/models', { tenant })
    } catch (err) {
      // Out of budget: the probes will say inconclusive, which never counts as clean.
      if (err instanceof BudgetExhaustedError) return
      throw err
    }
    if (res.status === 401 || res.status === 403) {
      throw new AuditError(
        'invalid_options',
        `tenant ${tenant.name}'s key was refused by the target (HTTP ${res.status})`,
      )
    }
  }
}
