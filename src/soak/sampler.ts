/** Samples of the cluster's health during a soak: resident memory of each process (from
 *  `/proc/PID/status`, Linux) and KV pages in use on each worker (its `/server_info`).
 *  Knows /proc and the workers' `/server_info`; knows nothing of requests. */
import { readFileSync } from 'node:fs'
import { ServerInfo } from '../engine/control.js'

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

/** The median of `values` (0 for none). */
export function median(values: readonly number[]): number {
  if (values.length === 0) return 0
  const sorted = [...values].sort((a, b) => a - b)
  const mid = sorted.length >> 1
  return sorted.length % 2 === 1 ? sorted[mid] : (sorted[mid - 1] + sorted[mid]) / 2
}
