/** Each kvfence worker's KV pages (from its `/server_info`) and guard trips (from its `/metrics`
 *  `kvfence_guard_trips_total`), read for the router's `/metrics`.
 *  Knows worker URLs and two metric names; knows nothing of requests. */
import type { WorkerStats } from './metrics.js'
import { samplesOf } from './prometheus-text.js'
import type { WorkerClient } from '../../control/worker-client.js'

/** Reads every worker once; a worker that does not answer is reported down, never omitted. */
export async function scrapeWorkerStats(workers: WorkerClient): Promise<WorkerStats[]> {
  const roles: [string, 'prefill' | 'decode'][] = [
    ...workers.prefillUrls.map((url) => [url, 'prefill'] as [string, 'prefill']),
    ...workers.decodeUrls.map((url) => [url, 'decode'] as [string, 'decode']),
  ]
  return Promise.all(
    roles.map(async ([url, role]): Promise<WorkerStats> => {
      try {
        const [info, text] = await Promise.all([workers.serverInfo(url), workers.metricsText(url)])
        const guardTrips: Record<string, number> = {}
        for (const s of samplesOf(text, 'kvfence_guard_trips_total')) {
          if (s.labels.guard !== undefined && Number.isFinite(s.value)) {
            guardTrips[s.labels.guard] = s.value
          }
        }
        return {
          url,
          role,
          isUp: true,
          numPagesUsed: info.numPagesUsed,
          numPagesFree: info.numPagesFree,
          guardTrips,
        }
      } catch {
        return { url, role, isUp: false, numPagesUsed: 0, numPagesFree: 0, guardTrips: {} }
      }
    }),
  )
}
