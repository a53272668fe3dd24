/** `runWatch`: the watch's loop. Every cycle (the mean cycle time, jittered ±20 %) it reserves
 *  its allowance from the hourly budget, runs one cycle, settles what it spent, updates the
 *  metrics, turns findings into alerts (once each, resolved after N quiet cycles; a log line and
 *  the optional webhook) and watches the idle pool usage across cycles. An endpoint that does not
 *  answer is `unreachable` (metric and log line), never a crash; the loop goes on until `signal`
 *  aborts, and then returns at once (a cycle in flight is abandoned).
 *  Knows the audit's words and the watch's parts; knows nothing of any engine. */
import type { Logger } from 'pino'
import { createRng } from '../rng.js'
import type { PromptSizer } from '../sizer.js'
import type { Finding } from '../types.js'
import { AlertTracker, type ActiveAlert } from './alerts.js'
import {
  maxReadRequests,
  observerMaxTokens,
  cutMaxCharacters,
  maxFollowUpRounds,
  plantMaxCharacters,
  plantMaxTokens,
  promptTokenBound,
  runCycle,
  type CycleReport,
  type WatchFinding,
} from './cycle.js'
import { HourlyBudget, PacingBucket, type Spend } from './hourly.js'
import type { WatchMetrics } from './metrics.js'
import type { WatchConfig } from './options.js'
import { armOf, createRotation, rotation } from './rotation.js'
import { OutageWatch } from '../outage.js'
import type { CompletionRequest, CompletionResult } from '../target.js'
import { alertEvidence, postWebhook, webhookBody, type AlertStatus } from './webhook.js'

/** A cycle may spend up to this many times its average share of the hourly budget (so a cycle
 *  that draws every trigger can run now and then, and one that finds the rejection path broken
 *  can run all its follow-up rounds at once: the cycle's own triggers and
 *  {@link maxFollowUpRounds} rounds of about 860 tokens each fit in 24 shares; the hour still
 *  averages out, and a healthy endpoint's cycles never come near it). */
const cycleShareFactor = 24
/** The plant is at most {@link plantMaxCharacters} ASCII characters, the cut stream
 *  {@link cutMaxCharacters}. */
const plantTokenBound = promptTokenBound('x'.repeat(plantMaxCharacters)) + plantMaxTokens
const cutTokenBound = promptTokenBound('x'.repeat(cutMaxCharacters)) + plantMaxTokens
/** An observer's prompt is two canaries (≤ 49 bytes) and answers with up to
 *  {@link observerMaxTokens} tokens. */
const observerTokenBound = promptTokenBound('x'.repeat(49)) + observerMaxTokens
/** The least a cycle sends: the plant and one look by another tenant. */
const minCycleTokens = plantTokenBound + observerTokenBound
/** Idle pool usage: this many cycles' readings form the baseline, and a warning needs every
 *  reading of that many recent cycles above it. */
const idleWindowCycles = 10
const jitter = 0.2

export interface WatchDeps {
  readonly log: Logger
  readonly metrics: WatchMetrics
  /** Aborting it ends the loop. */
  readonly signal: AbortSignal
  /** Sent before the loop (the tenants' key checks at start): counted in the hourly budget and
   *  the requests metric as a cycle's spending is. */
  readonly spentAtStart?: Spend
}

/** What one cycle costs at most, for the start-up line, and what a cycle may spend. */
export function cycleCostBound(config: WatchConfig): {
  readonly maxRequests: number
  readonly maxCanaryTokens: number
  readonly allowance: Spend
  /** The least a cycle must be allowed to start (its reads, the plant and one look): an hourly
   *  budget below it skips every cycle. */
  readonly minCycle: Spend
  /** The costliest rotating arm (rotation.ts), sent besides `maxRequests` and `maxCanaryTokens`
   *  when what the cycle has left holds it. */
  readonly rotationArm: Spend
} {
  // The plant and the cut stream are whole canary prompts; five observer prompts (the look, the
  // fresh request after the cut, the burst of three); one over-capacity or boundary prompt; and,
  // where a prompt over the limit was answered 200, follow-up rounds of a plant and an
  // over-capacity prompt each.
  return {
    maxRequests: maxReadRequests + 8 + 2 * maxFollowUpRounds,
    maxCanaryTokens:
      (1 + maxFollowUpRounds) * plantTokenBound + cutTokenBound + 5 * observerTokenBound,
    allowance: pacing(config).capacity,
    minCycle: { tokens: minCycleTokens, requests: maxReadRequests + 2 },
    rotationArm: rotation
      .map((arm) =>
        arm.cost({ poolTokens: Infinity, contextTokens: Infinity, inputLimitTokens: Infinity }),
      )
      .reduce(
        (a, b) => ({
          tokens: Math.max(a.tokens, b.tokens),
          requests: Math.max(a.requests, b.requests),
        }),
        { tokens: 0, requests: 0 },
      ),
  }
}

/** The bucket that paces cycles: a cycle's allowance is at most `cycleShareFactor` average
 *  shares, and never less than one cycle of reads and a plant (when the hour allows that). */
export function pacing(config: WatchConfig, now: () => number = Date.now): PacingBucket {
  const cyclesPerHour = 3600 / config.cycleSeconds
  const share = (perHour: number) => Math.ceil((cycleShareFactor * perHour) / cyclesPerHour)
  const perHour = { tokens: config.maxTokensPerHour, requests: config.maxRequestsPerHour }
  return new PacingBucket(
    perHour,
    {
      tokens: Math.min(perHour.tokens, Math.max(share(perHour.tokens), 2 * minCycleTokens)),
      requests: Math.min(perHour.requests, Math.max(share(perHour.requests), 2 * maxReadRequests)),
    },
    now,
  )
}

export async function runWatch(config: WatchConfig, deps: WatchDeps): Promise<void> {
  const { log, metrics, signal } = deps
  const rng = createRng(config.seed, 'watch')
  const hourly = new HourlyBudget(config.maxTokensPerHour, config.maxRequestsPerHour)
  const bucket = pacing(config)
  const alerts = new AlertTracker(config.resolveAfterCycles)
  const outage = watchOutage()
  // One rotation a watch: its arms remember what earlier cycles did (entrypoints served, turns).
  const arms = createRotation()
  const idleReadings: number[] = []
  let idleUnit: string | null = null
  let sizer: PromptSizer | null = null
  let usageEndpoint: string | undefined
  let isUnreachable = false
  const atStart = deps.spentAtStart ?? { tokens: 0, requests: 0 }
  hourly.reserve(atStart)?.settle(atStart)
  bucket.take(atStart)
  metrics.requestsSent.inc(atStart.requests)
  metrics.budgetLimit.set({ resource: 'tokens' }, config.maxTokensPerHour)
  metrics.budgetLimit.set({ resource: 'requests' }, config.maxRequestsPerHour)
  const stopped = new Promise<'stopped'>((resolve) => {
    if (signal.aborted) resolve('stopped')
    else signal.addEventListener('abort', () => resolve('stopped'), { once: true })
  })

  for (let cycle = 1; !signal.aborted; cycle++) {
    const left = hourly.remaining()
    const inBucket = bucket.available()
    const allowance = {
      tokens: Math.min(left.tokens, inBucket.tokens),
      requests: Math.min(left.requests, inBucket.requests),
    }
    // A cycle that could not pay for its reads and a plant is not started: nothing is sent.
    const isAffordable =
      allowance.requests >= maxReadRequests + 2 && allowance.tokens >= minCycleTokens
    const reservation = isAffordable ? hourly.reserve(allowance) : null
    let report: CycleReport | 'stopped'
    if (reservation === null) {
      report = skippedReport(
        `cycle skipped: the budget allows ${allowance.tokens} tokens and ${allowance.requests} requests now, a cycle needs ${minCycleTokens} and ${maxReadRequests + 2} (hourly budget: ${left.tokens} tokens, ${left.requests} requests left)`,
      )
    } else {
      const running: Promise<CycleReport> = runCycle({
        baseUrl: config.baseUrl,
        tenants: config.tenants,
        model: config.model,
        given: config.given,
        rng: createRng(rng.int(0, 2 ** 32 - 1), `cycle ${cycle}`),
        sizer,
        usageEndpoint,
        allowance,
        requestTimeoutMs: config.requestTimeoutMs,
        concurrency: config.concurrency,
        maxSeconds: Math.max(config.cycleSeconds, config.requestTimeoutMs / 1000),
        arm: armOf(cycle, arms),
        onCompletion: outage.onCompletion,
      }).catch((err: unknown) =>
        skippedReport(`cycle failed: ${err instanceof Error ? err.message : String(err)}`),
      )
      report = await Promise.race([running, stopped])
      // A cycle abandoned mid-way keeps its whole reservation: what it sent is not known.
      if (report === 'stopped') break
      reservation.settle(report.spent)
      bucket.take(report.spent)
    }
    sizer = report.sizer ?? sizer
    usageEndpoint = report.poolUsage?.endpoint ?? usageEndpoint
    const findings = [...report.findings, ...outage.findings()]
    if (report.poolUsage !== null) {
      const unit = `${report.poolUsage.field} (${report.poolUsage.unit})`
      if (unit !== idleUnit) idleReadings.length = 0
      idleUnit = unit
      idleReadings.push(report.poolUsage.used)
      metrics.idlePoolUsage.set(report.poolUsage.used)
      findings.push(...idleCreep(idleReadings, unit))
    }
    const outcome = report.outcome === 'clean' && findings.length > 0 ? 'finding' : report.outcome
    record(metrics, hourly, report, outcome)
    if ((outcome === 'unreachable') !== isUnreachable) {
      isUnreachable = outcome === 'unreachable'
      if (isUnreachable) log.warn({ cycle, reason: report.reason }, 'target unreachable')
      else log.info({ cycle }, 'target reachable again')
    }
    log.info(
      {
        cycle,
        outcome,
        triggers: report.triggers,
        ...(report.arm !== null ? { arm: report.arm } : {}),
        spent: report.spent,
        ...(report.refusedTokens > 0 ? { refusedTokens: report.refusedTokens } : {}),
        ...(report.followUps > 0 ? { followUps: report.followUps } : {}),
        ...(report.skipped.length > 0 ? { skipped: report.skipped } : {}),
        ...(report.reason !== null ? { reason: report.reason } : {}),
      },
      'cycle',
    )
    if (report.steps.length > 0) log.debug({ cycle, steps: report.steps }, 'cycle steps')
    if (outcome !== 'unreachable' && outcome !== 'skipped') {
      const changes = alerts.observe(cycle, findings)
      // Metrics first: whoever reads the log line and scrapes then sees the alert already.
      for (const { finding } of changes.fired)
        metrics.findings.inc({ verdict: finding.verdict, probe: finding.probe })
      metrics.activeFindings.reset()
      for (const alert of alerts.list())
        metrics.activeFindings.inc({ verdict: alert.finding.verdict, probe: alert.finding.probe })
      for (const alert of changes.fired) await announce(config, deps, 'firing', alert, cycle)
      for (const alert of changes.resolved) await announce(config, deps, 'resolved', alert, cycle)
    }
    const waitMs = config.cycleSeconds * 1000 * (1 - jitter + 2 * jitter * rng.next())
    await sleep(waitMs, signal)
  }
}

/** The audit's outage check (outage.ts) over the watch's completions across cycles: valid
 *  requests failing with a 5xx or no answer, six or more in a row over at least 10 s after the
 *  endpoint had answered, are an availability alert, numbered across the whole watch. */
export function watchOutage(): {
  onCompletion: (request: CompletionRequest, result: CompletionResult) => void
  findings: () => WatchFinding[]
} {
  const watch = new OutageWatch('watch')
  const startedAt = Date.now()
  let numSent = 0
  return {
    onCompletion: (request, result) => {
      watch.observe(
        request.isValid ?? true,
        {
          requestNumber: ++numSent,
          atMs: Date.now() - startedAt,
          probe: null,
          tenant: request.tenant.name,
          promptTokens: result.promptTokens ?? request.estimatedPromptTokens ?? null,
          promptChars: request.prompt.length,
          maxTokens: request.maxTokens,
          isStream: request.stream,
          status: result.status,
          failure: result.failure,
        },
        result,
      )
    },
    findings: () => {
      const finding = watch.isDown() ? watch.finding({ before: null, after: null }) : null
      return finding === null ? [] : [{ key: 'warning:outage', finding }]
    },
  }
}

function skippedReport(reason: string): CycleReport {
  return {
    outcome: 'skipped',
    findings: [],
    spent: { tokens: 0, requests: 0 },
    triggers: [],
    skipped: [reason],
    reason,
    discovery: null,
    poolUsage: null,
    latencies: [],
    sizer: null,
    steps: [],
    refusedTokens: 0,
    followUps: 0,
    arm: null,
  }
}

function record(
  metrics: WatchMetrics,
  hourly: HourlyBudget,
  report: CycleReport,
  outcome: string,
): void {
  metrics.cycles.inc({ outcome })
  if (outcome === 'inconclusive') metrics.inconclusiveCycles.inc()
  if (outcome === 'clean' || outcome === 'finding') metrics.lastSuccess.set(Date.now() / 1000)
  metrics.targetUnreachable.set(outcome === 'unreachable' ? 1 : 0)
  metrics.tokensSpent.inc(report.spent.tokens)
  metrics.requestsSent.inc(report.spent.requests)
  for (const { trigger, seconds } of report.latencies)
    metrics.answerSeconds.observe({ trigger }, seconds)
  const { contextTokens, poolTokens } = report.discovery ?? {
    contextTokens: null,
    poolTokens: null,
  }
  if (contextTokens !== null && poolTokens !== null)
    metrics.capacityGap.set(Math.max(0, contextTokens - poolTokens))
  const spent = hourly.spentInWindow()
  metrics.budgetSpent.set({ resource: 'tokens' }, spent.tokens)
  metrics.budgetSpent.set({ resource: 'requests' }, spent.requests)
}

/** Pool usage at the start of each cycle creeping up: the lowest reading of the last
 *  {@link idleWindowCycles} cycles is above the lowest of the first ones. Other traffic lifts
 *  single readings; only pages that never come back lift the floor. */
function idleCreep(readings: readonly number[], unit: string): WatchFinding[] {
  if (readings.length < 2 * idleWindowCycles) return []
  const baseline = Math.min(...readings.slice(0, idleWindowCycles))
  const recent = readings.slice(-idleWindowCycles)
  const floor = Math.min(...recent)
  if (floor <= baseline) return []
  const finding: Finding = {
    probe: 'page-leak',
    verdict: 'warning',
    severity: 'high',
    title: `KV pool usage at idle crept up: never below ${floor} in the last ${idleWindowCycles} cycles, ${baseline} at first (${unit})`,
    evidence: { baseline, readings: recent, unit },
    remediation:
      'Find the release path that forgets pages (abort, disconnect, timeout, failed transfer); ' +
      'until it is fixed the pool shrinks and stale pages accumulate.',
  }
  return [{ key: 'warning:page-leak', finding }]
}

/** One JSON log line, and the webhook when one is set. */
async function announce(
  config: WatchConfig,
  deps: WatchDeps,
  status: AlertStatus,
  alert: ActiveAlert,
  cycle: number,
): Promise<void> {
  const { finding } = alert
  if (status === 'firing') {
    const line = {
      cycle,
      finding: alert.key,
      verdict: finding.verdict,
      probe: finding.probe,
      severity: finding.severity,
      title: finding.title,
      evidence: alertEvidence(finding.evidence),
      remediation: finding.remediation,
    }
    if (finding.verdict === 'leak') deps.log.error(line, 'finding')
    else deps.log.warn(line, 'finding')
  } else {
    deps.log.info(
      {
        cycle,
        finding: alert.key,
        firstCycle: alert.firstCycle,
        lastCycle: alert.lastCycle,
        numSightings: alert.numSightings,
      },
      'finding resolved',
    )
  }
  if (config.webhook === null) return
  const body = webhookBody(config.webhook.format, status, alert, config.baseUrl)
  const sent = await postWebhook(config.webhook.url, body)
  const line = { finding: alert.key, status, httpStatus: sent.status, error: sent.error }
  if (sent.status !== null && sent.status < 300) deps.log.info(line, 'webhook sent')
  else deps.log.warn(line, 'webhook failed')
}

/** Resolves after `ms`, or at once when `signal` aborts (the timer is then cleared). */
function sleep(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    const done = () => {
      clearTimeout(timer)
      signal.removeEventListener('abort', done)
      resolve()
    }
    const timer = setTimeout(done, ms)
    signal.addEventListener('abort', done, { once: true })
  })
}
