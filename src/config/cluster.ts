/** The cluster config file: one YAML file for the whole deployment — the router, its workers (to
 *  start here with their pool sizes, or already running at a URL) or the engine it fronts
 *  (gateway mode), and the tenants with their limits. Parsed once with zod into a frozen value;
 *  a bad file is a one-line `config_invalid` error naming the file and the field.
 *
 *  ```yaml
 *  model: ./models/echo-tiny          # tokenizer (and weights for workers started here)
 *  router: { host: 127.0.0.1, port: 8000, maxConcurrentRequests: 64, maxQueuedRequests: 256 }
 *  workers:
 *    pageSize: 16
 *    prefill: [{ pages: 64 }]          # started here …
 *    decode: [{ url: http://10.0.0.7:8102 }]   # … or already running elsewhere
 *  tenants:
 *    - { name: alice, keySha256: <64 hex>, limits: { maxConcurrentRequests: 4, tokensPerMinute: 100000 } }
 *  ```
 *  Knows the file's shape and defaults; knows nothing of starting processes or serving. */
import { readFileSync } from 'node:fs'
import { dirname, isAbsolute, resolve } from 'node:path'
import { parse as parseYaml } from 'yaml'
import { z } from 'zod'
import { KvfenceError } from '../errors.js'
import { queueLimitDefaults } from '../router/limits.js'
import { TenantRecord } from '../router/tenants.js'

const port = z.number().int().min(0).max(65535)
const positive = z.number().int().min(1)
const httpUrl = z.url({ protocol: /^https?$/, error: 'must be an http(s) URL' })

/** The router's section. */
export const RouterSection = z.strictObject({
  host: z.string().min(1).default('127.0.0.1'),
  port: port.default(8000),
  /** Served model name; default: what the workers report. */
  modelName: z.string().min(1).optional(),
  /** Advertised context window; default: the effective capacity (G1). */
  contextWindow: positive.optional(),
  clampContext: z.boolean().default(false),
  maxBodyBytes: positive.default(1024 * 1024),
  maxConcurrentRequests: positive.default(queueLimitDefaults.maxConcurrentRequests),
  maxQueuedRequests: z.number().int().min(0).default(queueLimitDefaults.maxQueuedRequests),
  maxQueueWaitMs: z.number().int().min(0).default(queueLimitDefaults.maxQueueWaitMs),
  logContent: z.boolean().default(false),
  logLevel: z.enum(['fatal', 'error', 'warn', 'info', 'debug', 'trace', 'silent']).default('info'),
})

/** A worker: started here with a pool of `pages`, or already running at `url`. */
export const WorkerEntry = z.union(
  [z.strictObject({ pages: positive }), z.strictObject({ url: httpUrl })],
  { error: 'a worker is { pages: N } (started here) or { url: http://host:port } (running)' },
)
export type WorkerEntry = z.infer<typeof WorkerEntry>

/** Native kvfence workers. */
export const WorkersSection = z.strictObject({
  /** Tokens per KV page of the workers started here. */
  pageSize: positive.default(16),
  prefill: z.array(WorkerEntry).min(1),
  decode: z.array(WorkerEntry).min(1),
})

/** Gateway mode: the engine behind the router. */
export const BackendSection = z.strictObject({
  kind: z.enum(['sglang', 'vllm']),
  url: httpUrl,
  /** The engine's model id; default: the first it lists. */
  model: z.string().min(1).optional(),
  /** A directory with the engine's tokenizer.json; default: the engine's /tokenize. */
  tokenizerDir: z.string().min(1).optional(),
  discoveryIntervalMs: z.number().int().min(0).default(30_000),
  /** Name of an environment variable holding the engine's API key (never the key itself). */
  apiKeyEnv: z.string().min(1).optional(),
})

/** The whole file. */
export const ClusterConfig = z
  .strictObject({
    /** Model directory; relative paths are relative to the config file. */
    model: z.string().min(1).optional(),
    router: RouterSection.default(RouterSection.parse({})),
    workers: WorkersSection.optional(),
    backend: BackendSection.optional(),
    tenants: z.array(TenantRecord).min(1, 'tenants must list at least one tenant'),
  })
  .refine((c) => (c.workers === undefined) !== (c.backend === undefined), {
    error: 'give either workers (kvfence prefill/decode) or backend (gateway mode), not both',
    path: ['workers'],
  })
export type ClusterConfig = z.infer<typeof ClusterConfig>

/** Parses a config value; throws `config_invalid` "`source`: `field`: problem". Relative paths
 *  are resolved against `baseDir`. The result is frozen. */
export function parseClusterConfig(value: unknown, source: string, baseDir: string): ClusterConfig {
  const parsed = ClusterConfig.safeParse(value ?? {})
  if (!parsed.success) {
    const issue = parsed.error.issues[0]
    const field = issue.path.map(String).join('.')
    throw new KvfenceError(
      'config_invalid',
      `${source}: ${field === '' ? '' : `${field}: `}${issue.message}`,
    )
  }
  const config = parsed.data
  const at = (p: string | undefined) => (p === undefined || isAbsolute(p) ? p : resolve(baseDir, p))
  const names = new Set<string>()
  for (const t of config.tenants) {
    if (names.has(t.name))
      throw new KvfenceError('config_invalid', `${source}: tenants: duplicate name ${t.name}`)
    names.add(t.name)
  }
  return deepFreeze({
    ...config,
    model: at(config.model),
    ...(config.backend === undefined
      ? {}
      : { backend: { ...config.backend, tokenizerDir: at(config.backend.tokenizerDir) } }),
  })
}

/** Reads and parses a cluster config file; throws `config_invalid` with a one-line message. */
export function loadClusterConfig(path: string): ClusterConfig {
  let text: string
  try {
    text = readFileSync(path, 'utf8')
  } catch (err) {
    throw new KvfenceError('config_invalid', `cannot read config file ${path}: ${messageOf(err)}`)
  }
  let value: unknown
  try {
    value = parseYaml(text)
  } catch (err) {
    throw new KvfenceError(
      'config_invalid',
      `${path} is not valid YAML: ${messageOf(err).split('\n')[0]}`,
    )
  }
  return parseClusterConfig(value, path, dirname(resolve(path)))
}

function deepFreeze<T>(value: T): T {
  if (typeof value === 'object' && value !== null && !Object.isFrozen(value)) {
    Object.freeze(value)
    for (const child of Object.values(value)) deepFreeze(child)
  }
  return value
}

function messageOf(err: unknown): string {
  return err instanceof Error ? err.message : String(err)
}
