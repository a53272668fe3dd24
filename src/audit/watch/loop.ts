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
  promptTokenBound,
  runCycle,
  type CycleReport,
  type WatchFinding,
} from './cycle.js'
import { HourlyBudget, type Spend } from './hourly.js'
import type { WatchMetrics } from './metrics.js'
import type { WatchConfig } from './options.js'
import { alertEvidence, postWebhook, webhookBody, type AlertStatus } from './webhook.js'

/** A cycle may spend at most this many times its fair share of the hourly budget (so a cycle
 *  that draws every trigger can run, and the hour still averages out). */
const cycleShareFactor = 2
/** Idle pool usage: this many cycles' readings form the baseline, and a warning needs every
 *  reading of that many recent cycles above it. */
const idleWindowCycles = 10
const jitter = 0.2

export interface WatchDeps {
  readonly log: Logger
  readonly metrics: WatchMetrics
  /** Aborting it ends the loop. */
  readonly signal: AbortSignal
}

/** What one cycle costs at most, for the start-up line. */
export function cycleCostBound(config: WatchConfig): {
  readonly maxRequests: number
  readonly maxCanaryTokens: number
  readonly allowance: Spend
} {
  // Canary prompts are 200–330 characters plus one canary (≤ 24): ≤ 355 bytes.
  const plantBound = promptTokenBound('x'.repeat(355))
  const observerBound = promptTokenBound('x'.repeat(49))
  const maxCanaryTokens = 2 * (plantBound + 16) + 4 * (observerBound + 32)
  return {
    maxRequests: maxReadRequests + 8,
    maxCanaryTokens,
    allowance: cycleAllowance(config, {
      tokens: config.maxTokensPerHour,
      requests: config.maxRequestsPerHour,
    }),
  }
}

function cycleAllowance(config: WatchConfig, remaining: Spend): Spend {
  const cyclesPerHour = 3600 / config.cycleSeconds
  const share = (perHour: number) => Math.ceil((cycleShareFactor * perHour) / cyclesPerHour)
  return {
    tokens: Math.min(remaining.tokens, share(config.maxTokensPerHour)),
    requests: Math.min(
      remaining.requests,
      Math.max(maxReadRequests + 2, share(config.maxRequestsPerHour)),
    ),
  }
}

export async function runWatch(config: WatchConfig, deps: WatchDeps): Promise<void> {
  const { log, metrics, signal } = deps
  const rng = createRng(config.seed, 'watch')
  const hourly = new HourlyBudget(config.maxTokensPerHour, config.maxRequestsPerHour)
  const alerts = new AlertTracker(config.resolveAfterCycles)
  const idleReadings: number[] = []
  let idleUnit: string | null = null
  let sizer: PromptSizer | null = null
  let usageEndpoint: string | undefined
  let isUnreachable = false
  metrics.budgetLimit.set({ resource: 'tokens' }, config.maxTokensPerHour)
  metrics.budgetLimit.set({ resource: 'requests' }, config.maxRequestsPerHour)
  const stopped = new Promise<'stopped'>((resolve) => {
    if (signal.aborted) resolve('stopped')
    else signal.addEventListener('abort', () => resolve('stopped'), { once: true })
  })

  for (let cycle = 1; !signal.aborted; cycle++) {
    const allowance = cycleAllowance(config, hourly.remaining())
    const reservation = allowance.requests >= maxReadRequests ? hourly.reserve(allowance) : null
    let report: CycleReport | 'stopped'
    if (reservation === null) {
      report = skippedReport(
        `cycle skipped: the hourly budget has ${allowance.requests} requests left, a cycle's reads need ${maxReadRequests}`,
      )
    } else {
      const running: Promise<CycleReport> = runCycle({
        baseUrl: config.baseUrl,
        tenants: config.tenants,
        model: config.model,
        rng: createRng(rng.int(0, 2 ** 32 - 1), `cycle ${cycle}`),
        sizer,
        usageEndpoint,
        allowance,
        requestTimeoutMs: config.requestTimeoutMs,
        concurrency: config.concurrency,
        maxSeconds: Math.max(config.cycleSeconds, config.requestTimeoutMs / 1000),
      }).catch((err: unknown) =>
        skippedReport(`cycle failed: ${err instanceof Error ? err.message : String(err)}`),
      )
      report = await Promise.race([running, stopped])
      // A cycle abandoned mid-way keeps its whole reservation: what it sent is not known.
      if (report === 'stopped') break
      reservation.settle(report.spent)
    }
    sizer = report.sizer ?? sizer
    usageEndpoint = report.poolUsage?.endpoint ?? usageEndpoint
    const findings = [...report.findings]
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
        spent: report.spent,
        ...(report.skipped.length > 0 ? { skipped: report.skipped } : {}),
        ...(report.reason !== null ? { reason: report.reason } : {}),
      },
      'cycle',
    )
    if (outcome !== 'unreachable' && outcome !== 'skipped') {
      const changes = alerts.observe(cycle, findings)
      for (const alert of changes.fired) await announce(config, deps, 'firing', alert, cycle)
      for (const alert of changes.resolved) await announce(config, deps, 'resolved', alert, cycle)
      metrics.activeFindings.reset()
      for (const alert of alerts.list())
        metrics.activeFindings.inc({ verdict: alert.finding.verdict, probe: alert.finding.probe })
    }
    const waitMs = config.cycleSeconds * 1000 * (1 - jitter + 2 * jitter * rng.next())
    await sleep(waitMs, signal)
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
    deps.metrics.findings.inc({ verdict: finding.verdict, probe: finding.probe })
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
