/** The watch's Prometheus metrics, in a registry of its own, and the HTTP server that exposes
 *  them at `GET /metrics` (prom-client's text format). docs/monitoring.md lists them and the
 *  alert rules in deploy/ read them.
 *  Knows counts, times and tenant names; knows nothing of keys or answer texts. */
import { createServer, type Server } from 'node:http'
import type { AddressInfo } from 'node:net'
import { Counter, Gauge, Histogram, Registry, collectDefaultMetrics } from 'prom-client'

/** The watch's metrics. */
export interface WatchMetrics {
  readonly registry: Registry
  /** Cycles by outcome: clean, finding, inconclusive, unreachable, skipped. */
  readonly cycles: Counter<'outcome'>
  /** New findings (one per alert fired) by verdict and probe. */
  readonly findings: Counter<'verdict' | 'probe'>
  /** Alerts firing now, by verdict and probe. */
  readonly activeFindings: Gauge<'verdict' | 'probe'>
  /** Unix seconds of the last cycle that ended clean or with a finding; the start time until
   *  then (so "no successful cycle for 5 minutes" also fires for a watch that never succeeds). */
  readonly lastSuccess: Gauge
  readonly inconclusiveCycles: Counter
  readonly tokensSpent: Counter
  readonly requestsSent: Counter
  /** Seconds from sending a completion to its end (or its cut), by trigger. */
  readonly answerSeconds: Histogram<'trigger'>
  /** 1 while the endpoint does not answer, else 0. */
  readonly targetUnreachable: Gauge
  /** Advertised context minus the effective pool (tokens) at the last read; 0 when it fits. */
  readonly capacityGap: Gauge
  /** KV pool usage read at the start of the last cycle (pages or a fraction, as exposed). */
  readonly idlePoolUsage: Gauge
  /** The hourly budget: what may be spent, and what was spent in the last hour. */
  readonly budgetLimit: Gauge<'resource'>
  readonly budgetSpent: Gauge<'resource'>
}

/** A fresh registry with every watch metric (and the process's default metrics). */
export function createWatchMetrics(): WatchMetrics {
  const registry = new Registry()
  collectDefaultMetrics({ register: registry })
  const registers = [registry]
  const metrics: WatchMetrics = {
    registry,
    cycles: new Counter({
      name: 'kvfence_watch_cycles_total',
      help: 'Watch cycles by outcome (clean, finding, inconclusive, unreachable, skipped).',
      labelNames: ['outcome'],
      registers,
    }),
    findings: new Counter({
      name: 'kvfence_watch_findings_total',
      help: 'New findings (one per alert fired) by verdict and probe.',
      labelNames: ['verdict', 'probe'],
      registers,
    }),
    activeFindings: new Gauge({
      name: 'kvfence_watch_active_findings',
      help: 'Findings firing now (seen and not yet resolved), by verdict and probe.',
      labelNames: ['verdict', 'probe'],
      registers,
    }),
    lastSuccess: new Gauge({
      name: 'kvfence_watch_last_success_timestamp_seconds',
      help: 'Unix time of the last cycle that ended clean or with a finding (start time until then).',
      registers,
    }),
    inconclusiveCycles: new Counter({
      name: 'kvfence_watch_inconclusive_cycles_total',
      help: 'Cycles that could not tell (plant refused, no answer read whole).',
      registers,
    }),
    tokensSpent: new Counter({
      name: 'kvfence_watch_tokens_spent_total',
      help: 'Tokens spent (prompt + max_tokens; upper bounds where the server reported no count).',
      registers,
    }),
    requestsSent: new Counter({
      name: 'kvfence_watch_requests_sent_total',
      help: 'Requests sent to the endpoint (reads and completions).',
      registers,
    }),
    answerSeconds: new Histogram({
      name: 'kvfence_watch_answer_seconds',
      help: 'Seconds from sending a completion to its end, by trigger.',
      labelNames: ['trigger'],
      buckets: [0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 60],
      registers,
    }),
    targetUnreachable: new Gauge({
      name: 'kvfence_watch_target_unreachable',
      help: '1 while the endpoint does not answer, else 0.',
      registers,
    }),
    capacityGap: new Gauge({
      name: 'kvfence_watch_capacity_gap_tokens',
      help: 'Advertised context minus the effective KV pool (tokens); 0 when it fits.',
      registers,
    }),
    idlePoolUsage: new Gauge({
      name: 'kvfence_watch_idle_pool_usage',
      help: 'KV pool usage read at the start of the last cycle (pages, or a fraction of the pool).',
      registers,
    }),
    budgetLimit: new Gauge({
      name: 'kvfence_watch_budget_per_hour',
      help: 'The hourly budget, by resource (tokens, requests).',
      labelNames: ['resource'],
      registers,
    }),
    budgetSpent: new Gauge({
      name: 'kvfence_watch_budget_spent_last_hour',
      help: 'Spent in the last hour, by resource (tokens, requests).',
      labelNames: ['resource'],
      registers,
    }),
  }
  metrics.lastSuccess.set(Date.now() / 1000)
  metrics.targetUnreachable.set(0)
  return metrics
}

/** Serves `GET /metrics` on `host:port` (0 picks a port); resolves once listening. Throws the
 *  listen error (e.g. EADDRINUSE) with the address in its message. */
export async function serveMetrics(
  registry: Registry,
  host: string,
  port: number,
): Promise<{ readonly server: Server; readonly url: string }> {
  const server = createServer((req, res) => {
    if (req.method !== 'GET' || (req.url ?? '').split('?')[0] !== '/metrics') {
      res.writeHead(404, { 'content-type': 'text/plain' }).end('not found\n')
      return
    }
    registry.metrics().then(
      (text) => res.writeHead(200, { 'content-type': registry.contentType }).end(text),
      (err: unknown) => res.writeHead(500).end(String(err)),
    )
  })
  await new Promise<void>((resolve, reject) => {
    server.once('error', (err: NodeJS.ErrnoException) =>
      reject(new Error(`cannot serve metrics on ${host}:${port}: ${err.code ?? err.message}`)),
    )
    server.listen(port, host, () => resolve())
  })
  const address = server.address() as AddressInfo
  const shownHost = address.family === 'IPv6' ? `[${address.address}]` : address.address
  return { server, url: `http://${shownHost}:${address.port}/metrics` }
}
