/** What differs between the engines gateway mode fronts, one entry per engine: where each reports
 *  its KV capacity, and how a request is named and aborted on it. The engines' documented shapes:
 *  - SGLang `GET /server_info` (older: `/get_server_info`): `max_total_num_tokens` (KV pool,
 *    top-level or in `internal_states[0]`), `max_req_input_len`, `context_length`;
 *    abort: `POST /abort_request {"rid"}`; the request id is sent as `rid`.
 *  - vLLM `GET /metrics` `vllm:cache_config_info{num_gpu_blocks, block_size}` (KV pool =
 *    blocks × block size); closing the connection aborts the request.
 *  - llama.cpp's server `GET /props`: `default_generation_settings.n_ctx` is the context of one
 *    slot (the whole KV cache divided among `total_slots` parallel slots), so it is what one
 *    request can hold; closing the connection aborts the request.
 *  - a plain OpenAI-compatible server (`openai`, e.g. Hugging Face `transformers serve`) reports
 *    no capacity at all: the operator declares it (`backend.kvPoolTokens`).
 *  What both share (`/v1/models`, `/tokenize`) is in discovery.ts and prompt-count.ts.
 *  Knows the engines' HTTP APIs; knows nothing of tenants, admission or OpenAI bodies. */
import type { Logger } from 'pino'
import { samplesOf } from '../metrics/prometheus-text.js'
import { type EngineHttp, asObject, json, messageOf, positive } from './engine-http.js'

/** Engines the gateway knows how to discover and abort on. */
export type BackendKind = 'sglang' | 'vllm' | 'llamacpp' | 'openai'

/** What an engine's own endpoints say about its capacity (null: not reported). */
export interface EngineCapacityReport {
  /** KV pool in tokens. */
  capacityTokens: number | null
  /** Longest sequence the model allows. */
  maxModelLen: number | null
  /** Longest prompt the engine accepts. */
  maxInputTokens: number | null
}

/** One engine's particulars. */
export interface Engine {
  /** Reads the engine's own capacity endpoints; never rejects (an unread field is null). */
  readCapacity(http: EngineHttp): Promise<EngineCapacityReport>
  /** Where {@link Engine.readCapacity} looks, for the error when it finds nothing. */
  readonly capacitySource: string
  /** How the engine counts a prompt: vLLM's and SGLang's `POST /tokenize {model, prompt|messages}`,
   *  llama.cpp's (`POST /apply-template {messages}` → `{prompt}`, then `POST /tokenize {content}`
   *  → `{tokens}`), or not at all (a local `tokenizerDir` is then required). */
  readonly tokenize: 'openai' | 'llamacpp' | null
  /** Names the request `rid` in the engine's `body` when the engine aborts by id. */
  nameRequest(body: Record<string, unknown>, rid: string): void
  /** Aborts request `rid` on the engine after its client went away (fire and forget: the
   *  outcome is logged). */
  abort(http: EngineHttp, rid: string, log: Logger): void
}

const sglang: Engine = {
  async readCapacity(http) {
    let res = await http.call('/server_info', 'GET', null).catch(() => null)
    if (res?.status !== 200)
      res = await http.call('/get_server_info', 'GET', null).catch(() => null)
    const info = res?.status === 200 ? asObject(json(res.body)) : null
    const states = Array.isArray(info?.internal_states) ? info.internal_states : []
    const state = asObject(states[0])
    return {
      capacityTokens: positive(info?.max_total_num_tokens) ?? positive(state?.max_total_num_tokens),
      maxInputTokens: positive(info?.max_req_input_len) ?? positive(state?.max_req_input_len),
      maxModelLen: positive(info?.context_length),
    }
  },
  capacitySource: '/server_info or /get_server_info max_total_num_tokens',
  tokenize: 'openai',
  nameRequest(body, rid) {
    body.rid = rid
  },
  abort(http, rid, log) {
    http.call('/abort_request', 'POST', { rid }).then(
      (r) => log.info({ status: r.status }, 'aborted on the backend'),
      (err: unknown) => log.warn({ detail: messageOf(err) }, 'backend abort failed'),
    )
  },
}

const vllm: Engine = {
  async readCapacity(http) {
    const res = await http.call('/metrics', 'GET', null).catch(() => null)
    let capacityTokens: number | null = null
    if (res?.status === 200) {
      const [sample] = samplesOf(res.body, 'vllm:cache_config_info')
      const numBlocks = positive(Number(sample?.labels.num_gpu_blocks))
      const blockSize = positive(Number(sample?.labels.block_size))
      if (numBlocks !== null && blockSize !== null) capacityTokens = numBlocks * blockSize
    }
    return { capacityTokens, maxModelLen: null, maxInputTokens: null }
  },
  capacitySource: '/metrics vllm:cache_config_info',
  tokenize: 'openai',
  nameRequest() {}, // vLLM takes no request id: it aborts when the connection closes
  abort() {},
}

const llamacpp: Engine = {
  async readCapacity(http) {
    const res = await http.call('/props', 'GET', null).catch(() => null)
    const props = res?.status === 200 ? asObject(json(res.body)) : null
    const settings = asObject(props?.default_generation_settings)
    // n_ctx here is one slot's share of the KV cache: no request can be longer.
    const slotContext = positive(settings?.n_ctx)
    return { capacityTokens: slotContext, maxModelLen: slotContext, maxInputTokens: null }
  },
  capacitySource: '/props default_generation_settings.n_ctx',
  tokenize: 'llamacpp',
  nameRequest() {}, // llama.cpp takes no request id: it stops a slot when the connection closes
  abort() {},
}

const openai: Engine = {
  readCapacity: () =>
    Promise.resolve({ capacityTokens: null, maxModelLen: null, maxInputTokens: null }),
  capacitySource: 'nothing: a plain OpenAI-compatible server reports no KV capacity',
  tokenize: null,
  nameRequest() {},
  abort() {},
}

/** Each engine's particulars. */
export const engines: { readonly [K in BackendKind]: Engine } = { sglang, vllm, llamacpp, openai }
