/** The router's Prometheus metrics, in a registry of their own (no global default registry):
 *  requests by tenant and status, TTFT and TPOT, admission refusals, transfers, the queue, and
 *  each worker's KV pages and guard trips (read from the workers when scraped). `GET /metrics`
 *  appends the process's default metrics (src/common/process-metrics.ts).
 *  Knows counts and durations; knows nothing of prompts, texts or keys. */
import { Counter, Gauge, Histogram, Registry } from 'prom-client'

/** One worker's state as scraped from its `/server_info` and `/metrics`. */
export interface WorkerStats {
  /** The worker's control URL. */
  url: string
  role: string
  /** False when the worker did not answer; the other fields are then 0 / empty. */
  isUp: boolean
  numPagesUsed: number
  numPagesFree: number
  /** Trips by guard id (`G1`…`G10`), from the worker's `kvfence_guard_trips_total`. */
  guardTrips: Record<string, number>
}

/** The router's metrics and the registry that exposes them at `GET /metrics`. */
export interface RouterMetrics {
  readonly registry: Registry
  /** Finished requests by endpoint, tenant and HTTP status (499 = client went away). */
  readonly requests: Counter<'endpoint' | 'tenant' | 'status'>
  /** Requests refused before reaching a worker, by reason (`context_length_exceeded`,
   *  `tenant_limit`, `limit_store_unavailable`, `queue_full`, `pool_full`). */
  readonly admissionRejections: Counter<'reason'>
  /** Times a request found the decode worker's KV pool full and was tried again. */
  readonly poolFullRetries: Counter
  /** Prompt tokens of admitted requests. */
  readonly promptTokens: Counter
  /** Seconds an admitted request waited in the router queue for a running slot, by tenant. */
  readonly queueWaitSeconds: Histogram<'tenant'>
  /** Seconds a request that got KV room waited for it in all (its turns, not its tries), by
   *  tenant; 0 for one that found room at once. */
  readonly poolWaitSeconds: Histogram<'tenant'>
  /** Tokens generated. */
  readonly completionTokens: Counter
  /** Seconds from request to last byte, by endpoint. */
  readonly requestSeconds: Histogram<'endpoint'>
  /** Time to first token, seconds. */
  readonly ttftSeconds: Histogram<'endpoint'>
  /** Time per output token after the first, seconds. */
  readonly tpotSeconds: Histogram<'endpoint'>
  /** P→D KV transfers by outcome (`ok`, `failed`). */
  readonly transfers: Counter<'status'>
  /** KV pages transferred P→D. */
  readonly transferPages: Counter
  /** Answers the response sentinel found holding a run of another tenant's recent prompt, by
   *  action (`observed`, `blocked`); no tenant label, so that a metric names no tenant. */
  readonly sentinelSuspected: Counter<'action'>
  /** Answers holding a fragment of a canary tenant's canary, by action. */
  readonly sentinelConfirmed: Counter<'action'>
  /** Estimated bytes of the sentinel's fingerprints. */
  readonly sentinelBytes: Gauge
  /** The sentinel's cap on those bytes (`sentinel.maxBytes`). */
  readonly sentinelMaxBytes: Gauge
  /** How long the sentinel keeps a prompt's fingerprints and a canary (`sentinel.windowSeconds`). */
  readonly sentinelWindowSeconds: Gauge
}

/** Where gauges read live values at scrape time. */
export interface MetricSources {
  /** Requests running and queued in the router. */
  queue?: () => { numRunning: number; numQueued: number; numWaitingForRoom?: number }
  /** Every worker's state (scraped once per collection). */
  workers?: () => Promise<WorkerStats[]>
  /** Gateway mode: the last isolation self-check's result on each path (empty before it). */
  isolation?: () => readonly { endpoint: string; result: string }[]
}

/** Fresh metrics in a fresh registry. */
export function createRouterMetrics(sources: MetricSources = {}): RouterMetrics {
  const registry = new Registry()
  const registers = [registry]
  const latency = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]

  if (sources.queue) registerQueueGauges(sources.queue, registers)
  if (sources.workers) registerWorkerGauges(sources.workers, registers)
  if (sources.isolation) registerIsolationGauge(sources.isolation, registers)

  return Object.freeze({
    registry,
    requests: new Counter({
      name: 'kvfence_router_requests_total',
      help: 'Finished requests by endpoint, tenant and HTTP status.',
      labelNames: ['endpoint', 'tenant', 'status'] as const,
      registers,
    }),
    admissionRejections: new Counter({
      name: 'kvfence_router_admission_rejections_total',
      help: 'Requests refused before reaching a worker, by reason.',
      labelNames: ['reason'] as const,
      registers,
    }),
    poolFullRetries: new Counter({
      name: 'kvfence_router_pool_full_retries_total',
      help: 'Times a request found the KV pool full and was tried again.',
      registers,
    }),
    promptTokens: new Counter({
      name: 'kvfence_router_prompt_tokens_total',
      help: 'Prompt tokens of admitted requests.',
      registers,
    }),
    queueWaitSeconds: new Histogram({
      name: 'kvfence_router_queue_wait_seconds',
      help: 'Seconds an admitted request waited in the router queue for a running slot, by tenant.',
      labelNames: ['tenant'] as const,
      buckets: [0.001, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60],
      registers,
    }),
    poolWaitSeconds: new Histogram({
      name: 'kvfence_router_pool_wait_seconds',
      help: 'Seconds a request waited for room in a full KV pool before the workers took it, by tenant.',
      labelNames: ['tenant'] as const,
      buckets: [0.001, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60],
      registers,
    }),
    completionTokens: new Counter({
      name: 'kvfence_router_completion_tokens_total',
      help: 'Generated tokens.',
      registers,
    }),
    requestSeconds: new Histogram({
      name: 'kvfence_router_request_seconds',
      help: 'Seconds from request to the last byte of the response.',
      labelNames: ['endpoint'] as const,
      buckets: [0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120],
      registers,
    }),
    ttftSeconds: new Histogram({
      name: 'kvfence_router_ttft_seconds',
      help: 'Time to first token: seconds from request to the first generated token.',
      labelNames: ['endpoint'] as const,
      buckets: latency,
      registers,
    }),
    tpotSeconds: new Histogram({
      name: 'kvfence_router_tpot_seconds',
      help: 'Time per output token after the first, seconds.',
      labelNames: ['endpoint'] as const,
      buckets: [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1],
      registers,
    }),
    transfers: new Counter({
      name: 'kvfence_router_transfers_total',
      help: 'P->D KV transfers by outcome.',
      labelNames: ['status'] as const,
      registers,
    }),
    transferPages: new Counter({
      name: 'kvfence_router_transfer_pages_total',
      help: 'KV pages transferred P->D.',
      registers,
    }),
    sentinelSuspected: new Counter({
      name: 'kvfence_sentinel_suspected_total',
      help: "Answers holding a run of another tenant's recent prompt text, by action.",
      labelNames: ['action'] as const,
      registers,
    }),
    sentinelConfirmed: new Counter({
      name: 'kvfence_sentinel_confirmed_total',
      help: "Answers holding a fragment of a canary tenant's canary, by action.",
      labelNames: ['action'] as const,
      registers,
    }),
    sentinelBytes: new Gauge({
      name: 'kvfence_sentinel_fingerprint_bytes',
      help: "Estimated bytes of the response sentinel's prompt fingerprints.",
      registers,
    }),
    sentinelMaxBytes: new Gauge({
      name: 'kvfence_sentinel_fingerprint_max_bytes',
      help: "The response sentinel's cap on its fingerprints' estimated bytes (sentinel.maxBytes).",
      registers,
    }),
    sentinelWindowSeconds: new Gauge({
      name: 'kvfence_sentinel_window_seconds',
      help: "How long the response sentinel keeps a prompt's fingerprints and a canary (sentinel.windowSeconds).",
      registers,
    }),
  })
}

/** Gauges of the router's running, queued and room-waiting requests, read from `queue`. */
function registerQueueGauges(
  queue: NonNullable<MetricSources['queue']>,
  registers: Registry[],
): void {
  new Gauge({
    name: 'kvfence_router_requests_running',
    help: 'Requests holding a running slot.',
    registers,
    collect() {
      this.set(queue().numRunning)
    },
  })
  new Gauge({
    name: 'kvfence_router_requests_waiting_for_room',
    help: 'Requests waiting for room in a full KV pool.',
    registers,
    collect() {
      this.set(queue().numWaitingForRoom ?? 0)
    },
  })
  new Gauge({
    name: 'kvfence_router_requests_queued',
    help: 'Requests waiting in the bounded queue.',
    registers,
    collect() {
      this.set(queue().numQueued)
    },
  })
}

/** Gateway mode: 1 for each path's last isolation self-check result (`isolated`, `shared`,
 *  `salt-refused`, `cannot-tell`); an alert on `result!="isolated"` names the path. */
function registerIsolationGauge(
  isolation: NonNullable<MetricSources['isolation']>,
  registers: Registry[],
): void {
  new Gauge({
    name: 'kvfence_gateway_path_isolation',
    help: "The engine's isolation self-check result per gateway path (1 = the current result).",
    labelNames: ['endpoint', 'result'] as const,
    registers,
    collect() {
      this.reset()
      for (const { endpoint, result } of isolation()) this.set({ endpoint, result }, 1)
    },
  })
}

/** Gauges of every worker's pages and guard trips, filled from one scrape per collection. */
function registerWorkerGauges(scrape: () => Promise<WorkerStats[]>, registers: Registry[]): void {
  // prom-client collects each gauge on its own: share one scrape among them.
  let pending: Promise<WorkerStats[]> | null = null
  const stats = () => {
    pending ??= scrape().finally(() => setImmediate(() => (pending = null)))
    return pending
  }
  const labelNames = ['worker', 'role'] as const
  new Gauge({
    name: 'kvfence_worker_up',
    help: 'Whether the worker answered the router (1) or not (0).',
    labelNames,
    registers,
    async collect() {
      this.reset()
      for (const w of await stats()) this.set({ worker: w.url, role: w.role }, w.isUp ? 1 : 0)
    },
  })
  new Gauge({
    name: 'kvfence_worker_kv_pages_used',
    help: 'KV pool pages owned by requests, per worker.',
    labelNames,
    registers,
    async collect() {
      this.reset()
      for (const w of await stats()) {
        if (w.isUp) this.set({ worker: w.url, role: w.role }, w.numPagesUsed)
      }
    },
  })
  new Gauge({
    name: 'kvfence_worker_kv_pages_free',
    help: 'KV pool pages on the free list, per worker.',
    labelNames,
    registers,
    async collect() {
      this.reset()
      for (const w of await stats()) {
        if (w.isUp) this.set({ worker: w.url, role: w.role }, w.numPagesFree)
      }
    },
  })
  new Gauge({
    name: 'kvfence_worker_guard_trips_total',
    help: 'Times a worker guard refused an operation, per worker and guard.',
    labelNames: ['worker', 'role', 'guard'] as const,
    registers,
    async collect() {
      this.reset()
      for (const w of await stats()) {
        for (const [guard, n] of Object.entries(w.guardTrips)) {
          this.set({ worker: w.url, role: w.role, guard }, n)
        }
      }
    },
  })
}
