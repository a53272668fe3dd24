/** The watch's options: defaults, the `watch:` section of the audit's YAML config file, and the
 *  one validation that turns what the operator gave into a frozen {@link WatchConfig} or an
 *  `AuditError('invalid_options' | 'invalid_config')` with a one-line message (never a key).
 *
 *  ```yaml
 *  # the audit's config (target, model, tenants with keyEnv, seed) plus:
 *  watch:
 *    cycleSeconds: 30
 *    maxTokensPerHour: 100000
 *    maxRequestsPerHour: 1440
 *    metricsPort: 9464
 *    metricsHost: 127.0.0.1
 *    resolveAfterCycles: 10
 *    webhook: { url: https://alerts.example/hook, format: alertmanager }   # or slack
 *  ```
 *  Knows YAML and numbers; knows nothing of HTTP. */
import type { GivenCapacity } from '../discovery.js'
import { readFile } from 'node:fs/promises'
import { parse as parseYaml, stringify as stringifyYaml } from 'yaml'
import { z } from 'zod'
import { parseAuditConfig, sameTenantNameFault, type AuditConfigFile } from '../config.js'
import { normalizeBaseUrl } from '../run.js'
import { AuditError, type Tenant } from '../types.js'

export const webhookFormats = ['alertmanager', 'slack'] as const
export type WebhookFormat = (typeof webhookFormats)[number]

/** Defaults, each with its reason (docs/monitoring.md gives the arithmetic). */
export const watchDefaults = Object.freeze({
  /** Mean time between cycles (s); each wait is jittered ±20 % so cycles do not align with
   *  anything periodic on the endpoint. */
  cycleSeconds: 30,
  /** ~1 % of a small deployment: one GPU serving ~3,000 tokens/s (prompt + generated) is
   *  ~10.8 M tokens/hour; 1 % of that, rounded down. */
  maxTokensPerHour: 100_000,
  /** ~1 % of a small deployment serving 40 requests/s (144,000 per hour). */
  maxRequestsPerHour: 1_440,
  metricsPort: 9464,
  metricsHost: '127.0.0.1',
  /** A finding is resolved after this many completed cycles without it. */
  resolveAfterCycles: 10,
  /** Upper bound for one request (s); a cycle never lasts longer than its cycle time. */
  requestTimeoutSeconds: 20,
  /** Requests in flight at most during a cycle. */
  concurrency: 4,
})

/** The range of each numeric option, inclusive (`integer` false: any number, e.g. 0.3 s). One
 *  table read by {@link validateWatchOptions}, the config file's parser and the CLI's flag
 *  parsers, so a bad value is refused with the same range wherever it came from. */
export const watchBounds = Object.freeze({
  cycleSeconds: { min: 0.1, max: 86_400, integer: false },
  maxTokensPerHour: { min: 1, max: 1e12, integer: true },
  maxRequestsPerHour: { min: 1, max: 1e9, integer: true },
  metricsPort: { min: 0, max: 65_535, integer: true },
  resolveAfterCycles: { min: 1, max: 100_000, integer: true },
  requestTimeoutSeconds: { min: 1, max: 3600, integer: true },
})

/** `"must be an integer from 1 to 3600"` (or "a number") for one of {@link watchBounds}. */
export function describeWatchBound(bound: (typeof watchBounds)[keyof typeof watchBounds]): string {
  return `must be ${bound.integer ? 'an integer' : 'a number'} from ${bound.min} to ${bound.max}`
}

/** What the operator gave (flags merged over the file); every field optional but target and
 *  tenants. */
export interface WatchOptions {
  readonly target: string
  readonly tenants: readonly Tenant[]
  readonly model?: string
  /** `--context-window`, `--kv-pool-tokens` (tokens): used over what discovery reads. */
  readonly contextWindow?: number
  readonly kvPoolTokens?: number
  readonly seed?: number
  readonly cycleSeconds?: number
  readonly maxTokensPerHour?: number
  readonly maxRequestsPerHour?: number
  /** 0 picks a free port (printed at start). */
  readonly metricsPort?: number
  readonly metricsHost?: string
  readonly resolveAfterCycles?: number
  readonly requestTimeoutSeconds?: number
  readonly webhookUrl?: string
  readonly webhookFormat?: WebhookFormat
}

/** The validated, frozen configuration the watch runs with. */
export interface WatchConfig {
  /** Base URL without `/v1`, credentials or trailing slash. */
  readonly baseUrl: string
  readonly tenants: readonly Tenant[]
  readonly model: string | null
  /** Sizes the operator gave, used over what discovery reads (discovery.ts `withGiven`). */
  readonly given: GivenCapacity
  readonly seed: number
  readonly cycleSeconds: number
  readonly maxTokensPerHour: number
  readonly maxRequestsPerHour: number
  readonly metricsPort: number
  readonly metricsHost: string
  readonly resolveAfterCycles: number
  readonly requestTimeoutMs: number
  readonly concurrency: number
  readonly webhook: { readonly url: string; readonly format: WebhookFormat } | null
}

/** Validates `options` (throws `AuditError('invalid_options')`, one line, no key). */
export function validateWatchOptions(options: WatchOptions, seed: number): WatchConfig {
  const fail = (message: string): never => {
    throw new AuditError('invalid_options', message)
  }
  const baseUrl = normalizeBaseUrl(options.target, fail)
  if (options.tenants.length < 2) {
    fail(
      `need at least two monitoring tenants (--tenant NAME=env:VAR twice), got ${options.tenants.length}`,
    )
  }
  for (const tenant of options.tenants) {
    if (!/^[\w.@-]+$/.test(tenant.name))
      fail(`tenant name ${JSON.stringify(tenant.name)} is not a plain word`)
    if (tenant.key === '') fail(`tenant ${tenant.name} has an empty key`)
  }
  const same = sameTenantNameFault(options.tenants.map((t) => t.name))
  if (same !== null) fail(same)
  if (new Set(options.tenants.map((t) => t.key)).size < options.tenants.length)
    fail('two tenants share one key: give each its own')
  const int = (
    what: string,
    value: number | undefined,
    fallback: number,
    min: number,
    max: number,
  ) => {
    const n = value ?? fallback
    if (!Number.isInteger(n) || n < min || n > max)
      fail(`${what} must be an integer from ${min} to ${max}, got ${n}`)
    return n
  }
  const cycleSeconds = options.cycleSeconds ?? watchDefaults.cycleSeconds
  const cycleBound = watchBounds.cycleSeconds
  if (!(
    Number.isFinite(cycleSeconds) &&
    cycleSeconds >= cycleBound.min &&
    cycleSeconds <= cycleBound.max
  ))
    fail(`cycle seconds ${describeWatchBound(cycleBound)}, got ${cycleSeconds}`)
  let webhook: WatchConfig['webhook'] = null
  if (options.webhookUrl !== undefined) {
    let url: URL | null = null
    try {
      url = new URL(options.webhookUrl)
    } catch {
      fail('webhook is not a URL')
    }
    if (url !== null && url.protocol !== 'http:' && url.protocol !== 'https:')
      fail(`webhook must be an http(s) URL, got ${url.protocol}`)
    webhook = Object.freeze({
      url: options.webhookUrl,
      format: options.webhookFormat ?? 'alertmanager',
    })
  }
  if (options.webhookFormat !== undefined && !webhookFormats.includes(options.webhookFormat))
    fail(`webhook format must be one of ${webhookFormats.join(', ')}`)
  return Object.freeze({
    baseUrl,
    tenants: Object.freeze(options.tenants.map((t) => Object.freeze({ name: t.name, key: t.key }))),
    model: options.model ?? null,
    given: Object.freeze({
      ...(options.contextWindow === undefined
        ? {}
        : { contextTokens: int('context window', options.contextWindow, 0, 2, 1e9) }),
      ...(options.kvPoolTokens === undefined
        ? {}
        : { poolTokens: int('KV pool tokens', options.kvPoolTokens, 0, 2, 1e12) }),
    }),
    seed: int('seed', options.seed, seed, 0, 2 ** 32 - 1),
    cycleSeconds,
    maxTokensPerHour: int(
      'max tokens per hour',
      options.maxTokensPerHour,
      watchDefaults.maxTokensPerHour,
      watchBounds.maxTokensPerHour.min,
      watchBounds.maxTokensPerHour.max,
    ),
    maxRequestsPerHour: int(
      'max requests per hour',
      options.maxRequestsPerHour,
      watchDefaults.maxRequestsPerHour,
      watchBounds.maxRequestsPerHour.min,
      watchBounds.maxRequestsPerHour.max,
    ),
    metricsPort: int(
      'metrics port',
      options.metricsPort,
      watchDefaults.metricsPort,
      watchBounds.metricsPort.min,
      watchBounds.metricsPort.max,
    ),
    metricsHost: options.metricsHost ?? watchDefaults.metricsHost,
    resolveAfterCycles: int(
      'resolve after cycles',
      options.resolveAfterCycles,
      watchDefaults.resolveAfterCycles,
      watchBounds.resolveAfterCycles.min,
      watchBounds.resolveAfterCycles.max,
    ),
    requestTimeoutMs:
      int(
        'request timeout (s)',
        options.requestTimeoutSeconds,
        watchDefaults.requestTimeoutSeconds,
        watchBounds.requestTimeoutSeconds.min,
        watchBounds.requestTimeoutSeconds.max,
      ) * 1000,
    concurrency: watchDefaults.concurrency,
    webhook,
  })
}

/** A config field within its {@link watchBounds} (the error names the range; the caller names the
 *  key). */
function bounded(bound: (typeof watchBounds)[keyof typeof watchBounds]) {
  const n = bound.integer ? z.number().int(describeWatchBound(bound)) : z.number()
  const message = describeWatchBound(bound)
  return n.min(bound.min, message).max(bound.max, message).optional()
}

const WatchSection = z.strictObject({
  cycleSeconds: bounded(watchBounds.cycleSeconds),
  maxTokensPerHour: bounded(watchBounds.maxTokensPerHour),
  maxRequestsPerHour: bounded(watchBounds.maxRequestsPerHour),
  metricsPort: bounded(watchBounds.metricsPort),
  metricsHost: z.string().min(1).optional(),
  resolveAfterCycles: bounded(watchBounds.resolveAfterCycles),
  requestTimeoutSeconds: bounded(watchBounds.requestTimeoutSeconds),
  webhook: z
    .strictObject({ url: z.string().min(1), format: z.enum(webhookFormats).optional() })
    .optional(),
})

/** The audit's config file with its `watch:` section. */
export interface WatchConfigFile {
  readonly audit: AuditConfigFile
  readonly watch: Partial<Omit<WatchOptions, 'target' | 'tenants' | 'model' | 'seed'>>
}

/** Reads `file`: the `watch:` section here, everything else through the audit's own parser
 *  (same fields, same checks, keys from the environment). Throws `AuditError('invalid_config')`. */
export async function loadWatchConfig(
  file: string,
  env: Readonly<Record<string, string | undefined>>,
): Promise<WatchConfigFile> {
  let text: string
  try {
    text = await readFile(file, 'utf8')
  } catch (err) {
    const code = (err as { code?: string }).code ?? 'unreadable'
    throw new AuditError('invalid_config', `cannot read config ${file}: ${code}`)
  }
  let raw: unknown
  try {
    raw = parseYaml(text)
  } catch (err) {
    const first = (err instanceof Error ? err.message : String(err)).split('\n')[0]
    throw new AuditError('invalid_config', `config ${file} is not valid YAML: ${first}`)
  }
  const isMap = typeof raw === 'object' && raw !== null && !Array.isArray(raw)
  const { watch: rawWatch, ...rest } = isMap ? (raw as Record<string, unknown>) : {}
  const parsed = WatchSection.safeParse(rawWatch ?? {})
  if (!parsed.success) {
    const issue = parsed.error.issues[0]
    const where = ['watch', ...issue.path].join('.')
    throw new AuditError('invalid_config', `config ${file}: ${where}: ${issue.message}`)
  }
  const audit = parseAuditConfig(isMap ? stringifyYaml(rest) : text, file, env)
  const { webhook, ...numbers } = parsed.data
  return {
    audit,
    watch: { ...numbers, webhookUrl: webhook?.url, webhookFormat: webhook?.format },
  }
}
