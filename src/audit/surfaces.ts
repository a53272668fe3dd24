/** Capacity as llama.cpp's server and Hugging Face TGI publish it, for endpoints that answer
 *  neither kvfence's nor SGLang's server info. Each reader turns one endpoint's JSON into the
 *  sizes discovery compares, by that engine's own published rule:
 *  - llama.cpp (`llama-server`, ggml-org/llama.cpp tools/server): `GET /props`
 *    `default_generation_settings.n_ctx` and `GET /slots` `[i].n_ctx` are the context of one slot,
 *    `n_ctx_seq` (the KV cells one sequence may hold: the whole cache divided by `--parallel`, or,
 *    with the unified KV cache, the whole cache, capped by `--kv-unified-per-slot`). A request of
 *    `n_ctx` prompt tokens or more is refused (400 `exceed_context_size_error`); generation stops
 *    at the context. So one slot's `n_ctx` is at once the context a client may use and the KV a
 *    request can hold: the comparison is per slot, never with the whole cache (`-c`) nor with the
 *    model's training context (`/v1/models` `meta.n_ctx_train`, not read). `total_slots` is
 *    `--parallel`; a top-level `n_ctx` (some builds) is the whole cache.
 *  - TGI (huggingface/text-generation-inference router): `GET /info` `max_total_tokens` (prompt
 *    plus new tokens of one request: the advertised context), `max_input_tokens` (older
 *    `max_input_length`: the longest prompt, accepted up to and including it) and
 *    `max_batch_total_tokens` (tokens all requests of a batch may hold at once: the KV pool; the
 *    launcher refuses `max_total_tokens` over it, so one request always fits), `block_size` (v3:
 *    the page size).
 *  Knows field names of public APIs and these published rules; knows nothing else of any engine. */
import type { CapacitySource } from './discovery.js'
import { tryJson, type HttpResult, type Target } from './target.js'
import type { Tenant } from './types.js'

/** What one surface said, as discovery takes it. */
export interface SurfaceReading {
  readonly engine: 'llamacpp' | 'tgi'
  readonly advertised: readonly CapacitySource[]
  readonly pools: readonly CapacitySource[]
  /** Input limits as reported (not yet turned into the largest accepted prompt). */
  readonly inputLimits: readonly CapacitySource[]
  /** The largest prompt (tokens) the engine accepts by its rule, or null. */
  readonly largestInputTokens: number | null
  readonly pageSizes: readonly CapacitySource[]
  /** Requests running now (llama.cpp `/slots` `is_processing`), or null. */
  readonly numRunning: number | null
}

/** llama.cpp `GET /props`: null when the body is not llama.cpp's (no per-slot `n_ctx`). */
export function readLlamaCppProps(json: unknown): SurfaceReading | null {
  if (!isObject(json) || !isObject(json.default_generation_settings)) return null
  const slotContext = asPositiveInt(json.default_generation_settings.n_ctx)
  if (slotContext === null) return null
  const field = 'default_generation_settings.n_ctx'
  const pools: CapacitySource[] = [
    { endpoint: '/props', field: `${field} (one slot)`, tokens: slotContext },
  ]
  // Some builds also report the whole cache; a slot never holds more than that.
  const wholeCache = asPositiveInt(json.n_ctx)
  if (wholeCache !== null)
    pools.push({ endpoint: '/props', field: 'n_ctx (whole cache)', tokens: wholeCache })
  return llamaCppReading('/props', field, slotContext, pools, null)
}

/** llama.cpp `GET /slots`: every slot's `n_ctx`; null when the body is not llama.cpp's. */
export function readLlamaCppSlots(json: unknown): SurfaceReading | null {
  if (!Array.isArray(json) || json.length === 0) return null
  const contexts = json.map((slot: unknown) => (isObject(slot) ? asPositiveInt(slot.n_ctx) : null))
  if (contexts.some((n) => n === null)) return null
  const slotContext = Math.min(...(contexts as number[]))
  const index = contexts.indexOf(slotContext)
  const pools = [{ endpoint: '/slots', field: `[${index}].n_ctx (one slot)`, tokens: slotContext }]
  const numRunning = json.filter((slot) => isObject(slot) && slot.is_processing === true).length
  return llamaCppReading('/slots', `[${index}].n_ctx`, slotContext, pools, numRunning)
}

function llamaCppReading(
  endpoint: string,
  field: string,
  slotContext: number,
  pools: CapacitySource[],
  numRunning: number | null,
): SurfaceReading {
  return {
    engine: 'llamacpp',
    advertised: [{ endpoint, field: `${field} (one slot)`, tokens: slotContext }],
    pools,
    // A prompt of n_ctx tokens or more is refused: the largest accepted is n_ctx − 1.
    inputLimits: [{ endpoint, field: `${field} (prompt < n_ctx)`, tokens: slotContext }],
    largestInputTokens: slotContext - 1,
    pageSizes: [],
    numRunning,
  }
}

/** TGI `GET /info`: null when the body is not TGI's (no `max_total_tokens` with a batch budget
 *  or TGI's router name). */
export function readTgiInfo(json: unknown): SurfaceReading | null {
  if (!isObject(json)) return null
  const total = asPositiveInt(json.max_total_tokens)
  const batch = asPositiveInt(json.max_batch_total_tokens)
  const isTgi = json.router === 'text-generation-router' || batch !== null
  if (total === null || !isTgi) return null
  const inputField = json.max_input_tokens !== undefined ? 'max_input_tokens' : 'max_input_length'
  const input = asPositiveInt(json[inputField])
  const blockSize = asPositiveInt(json.block_size)
  const source = (field: string, tokens: number): CapacitySource => ({
    endpoint: '/info',
    field,
    tokens,
  })
  return {
    engine: 'tgi',
    advertised: [source('max_total_tokens', total)],
    pools: batch === null ? [] : [source('max_batch_total_tokens', batch)],
    inputLimits: input === null ? [] : [source(inputField, input)],
    // TGI refuses a prompt of more than max_input_tokens; that many is accepted.
    largestInputTokens: input,
    pageSizes: blockSize === null ? [] : [source('block_size', blockSize)],
    numRunning: null,
  }
}

function asPositiveInt(value: unknown): number | null {
  return typeof value === 'number' && Number.isSafeInteger(value) && value > 0 ? value : null
}

function isObject(value: unknown): value is Record<string, unknown> {
  return typeof value === 'object' && value !== null && !Array.isArray(value)
}

/** Reads llama.cpp's `/props` (else its `/slots`), else TGI's `/info`: the first that answers in
 *  its engine's shape. `record` notes each endpoint's status. Throws `BudgetExhaustedError`. */
export async function readSurface(
  target: Target,
  tenant: Tenant,
  record: (endpoint: string, res: HttpResult) => void,
): Promise<SurfaceReading | null> {
  const readers: [string, (json: unknown) => SurfaceReading | null][] = [
    ['/props', readLlamaCppProps],
    ['/slots', readLlamaCppSlots],
    ['/info', readTgiInfo],
  ]
  for (const [path, read] of readers) {
    const res = await target.get(path, { tenant })
    record(path, res)
    const reading = res.status === 200 ? read(tryJson(res.body)) : null
    if (reading !== null) return reading
  }
  return null
}
