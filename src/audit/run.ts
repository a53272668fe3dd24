/** `runAudit`: validates options, reads what the endpoint says about itself, runs the chosen
 *  probes within the budget and returns the report. Never throws for what it finds; throws
 *  `AuditError` only when it cannot audit at all (bad options, target unreachable, a key refused)
 *  or when the target answered none of the valid completions sent (`no_completion_answered`,
 *  with the report of what was seen attached): then nothing was audited, and an audit that
 *  returned a report would read as "no leak observed". */
import { randomInt } from 'node:crypto'
import { Budget, BudgetExhaustedError } from './budget.js'
import { discover, type Discovery } from './discovery.js'
import { controlsOf } from './controls.js'
import { Ledger } from './ledger.js'
import type { ProbeContext } from './probe.js'
import { inconclusiveRemediation } from './probe.js'
import { probes } from './probes/index.js'
import { calibrate, calibrationWords, type PromptSizer } from './sizer.js'
import { probePlan, totalPlan, type AuditPlan, type PlanInput } from './plan.js'
import { createTarget, type HttpResult, type Target } from './target.js'
import {
  AuditError,
  probeNames,
  type AuditReport,
  type Finding,
  type ProbeName,
  type ProbeRun,
  type Tenant,
  type Verdict,
  verdictRank,
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
  /** uint32; default: random (and reported, so a run can be repeated). */
  readonly seed?: number
  readonly maxRequests?: number // default 300
  readonly maxSeconds?: number // default 300
  readonly concurrency?: number // default 4
  /** In flight at most for probes that ramp (concurrency): default 16, or `concurrency` when that
   *  is given (an explicit cap is honoured everywhere unless this raises it). */
  readonly maxConcurrency?: number
  readonly requestTimeoutMs?: number // default 60_000, cut shorter by the deadline
  readonly overCapacityAttempts?: number // default 6
  /** Send bodies that could disturb a shared engine (cache-fields' engine-internal fields);
   *  default false. */
  readonly isAggressive?: boolean
  /** Progress, one line at a time (probe started, probe details, probe finished). */
  readonly onProgress?: (event: ProgressEvent) => void
}

export type ProgressEvent =
  | { readonly type: 'probe-start'; readonly probe: ProbeName }
  | { readonly type: 'probe-log'; readonly probe: ProbeName; readonly message: string }
  | { readonly type: 'probe-end'; readonly probe: ProbeName; readonly findings: readonly Finding[] }

export const auditDefaults = Object.freeze({
  maxRequests: 300,
  maxSeconds: 300,
  concurrency: 4,
  maxConcurrency: 16,
  requestTimeoutMs: 60_000,
  overCapacityAttempts: 6,
})

export async function runAudit(options: AuditOptions): Promise<AuditReport> {
  const startedAt = new Date()
  const config = validate(options)
  const budget = new Budget(config.budget, startedAt.getTime())
  const emit = options.onProgress ?? (() => {})

  // The first valid completion that fails asks /health once: a health check that says all is
  // well while requests fail keeps a load balancer sending traffic here.
  let health: Promise<HealthReading> | null = null
  const ledger = new Ledger(() => {
    health ??= readHealth(target)
  })
  const targetOptions = {
    baseUrl: config.baseUrl,
    tenants: config.tenants,
    budget,
    requestTimeoutMs: config.requestTimeoutMs,
    ledger,
  }
  const discovery = await discover(createTarget({ ...targetOptions, model: null }), config.model)
  const target = createTarget({ ...targetOptions, model: discovery.model })
  await checkKeys(target)

  let sizing: Promise<PromptSizer | null> | null = null
  const findings: Finding[] = []
  const probeRuns: ProbeRun[] = []
  for (const name of config.probes) {
    const probeStartedAt = performance.now()
    const requestsBefore = budget.requestsSent
    budget.takeMostInFlight()
    emit({ type: 'probe-start', probe: name })
    ledger.setProbe(name)
    let isAbandoned = false
    const context: ProbeContext = {
      seed: config.seed,
      overCapacityAttempts: config.overCapacityAttempts,
      isAggressive: options.isAggressive === true,
      discovery,
      sizer: () => (sizing ??= calibrate(target)),
      log: (message) => {
        if (!isAbandoned) emit({ type: 'probe-log', probe: name, message })
      },
    }
    let probeFindings: Finding[]
    try {
      const outcome = await withinDeadline(probes[name].run(target, budget, context), budget)
      if (outcome === 'overran') {
        isAbandoned = true
        probeFindings = [overranProbe(name, budget)]
      } else {
        probeFindings = outcome
        if (probeFindings.length === 0) throw new Error('probe returned no finding')
      }
    } catch (err) {
      probeFindings = [failedProbe(name, err)]
    }
    probeFindings = probeFindings.map((f) => ({
      ...withReason(f, ledger.unansweredReason(name)),
      controls: controlsOf(f.probe),
    }))
    findings.push(...probeFindings)
    probeRuns.push({
      probe: name,
      durationMs: Math.round(performance.now() - probeStartedAt),
      requestsSent: budget.requestsSent - requestsBefore,
      completions: ledger.counts(name),
      inconclusiveReasons: probeFindings
        .filter((f) => f.verdict === 'inconclusive')
        .map((f) => f.title),
      concurrencyReached: budget.takeMostInFlight(),
    })
    emit({ type: 'probe-end', probe: name, findings: probeFindings })
  }
  ledger.setProbe(null)
  const healthReading = health === null ? null : await (health as Promise<HealthReading>)
  findings.push(
    ...availabilityFindings(ledger, healthReading).map((f) => ({
      ...f,
      controls: controlsOf(f.probe),
    })),
  )

  const report: AuditReport = {
    schemaVersion: 1,
    tool: 'kvfence audit',
    target: config.baseUrl,
    model: discovery.model,
    startedAt: startedAt.toISOString(),
    durationMs: Date.now() - startedAt.getTime(),
    seed: config.seed,
    budget: config.budget,
    requestsSent: budget.requestsSent,
    probeRuns,
    findings,
    completions: ledger.timeline(),
  }
  const valid = ledger.validSummary()
  if (valid.numSent > 0 && valid.numAnswered === 0) {
    throw new AuditError(
      'no_completion_answered',
      noAnswerMessage(valid, config.baseUrl, discovery, healthReading),
      report,
    )
  }
  return report
}

/** `kvfence audit --plan`: what {@link runAudit} with these options would send, per probe, and
 *  what its tokens cost at `pricePerMillionTokens` (default 0: not priced). Sends discovery's
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
  const budget = new Budget(config.budget)
  const discoveryTarget = createTarget({
    baseUrl: config.baseUrl,
    tenants: config.tenants,
    budget,
    requestTimeoutMs: config.requestTimeoutMs,
    model: null,
  })
  const discovery = await discover(discoveryTarget, config.model)
  const input: PlanInput = {
    limits: config.budget,
    numTenants: config.tenants.length,
    overCapacityAttempts: config.overCapacityAttempts,
    poolTokens: discovery.poolTokens,
    contextTokens: discovery.contextTokens,
    inputLimitTokens: discovery.inputLimitTokens,
    isAggressive: options.isAggressive === true,
    chunkedPrefillTokens: discovery.chunkedPrefillTokens,
  }
  const isSized = config.probes.some((p) => probesThatSize.includes(p))
  const own = probePlan('audit', [
    { what: 'discovery reads (GET)', numRequests: discovery.endpoints.length, tokensEach: 0 },
    { what: 'key checks (GET /v1/models)', numRequests: config.tenants.length, tokensEach: 0 },
    ...calibrationWords.map((words) => ({
      what: `token calibration (${words} words)`,
      numRequests: isSized ? 1 : 0,
      tokensEach: 2 * words + 2,
    })),
  ])
  return totalPlan(
    {
      target: config.baseUrl,
      limits: config.budget,
      poolTokens: discovery.poolTokens,
      contextTokens: discovery.contextTokens,
      endpoints: discovery.endpoints,
      probes: [
        own,
        ...config.probes.map((name) => probePlan(name, probes[name].plan?.(input) ?? [])),
      ],
    },
    price,
  )
}

/** Probes that calibrate token counts (the audit's calibration completions are theirs). */
const probesThatSize: readonly ProbeName[] = ['boundary', 'canary', 'abort-retry', 'prefix-timing']

/** The exit code `kvfence audit` uses: 1 when a finding's verdict is at or above `failOn` (a leak
 *  always is), else 0. (2, for a tool error, is the caller's: `runAudit` then throws, e.g. for a
 *  target that answered none of the valid completions.) */
export function exitCodeFor(report: AuditReport, failOn: Verdict = 'leak'): 0 | 1 {
  const threshold = verdictRank[failOn]
  return report.findings.some((f) => verdictRank[f.verdict] >= threshold) ? 1 : 0
}

/** How long after the budget's deadline a probe may still take to conclude from what it saw
 *  (its requests are all cut at the deadline, so this is analysis and bookkeeping only). A probe
 *  still running then is abandoned: the audit ends within `maxSeconds` + this + the time to write
 *  the reports (docs/auditing.md promises a few seconds in all). */
export const probeGraceMs = 2_000

/** `run`'s findings, or 'overran' when it has not ended {@link probeGraceMs} after the budget's
 *  deadline. An abandoned probe can send nothing more (every request is refused past the
 *  deadline); its late rejection is swallowed. */
async function withinDeadline(
  run: Promise<Finding[]>,
  budget: Budget,
): Promise<Finding[] | 'overran'> {
  let timer: ReturnType<typeof setTimeout> | undefined
  const overran = new Promise<'overran'>((resolve) => {
    timer = setTimeout(() => resolve('overran'), budget.remainingMs + probeGraceMs)
  })
  run.catch(() => {})
  try {
    return await Promise.race([run, overran])
  } finally {
    clearTimeout(timer)
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

// ─── Availability ────────────────────────────────────────────────────────────────────────────

/** What `GET /health` answered: an HTTP status, or why none came (`timeout`, `network`,
 *  `budget`). */
interface HealthReading {
  readonly endpoint: '/health'
  readonly status: number | string
}

async function readHealth(target: Target): Promise<HealthReading> {
  let res: HttpResult
  try {
    res = await target.get('/health', { tenant: target.tenants[0] })
  } catch (err) {
    if (err instanceof BudgetExhaustedError) return { endpoint: '/health', status: 'budget' }
    throw err
  }
  return { endpoint: '/health', status: res.status ?? res.failure ?? 'network' }
}

/** Valid completions that failed (5xx, timeouts, broken streams) are a warning whatever the
 *  probes made of them: a probe that could not tell says inconclusive, but an endpoint failing
 *  valid requests is itself a finding. A `/health` that answered 200 meanwhile is another. */
function availabilityFindings(ledger: Ledger, health: HealthReading | null): Finding[] {
  const valid = ledger.validSummary()
  if (valid.numFailed === 0) return []
  const byCause = Object.entries(valid.failedBy)
    .sort(([, a], [, b]) => b - a)
    .map(([cause, n]) => `${cause} ×${n}`)
    .join(', ')
  const evidence = {
    numValidSent: valid.numSent,
    numValidAnswered: valid.numAnswered,
    numValidFailed: valid.numFailed,
    failedBy: valid.failedBy,
    refusedBy: valid.refusedBy,
    failedByProbe: valid.failedByProbe,
    health,
  }
  const findings: Finding[] = [
    {
      probe: 'availability',
      verdict: 'warning',
      severity: valid.numFailed * 10 >= valid.numSent ? 'high' : 'medium',
      title: `${valid.numFailed} of ${valid.numSent} valid requests failed (${byCause})`,
      evidence,
      remediation:
        'Find why the endpoint fails requests it should answer (its logs at the times in the ' +
        "report's completions); probes that saw these failures could not tell, and a failing " +
        'transfer or decode path is where stale pages get read.',
    },
  ]
  if (health !== null && health.status === 200) {
    findings.push({
      probe: 'availability',
      verdict: 'warning',
      severity: 'high',
      title: `/health answered 200 while ${valid.numFailed} of ${valid.numSent} valid requests failed`,
      evidence,
      remediation:
        'Make the health check exercise the path requests take (a short completion, or the ' +
        "workers' own state), so that a load balancer stops sending traffic to an endpoint that " +
        'fails them.',
    })
  }
  return findings
}

/** The one line of the `no_completion_answered` tool error: what came back, and the likely cause. */
function noAnswerMessage(
  valid: ReturnType<Ledger['validSummary']>,
  baseUrl: string,
  discovery: Discovery,
  health: HealthReading | null,
): string {
  const causes = { ...valid.failedBy, ...valid.refusedBy }
  const sorted = Object.entries(causes).sort(([, a], [, b]) => b - a)
  const byCause = sorted.map(([cause, n]) => `${cause} ×${n}`).join(', ')
  const top = sorted[0]?.[0] ?? ''
  const model = discovery.model
  const isModelUnlisted =
    model !== null && discovery.modelsListed.length > 0 && !discovery.modelsListed.includes(model)
  let hint: string
  if (top === 'HTTP 404' && isModelUnlisted)
    hint = `model ${JSON.stringify(model)} is not one /v1/models lists (${discovery.modelsListed.slice(0, 5).join(', ')}): check --model`
  else if (top === 'HTTP 404')
    hint = `check --model and the target's path prefix (${baseUrl}/v1/completions was asked)`
  else if (top === 'HTTP 405' || top === 'HTTP 501')
    hint = `${baseUrl} does not serve POST /v1/completions: check that --target is an OpenAI-compatible endpoint, with its path prefix`
  else if (top.startsWith('HTTP 4'))
    hint =
      'every one was refused: check --model and that the endpoint takes prompt, max_tokens and temperature'
  else if (top === 'timeout') hint = 'none was answered within the request timeout'
  else hint = 'the endpoint failed every one'
  const healthNote = health === null ? '' : `; /health answered ${health.status}`
  return (
    `the target answered none of the ${valid.numSent} valid completions sent to ${baseUrl}/v1/completions ` +
    `(${byCause})${healthNote}: ${hint}. Nothing was audited`
  )
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
  if (!(Number.isFinite(maxSeconds) && maxSeconds > 0))
    fail(`max seconds must be a positive number, got ${maxSeconds}`)

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
