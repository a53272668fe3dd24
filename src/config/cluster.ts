/** The cluster config file: one YAML file for the whole deployment — the router, its workers (to
 *  start here with their pool sizes, or already running at a URL) or the engine it fronts
 *  (gateway mode), and the tenants with their limits. Parsed once with zod into a frozen value;
 *  a bad file is a one-line `config_invalid` error naming the file and the field.
 *
 *  ```yaml
 *  model: ./models/echo-tiny          # tokenizer (and weights for workers started here)
 *  router: { host: 127.0.0.1, port: 8000, maxConcurrentRequests: 64, maxQueuedRequests: 256, reservedSlots: 1 }
 *  # router: { tls: { cert: ./certs/router.crt, key: ./certs/router.key } }   # clients over HTTPS
 *  workers:
 *    pageSize: 16
 *    prefill: [{ pages: 64, prefixCachePages: 0 }]   # started here (prefix cache off) …
 *    decode: [{ url: http://10.0.0.7:8102 }]   # … or already running elsewhere
 *  tls: { dir: ./certs }                # optional: mutual TLS (kvfence certs init ./certs)
 *  allowPlaintext: false                # true: without tls:, run beyond loopback in plaintext
 *  tenants:
 *    - { name: alice, keySha256: <64 hex>, limits: { maxConcurrentRequests: 4, tokensPerMinute: 100000 } }
 *  ```
 *  Knows the file's shape and defaults; knows nothing of starting processes or serving. */
import { dirname, isAbsolute, resolve } from 'node:path'
import { z } from 'zod'
import { maxTimerMs, maxTimerSeconds } from '../common/timer-limit.js'
import { KvfenceError } from '../common/errors.js'
import { queueLimitDefaults } from '../router/admission/queue-limits.js'
import { sameTenantNames, sameTenantNamesFault, TenantRecord } from '../router/tenants/tenants.js'
import { describeIssue } from '../files/issues.js'
import { loadYamlFile } from '../files/yaml-file.js'
import {
  logLevels,
  optionsOf,
  type WorkerFileEntry,
  type WorkerOption,
  type WorkerRole,
} from '../engine/worker-options.js'

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
  /** Slots taken only by a request whose tenant has none running (router/admission/fair-queue.ts); 0 = none; at
   *  most `maxConcurrentRequests − 1` take effect. */
  reservedSlots: z.number().int().min(0).default(queueLimitDefaults.reservedSlots),
  maxQueueWaitMs: z
    .number()
    .int()
    .min(0)
    .max(maxTimerMs)
    .default(queueLimitDefaults.maxQueueWaitMs),
  logContent: z.boolean().default(false),
  /** On SIGTERM, how long running requests may finish before they are ended, seconds (default
   *  `routerConfigDefaults.drainSeconds`, 30). */
  drainSeconds: z.number().int().min(0).max(maxTimerSeconds).optional(),
  logLevel: z.enum(logLevels).default('info'),
  /** Serve clients over HTTPS with this certificate and key (paths relative to this file; the
   *  pair is reloaded on change, as `kvfence router --tls-cert/--tls-key`); default: HTTP. */
  tls: z.strictObject({ cert: z.string().min(1), key: z.string().min(1) }).optional(),
  /** A file holding the secret of gateway mode's cache salts (≥ 32 bytes; relative to this
   *  file), shared by replicas; default: a random secret per process. */
  saltSecretFile: z.string().min(1).optional(),
  /** Where tenants' limits are counted; default: in this process. */
  limits: z
    .strictObject({
      store: z.enum(['in-process', 'redis']).default('in-process'),
      url: z
        .url({ protocol: /^rediss?$/, error: 'must be a redis:// or rediss:// URL' })
        .optional(),
      keyPrefix: z.string().min(1).optional(),
      onUnavailable: z.enum(['fail-closed', 'local']).default('fail-closed'),
      /** How long a dead router's concurrency units stay counted, seconds. */
      leaseSeconds: positive.default(15),
    })
    .refine((l) => l.store !== 'redis' || l.url !== undefined, {
      error: 'store: redis needs a url',
      path: ['url'],
    })
    .optional(),
  /** The response sentinel (docs/monitoring.md); unset fields take `sentinelDefaults`. */
  sentinel: z
    .strictObject({
      mode: z.enum(['off', 'observe', 'block']).optional(),
      windowSeconds: z.number().positive().optional(),
      maxBytes: positive.optional(),
      ngramTokens: positive.optional(),
      minRunTokens: positive.optional(),
    })
    .optional(),
})

const workerShapeError =
  'a worker is { pages: N } (started here) or { url: http://host:port } (running)'

/** The schema of worker option `o` in a worker entry. A required option is a plain zod check; an
 *  optional one is checked by a refinement rather than z.number().int(): a wrong type inside a
 *  union member makes zod report only the union's message, which would not name the field. */
function entryField(o: WorkerOption): z.ZodType {
  if (o.kind === 'int') {
    if (o.inFile === 'required') {
      const n = z.number().int().min(o.min)
      return o.max === undefined ? n : n.max(o.max)
    }
    const range = o.max === undefined ? `≥ ${o.min}` : `from ${o.min} to ${o.max}`
    return z
      .unknown()
      .refine(
        (v) =>
          Number.isInteger(v) && (v as number) >= o.min && (v as number) <= (o.max ?? Infinity),
        `must be an integer ${range}`,
      )
      .transform((v) => v as number)
      .optional()
  }
  if (o.kind === 'switch')
    return z
      .unknown()
      .refine((v) => typeof v === 'boolean', 'must be true or false')
      .transform((v) => v as boolean)
      .optional()
  if (o.kind === 'text') {
    const t = o.choices === undefined ? z.string().min(1) : z.enum(o.choices as [string])
    return o.inFile === 'required' ? t : t.optional()
  }
  const l = z.array(z.string().min(1))
  return o.inFile === 'required' ? l : l.optional()
}

/** A worker of `role` started here: the options of src/engine/worker-options.ts that a worker
 *  entry sets (`pages`, and for prefill its prefix cache and offload tiers). */
function startedWorker<R extends WorkerRole>(role: R) {
  const shape = Object.fromEntries(
    optionsOf(role).flatMap(([name, o]) => (o.inFile === undefined ? [] : [[name, entryField(o)]])),
  )
  return z.strictObject(shape) as unknown as z.ZodType<WorkerFileEntry<R>>
}

/** A decode worker: started here with a pool of `pages` (and the other options a decode worker
 *  entry may set), or already running at `url`. */
export const WorkerEntry = z.union([startedWorker('decode'), z.strictObject({ url: httpUrl })], {
  error: workerShapeError,
})
export type WorkerEntry = z.infer<typeof WorkerEntry>

/** A prefill worker: as {@link WorkerEntry}; one started here may also set `prefixCachePages`,
 *  the most pool pages its prefix cache may hold (`kvfence prefill --prefix-cache-pages`; 0 turns
 *  the cache off; default: a quarter of `pages`), split between tenants by the tenants file (each
 *  its own partition: no tenant's traffic changes another's hits); `prefixCachePagesPerTenant`,
 *  the most pages of a tenant's default share (`--prefix-cache-pages-per-tenant`);
 *  `prefixCacheShared: true`, one budget shared by all tenants instead (`--prefix-cache-shared`:
 *  the load side channel of docs/threat-model.md, for single-tenant operators);
 *  `prefixCacheOffloadBytes`, the host memory of its offload tier (`--prefix-cache-offload-bytes`;
 *  default 0: none; each tenant its partition's share unless shared); and
 *  `prefixCacheOffloadDir` with `prefixCacheOffloadDiskBytes`, the offload tier's disk part
 *  (`--prefix-cache-offload-dir`, `--prefix-cache-offload-disk-bytes`; both or neither; a
 *  relative directory is resolved against the config file's). The rules between these options
 *  are checked here. */
export const PrefillWorkerEntry = z.union(
  [
    startedWorker('prefill')
      .refine(
        (e) =>
          (e.prefixCacheOffloadDir === undefined) === (e.prefixCacheOffloadDiskBytes === undefined),
        {
          error: 'give both prefixCacheOffloadDir and prefixCacheOffloadDiskBytes, or neither',
          path: ['prefixCacheOffloadDir'],
        },
      )
      .refine((e) => e.prefixCachePages === undefined || e.prefixCachePages <= e.pages, {
        error: 'may not exceed pages',
        path: ['prefixCachePages'],
      })
      .refine(
        (e) =>
          // Against the worker's default cache size the worker itself checks, when it starts.
          e.prefixCachePagesPerTenant === undefined ||
          e.prefixCachePages === undefined ||
          e.prefixCachePagesPerTenant <= e.prefixCachePages,
        { error: 'may not exceed prefixCachePages', path: ['prefixCachePagesPerTenant'] },
      )
      .refine((e) => !(e.prefixCacheShared === true && e.prefixCachePagesPerTenant !== undefined), {
        error: 'is a partition, not for a shared cache (prefixCacheShared: true)',
        path: ['prefixCachePagesPerTenant'],
      }),
    z.strictObject({ url: httpUrl }),
  ],
  { error: workerShapeError.replace('{ pages: N }', '{ pages: N, prefixCachePages?: N }') },
)
export type PrefillWorkerEntry = z.infer<typeof PrefillWorkerEntry>

/** Native kvfence workers. */
export const WorkersSection = z.strictObject({
  /** Tokens per KV page of the workers started here. */
  pageSize: positive.default(16),
  prefill: z.array(PrefillWorkerEntry).min(1),
  decode: z.array(WorkerEntry).min(1),
})

/** Gateway mode: the engine behind the router. */
export const BackendSection = z
  .strictObject({
    kind: z.enum(['sglang', 'vllm', 'llamacpp', 'openai']),
    url: httpUrl,
    /** The engine's model id; default: the first it lists. */
    model: z.string().min(1).optional(),
    /** A directory with the engine's tokenizer.json; default: the engine's /tokenize. */
    tokenizerDir: z.string().min(1).optional(),
    discoveryIntervalMs: z.number().int().min(0).max(maxTimerMs).default(30_000),
    /** Name of an environment variable holding the engine's API key (never the key itself). */
    apiKeyEnv: z.string().min(1).optional(),
    /** The engine's KV capacity in tokens, as the operator knows it: required for `openai` (a plain
     *  server that reports none, so that G1 can be checked); for the others it caps the report. */
    kvPoolTokens: positive.optional(),
    /** Paths served even where the isolation self-check finds that the engine does not keep
     *  tenants' prefix caches apart or refuses the salt (default: none: such a path is refused). */
    allowUnsalted: z.array(z.enum(['chat', 'completion'])).optional(),
    /** How often the isolation self-check runs again, ms (0: only at start; else at least 10 s,
     *  since each run sends the engine up to six requests). */
    selfCheckIntervalMs: z
      .number()
      .int()
      .min(0)
      .max(maxTimerMs)
      .refine((ms) => ms === 0 || ms >= 10_000, {
        error:
          'must be 0 (at start only) or at least 10000 ms: each run sends the engine up to six requests',
      })
      .default(600_000),
  })
  .refine((b) => b.kind !== 'openai' || b.kvPoolTokens !== undefined, {
    error:
      'kind openai reports no KV capacity: declare it with kvPoolTokens (G1 cannot be checked otherwise)',
    path: ['kvPoolTokens'],
  })

/** Mutual TLS between the parts: `dir` holds what `kvfence certs init` wrote (ca.crt and
 *  router/prefill/decode .crt/.key); relative to the config file. */
export const TlsSection = z.strictObject({ dir: z.string().min(1) })

/** The whole file. */
export const ClusterConfig = z
  .strictObject({
    /** Model directory; relative paths are relative to the config file. */
    model: z.string().min(1).optional(),
    router: RouterSection.default(RouterSection.parse({})),
    workers: WorkersSection.optional(),
    backend: BackendSection.optional(),
    tls: TlsSection.optional(),
    /** Without `tls:`, let the parts bind and dial addresses beyond loopback in plaintext (each
     *  logs a warning); default: such a cluster is refused at start (src/link/plaintext.ts). */
    allowPlaintext: z.boolean().optional(),
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
    throw new KvfenceError('config_invalid', `${source}: ${describeIssue(parsed.error.issues[0])}`)
  }
  const config = parsed.data
  const at = (p: string | undefined) => (p === undefined || isAbsolute(p) ? p : resolve(baseDir, p))
  const same = sameTenantNames(config.tenants.map((t) => t.name))
  if (same !== null)
    throw new KvfenceError('config_invalid', `${source}: tenants: ${sameTenantNamesFault(same)}`)
  return deepFreeze({
    ...config,
    model: at(config.model),
    router: {
      ...config.router,
      ...(config.router.saltSecretFile === undefined
        ? {}
        : { saltSecretFile: at(config.router.saltSecretFile) }),
      ...(config.router.tls === undefined
        ? {}
        : { tls: { cert: at(config.router.tls.cert)!, key: at(config.router.tls.key)! } }),
    },
    ...(config.tls === undefined ? {} : { tls: { dir: at(config.tls.dir)! } }),
    ...(config.workers === undefined
      ? {}
      : {
          workers: {
            ...config.workers,
            prefill: config.workers.prefill.map((w) => resolvePaths(w, 'prefill', at)),
            decode: config.workers.decode.map((w) => resolvePaths(w, 'decode', at)),
          },
        }),
    ...(config.backend === undefined
      ? {}
      : { backend: { ...config.backend, tokenizerDir: at(config.backend.tokenizerDir) } }),
  })
}

/** Reads and parses a cluster config file; throws `config_invalid` with a one-line message that
 *  quotes nothing of the file but field names (it holds tenants: see src/files/yaml-file.ts).
 *  Refuses a directory, a device or a file over 16 MiB. */
export function loadClusterConfig(path: string): ClusterConfig {
  const value = loadYamlFile(path, `config file ${path}`, 'config_invalid')
  return parseClusterConfig(value, path, dirname(resolve(path)))
}

/** `entry` with each path option of `role` (a text option marked `isPath`) resolved by `at`. */
function resolvePaths<E extends object>(
  entry: E,
  role: WorkerRole,
  at: (p: string | undefined) => string | undefined,
): E {
  const paths = optionsOf(role).flatMap(([name, o]) =>
    o.kind === 'text' && o.isPath === true && name in entry
      ? [[name, at((entry as Record<string, string>)[name])]]
      : [],
  )
  return paths.length === 0 ? entry : { ...entry, ...Object.fromEntries(paths) }
}

function deepFreeze<T>(value: T): T {
  if (typeof value === 'object' && value !== null && !Object.isFrozen(value)) {
    Object.freeze(value)
    for (const child of Object.values(value)) deepFreeze(child)
  }
  return value
}
