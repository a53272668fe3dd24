/** Samples of the cluster's health during a soak: resident memory of each process (from
 *  `/proc/PID/status`, Linux), the heap each retains after major GCs (its `/metrics`) and KV pages
 *  in use on each worker (its `/server_info`).
 *  Knows /proc, `/metrics` and the workers' `/server_info`; knows nothing of requests. */
import { readFileSync } from 'node:fs'
import { ServerInfo } from '../control/messages.js'
import { heapAfterMajorGcMetric } from '../common/process-metrics.js'
import { samplesOf } from '../router/metrics/prometheus-text.js'
import type { RssSample } from './types.js'

/** Resident set size of process `pid` in bytes (VmRSS), or null when it is gone or /proc has
 *  no such field (not Linux). */
export function rssBytes(pid: number): number | null {
  let status: string
  try {
    status = readFileSync(`/proc/${pid}/status`, 'utf8')
  } catch {
    return null
  }
  const match = /^VmRSS:\s+(\d+)\s+kB$/m.exec(status)
  return match ? Number(match[1]) * 1024 : null
}

/** Pages in use on the worker at `url` (`numPagesUsed` of its `/server_info`). Throws when the
 *  worker does not answer within `timeoutMs` or answers something else. */
export async function pagesUsed(url: string, timeoutMs = 5_000): Promise<number> {
  const res = await fetch(`${url}/server_info`, { signal: AbortSignal.timeout(timeoutMs) })
  if (!res.ok) throw new Error(`${url}/server_info: HTTP ${res.status}`)
  return ServerInfo.parse(await res.json()).numPagesUsed
}

/** The router's response-sentinel events so far: the sums of `kvfence_sentinel_suspected_total`
 *  and `kvfence_sentinel_confirmed_total` over their labels (0 when a counter has no sample yet).
 *  Throws when the router does not answer within `timeoutMs`. */
export async function sentinelCounts(
  routerUrl: string,
  timeoutMs = 5_000,
): Promise<{ suspected: number; confirmed: number }> {
  const res = await fetch(`${routerUrl}/metrics`, { signal: AbortSignal.timeout(timeoutMs) })
  if (!res.ok) throw new Error(`${routerUrl}/metrics: HTTP ${res.status}`)
  const text = await res.text()
  const sum = (name: string) => samplesOf(text, name).reduce((n, s) => n + s.value, 0)
  return {
    suspected: sum('kvfence_sentinel_suspected_total'),
    confirmed: sum('kvfence_sentinel_confirmed_total'),
  }
}

/** The router sentinel's window (its `/metrics` gauge `kvfence_sentinel_window_seconds`),
 *  seconds; null when the router reports none (sentinel off). Throws when the router does not
 *  answer within `timeoutMs`. */
export async function sentinelWindowSeconds(
  routerUrl: string,
  timeoutMs = 5_000,
): Promise<number | null> {
  const res = await fetch(`${routerUrl}/metrics`, { signal: AbortSignal.timeout(timeoutMs) })
  if (!res.ok) throw new Error(`${routerUrl}/metrics: HTTP ${res.status}`)
  return samplesOf(await res.text(), 'kvfence_sentinel_window_seconds')[0]?.value ?? null
}

/** The heap the process at `url` retained after its latest major GC (its `/metrics` gauge
 *  `kvfence_heap_used_after_major_gc_bytes`), bytes; null before its first major GC. Throws when
 *  the process does not answer within `timeoutMs` or serves no such gauge. */
export async function heapAfterMajorGc(url: string, timeoutMs = 5_000): Promise<number | null> {
  const res = await fetch(`${url}/metrics`, { signal: AbortSignal.timeout(timeoutMs) })
  if (!res.ok) throw new Error(`${url}/metrics: HTTP ${res.status}`)
  const [sample] = samplesOf(await res.text(), heapAfterMajorGcMetric)
  if (sample === undefined) throw new Error(`${url}/metrics has no ${heapAfterMajorGcMetric}`)
  return sample.value > 0 ? sample.value : null
}

/** Per process, the trend of the heap retained after major GCs over the load after warm-up. */
export interface HeapTrend {
  /** Distinct post-GC values seen after warm-up (one per major GC that changed it). */
  collections: number
  /** Fitted values at the end of warm-up and at the end of the load, bytes (0 with < 3 values). */
  fittedAfterWarmup: number
  fittedAtEnd: number
  /** Fitted slope, bytes per minute. */
  slopePerMinute: number
}

/** The retained-heap trend of each process: a least-squares line through the distinct post-GC
 *  values sampled after warm-up (a repeated value is the same collection sampled twice). Unlike
 *  RSS, this floor does not move when V8 merely grows its heap, so a rising line is a leak. */
export function heapTrends(
  samples: readonly RssSample[],
  loadMs: number,
  warmupFraction: number,
): Record<string, HeapTrend> {
  const warmupEnd = loadMs * warmupFraction
  const kept = samples.filter((s) => s.atMs >= warmupEnd && s.atMs <= loadMs)
  const names = [...new Set(kept.flatMap((s) => Object.keys(s.bytes)))]
  const out: Record<string, HeapTrend> = {}
  for (const name of names) {
    const distinct: RssSample[] = []
    for (const s of kept) {
      const value = s.bytes[name]
      if (value !== undefined && value !== distinct.at(-1)?.bytes[name]) distinct.push(s)
    }
    const hasLine = distinct.length >= 3
    const line = fitLine(distinct, (s) => s.bytes[name])
    out[name] = {
      collections: distinct.length,
      fittedAfterWarmup: hasLine ? line.at(warmupEnd) : 0,
      fittedAtEnd: hasLine ? line.at(loadMs) : 0,
      slopePerMinute: hasLine ? line.slope * 60_000 : 0,
    }
  }
  return out
}

/** What {@link rssGrowth} finds. */
export interface RssGrowth {
  /** The fitted summed RSS at the end of the load ÷ the fitted value at the end of warm-up; 0 when
   *  fewer than 3 samples follow warm-up. */
  ratio: number
  /** Fitted summed RSS at the end of warm-up and at the end of the load, bytes. */
  fittedAfterWarmup: number
  fittedAtEnd: number
  /** Per process, the fitted slope in bytes per minute. */
  slopePerMinute: Record<string, number>
  /** Whether at least 3 samples follow warm-up. */
  hasSamples: boolean
}

/** RSS growth over a load of `loadMs`: a least-squares line through the summed RSS of every sample
 *  after warm-up, read at the end of warm-up and at the end of the load. A garbage-collected
 *  process's RSS saws by tens of MB between collections, and one major collection can hand memory
 *  back for a while; comparing two short windows (medians or minima) then reads GC phase as growth
 *  or hides it, while a line through several GC cycles follows only what is retained. */
export function rssGrowth(
  samples: readonly RssSample[],
  loadMs: number,
  warmupFraction: number,
): RssGrowth {
  const warmupEnd = loadMs * warmupFraction
  const kept = samples.filter((s) => s.atMs >= warmupEnd && s.atMs <= loadMs)
  const names = [...new Set(kept.flatMap((s) => Object.keys(s.bytes)))]
  const slopePerMinute: Record<string, number> = {}
  for (const name of names)
    slopePerMinute[name] = fitLine(kept, (s) => s.bytes[name] ?? 0).slope * 60_000
  if (kept.length < 3)
    return { ratio: 0, fittedAfterWarmup: 0, fittedAtEnd: 0, slopePerMinute, hasSamples: false }
  const line = fitLine(kept, (s) => sumValues(s.bytes))
  const fittedAfterWarmup = line.at(warmupEnd)
  const fittedAtEnd = line.at(loadMs)
  return {
    ratio: fittedAfterWarmup > 0 ? fittedAtEnd / fittedAfterWarmup : 0,
    fittedAfterWarmup,
    fittedAtEnd,
    slopePerMinute,
    hasSamples: true,
  }
}

/** Ordinary least squares of `y(s)` on `s.atMs`: slope in bytes per ms and the line's value. */
function fitLine(samples: readonly RssSample[], y: (s: RssSample) => number) {
  const n = samples.length
  const meanX = samples.reduce((a, s) => a + s.atMs, 0) / n
  const meanY = samples.reduce((a, s) => a + y(s), 0) / n
  let sxy = 0
  let sxx = 0
  for (const s of samples) {
    sxy += (s.atMs - meanX) * (y(s) - meanY)
    sxx += (s.atMs - meanX) ** 2
  }
  const slope = sxx > 0 ? sxy / sxx : 0
  return { slope, at: (x: number) => meanY + slope * (x - meanX) }
}

/** Sum of a record's values. */
export function sumValues(record: Record<string, number>): number {
  return Object.values(record).reduce((a, b) => a + b, 0)
}
