/** KV pool usage and running requests, read from whatever an endpoint exposes (the same reading
 *  for discovery, before any probe runs, and for the page-leak probe). Sources, first found wins:
 *  - kvfence `/server_info`: `workers[].numPagesUsed` (pages, summed over workers);
 *  - SGLang `/get_server_info` or `/server_info`: `internal_states[].token_usage` (fraction);
 *  - `/metrics`: `kvfence_kv_pages_used` (pages), vLLM `vllm:kv_cache_usage_perc` or
 *    `vllm:gpu_cache_usage_perc` (fraction), SGLang `sglang:token_usage` (fraction).
 *  Requests running: `/metrics` `kvfence_router_requests_running`, vLLM
 *  `vllm:num_requests_running`, SGLang `sglang:num_running_reqs`, llama.cpp
 *  `llamacpp:requests_processing`, TGI `tgi_batch_current_size`.
 *  Knows field names of public APIs; knows nothing of how any engine works inside. */
import { tryJson, type Target } from './target.js'

/** One reading of KV pool usage: where it came from and its value (`pages`, or a `fraction` of
 *  the pool in [0, 1], summed over workers). */
export interface PoolUsage {
  readonly endpoint: string
  readonly field: string
  readonly unit: 'pages' | 'fraction'
  readonly used: number
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

/** Usage from a server-info JSON body read at `endpoint`, or null when it holds none. */
export function usageFromInfo(json: unknown, endpoint: string): PoolUsage | null {
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

/** Prometheus text: requests running (summed over label sets), or null when no known gauge is
 *  there. */
export function runningFromMetrics(text: string): number | null {
  const names = new Set([
    'kvfence_router_requests_running',
    'vllm:num_requests_running',
    'sglang:num_running_reqs',
    'llamacpp:requests_processing',
    'tgi_batch_current_size',
  ])
  let sum: number | null = null
  for (const line of text.split('\n')) {
    const m = /^([\w:]+)(\{[^}]*\})?\s+(\S+)/.exec(line)
    if (!m || !names.has(m[1])) continue
    const value = Number(m[3])
    if (Number.isFinite(value)) sum = (sum ?? 0) + value
  }
  return sum
}

/** Requests the endpoint says are running now (one `GET /metrics`), or null when it says
 *  nothing. Throws `BudgetExhaustedError` like every request. */
export async function readRunning(target: Target): Promise<number | null> {
  const res = await target.get('/metrics', { tenant: target.tenants[0] })
  return res.status === 200 ? runningFromMetrics(res.body) : null
}
