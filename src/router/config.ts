/** The router's configuration: one typed value, built once (after G1), frozen.
 *  Knows limits and names; knows nothing of sockets or workers' addresses. */
import {
  type SentinelSettings,
  buildSentinelSettings,
  sentinelDefaults,
} from './sentinel/sentinel.js'

/** Everything the request handler needs to know about the deployment. */
export interface RouterConfig {
  /** Served model name: the only `model` accepted, the `id` in `/v1/models`. */
  readonly model: string
  /** Advertised context window (prompt + completion tokens), decided by G1. */
  readonly contextWindow: number
  /** min over all workers of KV capacity and max positions, in tokens (G1). */
  readonly effectiveCapacityTokens: number
  /** Tokens per KV page, as the workers report. */
  readonly pageSize: number
  /** False only in the incident's configuration (`--unsafe-disable-guards`). */
  readonly guardsEnabled: boolean
  /** Largest request body accepted, in bytes; larger → 413. */
  readonly maxBodyBytes: number
  /** `created` of the model in `/v1/models`, in Unix seconds. */
  readonly createdAtSec: number
  /** Log prompts and completions with each request (`--log-content`); off by default. */
  readonly logContent: boolean
  /** How long a graceful stop (SIGTERM) lets running requests finish before ending them, in
   *  seconds (`--drain-seconds`). */
  readonly drainSeconds: number
  /** The response sentinel (src/router/sentinel/). */
  readonly sentinel: SentinelSettings
}

/** Values of {@link RouterConfig} that have defaults. */
export const routerConfigDefaults = {
  guardsEnabled: true,
  maxBodyBytes: 1024 * 1024, // 1 MiB
  logContent: false,
  drainSeconds: 30,
  sentinel: sentinelDefaults,
} as const

/** Builds a frozen {@link RouterConfig}; unspecified fields take {@link routerConfigDefaults}. */
export function buildRouterConfig(
  fields: Pick<RouterConfig, 'model' | 'contextWindow' | 'effectiveCapacityTokens' | 'pageSize'> &
    Partial<Omit<RouterConfig, 'model' | 'contextWindow' | 'effectiveCapacityTokens' | 'pageSize'>>,
): RouterConfig {
  return Object.freeze({
    guardsEnabled: fields.guardsEnabled ?? routerConfigDefaults.guardsEnabled,
    maxBodyBytes: fields.maxBodyBytes ?? routerConfigDefaults.maxBodyBytes,
    createdAtSec: fields.createdAtSec ?? Math.floor(Date.now() / 1000),
    logContent: fields.logContent ?? routerConfigDefaults.logContent,
    drainSeconds: fields.drainSeconds ?? routerConfigDefaults.drainSeconds,
    model: fields.model,
    contextWindow: fields.contextWindow,
    effectiveCapacityTokens: fields.effectiveCapacityTokens,
    pageSize: fields.pageSize,
    sentinel: buildSentinelSettings(fields.sentinel ?? {}),
  })
}
