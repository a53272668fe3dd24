/** Stand-in OpenAI-compatible servers for the auditor's tests, on 127.0.0.1, port 0.
 *  - `leaky`: the incident. Advertises a 1024-token context but holds a 384-token KV pool; a
 *    prompt between the two is "rejected" inside, replaced by a one-token placeholder, and still
 *    decoded: every other time (or every `staleReadEvery`-th time) the output is read from the
 *    stale pool pages the previous request left behind (200, coherent, someone else's words).
 *  - `safe`: same pool, context = pool, longer prompts refused with 400 context_length_exceeded.
 *  - `broken`: every request answers 500.
 *  - `refusing`: like `safe`, but every completion is refused with a 400 that has nothing to do
 *    with size (as when the model id or a parameter is wrong).
 *  - `static`: not an inference server at all, a plain static file server (`python -m
 *    http.server`): `GET /` is a page, other GETs 404, every POST 501.
 *  Discovery endpoints take the shape of kvfence, SGLang or vLLM (`flavour`), or of llama.cpp's
 *  server, TGI or a plain server that reports nothing, which also parse and refuse completions
 *  as those engines do (surface-standins.ts); an SGLang-shaped
 *  stand-in reports and (when `safe`) enforces SGLang's input limit, `min(context − 1, pool − 1)
 *  − 5`; `/health` answers
 *  200 whatever happens to completions. A completion naming another model than `tiny-echo` gets
 *  404 `model_not_found`.
 *  The "model" echoes: its output is the words in its KV pages. A token is a whitespace-separated
 *  word, plus one BOS token. Every request is counted, with the most ever in flight.
 *  Options add the other bug classes the probes look for: a prefix cache shared across tenants
 *  (`prefixCache`), pages lost on abort (`isPageLeakOnAbort`), an aborted request's words served to
 *  the next request (`isAbortLeak`), a bounded batch (`maxBatch`) and queue (`maxQueued`), output
 *  that changes under load (`isLoadSensitive`), errors answered as 200 (`isErrorAs200`) and a
 *  tenant's own rate limit (`rateLimit`), answers that never end (`isEndless`), valid requests
 *  failed with a 5xx (`failValid`), an engine warming up (`warmUp`), pages an abort holds for a while (`abortHoldMs`) and a
 *  chunked prefill whose aborted pages may be published to a per-tenant prefix cache
 *  (`chunkedPrefill`, see {@link ChunkedPrefill}).
 *  `kvCache` is a cache of answers per whole prompt (its "KV" is the prompt's words), keyed by
 *  tenant, `cache_salt` (as vLLM takes it) and the prompt, in a pool of 384 tokens evicting the
 *  least recently used, with an optional offload tier: correct, or with one of the warm path's
 *  bugs (`kvCache.bug`). */
import { createServer, type IncomingMessage, type ServerResponse } from 'node:http'
import type { AddressInfo } from 'node:net'
import {
  parseSurfaceRequest,
  serveSurfaceGet,
  type SurfaceFlavour,
  type SurfaceRequest,
} from './surface-standins.js'

export type StandInKind = 'leaky' | 'safe' | 'broken' | 'refusing' | 'static'

export interface StandInStats {
  numRequests: number
  numInFlight: number
  maxInFlight: number
  numOverCapacity: number
  paths: string[]
  /** Pages (of 16 tokens) held by completions in flight, plus leaked ones. */
  numPagesUsed: number
}

export interface StandIn {
  readonly url: string
  readonly stats: StandInStats
  /** Stops accepting `key` from now on (a key revoked while a client runs); startStandIn's only. */
  revokeKey?(key: string): void
  close(): Promise<void>
}

export const tenantKeys = { alice: 'sk-alice-0123456789secret', bob: 'sk-bob-9876543210secret' }
/** The stand-ins' two tenants as the auditor takes them (`--tenant name=key`). */
export const standInTenants = [
  { name: 'alice', key: tenantKeys.alice },
  { name: 'bob', key: tenantKeys.bob },
]

export interface StandInOptions {
  /** Delay before every answer (ms). */
  readonly delayMs?: number
  /** Serve `/tokenize` (vLLM shape) and report no usage. */
  readonly isTokenizeOnly?: boolean
  /** Which server's discovery endpoints to imitate (default kvfence). */
  readonly flavour?: 'kvfence' | 'sglang' | 'vllm' | SurfaceFlavour
  /** `llamacpp`: the whole cache `/props` reports (`n_ctx`); default none, or the pool when the
   *  context is larger. */
  readonly wholeCacheTokens?: number
  /** Appended to the text of every whole (not streamed) answer: words a model may write. */
  readonly answerSuffix?: string
  /** Fields added to every whole answer's body (`error: null`, as some servers send). */
  readonly answerFields?: Readonly<Record<string, unknown>>
  /** Counts a prompt's tokens (a real tokenizer); default: its words plus one BOS token. */
  readonly countTokens?: (prompt: string) => number
  readonly hitDelayMs?: number
  readonly missDelayMs?: number
  /** Prefix cache over the first 32 words: none (default), keyed by tenant, or shared. A hit is
   *  answered after `hitDelayMs` (default 1), a miss after `missDelayMs` (default 40), and the hit
   *  reports `cached_tokens` unless `isCachedTokensHidden`. */
  readonly prefixCache?: 'none' | 'per-tenant' | 'shared'
  readonly isCachedTokensHidden?: boolean
  /** With a shared cache: `cached_tokens` counts only hits on the tenant's own entries (a shared
   *  layer the count does not see, like an external KV store keyed by tokens alone). */
  readonly isCrossHitUncounted?: boolean
  /** Extra delay per generated token (ms), to keep requests in flight. */
  readonly tokenDelayMs?: number
  /** Completions processed at once; the rest wait in a queue. */
  readonly maxBatch?: number
  /** With `maxBatch`: completions waiting at most; one more is refused 503 `capacity_exhausted`
   *  (kvfence's body for a full queue). */
  readonly maxQueued?: number
  /** Completions of `tenant` past its first `numAllowed` are refused 429 `rate_limited`, the body
   *  kvfence's router sends a tenant over its own tokens-per-minute limit (src/common/errors.ts). */
  readonly rateLimit?: { readonly tenant: keyof typeof tenantKeys; readonly numAllowed: number }
  /** A completion whose client went away keeps its pages forever. */
  readonly isPageLeakOnAbort?: boolean
  /** The words of a completion whose client went away are served to the next completion. */
  readonly isAbortLeak?: boolean
  /** With `isAbortLeak`: only an abort while this many completions (it included) were running
   *  leaks (a release race that opens under load only). */
  readonly abortLeakMinRunning?: number
  /** A completion started while another runs begins with the other one's words (crossed slots). */
  readonly isCrossTalk?: boolean
  /** After at least this many completions in a row from one tenant (a flood), the next from
   *  another tenant is answered with the first words of the flood's last prompt (a buffer a
   *  burst left behind, served to the wrong tenant). */
  readonly answerAfterFlood?: number
  /** With `isCrossTalk`: slots cross only when this many completions (this one included) are
   *  running at once (a race that opens at a batch size only). */
  readonly crossTalkMinRunning?: number
  /** Output gains a word when another completion is in flight. */
  readonly isLoadSensitive?: boolean
  /** Invalid requests are answered 200 with an error text. */
  readonly isErrorAs200?: boolean
  /** Every completion is answered 200 with a stream of token events that never ends (whatever
   *  `stream` and `max_tokens` asked): one event every `tokenDelayMs` ms, or as fast as the
   *  client reads when that is 0 or unset. */
  readonly isEndless?: boolean
  /** Every `every`-th valid completion (1: all) is answered `status` with a server error body
   *  (an engine whose transfer or decode path fails), counted from the first. */
  readonly failValid?: { readonly status: number; readonly every: number }
  /** The first `numRefused` completions (valid or not) are answered `status` with a body saying
   *  the model is loading, and the endpoint serves normally after (an engine warming up). */
  readonly warmUp?: { readonly status: number; readonly numRefused: number }
  /** A completion whose client went away keeps its pages this long (ms) before they are freed
   *  (an abort the engine never hears of, released by a timeout). */
  readonly abortHoldMs?: number
  /** The KV pool (tokens, a multiple of 16); default 384. */
  readonly poolTokens?: number
  /** Advertised context window (tokens); default 1024 for `leaky`, the pool (384) otherwise. A
   *  `safe` stand-in refuses a prompt plus max_tokens over it. */
  readonly contextTokens?: number
  /** Fields that steer the cache (`cache_salt`, `extra_key`, engine-internal ones): ignored
   *  (default), `honoured` (a salt replaces the tenant as the prefix cache's key, whoever sends
   *  it: vllm#53347), or `refused` with 400 (kvfence's router). */
  readonly clientSalt?: 'honoured' | 'refused'
  /** Models served besides `tiny-echo` that `/v1/models` does not list (a gateway's aliases). */
  readonly unlistedModels?: readonly string[]
  /** A cache of answers per whole prompt (see the module's header; {@link KvCacheOptions}). */
  readonly kvCache?: KvCacheOptions
  /** Completions are prefilled in chunks, over a prefix cache keyed by tenant (see
   *  {@link ChunkedPrefill}); reported as kvfence's `prefillChunkTokens` or SGLang's
   *  `chunked_prefill_size`. */
  readonly chunkedPrefill?: ChunkedPrefill
  /** `leaky`: only every this-many-th prompt over the pool (the N-th, the 2N-th…) is decoded over
   *  the stale pages the previous request left; the others over pages another request took first
   *  (words no tenant sent), as a read that loses the race for the freed pages under a busy
   *  workload. Default: every other one (the 1st, the 3rd…). */
  readonly staleReadEvery?: number
  /** Prompts of more than this many words count one token more than their words and BOS (a
   *  tokenizer that merges or splits somewhere a short calibration prompt never reaches). */
  readonly extraTokenPastWords?: number
}

/** A chunked prefill over a per-tenant prefix cache (sglang#38319's shape): a prompt's words are
 *  written into the pool `chunkTokens` at a time, `stepMs` per chunk, and a client that goes
 *  away is noticed between chunks. A prefill that completes publishes the prompt (its words as
 *  written) to the tenant's cache; one aborted publishes it too when `isPartialPublished` (the
 *  bug), positions past the last chunk holding whatever the pool held there before (someone
 *  else's words: the pool is not scrubbed), and nothing otherwise. A prompt found whole in the
 *  tenant's cache is not prefilled again. The "model" answers the last `max_tokens` words of
 *  the prompt as its pages hold them. */
export interface ChunkedPrefill {
  readonly chunkTokens: number
  readonly stepMs: number
  readonly isPartialPublished: boolean
  /** Unwritten positions published empty (pages never used: zeros) instead of stale. */
  readonly isUnwrittenBlank?: boolean
  /** Report `cached_tokens` (the whole prompt on a hit in the tenant's cache, else 0). */
  readonly isCachedTokensReported?: boolean
  /** The answer is `max_tokens` words from the middle of a prompt instead of the pages' last
   *  words: the request's own (`own`), or the last one another tenant sent (`other`; its own
   *  while no other tenant has sent one): a leak of words alone, no canary among them. */
  readonly answerFrom?: 'own' | 'other'
}

/** The `kvCache` stand-in: what it keeps and which bug it has. */
export interface KvCacheOptions {
  /** Entries the pool evicts go to an offload tier, and a later hit loads them back. */
  readonly isOffloaded?: boolean
  /** The pool is split in halves, one per tenant (kvfence's default partitions): a tenant's
   *  entries are evicted only by its own. */
  readonly isPartitioned?: boolean
  /** The offload tier is a ring of this many entries, written over in place as it wraps; its
   *  index keeps naming an entry whose slot was written over (a load must check the slot).
   *  Default: unbounded. */
  readonly offloadSlots?: number
  /** - `page-multiple-cross`: a warm hit of a prompt of an exact multiple of 16 tokens (a prompt
   *    cached whole) is served from the latest entry of that length and salt that another tenant
   *    cached (a key that, for a whole last page, keeps the length and salt but drops the tenant
   *    and the tokens);
   *  - `page-multiple-shift`: a warm hit of such a prompt is answered one position late (the
   *    last token of a prompt cached whole is not recomputed): its own words, shifted;
   *  - `offload-load-any`: every load from the offload tier fails and is counted as a hit anyway:
   *    the answer comes from whatever the tier's staging buffer last held, the entry it offloaded
   *    last (dynamo#15079, LMCache#4385);
   *  - `offload-stale-slot`: with `offloadSlots`, a load whose slot was written over is counted
   *    as a hit and answers the slot's words as they are now (the correct tier: a miss);
   *  - `offload-key-without-tenant`: the offload tier's key leaves out the tenant (salt and
   *    prompt only), so another tenant's lookup of an evicted prompt loads it (lmdeploy#4930). */
  readonly bug?:
    | 'page-multiple-cross'
    | 'page-multiple-shift'
    | 'offload-load-any'
    | 'offload-stale-slot'
    | 'offload-key-without-tenant'
}

/** One cached prompt: its key's parts and its words (the "KV"). */
interface KvEntry {
  readonly tenant: string
  readonly salt: string
  readonly numTokens: number
  readonly words: readonly string[]
}

/** The `kvCache` stand-in's offload tier: unbounded, or a ring of `slots` entries whose index
 *  keeps naming an entry after its slot was written over. `load` answers the entry under `key`
 *  (removing it), or null; a written-over slot is a miss, or with `isStaleHit` the slot's
 *  present entry. `lastStored` is the entry offloaded last. */
function createOffloadTier(slots: number | undefined, isStaleHit: boolean) {
  const index = new Map<string, number>()
  const ring: { key: string; entry: KvEntry }[] = []
  let head = 0
  let serial = 0
  const tier = {
    lastStored: null as KvEntry | null,
    store(key: string, entry: KvEntry): void {
      tier.lastStored = entry
      const at = slots === undefined ? serial++ : head
      ring[at] = { key, entry }
      index.set(key, at)
      if (slots !== undefined) head = (head + 1) % slots
    },
    load(key: string): KvEntry | null {
      const at = index.get(key)
      if (at === undefined) return null
      index.delete(key)
      const slot = ring[at]
      if (slot.key === key) return slot.entry
      return isStaleHit ? slot.entry : null
    },
  }
  return tier
}

/** The `kvCache` stand-in over `capacityTokens`: `lookup` answers the words a prompt's answer is
 *  made of, and whether they came from the cache (a hit, reported as `cached_tokens`). */
function createKvCache(
  options: KvCacheOptions,
  capacityTokens: number,
): (entry: KvEntry, prompt: string) => { words: readonly string[]; isHit: boolean } {
  /** Pools by partition (the tenant, or '' for one shared pool); keys in LRU order. */
  const pools = new Map<string, Map<string, { entry: KvEntry; tierKey: string }>>()
  const held = new Map<string, number>()
  const capacity = options.isPartitioned ? Math.floor(capacityTokens / 2) : capacityTokens
  const offloaded = createOffloadTier(options.offloadSlots, options.bug === 'offload-stale-slot')
  const partitionOf = (entry: KvEntry) => (options.isPartitioned ? entry.tenant : '')
  const poolOf = (entry: KvEntry) => {
    const name = partitionOf(entry)
    if (!pools.has(name)) pools.set(name, new Map())
    return pools.get(name)!
  }
  const insert = (key: string, tierKey: string, entry: KvEntry): void => {
    const pool = poolOf(entry)
    const name = partitionOf(entry)
    pool.set(key, { entry, tierKey })
    held.set(name, (held.get(name) ?? 0) + entry.numTokens)
    for (const [oldKey, old] of pool) {
      if (held.get(name)! <= capacity || oldKey === key) break
      pool.delete(oldKey)
      held.set(name, held.get(name)! - old.entry.numTokens)
      if (options.isOffloaded) offloaded.store(old.tierKey, old.entry)
    }
  }
  return (entry, prompt) => {
    const key = JSON.stringify([entry.tenant, entry.salt, prompt])
    const tierKey =
      options.bug === 'offload-key-without-tenant' ? JSON.stringify([entry.salt, prompt]) : key
    const pool = poolOf(entry)
    const cached = pool.get(key)?.entry
    if (cached !== undefined) {
      pool.delete(key)
      pool.set(key, { entry: cached, tierKey })
      if (options.bug === 'page-multiple-cross' && entry.numTokens % 16 === 0) {
        const other = [...pools.values()]
          .flatMap((p) => [...p.values()].map((v) => v.entry))
          .reverse()
          .find(
            (e) =>
              e.numTokens === entry.numTokens && e.salt === entry.salt && e.tenant !== entry.tenant,
          )
        if (other) return { words: other.words, isHit: true }
      }
      if (options.bug === 'page-multiple-shift' && entry.numTokens % 16 === 0)
        return { words: cached.words.slice(1), isHit: true }
      return { words: cached.words, isHit: true }
    }
    const lastStored = offloaded.lastStored
    const stored = offloaded.load(tierKey)
    if (stored !== null) {
      const loaded = options.bug === 'offload-load-any' && lastStored ? lastStored : stored
      // What the tier held is cached under the asking tenant's key, as a loaded page would be.
      insert(key, tierKey, { ...stored, tenant: entry.tenant })
      return { words: loaded.words, isHit: true }
    }
    insert(key, tierKey, entry)
    return { words: entry.words, isHit: false }
  }
}

/** The KV pool (tokens) unless `poolTokens` is given. */
const defaultPoolTokens = 384

export async function startStandIn(
  kind: StandInKind,
  options: StandInOptions = {},
): Promise<StandIn> {
  const poolTokens = options.poolTokens ?? defaultPoolTokens
  const contextTokens = options.contextTokens ?? (kind === 'leaky' ? 1024 : poolTokens)
  // SGLang's scheduler: min(context − 1, pool − 1) − 5, and an input of that many tokens or more
  // is refused (a correct SGLang; the leaky one decodes it over stale pages instead).
  const sglangInputLimit = Math.min(contextTokens - 1, poolTokens - 1) - 5
  const pool: string[] = new Array<string>(poolTokens).fill('')
  const stats: StandInStats = {
    numRequests: 0,
    numInFlight: 0,
    maxInFlight: 0,
    numOverCapacity: 0,
    paths: [],
    numPagesUsed: 0,
  }
  const prefixCache = new Map<string, Set<string>>()
  /** `chunkedPrefill`'s cache: tenant and prompt → the prompt's words as its pages hold them. */
  const chunkCache = new Map<string, string[]>()
  const chunkLastWords = new Map<string, readonly string[]>()
  let numRunning = 0
  const queue: (() => void)[] = []
  let abortedWords: string[] | null = null
  /** `answerAfterFlood`: the tenant of the latest completions, how many in a row, its last words. */
  let streak = { tenant: '', count: 0, words: [] as string[] }
  const runningWords = new Set<string[]>()
  const keys = new Set(Object.values(tenantKeys))
  let numRateLimitedSeen = 0
  let numValidSeen = 0
  let numWarmUpRefused = 0
  let numRunningCompletions = 0
  const holdTimers = new Set<ReturnType<typeof setTimeout>>()
  const kvCache = options.kvCache ? createKvCache(options.kvCache, poolTokens) : null
  const count = (prompt: string): number =>
    options.countTokens?.(prompt) ?? countTokens(prompt, options.extraTokenPastWords)

  const handle = async (req: IncomingMessage, res: ServerResponse): Promise<void> => {
    const body = await readBody(req)
    if (options.delayMs) await new Promise((r) => setTimeout(r, options.delayMs))
    const path = (req.url ?? '/').split('?')[0]
    if (kind === 'broken')
      return sendJson(res, 500, { error: { message: 'internal error', type: 'server_error' } })
    if (kind === 'static') return serveStatic(req, res, path)
    if (req.method === 'GET' && path === '/health') return sendJson(res, 200, { status: 'ok' })
    if (!keys.has((req.headers.authorization ?? '').replace(/^Bearer /, ''))) {
      return sendJson(res, 401, {
        error: { message: 'bad key', type: 'authentication_error', code: 'invalid_api_key' },
      })
    }
    const flavour = options.flavour ?? 'kvfence'
    const sizes = {
      contextTokens,
      poolTokens,
      numSlots: 4,
      numRunning: numRunningCompletions,
      // A slot larger than the pool: the whole cache is reported (as some llama.cpp builds do).
      wholeCacheTokens:
        options.wholeCacheTokens ?? (contextTokens > poolTokens ? poolTokens : null),
    }
    if (isSurface(flavour) && req.method === 'GET' && serveSurfaceGet(res, flavour, path, sizes))
      return
    if (req.method === 'GET' && path === '/v1/models') {
      return sendJson(res, 200, {
        object: 'list',
        data: [{ id: 'tiny-echo', object: 'model', max_model_len: contextTokens }],
      })
    }
    if (req.method === 'GET' && path === '/server_info' && flavour === 'kvfence') {
      return sendJson(res, 200, {
        contextWindow: contextTokens,
        effectiveCapacityTokens: poolTokens,
        workers: [
          {
            role: 'prefill',
            capacityTokens: poolTokens,
            numPagesUsed: 0,
            ...(options.chunkedPrefill
              ? { prefillChunkTokens: options.chunkedPrefill.chunkTokens }
              : {}),
          },
          { role: 'decode', capacityTokens: poolTokens, numPagesUsed: stats.numPagesUsed },
        ],
      })
    }
    if (req.method === 'GET' && path === '/get_server_info' && flavour === 'sglang') {
      return sendJson(res, 200, {
        model_path: 'tiny-echo',
        context_length: null,
        chunked_prefill_size: options.chunkedPrefill?.chunkTokens ?? 8192,
        max_prefill_tokens: 16384,
        internal_states: [
          { max_total_num_tokens: poolTokens, max_req_input_len: sglangInputLimit },
        ],
      })
    }
    if (req.method === 'GET' && path === '/metrics' && flavour === 'kvfence') {
      res.writeHead(200, { 'content-type': 'text/plain; version=0.0.4' })
      res.end(`kvfence_router_requests_running ${numRunningCompletions}\n`)
      return
    }
    if (req.method === 'GET' && path === '/metrics' && flavour === 'vllm') {
      res.writeHead(200, { 'content-type': 'text/plain; version=0.0.4' })
      res.end(
        '# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n' +
          '# TYPE vllm:cache_config_info gauge\n' +
          `vllm:cache_config_info{block_size="16",cache_dtype="auto",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="${poolTokens / 16}"} 1.0\n` +
          'vllm:num_requests_running{model_name="tiny-echo"} 0.0\n',
      )
      return
    }
    if (req.method === 'POST' && path === '/tokenize' && options.isTokenizeOnly) {
      const { prompt } = JSON.parse(body) as { prompt: string }
      return sendJson(res, 200, {
        count: count(prompt),
        max_model_len: contextTokens,
      })
    }
    if (req.method === 'GET' && path === '/metrics' && flavour === 'sglang') {
      res.writeHead(200, { 'content-type': 'text/plain; version=0.0.4' })
      res.end(
        `sglang:token_usage{model_name="tiny-echo"} ${stats.numPagesUsed / (poolTokens / 16)}\n`,
      )
      return
    }
    if (req.method !== 'POST' || path !== '/v1/completions') {
      return sendJson(res, 404, { error: { message: 'not found', type: 'invalid_request_error' } })
    }

    if (options.warmUp && numWarmUpRefused < options.warmUp.numRefused) {
      numWarmUpRefused++
      return sendJson(res, options.warmUp.status, {
        error: { message: 'the model is loading', type: 'server_error', code: 'model_loading' },
      })
    }
    if (kind === 'refusing') {
      return sendJson(res, 400, {
        error: { message: 'model not served', type: 'invalid_request_error', param: 'model' },
      })
    }
    if (options.isEndless) return streamForever(res, options.tokenDelayMs ?? 0)
    const surfaceRequest = isSurface(flavour)
      ? parseSurfaceRequest(flavour, body, contextTokens, count)
      : null
    if (surfaceRequest !== null && 'status' in surfaceRequest)
      return sendJson(res, surfaceRequest.status, surfaceRequest.body)
    const parsedBody = surfaceRequest
      ? fromSurface(surfaceRequest, contextTokens, count)
      : parseRequest(body)
    if (typeof parsedBody === 'string') {
      if (options.isErrorAs200)
        return sendJson(res, 200, { object: 'error', message: parsedBody, code: 400 })
      return sendJson(res, 400, {
        error: { message: parsedBody, type: 'invalid_request_error', code: 'invalid_request' },
      })
    }
    const request = parsedBody
    const served = ['tiny-echo', ...(options.unlistedModels ?? [])]
    if (request.model !== undefined && !served.includes(request.model)) {
      return sendJson(res, 404, {
        error: {
          message: `The model \`${request.model}\` does not exist.`,
          type: 'invalid_request_error',
          code: 'model_not_found',
        },
      })
    }
    const rateLimit = options.rateLimit
    if (
      rateLimit &&
      req.headers.authorization === `Bearer ${tenantKeys[rateLimit.tenant]}` &&
      ++numRateLimitedSeen > rateLimit.numAllowed
    ) {
      res.setHeader('retry-after', '1')
      return sendJson(res, 429, {
        error: {
          message: 'Rate limit reached: your key allows 2000 tokens per minute; retry later.',
          type: 'rate_limit_error',
          param: null,
          code: 'rate_limited',
        },
      })
    }
    const fields = JSON.parse(body) as Record<string, unknown>
    const steering = Object.keys(fields).filter((k) => steeringFields.has(k))
    if (options.clientSalt === 'refused' && steering.length > 0) {
      return sendJson(res, 400, {
        error: {
          message: `Unrecognized request argument supplied: ${steering[0]}`,
          type: 'invalid_request_error',
          param: steering[0],
          code: 'invalid_request',
        },
      })
    }
    const salt = fields.cache_salt ?? fields.extra_key
    const words = request.prompt.trim().split(/\s+/)
    const numTokens = count(request.prompt)
    if (options.isErrorAs200 && numTokens + request.max_tokens > contextTokens) {
      return sendJson(res, 200, {
        choices: [{ index: 0, text: 'Error: input too long', finish_reason: 'stop' }],
      })
    }
    if (surfaceRequest === null && numTokens + request.max_tokens > contextTokens) {
      return sendJson(res, 400, {
        error: {
          message: `This model's maximum context length is ${contextTokens} tokens; you requested ${numTokens + request.max_tokens}.`,
          type: 'invalid_request_error',
          param: 'prompt',
          code: 'context_length_exceeded',
        },
      })
    }
    if (flavour === 'sglang' && kind === 'safe' && numTokens >= sglangInputLimit) {
      return sendJson(res, 400, {
        object: 'error',
        message: `Input length (${numTokens} tokens) exceeds the maximum allowed length (${sglangInputLimit} tokens). Use a shorter input or enable --allow-auto-truncate.`,
        type: 'BadRequestError',
        param: null,
        code: 400,
      })
    }
    if (options.failValid && numTokens <= poolTokens) {
      if (numValidSeen++ % options.failValid.every === 0) {
        return sendJson(res, options.failValid.status, {
          error: { message: 'transfer failed', type: 'server_error', code: 'transfer_failed' },
        })
      }
    }
    if (options.chunkedPrefill) {
      const tenant = options.prefixCache === 'shared' ? '' : (req.headers.authorization ?? '')
      return serveChunkedPrefill(res, request, words, tenant, {
        ...options.chunkedPrefill,
        pool,
        cache: chunkCache,
        lastWords: chunkLastWords,
      })
    }
    let output: string[]
    if (numTokens > poolTokens) {
      // The incident: rejected inside, swapped for a placeholder, decoded over stale pages.
      stats.numOverCapacity++
      pool[0] = '<placeholder>'
      const isStaleRead =
        options.staleReadEvery === undefined
          ? stats.numOverCapacity % 2 === 1
          : stats.numOverCapacity % options.staleReadEvery === 0
      output = isStaleRead
        ? pool.slice(1, 1 + request.max_tokens)
        : Array(request.max_tokens).fill('the')
    } else {
      // Pages are handed out from the start of the pool and freed without scrubbing.
      pool.splice(0, words.length + 1, '<bos>', ...words)
      pool.length = poolTokens
      output = words.slice(0, request.max_tokens)
    }
    if (options.answerAfterFlood !== undefined) {
      const tenant = req.headers.authorization ?? ''
      if (streak.tenant !== tenant && streak.count >= options.answerAfterFlood)
        output = streak.words.slice(0, request.max_tokens)
      streak = { tenant, count: streak.tenant === tenant ? streak.count + 1 : 1, words }
    }
    // Queue behind a full batch, then hold pages while "generating".
    if (options.maxBatch !== undefined && numRunning >= options.maxBatch) {
      if (options.maxQueued !== undefined && queue.length >= options.maxQueued) {
        return sendJson(res, 503, {
          error: {
            message: 'The server is at capacity; retry later.',
            type: 'server_error',
            param: null,
            code: 'capacity_exhausted',
          },
        })
      }
      await new Promise<void>((resolve) => queue.push(resolve))
    } else numRunning++
    const numPages = Math.ceil((numTokens + request.max_tokens) / 16)
    stats.numPagesUsed += numPages
    numRunningCompletions++
    let isDone = false
    const finish = (isAborted: boolean): void => {
      if (isDone) return
      isDone = true
      numRunningCompletions--
      const wasRunning = numRunningCompletions + 1 // this one included (already counted out)
      if (isAborted && options.isAbortLeak && wasRunning >= (options.abortLeakMinRunning ?? 1))
        abortedWords = words
      if (isAborted && options.abortHoldMs !== undefined) {
        const timer = setTimeout(() => {
          holdTimers.delete(timer)
          stats.numPagesUsed -= numPages
        }, options.abortHoldMs)
        holdTimers.add(timer)
      } else if (!(isAborted && options.isPageLeakOnAbort)) stats.numPagesUsed -= numPages
      const next = queue.shift()
      if (next) next()
      else numRunning--
    }
    res.on('close', () => finish(!res.writableFinished))
    if (abortedWords !== null) {
      output = [...abortedWords, ...output]
      abortedWords = null
    }
    if (options.isLoadSensitive && stats.numInFlight > 1) output = [...output, 'loaded']
    const minRunning = Math.max(2, options.crossTalkMinRunning ?? 2)
    if (options.isCrossTalk && runningWords.size + 1 >= minRunning)
      output = [...[...runningWords][0], ...output]
    runningWords.add(words)
    res.on('close', () => runningWords.delete(words))
    let cachedTokens = 0
    if (options.prefixCache && options.prefixCache !== 'none') {
      const key = words.slice(0, 32).join(' ')
      const owners = prefixCache.get(key) ?? new Set<string>()
      const tenant =
        options.clientSalt === 'honoured' && typeof salt === 'string'
          ? `salt:${salt}`
          : (req.headers.authorization ?? '')
      const isHit = options.prefixCache === 'shared' ? owners.size > 0 : owners.has(tenant)
      const isCounted = isHit && (!options.isCrossHitUncounted || owners.has(tenant))
      owners.add(tenant)
      prefixCache.set(key, owners)
      if (isCounted) cachedTokens = 32
      await sleep(isHit ? (options.hitDelayMs ?? 1) : (options.missDelayMs ?? 40))
    }
    if (kvCache !== null && numTokens <= poolTokens) {
      const { words: served, isHit } = kvCache(
        {
          tenant: req.headers.authorization ?? '',
          salt: typeof fields.cache_salt === 'string' ? fields.cache_salt : '',
          numTokens,
          words,
        },
        request.prompt,
      )
      output = served.slice(0, request.max_tokens)
      cachedTokens = isHit ? numTokens : 0
    }
    const tokenDelayMs = options.tokenDelayMs ?? 0
    if (!request.stream && tokenDelayMs > 0) await sleep(tokenDelayMs * request.max_tokens)
    const usage = options.isTokenizeOnly
      ? undefined
      : {
          prompt_tokens: numTokens,
          completion_tokens: output.length,
          total_tokens: numTokens + output.length,
          ...((options.prefixCache || options.kvCache) && !options.isCachedTokensHidden
            ? { prompt_tokens_details: { cached_tokens: cachedTokens } }
            : {}),
        }
    if (!request.stream) {
      return sendJson(res, 200, {
        id: 'cmpl-1',
        object: 'text_completion',
        model: 'tiny-echo',
        choices: [
          {
            index: 0,
            text: ' ' + output.join(' ') + (options.answerSuffix ?? ''),
            finish_reason: 'length',
          },
        ],
        usage,
        ...options.answerFields,
      })
    }
    res.writeHead(200, { 'content-type': 'text/event-stream' })
    for (const word of output) {
      if (tokenDelayMs > 0) await sleep(tokenDelayMs)
      if (res.destroyed) return
      res.write(
        `data: ${JSON.stringify({ object: 'text_completion', choices: [{ index: 0, text: ' ' + word, finish_reason: null }] })}\n\n`,
      )
    }
    if (usage)
      res.write(`data: ${JSON.stringify({ object: 'text_completion', choices: [], usage })}\n\n`)
    res.end('data: [DONE]\n\n')
  }

  const server = createServer((req, res) => {
    stats.numRequests++
    stats.numInFlight++
    stats.maxInFlight = Math.max(stats.maxInFlight, stats.numInFlight)
    stats.paths.push(`${req.method} ${req.url}`)
    res.on('close', () => stats.numInFlight--)
    handle(req, res).catch((err: unknown) => {
      if (!res.headersSent)
        sendJson(res, 500, { error: { message: String(err), type: 'server_error' } })
      else res.end()
    })
  })
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  const { port } = server.address() as AddressInfo
  return {
    url: `http://127.0.0.1:${port}`,
    stats,
    revokeKey: (key) => void keys.delete(key),
    close: () =>
      new Promise<void>((resolve) => {
        for (const timer of holdTimers) clearTimeout(timer)
        server.closeAllConnections()
        server.close(() => resolve())
      }),
  }
}

/** Request fields that steer an engine's cache or transfer path. */
const steeringFields = new Set([
  'cache_salt',
  'extra_key',
  'kv_transfer_params',
  'bootstrap_host',
  'bootstrap_port',
  'bootstrap_room',
  'positional_embed_overrides',
])

/** A completion of the `chunkedPrefill` stand-in (see {@link ChunkedPrefill}): streamed or whole,
 *  headers sent only once the prefill is done (a cut before then is a cut during prefill). */
async function serveChunkedPrefill(
  res: ServerResponse,
  request: { max_tokens: number; stream?: boolean },
  words: readonly string[],
  tenant: string,
  setup: ChunkedPrefill & {
    pool: string[]
    cache: Map<string, string[]>
    /** Per tenant, the words of its last prompt answered (in the order tenants last sent). */
    lastWords: Map<string, readonly string[]>
  },
): Promise<void> {
  const { pool, cache, chunkTokens, stepMs, isPartialPublished, isUnwrittenBlank } = setup
  const key = `${tenant}\n${words.join(' ')}`
  const prompt = ['<bos>', ...words]
  let pages = cache.get(key)
  const cachedTokens = pages === undefined ? 0 : prompt.length
  if (pages === undefined) {
    let isGone = false
    let numWritten = 0
    res.on('close', () => (isGone = !res.writableFinished))
    for (let done = 0; done < prompt.length; done += chunkTokens) {
      await sleep(stepMs)
      if (isGone) break
      numWritten = Math.min(prompt.length, done + chunkTokens)
      pool.splice(
        done,
        Math.min(chunkTokens, prompt.length - done),
        ...prompt.slice(done, done + chunkTokens),
      )
    }
    // Past the last chunk written, the pages hold what the pool held there: stale words.
    const written = pool.slice(0, prompt.length)
    if (isUnwrittenBlank) written.fill('', numWritten)
    if (isGone) {
      if (isPartialPublished) cache.set(key, written)
      return
    }
    cache.set(key, written)
    pages = written
  }
  setup.lastWords.delete(tenant)
  setup.lastWords.set(tenant, words)
  const output =
    setup.answerFrom === undefined
      ? pages.slice(Math.max(1, pages.length - request.max_tokens))
      : middleWords(
          setup.answerFrom === 'own'
            ? words
            : ([...setup.lastWords].filter(([t]) => t !== tenant).pop()?.[1] ?? words),
          request.max_tokens,
        )
  const usage = {
    prompt_tokens: prompt.length,
    completion_tokens: output.length,
    ...(setup.isCachedTokensReported
      ? { prompt_tokens_details: { cached_tokens: cachedTokens } }
      : {}),
  }
  if (!request.stream) {
    return sendJson(res, 200, {
      object: 'text_completion',
      model: 'tiny-echo',
      choices: [{ index: 0, text: ' ' + output.join(' '), finish_reason: 'length' }],
      usage,
    })
  }
  res.writeHead(200, { 'content-type': 'text/event-stream' })
  for (const word of output) {
    res.write(
      `data: ${JSON.stringify({ object: 'text_completion', choices: [{ index: 0, text: ' ' + word, finish_reason: null }] })}\n\n`,
    )
  }
  res.write(`data: ${JSON.stringify({ object: 'text_completion', choices: [], usage })}\n\n`)
  res.end('data: [DONE]\n\n')
}

/** `count` words from the middle of `words`. */
function middleWords(words: readonly string[], count: number): string[] {
  const from = Math.max(0, Math.floor((words.length - count) / 2))
  return words.slice(from, from + count)
}

/** A URL on which nothing listens: a port bound and released. */
export async function unreachableUrl(): Promise<string> {
  const server = createServer()
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  const { port } = server.address() as AddressInfo
  await new Promise<void>((resolve) => server.close(() => resolve()))
  return `http://127.0.0.1:${port}`
}

/** Token events until the client goes away: every `delayMs` ms, or (0) whenever the socket
 *  takes more. */
function streamForever(res: ServerResponse, delayMs: number): void {
  res.writeHead(200, { 'content-type': 'text/event-stream' })
  const event = `data: ${JSON.stringify({ object: 'text_completion', choices: [{ index: 0, text: ' more', finish_reason: null }] })}\n\n`
  if (delayMs > 0) {
    const timer = setInterval(() => res.write(event), delayMs)
    res.on('close', () => clearInterval(timer))
    return
  }
  const pump = (): void => {
    while (!res.destroyed) if (!res.write(event)) return void res.once('drain', pump)
  }
  pump()
}

function sleep(ms: number): Promise<void> {
  return new Promise((r) => setTimeout(r, ms))
}

/** What `python -m http.server` answers: a listing at `/`, 404 for other GETs, 501 for POST. */
function serveStatic(req: IncomingMessage, res: ServerResponse, path: string): void {
  if (req.method === 'GET' && path === '/') {
    res.writeHead(200, { 'content-type': 'text/html; charset=utf-8' })
    res.end('<!DOCTYPE HTML><html><body><h1>Directory listing for /</h1></body></html>\n')
    return
  }
  const [status, text] =
    req.method === 'GET' ? [404, 'File not found'] : [501, 'Unsupported method']
  res.writeHead(status, { 'content-type': 'text/html;charset=utf-8' })
  res.end(
    `<html><body><h1>Error response</h1><p>Error code: ${status}</p><p>${text}</p></body></html>\n`,
  )
}

function isSurface(flavour: string): flavour is SurfaceFlavour {
  return flavour === 'llamacpp' || flavour === 'tgi' || flavour === 'plain'
}

/** A surface's accepted request in this stand-in's terms: "no limit" generates to the end of the
 *  context (at least one token), as llama.cpp does. */
function fromSurface(
  request: Exclude<SurfaceRequest, { status: number }>,
  contextTokens: number,
  count: (prompt: string) => number,
): { prompt: string; max_tokens: number; stream?: boolean; model?: string } {
  const room = Math.max(1, contextTokens - count(request.prompt))
  return {
    prompt: request.prompt,
    max_tokens: Math.min(request.maxTokens ?? room, room),
    stream: request.stream,
    model: request.model,
  }
}

/** The completion request, or why it is invalid. */
function parseRequest(
  body: string,
): { prompt: string; max_tokens: number; stream?: boolean; model?: string } | string {
  let json: unknown
  try {
    json = JSON.parse(body)
  } catch {
    return 'body is not valid JSON'
  }
  const o = json as Record<string, unknown>
  if (typeof o.prompt !== 'string') return 'prompt is required'
  if (!Number.isInteger(o.max_tokens) || (o.max_tokens as number) < 1)
    return 'max_tokens must be a positive integer'
  return {
    prompt: o.prompt,
    max_tokens: o.max_tokens as number,
    stream: o.stream === true,
    model: typeof o.model === 'string' ? o.model : undefined,
  }
}

function countTokens(prompt: string, extraTokenPastWords?: number): number {
  const numWords = prompt.trim().split(/\s+/).length
  return (
    numWords + 1 + (extraTokenPastWords !== undefined && numWords > extraTokenPastWords ? 1 : 0)
  )
}

function readBody(req: IncomingMessage): Promise<string> {
  return new Promise((resolve, reject) => {
    const chunks: Buffer[] = []
    req.on('data', (c: Buffer) => chunks.push(c))
    req.on('end', () => resolve(Buffer.concat(chunks).toString('utf8')))
    req.on('error', reject)
  })
}

function sendJson(res: ServerResponse, status: number, body: unknown): void {
  res.writeHead(status, { 'content-type': 'application/json' })
  res.end(JSON.stringify(body))
}
