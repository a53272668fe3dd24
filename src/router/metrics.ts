/** The router's Prometheus metrics, in a registry of their own (no global default registry).
 *  Knows counts and durations; knows nothing of prompts, texts or keys. */
import { Counter, Histogram, Registry } from 'prom-client'

/** The router's metrics and the registry that exposes them at `GET /metrics`. */
export interface RouterMetrics {
  readonly registry: Registry
  /** Finished requests by endpoint and HTTP status (499 = client went away). */
  readonly requests: Counter<'endpoint' | 'status'>
  /** Requests refused by admission (G2), by reason. */
  readonly admissionRejections: Counter<'reason'>
  /** Prompt tokens of admitted requests. */
  readonly promptTokens: Counter
  /** Tokens generated. */
  readonly completionTokens: Counter
  /** Seconds from request to last byte, by endpoint. */
  readonly requestSeconds: Histogram<'endpoint'>
}

/** Fresh metrics in a fresh registry. */
export function createRouterMetrics(): RouterMetrics {
  const registry = new Registry()
  const registers = [registry]
  return Object.freeze({
    registry,
    requests: new Counter({
      name: 'kvfence_router_requests_total',
      help: 'Finished requests by endpoint and HTTP status.',
      labelNames: ['endpoint', 'status'] as const,
      registers,
    }),
    admissionRejections: new Counter({
      name: 'kvfence_router_admission_rejections_total',
      help: 'Requests refused by admission (G2), by reason.',
      labelNames: ['reason'] as const,
      registers,
    }),
    promptTokens: new Counter({
      name: 'kvfence_router_prompt_tokens_total',
      help: 'Prompt tokens of admitted requests.',
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
  })
}
