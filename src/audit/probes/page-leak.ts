/** Probe `page-leak`: KV pool usage, read from whatever the endpoint exposes, must return to its
 *  idle baseline once a workload of normal and aborted requests is over. Pages that stay used
 *  after every request has ended are pages whose release path is broken (abort, timeout or
 *  transfer-failure paths): a pool that shrinks until the server refuses work, and pages that may
 *  later be read without being written. Usage sources, first found wins:
 *  - kvfence `/server_info`: `workers[].numPagesUsed` (pages, summed over workers);
 *  - SGLang `/get_server_info` or `/server_info`: `internal_states[].token_usage` (fraction);
 *  - `/metrics`: `kvfence_kv_pages_used` (pages), vLLM `vllm:kv_cache_usage_perc` or
 *    `vllm:gpu_cache_usage_perc` (fraction), SGLang `sglang:token_usage` (fraction).
 *  A warning, never a leak: no data was seen crossing. */
import { BudgetExhaustedError } from '../budget.js'
import type { Probe } from '../probe.js'
import { inconclusiveRemediation } from '../probe.js'
import { createRng } from '../rng.js'
import { tryJson, type Target } from '../target.js'
import type { Finding } from '../types.js'
import { plantMaterial } from './material.js'

/** One reading of KV pool usage: where it came from and its value (`pages`, or a `fraction` of
 *  the pool in [0, 1], summed over workers). */
export interface PoolUsage {
  readonly endpoint: string
  readonly field: string
  readonly unit: 'pages' | 'fraction'
  readonly used: number
}

/** A usage reading in time, for the evidence and the HTML plot. */
export interface UsageSample {
  /** Milliseconds since the probe started. */
  readonly tMs: number
  readonly phase: 'idle' | 'workload' | 'settle'
  readonly used: number
}

const numWorkload = 8
/** Most pool samples taken while the workload runs: a fast engine (the bundled model decodes 128
 *  tokens in 10–20 ms) can finish every request between two fixed samples, so sampling goes on,
 *  back to back, until the pool is seen in use or the workload has ended. */
const maxWorkloadSamples = 16
const pollIntervalMs = 200
const maxSettleMs = 10_000
const maxPolls = 40

export const pageLeakProbe: Probe = {
  name: 'page-leak',
  description:
    'KV pool usage (kvfence /server_info, vLLM/SGLang /metrics) must return to its idle baseline after a workload of normal and aborted requests',
  async run(target, budget, context): Promise<Finding[]> {
    const startedAt = performance.now()
    const samples: UsageSample[] = []
    let source: Omit<PoolUsage, 'used'> | null = null
    const sample = async (phase: UsageSample['phase']): Promise<number | null> => {
      const usage = await readPoolUsage(target, source?.endpoint)
      if (usage === null) return null
      source ??= { endpoint: usage.endpoint, field: usage.field, unit: usage.unit }
      samples.push({ tMs: Math.round(performance.now() - startedAt), phase, used: usage.used })
      return usage.used
    }
    const inconclusive = (title: string, evidence: Record<string, unknown>): Finding[] => [
      {
        probe: 'page-leak',
        verdict: 'inconclusive',
        severity: 'medium',
        title,
        evidence,
        remediation:
          'Expose KV pool usage to the auditor (kvfence /server_info, vLLM /metrics ' +
          'vllm:kv_cache_usage_perc, SGLang /metrics sglang:token_usage) and run it while the ' +
          `endpoint is otherwise idle. ${inconclusiveRemediation}`,
      },
    ]

    let stoppedBy: string | null = null
    let baseline: number | null = null
    let settled: number | null = null
    try {
      const first = await sample('idle')
      if (first === null) {
        return inconclusive('the endpoint exposes no KV pool usage', { samples })
      }
      const second = await sample('idle')
      if (second !== first) {
        return inconclusive(
          `pool usage moved while idle (${first} then ${second}): other traffic hides the baseline`,
          { source, samples },
        )
      }
      baseline = first

      const rng = createRng(context.seed, 'page-leak')
      const planted = plantMaterial(
        rng,
        target.tenants,
        Array.from({ length: numWorkload }, (_, i) => `w${i}`),
      )
      // One long generation keeps pages busy while usage is sampled (so the metric is seen to
      // move); of the other requests, every other one is cut after its first chunk.
      const send = (i: number, extra: { maxTokens: number; abortAfterChunks?: number }) =>
        target.complete({
          tenant: planted[i].tenant,
          prompt: planted[i].prompt,
          stream: i % 2 === 0,
          ...extra,
        })
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
        const used = await sample('workload')
        if (used !== null && used > baseline) break
      }
      for (const r of await workload)
        if (r.status === 'rejected' && !(r.reason instanceof BudgetExhaustedError)) throw r.reason

      const settleUntil = performance.now() + Math.min(maxSettleMs, budget.remainingMs - 500)
      for (let polls = 0; polls < maxPolls && performance.now() < settleUntil; polls++) {
        settled = await sample('settle')
        if (settled !== null && settled <= baseline) break
        await new Promise((r) => setTimeout(r, pollIntervalMs))
      }
    } catch (err) {
      if (!(err instanceof BudgetExhaustedError)) throw err
      stoppedBy = err.message
    }

    // null, not Math.max()'s -Infinity, when no sample was read (out of budget before the first).
    const peak = samples.length === 0 ? null : Math.max(...samples.map((s) => s.used))
    const evidence = { source, baseline, peak, settled, stoppedBy, samples }
    context.log(
      samples.length === 0
        ? `pool usage not read (${stoppedBy ?? 'no answer'})`
        : `pool usage: idle ${baseline ?? '?'}, peak ${peak}, after ${settled ?? '?'}`,
    )
    if (baseline === null || settled === null) {
      return inconclusive(
        `pool usage could not be read to the end (${stoppedBy ?? 'no answer'})`,
        evidence,
      )
    }
    if (settled > baseline) {
      const unit = (source as PoolUsage | null)?.unit === 'pages' ? ' pages' : ''
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
      return inconclusive(
        'pool usage never moved during the workload: the metric may not be live',
        evidence,
      )
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
  },
}

/** The endpoint's current KV pool usage, or null when it exposes none. `preferred` (an endpoint
 *  that answered before) is asked first so that every sample reads the same source. */
export async function readPoolUsage(target: Target, preferred?: string): Promise<PoolUsage | null> {
  const tenant = target.tenants[0]
  const endpoints = ['/server_info', '/get_server_info', '/metrics']
  const order = preferred ? [preferred] : endpoints
  for (const endpoint of order) {
    const res = await target.get(endpoint, { tenant })
    if (res.status !== 200) continue
    const usage =
      endpoint === '/metrics'
        ? usageFromMetrics(res.body)
        : usageFromInfo(tryJson(res.body), endpoint)
    if (usage !== null) return usage
  }
  return null
}

function usageFromInfo(json: unknown, endpoint: string): PoolUsage | null {
  if (typeof json !== 'object' || json === null) return null
  const info = json as Record<string, unknown>
  if (Array.isArray(info.workers)) {
    const used = info.workers.map((w) => (w as Record<string, unknown>)?.numPagesUsed)
    if (used.length > 0 && used.every((n) => typeof n === 'number')) {
      return {
        endpoint,
        field: 'workers[].numPagesUsed',
        unit: 'pages',
        used: (used as number[]).reduce((a, b) => a + b, 0),
      }
    }
  }
  if (Array.isArray(info.internal_states)) {
    const used = info.internal_states.map((s) => (s as Record<string, unknown>)?.token_usage)
    if (used.length > 0 && used.every((n) => typeof n === 'number')) {
      return {
        endpoint,
        field: 'internal_states[].token_usage',
        unit: 'fraction',
        used: (used as number[]).reduce((a, b) => a + b, 0),
      }
    }
  }
  return null
}

/** Prometheus text: the sum over label sets of the first usage metric found. */
export function usageFromMetrics(text: string): PoolUsage | null {
  const metrics: [string, PoolUsage['unit']][] = [
    ['kvfence_kv_pages_used', 'pages'],
    ['vllm:kv_cache_usage_perc', 'fraction'],
    ['vllm:gpu_cache_usage_perc', 'fraction'],
    ['sglang:token_usage', 'fraction'],
  ]
  for (const [name, unit] of metrics) {
    let sum = 0
    let isFound = false
    for (const line of text.split('\n')) {
      const m = /^([\w:]+)(\{[^}]*\})?\s+(\S+)/.exec(line)
      if (!m || m[1] !== name) continue
      const value = Number(m[3])
      if (!Number.isFinite(value)) continue
      sum += value
      isFound = true
    }
    if (isFound) return { endpoint: '/metrics', field: name, unit, used: sum }
  }
  return null
}
