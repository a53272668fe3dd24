/** Discovery: what the endpoint says about itself, read once at the start of an audit.
 *  The advertised context window (what clients are told they may send) and the KV capacity
 *  (what the cache can actually hold), from whichever of these the server offers:
 *  - `/v1/models`: `max_model_len` (vLLM, SGLang, kvfence), `context_length`, `context_window`;
 *  - `/server_info` (kvfence, newer SGLang) or `/get_server_info` (SGLang): kvfence's
 *    `contextWindow`, `effectiveCapacityTokens`, `workers[].capacityTokens`; SGLang's
 *    `context_length`, `max_total_num_tokens`, `max_req_input_len`;
 *  - `/metrics` (vLLM): `vllm:cache_config_info{num_gpu_blocks, block_size}`;
 *  - where none of these says anything: llama.cpp's `/props` (else `/slots`) and TGI's `/info`,
 *    read by their engines' rules (surfaces.ts).
 *  And the sizes the KV cache is cut into, where a cache's warm path has its edges: the page size
 *  (kvfence `pageSize`, SGLang `page_size`, vLLM `block_size`) and the prefill chunk size (kvfence
 *  `workers[].prefillChunkTokens`, SGLang `chunked_prefill_size`, vLLM `max_num_batched_tokens`;
 *  a negative value means "no chunking" and is not read).
 *  Which engine answered is told by the fields it reports (`engine`), because each derives its
 *  largest accepted input its own way:
 *  - SGLang's scheduler sets `max_req_input_len = min(context_len − 1, max_total_num_tokens − 1)
 *    − 5` and refuses an input of `max_req_input_len` tokens or more (sgl-project/sglang,
 *    python/sglang/srt/managers/scheduler.py; releases before the `− 5` reserved 1 token). The
 *    6 tokens between the smaller limit and `max_req_input_len` are a normal reserve, not a pool
 *    smaller than the context; the pool is `max_total_num_tokens`.
 *  - vLLM refuses `prompt + max_tokens > max_model_len` and refuses to start when one request of
 *    `max_model_len` does not fit the KV cache (vllm/v1/core/kv_cache_utils.py): a pool smaller
 *    than the context is never its normal state.
 *  - kvfence reports its pool and context directly.
 *  - llama.cpp and TGI: see surfaces.ts (one slot's `n_ctx`; TGI's `max_total_tokens` against
 *    `max_batch_total_tokens`).
 *  An endpoint that reports none of these (a plain OpenAI-compatible server) leaves the sizes
 *  null: the operator may give them (`--context-window`, `--kv-pool-tokens`).
 *  Knows field names of public APIs and these published rules; knows nothing else of how any
 *  engine works inside. */
import { BudgetExhaustedError } from './budget.js'
import {
  runningFromMetrics,
  usageFromInfo,
  usageFromMetrics,
  type PoolUsage,
} from './pool-usage.js'
import { readSurface, type SurfaceReading } from './surfaces.js'
import { tryJson, type HttpResult, type Target } from './target.js'
import { AuditError } from './errors.js'

/** One number read from the endpoint, and where. */
export interface CapacitySource {
  readonly endpoint: string
  readonly field: string
  readonly tokens: number
}

export interface EndpointStatus {
  readonly endpoint: string
  /** HTTP status, or the failure (`network`, `timeout`, `budget`). */
  readonly status: number | string
}

/** The engine whose reports discovery read, told by the fields it answered; null: none known. */
export type EngineKind = 'kvfence' | 'sglang' | 'vllm' | 'llamacpp' | 'tgi'

/** SGLang's reserve: `max_req_input_len` is the smaller of context and pool minus this. */
export const sglangInputReserveTokens = 6

export interface Discovery {
  /** Model ids listed by `/v1/models`. */
  readonly modelsListed: readonly string[]
  /** The model the audit uses: `--model`, else the first one listed, else none. */
  readonly model: string | null
  readonly advertised: readonly CapacitySource[]
  readonly pools: readonly CapacitySource[]
  /** Largest advertised context window (tokens): what a client may believe it can send. */
  readonly contextTokens: number | null
  /** Smallest KV capacity found (tokens): what the endpoint can actually hold. */
  readonly poolTokens: number | null
  /** Largest KV capacity found (tokens): what traffic must cover to evict from every pool. */
  readonly largestPoolTokens: number | null
  /** KV pool usage before any probe ran (the idle baseline page-leak compares with), or null when
   *  the endpoint exposes none. Read from the same answers as the capacity, no request of its own. */
  readonly idleUsage: PoolUsage | null
  /** Requests the endpoint said were running then (`/metrics`), or null when it says nothing. */
  readonly numRunning: number | null
  readonly endpoints: readonly EndpointStatus[]
  /** The engine the reports are from (see the module's header), or null. */
  readonly engine: EngineKind | null
  /** Input limits the engine reports (SGLang's `max_req_input_len`, llama.cpp's slot `n_ctx`,
   *  TGI's `max_input_tokens`), as reported. */
  readonly inputLimits: readonly CapacitySource[]
  /** The largest prompt (tokens) the engine says it accepts, or null when it says none: for
   *  SGLang `max_req_input_len − 1`, llama.cpp `n_ctx − 1`, TGI `max_input_tokens`. */
  readonly inputLimitTokens: number | null
  /** Page sizes (tokens per page) the endpoint reports, where and as reported. */
  readonly pageSizes: readonly CapacitySource[]
  /** Prefill chunk sizes (tokens) the endpoint reports, where and as reported. */
  readonly chunkSizes: readonly CapacitySource[]
  /** Prompt tokens per prefill step the engine reports (the largest of {@link chunkSizes}), or
   *  null when it reports none: a longer prompt is prefilled in several steps, and an abort can
   *  land between them. */
  readonly chunkedPrefillTokens: number | null
  /** Where a size the operator gave (`--context-window`, `--kv-pool-tokens`) differs from what
   *  the endpoint reported: the given one is used (absent: none given, or none differs). */
  readonly givenDisagreements?: readonly CapacityDisagreement[]
}

/** Sizes the operator gives for what the endpoint does not say, or says wrongly (tokens). */
export interface GivenCapacity {
  /** `--context-window`: the longest prompt plus `max_tokens` clients may send. */
  readonly contextTokens?: number
  /** `--kv-pool-tokens`: the KV pool of the smallest worker. */
  readonly poolTokens?: number
}

/** A size the operator gave and what the endpoint reported instead. */
export interface CapacityDisagreement {
  readonly flag: '--context-window' | '--kv-pool-tokens'
  readonly givenTokens: number
  readonly reported: readonly CapacitySource[]
}

/** Fields that advertise a context window. Not `max_total_tokens`: TGI's is one request's
 *  prompt plus new tokens, SGLang's a cap on its pool; each is read where its engine is known. */
const advertisedFields = new Set([
  'max_model_len',
  'context_length',
  'context_window',
  'contextWindow',
  'max_context_length',
])
/** Fields that state a KV capacity in tokens. */
const poolFields = new Set(['effectiveCapacityTokens', 'capacityTokens', 'max_total_num_tokens'])
/** Fields that state a page size in tokens. */
const pageSizeFields = new Set(['pageSize', 'page_size'])
/** Fields that state a prefill chunk size in tokens. */
const chunkSizeFields = new Set([
  'chunked_prefill_size',
  'prefillChunkTokens',
  'chunkedPrefillSize',
  'max_num_batched_tokens',
])
/** Fields that state the longest input an engine accepts (SGLang), not a capacity. */
const inputLimitFields = new Set(['max_req_input_len'])
/** Fields only kvfence reports. */
const kvfenceFields = new Set(['effectiveCapacityTokens', 'contextWindow', 'capacityTokens'])
/** Fields only SGLang reports. */
const sglangFields = new Set(['max_total_num_tokens', 'max_req_input_len'])

const maxScanDepth = 4

/** Reads `/v1/models`, server info and metrics. Throws `AuditError('target_unreachable')` when the
 *  first request gets no HTTP answer at all. */
export async function discover(
  target: Target,
  requestedModel: string | null,
  given: GivenCapacity = {},
): Promise<Discovery> {
  const tenant = target.tenants[0]
  const endpoints: EndpointStatus[] = []
  const advertised: CapacitySource[] = []
  const pools: CapacitySource[] = []
  const inputLimits: CapacitySource[] = []
  const pageSizes: CapacitySource[] = []
  const chunkSizes: CapacitySource[] = []
  const found = {
    advertised,
    pools,
    inputLimits,
    pageSizes,
    chunkSizes,
    keys: new Set<string>(),
  }
  let metricsText = ''
  let idleUsage: PoolUsage | null = null
  let numRunning: number | null = null
  let surface: SurfaceReading | null = null
  const record = (endpoint: string, res: HttpResult): void => {
    endpoints.push({ endpoint, status: res.status ?? res.failure ?? 'network' })
  }

  const modelsRes = await target.get('/v1/models', { tenant })
  record('/v1/models', modelsRes)
  if (modelsRes.status === null) {
    throw new AuditError(
      'target_unreachable',
      `cannot reach ${target.baseUrl}: ${modelsRes.failure === 'timeout' ? 'timed out' : modelsRes.failureDetail}`,
    )
  }
  const models = modelsRes.status === 200 ? listModels(tryJson(modelsRes.body)) : []
  const model = requestedModel ?? models[0]?.id ?? null
  const entry = models.find((m) => m.id === model)
  if (entry) scan(entry.raw, `/v1/models`, `data[${entry.index}]`, 1, found)

  try {
    const infoRes = await target.get('/server_info', { tenant })
    record('/server_info', infoRes)
    let info = infoRes.status === 200 ? tryJson(infoRes.body) : null
    let infoEndpoint = '/server_info'
    if (!isObject(info)) {
      const legacyRes = await target.get('/get_server_info', { tenant })
      record('/get_server_info', legacyRes)
      info = legacyRes.status === 200 ? tryJson(legacyRes.body) : null
      infoEndpoint = '/get_server_info'
    }
    if (isObject(info)) {
      scan(info, infoEndpoint, '', 0, found)
      idleUsage = usageFromInfo(info, infoEndpoint)
    }

    const metricsRes = await target.get('/metrics', { tenant })
    record('/metrics', metricsRes)
    if (metricsRes.status === 200) {
      pools.push(...parseMetrics(metricsRes.body))
      pageSizes.push(...pageSizesFromMetrics(metricsRes.body))
      metricsText = metricsRes.body
      idleUsage ??= usageFromMetrics(metricsRes.body)
      numRunning = runningFromMetrics(metricsRes.body)
    }
    // Nothing said the pool: llama.cpp's or TGI's own endpoints may.
    if (!isObject(info) && pools.length === 0) {
      surface = await readSurface(target, tenant, record)
      if (surface !== null) addSurface(found, surface)
    }
  } catch (err) {
    if (!(err instanceof BudgetExhaustedError)) throw err
    endpoints.push({ endpoint: '(remaining discovery)', status: 'budget' })
  }

  const engine = surface?.engine ?? engineOf(found.keys, metricsText)
  numRunning ??= surface?.numRunning ?? null
  const inputLimitTokens =
    surface !== null
      ? surface.largestInputTokens
      : inputLimits.length
        ? Math.min(...inputLimits.map((s) => s.tokens)) - 1
        : null
  // Without max_total_num_tokens, SGLang's input limit still bounds its pool from below.
  if (engine === 'sglang' && pools.length === 0 && inputLimits.length > 0) {
    const limit = Math.min(...inputLimits.map((s) => s.tokens))
    const source = inputLimits.find((s) => s.tokens === limit) as CapacitySource
    pools.push({
      endpoint: source.endpoint,
      field: `${source.field} + ${sglangInputReserveTokens}`,
      tokens: limit + sglangInputReserveTokens,
    })
  }
  return withGiven(given, {
    modelsListed: models.map((m) => m.id),
    model,
    advertised,
    pools,
    contextTokens: advertised.length ? Math.max(...advertised.map((s) => s.tokens)) : null,
    poolTokens: pools.length ? Math.min(...pools.map((s) => s.tokens)) : null,
    largestPoolTokens: pools.length ? Math.max(...pools.map((s) => s.tokens)) : null,
    idleUsage,
    numRunning,
    endpoints,
    engine,
    inputLimits,
    inputLimitTokens,
    pageSizes,
    chunkSizes,
    chunkedPrefillTokens: chunkSizes.length ? Math.max(...chunkSizes.map((s) => s.tokens)) : null,
  })
}

/** `discovery` with the operator's sizes in place of the reported ones: the flag wins, since the
 *  operator may know what an endpoint reports wrongly (a pool per process read as the whole),
 *  and a reported size that differs is kept in the sources and named in `givenDisagreements`. */
export function withGiven(given: GivenCapacity, discovery: Discovery): Discovery {
  const disagreements: CapacityDisagreement[] = []
  let out = discovery
  if (given.contextTokens !== undefined) {
    const tokens = given.contextTokens
    const differing = discovery.advertised.filter((s) => s.tokens !== tokens)
    if (differing.length > 0)
      disagreements.push({ flag: '--context-window', givenTokens: tokens, reported: differing })
    out = {
      ...out,
      advertised: [{ endpoint: '--context-window', field: 'flag', tokens }, ...out.advertised],
      contextTokens: tokens,
    }
  }
  if (given.poolTokens !== undefined) {
    const tokens = given.poolTokens
    const differing = discovery.pools.filter((s) => s.tokens !== tokens)
    if (differing.length > 0)
      disagreements.push({ flag: '--kv-pool-tokens', givenTokens: tokens, reported: differing })
    out = {
      ...out,
      pools: [{ endpoint: '--kv-pool-tokens', field: 'flag', tokens }, ...out.pools],
      poolTokens: tokens,
      largestPoolTokens: tokens,
    }
  }
  return disagreements.length === 0 ? out : { ...out, givenDisagreements: disagreements }
}

/** Adds what llama.cpp's or TGI's endpoint said to what discovery found. */
function addSurface(found: Found, surface: SurfaceReading): void {
  found.advertised.push(...surface.advertised)
  found.pools.push(...surface.pools)
  found.inputLimits.push(...surface.inputLimits)
  found.pageSizes.push(...surface.pageSizes)
}

interface ListedModel {
  readonly id: string
  readonly index: number
  readonly raw: Record<string, unknown>
}

function listModels(json: unknown): ListedModel[] {
  if (!isObject(json) || !Array.isArray(json.data)) return []
  const out: ListedModel[] = []
  json.data.forEach((raw: unknown, index: number) => {
    if (isObject(raw) && typeof raw.id === 'string') out.push({ id: raw.id, index, raw })
  })
  return out
}

/** Walks a JSON object (a few levels deep) collecting known capacity fields. */
/** What discovery collects, by kind. */
interface Found {
  readonly advertised: CapacitySource[]
  readonly pools: CapacitySource[]
  readonly inputLimits: CapacitySource[]
  readonly pageSizes: CapacitySource[]
  readonly chunkSizes: CapacitySource[]
  /** Every capacity field seen, by name (tells the engine). */
  readonly keys: Set<string>
}

function scan(value: unknown, endpoint: string, path: string, depth: number, found: Found): void {
  if (depth > maxScanDepth) return
  if (Array.isArray(value)) {
    value.forEach((item, i) => scan(item, endpoint, `${path}[${i}]`, depth + 1, found))
    return
  }
  if (!isObject(value)) return
  const role = typeof value.role === 'string' ? ` (${value.role})` : ''
  for (const [key, child] of Object.entries(value)) {
    const field = path === '' ? key : `${path}.${key}`
    const tokens = asPositiveInt(child)
    if (tokens !== null) {
      found.keys.add(key)
      if (advertisedFields.has(key)) found.advertised.push({ endpoint, field, tokens })
      else if (poolFields.has(key)) found.pools.push({ endpoint, field: field + role, tokens })
      else if (inputLimitFields.has(key)) found.inputLimits.push({ endpoint, field, tokens })
      else if (pageSizeFields.has(key)) found.pageSizes.push({ endpoint, field, tokens })
      else if (chunkSizeFields.has(key)) found.chunkSizes.push({ endpoint, field, tokens })
    } else if (typeof child === 'object' && child !== null) {
      scan(child, endpoint, field, depth + 1, found)
    }
  }
}

/** The engine told by the fields it reported: kvfence's and SGLang's own field names, else
 *  vLLM's, SGLang's, llama.cpp's or TGI's metric prefixes. */
function engineOf(keys: ReadonlySet<string>, metricsText: string): EngineKind | null {
  if ([...kvfenceFields].some((k) => keys.has(k))) return 'kvfence'
  if ([...sglangFields].some((k) => keys.has(k)) || /^sglang:/m.test(metricsText)) return 'sglang'
  if (/^vllm:/m.test(metricsText)) return 'vllm'
  if (/^llamacpp:/m.test(metricsText)) return 'llamacpp'
  if (/^tgi_/m.test(metricsText)) return 'tgi'
  return null
}

/** Prometheus text: vLLM's `vllm:cache_config_info{block_size="16",num_gpu_blocks="2048",...} 1`
 *  gives the KV capacity as blocks × block size; SGLang's `sglang:max_total_num_tokens` directly.
 *  Not where the labels give a `sliding_window`: such a cache holds windows, and vLLM sizes it so
 *  that one request of `max_model_len` fits in fewer blocks than its length, so blocks × block
 *  size is no bound on what one request may send. */
export function parseMetrics(text: string): CapacitySource[] {
  const out: CapacitySource[] = []
  for (const line of text.split('\n')) {
    if (line.startsWith('vllm:cache_config_info{')) {
      const labels = new Map<string, string>()
      for (const m of line.matchAll(/(\w+)="([^"]*)"/g)) labels.set(m[1], m[2])
      const numBlocks = asPositiveInt(labels.get('num_gpu_blocks'))
      const blockSize = asPositiveInt(labels.get('block_size'))
      const isWindowed = asPositiveInt(labels.get('sliding_window')) !== null
      if (numBlocks !== null && blockSize !== null && !isWindowed) {
        out.push({
          endpoint: '/metrics',
          field: 'vllm:cache_config_info num_gpu_blocks × block_size',
          tokens: numBlocks * blockSize,
        })
      }
    }
    const sglang = /^sglang:max_total_num_tokens(\{[^}]*\})?\s+([0-9.e+]+)\s*$/.exec(line)
    const tokens = sglang ? asPositiveInt(Number(sglang[2])) : null
    if (tokens !== null) {
      out.push({ endpoint: '/metrics', field: 'sglang:max_total_num_tokens', tokens })
    }
  }
  return out
}

/** Prometheus text: the page size vLLM reports as `block_size` of `vllm:cache_config_info`. */
export function pageSizesFromMetrics(text: string): CapacitySource[] {
  const out: CapacitySource[] = []
  for (const line of text.split('\n')) {
    if (!line.startsWith('vllm:cache_config_info{')) continue
    const blockSize = asPositiveInt(/\bblock_size="([^"]*)"/.exec(line)?.[1])
    if (blockSize !== null) {
      out.push({
        endpoint: '/metrics',
        field: 'vllm:cache_config_info block_size',
        tokens: blockSize,
      })
    }
  }
  return out
}

function asPositiveInt(value: unknown): number | null {
  const n = typeof value === 'string' && value.trim() !== '' ? Number(value) : value
  return typeof n === 'number' && Number.isSafeInteger(n) && n > 0 ? n : null
}

function isObject(value: unknown): value is Record<string, unknown> {
  return typeof value === 'object' && value !== null && !Array.isArray(value)
}
