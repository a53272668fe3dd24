/** Probe `page-leak`: KV pool usage, read from whatever the endpoint exposes (see
 *  ../pool-usage.ts), must be at its idle baseline, the usage discovery read before any probe
 *  ran, when the probe starts, and return to it once a workload of normal and aborted requests
 *  is over. Pages that stay used after every request has ended are pages whose release path is
 *  broken (abort, timeout or transfer-failure paths): a pool that shrinks until the server
 *  refuses work, and pages that may later be read without being written. Earlier probes' aborts
 *  are such a workload too, which is why the baseline is taken before them.
 *  On usage, a warning at most: no data was seen crossing. The workload is tenants' canary
 *  prompts, though, and every answer is checked for another request's canary: one found (a cut
 *  request's pages handed on unscrubbed) is a leak (`content-leak`) beside that verdict. */
import { materialPromptTokens } from '../plan.js'
import { BudgetExhaustedError, type Budget } from '../budget.js'
import { readPoolUsage, readRunning, type PoolUsage } from '../pool-usage.js'
import type { Probe, ProbeContext } from '../probe.js'
import { inconclusiveRemediation } from '../probe.js'
import { createRng } from '../rng.js'
import type { Target } from '../target.js'
import type { Finding } from '../types.js'
import {
  crossingRemediation,
  findCrossings,
  leakFindings,
  plantMaterial,
  requestLog,
  type Observed,
  type Planted,
} from './material.js'

export { readPoolUsage, usageFromMetrics, type PoolUsage } from '../pool-usage.js'

/** A usage reading in time, for the evidence and the HTML plot. */
export interface UsageSample {
  /** Milliseconds since the probe started. */
  readonly tMs: number
  readonly phase: 'idle' | 'workload' | 'settle'
  readonly used: number
}

const numWorkload = 8
/** Most pool samples taken while the workload runs, one every {@link workloadSampleGapMs} or as
 *  fast as they are answered, until the workload has ended: a fast engine (the bundled model
 *  decodes 128 tokens in 10–20 ms) can finish every request between two sparse samples, and the
 *  plot should show the pool filling and draining as it was seen, not a line between two points. */
const maxWorkloadSamples = 40
const workloadSampleGapMs = 25
const pollIntervalMs = 200
const maxSettleMs = 10_000
const maxPolls = 40

export const pageLeakProbe: Probe = {
  name: 'page-leak',
  description:
    'KV pool usage (kvfence /server_info, vLLM/SGLang /metrics) must return to its idle baseline after a workload of normal and aborted requests',
  class: 'resource-leak',
  controls: { aisvs: [], guards: ['G7', 'G8'] },
  plan: () => [
    { what: 'long generation', numRequests: 1, tokensEach: materialPromptTokens + 128 },
    {
      what: 'workload, every other one cut',
      numRequests: numWorkload - 1,
      tokensEach: materialPromptTokens + 32,
    },
    {
      what: 'reads of pool usage (GET)',
      numRequests: 2 * maxPolls + maxWorkloadSamples,
      tokensEach: 0,
    },
  ],
  async run(target, budget, context): Promise<Finding[]> {
    const sampler = new Sampler(target)
    const state: Readings = { preAudit: null, baseline: null, settled: null, stoppedBy: null }
    const traffic: { planted: Planted[]; observed: Observed[] } = { planted: [], observed: [] }
    try {
      const early = await readBaseline(sampler, budget, context, state)
      if (early !== null) return early
      await sendWorkload(sampler, target, budget, { seed: context.seed, traffic })
      await settle(sampler, budget, state)
    } catch (err) {
      if (!(err instanceof BudgetExhaustedError)) throw err
      state.stoppedBy = err.message
    }
    // The workload is tenants' canary prompts, half of them cut: an answer carrying another
    // request's canary (a cut request's pages handed on unscrubbed) is a leak beside the verdict
    // on the pool's usage.
    const crossings = findCrossings(traffic.observed, traffic.planted)
    const leaks =
      crossings.length === 0
        ? []
        : leakFindings(
            'page-leak',
            crossings,
            traffic.planted,
            { requests: requestLog(traffic.observed) },
            crossingRemediation,
          )
    return [...leaks, ...judge(sampler, state, context)]
  },
}

/** Reads of pool usage in time, from the source the first read found. */
class Sampler {
  readonly startedAt = performance.now()
  readonly samples: UsageSample[] = []
  source: Omit<PoolUsage, 'used'> | null = null

  constructor(readonly target: Target) {}

  async sample(phase: UsageSample['phase']): Promise<number | null> {
    const usage = await readPoolUsage(this.target, this.source?.endpoint)
    if (usage === null) return null
    this.source ??= { endpoint: usage.endpoint, field: usage.field, unit: usage.unit }
    this.samples.push({
      tMs: Math.round(performance.now() - this.startedAt),
      phase,
      used: usage.used,
    })
    return usage.used
  }

  get elapsedMs(): number {
    return Math.round(performance.now() - this.startedAt)
  }
}

/** What the probe read: the pool before the audit (when discovery read the same source), the
 *  idle baseline, the usage after the workload settled, and why the budget stopped it. */
interface Readings {
  preAudit: number | null
  baseline: number | null
  settled: number | null
  stoppedBy: string | null
}

/** Sets the idle baseline; returns the finding when there is none to set (no usage exposed,
 *  usage moving while idle, pages held from before the probe), else null. */
async function readBaseline(
  sampler: Sampler,
  budget: Budget,
  context: ProbeContext,
  state: Readings,
): Promise<Finding[] | null> {
  // The pool as discovery read it, before any probe ran (null when read from another source).
  const before = context.discovery.idleUsage
  const first = await sampler.sample('idle')
  if (first === null) {
    return [
      inconclusiveFinding('the endpoint exposes no KV pool usage', { samples: sampler.samples }),
    ]
  }
  const src = sampler.source
  if (before !== null && src?.endpoint === before.endpoint && src.field === before.field)
    state.preAudit = before.used
  const { preAudit } = state
  if (preAudit !== null && first < preAudit) {
    return [
      inconclusiveFinding(
        `pool usage moved while idle (${preAudit} before the audit, ${first} now): other traffic hides the baseline`,
        { source: sampler.source, preAuditUsage: preAudit, samples: sampler.samples },
      ),
    ]
  }
  if (preAudit !== null && first > preAudit) {
    const held = await heldPages(sampler, budget, preAudit, first)
    if (held !== null) return held
  }
  const last = sampler.samples[sampler.samples.length - 1].used
  const second = await sampler.sample('idle')
  if (second !== last) {
    return [
      inconclusiveFinding(
        `pool usage moved while idle (${last} then ${second}): other traffic hides the baseline`,
        { source: sampler.source, samples: sampler.samples },
      ),
    ]
  }
  state.baseline = preAudit ?? last
  return null
}

/** Pages over the pre-audit baseline before this probe sent anything: waits (polling) for them
 *  to be released; the finding when they are not, null when they were. */
async function heldPages(
  sampler: Sampler,
  budget: Budget,
  preAudit: number,
  first: number,
): Promise<Finding[] | null> {
  const waitUntil = performance.now() + Math.min(maxSettleMs, budget.remainingMs - 500)
  let now = first
  for (let polls = 0; polls < maxPolls && now > preAudit; polls++) {
    if (performance.now() >= waitUntil) break
    await new Promise((r) => setTimeout(r, pollIntervalMs))
    now = (await sampler.sample('idle')) ?? now
  }
  if (now <= preAudit) return null
  const numRunning = await readRunning(sampler.target)
  return [
    heldPagesFinding(sampler.source, preAudit, now, numRunning, sampler.elapsedMs, sampler.samples),
  ]
}

/** One long generation keeps pages busy while usage is sampled (so the metric is seen to move);
 *  of the other requests, every other one is cut after its first chunk. */
async function sendWorkload(
  sampler: Sampler,
  target: Target,
  budget: Budget,
  { seed, traffic }: { seed: number; traffic: { planted: Planted[]; observed: Observed[] } },
): Promise<void> {
  const rng = createRng(seed, 'page-leak')
  const planted = plantMaterial(
    rng,
    target.tenants,
    Array.from({ length: numWorkload }, (_, i) => `w${i}`),
  )
  traffic.planted.push(...planted)
  const send = async (i: number, extra: { maxTokens: number; abortAfterChunks?: number }) => {
    const stream = i % 2 === 0
    const result = await target.complete({
      tenant: planted[i].tenant,
      prompt: planted[i].prompt,
      stream,
      ...extra,
    })
    const label = `workload ${i}${extra.abortAfterChunks === undefined ? '' : ', cut'}`
    traffic.observed.push({ planted: planted[i], label, stream, result })
    return result
  }
  const long = send(0, { maxTokens: 128 })
  // A sample that runs out of budget skips the allSettled below; the requests' own
  // rejections must not then go unhandled (that would end the process).
  long.catch(() => {})
  // The other requests run at most (concurrency − 2) at a time: one slot is the long
  // generation's, one stays free so that samples are not queued behind the workload (they
  // would only run once it had ended, and see an idle pool).
  const width = Math.max(1, budget.limits.concurrency - 2)
  const queue = planted.slice(1).map((_, k) => k + 1)
  const lane = async (): Promise<void> => {
    for (let i = queue.shift(); i !== undefined; i = queue.shift())
      await send(i, { maxTokens: 32, ...(i % 2 === 0 ? { abortAfterChunks: 1 } : {}) })
  }
  const rest = Array.from({ length: width }, lane)
  for (const r of rest) r.catch(() => {})
  let isWorkloadDone = false
  const workload = Promise.allSettled([long, ...rest]).finally(() => (isWorkloadDone = true))
  for (let n = 0; n < maxWorkloadSamples && !isWorkloadDone; n++) {
    await sampler.sample('workload')
    await new Promise((r) => setTimeout(r, workloadSampleGapMs))
  }
  for (const r of await workload)
    if (r.status === 'rejected' && !(r.reason instanceof BudgetExhaustedError)) throw r.reason
}

/** Polls until usage is back at the baseline (or the polls or the budget's time end). */
async function settle(sampler: Sampler, budget: Budget, state: Readings): Promise<void> {
  const settleUntil = performance.now() + Math.min(maxSettleMs, budget.remainingMs - 500)
  for (let polls = 0; polls < maxPolls && performance.now() < settleUntil; polls++) {
    state.settled = await sampler.sample('settle')
    if (state.settled !== null && state.settled <= state.baseline!) break
    await new Promise((r) => setTimeout(r, pollIntervalMs))
  }
}

/** Clean when usage moved during the workload and came back to the baseline; a warning when it
 *  did not come back; inconclusive when it could not be read to the end or never moved. */
function judge(sampler: Sampler, state: Readings, context: ProbeContext): Finding[] {
  const { samples, source } = sampler
  const { preAudit, baseline, settled, stoppedBy } = state
  // null, not Math.max()'s -Infinity, when no sample was read (out of budget before the first).
  const peak = samples.length === 0 ? null : Math.max(...samples.map((s) => s.used))
  const evidence = {
    source,
    preAuditUsage: preAudit,
    baseline,
    peak,
    settled,
    stoppedBy,
    samples,
  }
  context.log(
    samples.length === 0
      ? `pool usage not read (${stoppedBy ?? 'no answer'})`
      : `pool usage: idle ${baseline ?? '?'}, peak ${peak}, after ${settled ?? '?'}`,
  )
  if (baseline === null || settled === null) {
    return [
      inconclusiveFinding(
        `pool usage could not be read to the end (${stoppedBy ?? 'no answer'})`,
        evidence,
      ),
    ]
  }
  if (settled > baseline) {
    const unit = source?.unit === 'pages' ? ' pages' : ''
    return [
      {
        probe: 'page-leak',
        verdict: 'warning',
        severity: 'high',
        title: `KV pool usage did not return to its idle baseline: ${baseline}${unit} before, ${settled}${unit} after every request ended`,
        evidence,
        remediation:
          'Find the release path that forgets pages (abort, client disconnect, timeout, failed ' +
          'transfer): every page must go back to the free list, scrubbed, once nothing can ' +
          'still write into it. Until then the pool shrinks and stale pages accumulate.',
      },
    ]
  }
  if (peak === null || peak <= baseline) {
    return [
      inconclusiveFinding(
        'pool usage never moved during the workload: the metric may not be live',
        evidence,
      ),
    ]
  }
  return [
    {
      probe: 'page-leak',
      verdict: 'clean',
      severity: 'info',
      title: `KV pool usage returned to its idle baseline (${baseline}) after the workload (peak ${peak})`,
      evidence,
      remediation: 'None needed.',
    },
  ]
}

const inconclusiveRemediationOfPool =
  'Expose KV pool usage to the auditor (kvfence /server_info, vLLM /metrics ' +
  'vllm:kv_cache_usage_perc, SGLang /metrics sglang:token_usage) and run it while the ' +
  `endpoint is otherwise idle. ${inconclusiveRemediation}`

function inconclusiveFinding(title: string, evidence: Record<string, unknown>): Finding {
  return {
    probe: 'page-leak',
    verdict: 'inconclusive',
    severity: 'medium',
    title,
    evidence,
    remediation: inconclusiveRemediationOfPool,
  }
}

/** Pages still over the pre-audit baseline (`preAudit`) after waiting: a warning when nothing
 *  runs, or when the endpoint does not say (`numRunning` null); inconclusive when it reports
 *  requests running that are not the auditor's. */
function heldPagesFinding(
  source: Omit<PoolUsage, 'used'> | null,
  preAudit: number,
  held: number,
  numRunning: number | null,
  elapsedMs: number,
  samples: readonly UsageSample[],
): Finding {
  const evidence = {
    source,
    preAuditUsage: preAudit,
    held,
    numRunning,
    waitedMs: elapsedMs,
    samples,
  }
  if (numRunning !== null && numRunning > 0) {
    return inconclusiveFinding(
      `pool usage over its pre-audit baseline (${preAudit}, now ${held}) while the endpoint reports ${numRunning} requests running that are not the auditor's: other traffic hides the baseline`,
      evidence,
    )
  }
  const unit = source?.unit === 'pages' ? ' pages' : ''
  const running =
    numRunning === null
      ? "with none of the auditor's requests in flight"
      : 'while the endpoint reports 0 requests running'
  return {
    probe: 'page-leak',
    verdict: 'warning',
    severity: 'high',
    title: `KV pages held ${running}: ${held}${unit} in use before the workload, ${preAudit}${unit} before the audit, still after ${(elapsedMs / 1000).toFixed(1)} s`,
    evidence,
    remediation:
      'Find the release path earlier requests took (an abort, a client disconnect, a failed ' +
      'transfer) that keeps pages until a timeout: every page must go back to the free list, ' +
      'scrubbed, as soon as nothing can still write into it.',
  }
}
