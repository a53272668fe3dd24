/** Stand-ins for SGLang, vLLM, llama.cpp's server and a plain OpenAI-compatible server behind the
 *  gateway, on 127.0.0.1 (port 0), answering in each
 *  engine's own documented shapes, extra fields and nulls included, so that the gateway's
 *  translation to OpenAI's shapes is tested against what the engines really send:
 *  - discovery: SGLang `/get_server_info` (`max_total_num_tokens`, `max_req_input_len`,
 *    `context_length`) and `/abort_request {rid}`; vLLM `/metrics`
 *    `vllm:cache_config_info{block_size, num_gpu_blocks}`, `/v1/models` `max_model_len`, `/tokenize`
 *    `{count, max_model_len, tokens}` (words are tokens); llama.cpp `/props`
 *    `default_generation_settings.n_ctx` (one slot's context); the plain server (`openai`) reports
 *    nothing, as Hugging Face `transformers serve` 5.17 does (tried here): `/v1/models` answers 500,
 *    a field outside OpenAI's is refused with 422 `{"detail": "Unexpected fields in the request:
 *    {'cache_salt'}"}`, and its streams end without `data: [DONE]`.
 *  - prefix cache (`prefixCache`): `cached_tokens` is the longest run of words a prompt shares with
 *    an earlier one under the same key — the `cache_salt` (`salted`) or nothing (`shared`, an
 *    engine that ignores the salt; `saltIgnoredOn` names paths that ignore it under `salted`);
 *    absent: `prompt_tokens_details: null`.
 *  - bodies (pydantic models of sglang/srt/entrypoints/openai/protocol.py and
 *    vllm/entrypoints/openai/protocol.py, dumped as those servers dump them): non-streamed replies
 *    with every field, None as null (SGLang `matched_stop`, `tool_calls: null`, `metadata`, usage
 *    `reasoning_tokens`; vLLM `stop_reason`, `refusal`/`annotations`/`audio`/`function_call: null`,
 *    `service_tier`, `system_fingerprint: null`, `kv_transfer_params`); streamed chunks as SGLang
 *    dumps them (all fields, `usage: null`) and as vLLM does (only the fields set).
 *  - errors: SGLang `{object: "error", message, type, param, code: <HTTP status>}` at the top
 *    level; vLLM `{error: {message, type, param, code: <HTTP status>}}`; in a stream, either as
 *    `data: {"error": {...}}`.
 *  The reply is `numTokens` words `w0 w1 …`, finish reason `length`. Shared by the gateway's tests
 *  and whatever else needs an SGLang or vLLM to talk to. Not a test file itself. */
import http from 'node:http'
import type { AddressInfo } from 'node:net'

/** How the engine fails every completion, when set: its own 400 (`bad-request`), its own 500
 *  (`server-error`), or a stream whose in-stream error event comes after one token
 *  (`stream-error`) or before anything (`stream-error-at-start`); non-streamed requests answer
 *  500 for both. */
export type EngineFailure =
  'bad-request' | 'server-error' | 'stream-error' | 'stream-error-at-start'

/** A running stand-in engine. */
/** The engines the stand-in can be. */
export type EngineKind = 'sglang' | 'vllm' | 'llamacpp' | 'openai'

export interface Engine {
  url: string
  kind: EngineKind
  /** KV pool in tokens; may be changed while running. */
  poolTokens: number
  /** How its prefix cache keys prompts (null: it has none); may be changed while running. */
  prefixCache: 'salted' | 'shared' | null
  /** Paths on which a salted cache ignores the salt all the same (one entrypoint that drops it,
   *  as vLLM PR #51818 found); may be changed while running. */
  saltIgnoredOn: Set<'chat' | 'completion'>
  /** Set to make completions fail (see {@link EngineFailure}); null: answer normally. */
  failure: EngineFailure | null
  /** True: every connection is dropped without an answer (an engine down or redeploying, its
   *  port still open); may be changed while running. */
  isDown: boolean
  /** Bodies of the completion requests received (the gateway's self-check's apart). */
  completions: Record<string, unknown>[]
  /** Headers of the completion requests, in the order of {@link Engine.completions}. */
  completionHeaders: http.IncomingHttpHeaders[]
  /** Every `METHOD /path` the engine was sent, in order. */
  routes: string[]
  /** Bodies of the gateway's isolation self-check requests (prompt `kvfence isolation
   *  self-check …`). */
  selfChecks: Record<string, unknown>[]
  /** `rid`s of SGLang `/abort_request` calls. */
  aborted: string[]
  tokenizeCalls: number
  close(): Promise<void>
}

/** Options of {@link startEngine}. */
export interface EngineOptions {
  poolTokens: number
  maxModelLen: number
  /** Delay after each streamed token (ms, default 0). */
  tokenDelayMs?: number
  /** Words in a reply (default 3). */
  numTokens?: number
  /** How a prefix cache keys prompts, when the engine has one (see the module's header). */
  prefixCache?: 'salted' | 'shared'
}

/** Fields a plain server accepts on completions (OpenAI's; anything else is refused, 422). */
const openAiFields = new Set(
  (
    'model messages prompt max_tokens max_completion_tokens stream stream_options temperature ' +
    'top_p n stop seed presence_penalty frequency_penalty logprobs top_logprobs logit_bias user ' +
    'response_format tools tool_choice echo suffix best_of'
  ).split(' '),
)

/** The text the engine's reply carries for `numTokens` words. */
export function engineReplyText(numTokens = 3): string {
  return Array.from({ length: numTokens }, (_, i) => `w${i} `).join('')
}

/** Starts a stand-in engine of `kind`. */
export async function startEngine(kind: EngineKind, options: EngineOptions): Promise<Engine> {
  const engine: Engine = {
    url: '',
    kind,
    poolTokens: options.poolTokens,
    prefixCache: options.prefixCache ?? null,
    saltIgnoredOn: new Set(),
    failure: null,
    isDown: false,
    completions: [],
    completionHeaders: [],
    routes: [],
    selfChecks: [],
    aborted: [],
    tokenizeCalls: 0,
    close: async () => undefined,
  }
  const send = (res: http.ServerResponse, status: number, body: unknown) => {
    res.writeHead(status, { 'content-type': 'application/json' })
    res.end(JSON.stringify(body))
  }
  /** The engine's error body for `status`: SGLang's ErrorResponse, vLLM's ErrorResponse. */
  const errorBody = (status: number, message: string) => {
    const type = status < 500 ? 'BadRequestError' : 'InternalServerError'
    return kind === 'sglang'
      ? { object: 'error', message, type, param: null, code: status }
      : { error: { message, type, param: null, code: status } }
  }
  /** The in-stream error event's value (both wrap their ErrorResponse fields in `error`). */
  const streamErrorBody = (message: string) =>
    kind === 'sglang'
      ? { error: { object: 'error', message, type: 'InternalServerError', param: null, code: 500 } }
      : { error: { message, type: 'InternalServerError', param: null, code: 500 } }

  /** Earlier prompts' words by prefix-cache key. */
  const cache = new Map<string, string[][]>()
  const deadSockets = new WeakSet<object>()
  const server = http.createServer(async (req, res) => {
    if (deadSockets.has(req.socket) || engine.isDown) return req.socket.destroy()
    const chunks: Buffer[] = []
    for await (const c of req as AsyncIterable<Buffer>) chunks.push(c)
    const body = chunks.length > 0 ? JSON.parse(Buffer.concat(chunks).toString('utf8')) : null
    const route = `${req.method} ${req.url}`
    engine.routes.push(route)
    if (kind === 'openai' && route === 'GET /v1/models') {
      // As uvicorn after a handler's exception: the connection is not kept, though the answer
      // does not say so; the next request sent on it is cut unanswered.
      deadSockets.add(req.socket)
      res.writeHead(500, { 'content-type': 'text/plain; charset=utf-8' })
      return res.end('Internal Server Error')
    }
    if (kind === 'llamacpp' && route === 'GET /props') {
      return send(res, 200, {
        default_generation_settings: { n_ctx: engine.poolTokens, params: { n_predict: -1 } },
        total_slots: 1,
        model_path: 'tiny-engine.gguf',
        chat_template: '',
        build_info: 'b7000-stand-in',
      })
    }
    if (kind === 'llamacpp' && route === 'POST /apply-template') {
      engine.tokenizeCalls++
      const turns = body.messages.map(
        (m: { role: string; content: string }) => `${m.role}: ${m.content}`,
      )
      return send(res, 200, { prompt: `${turns.join(' ')} assistant:` })
    }
    if (kind === 'llamacpp' && route === 'POST /tokenize') {
      engine.tokenizeCalls++
      const words: string[] = String(body.content).trim().split(/\s+/)
      return send(res, 200, { tokens: words.map((_w, i) => i + 10) })
    }
    if (route === 'GET /v1/models') {
      const card = { id: 'tiny-engine', object: 'model', created: 0, owned_by: kind }
      return send(res, 200, {
        object: 'list',
        data: [
          kind === 'sglang'
            ? { ...card, root: 'tiny-engine', parent: null, max_model_len: options.maxModelLen }
            : {
                ...card,
                root: 'tiny-engine',
                parent: null,
                max_model_len: options.maxModelLen,
                permission: [],
              },
        ],
      })
    }
    if (kind === 'sglang' && route === 'GET /get_server_info') {
      return send(res, 200, {
        model_path: 'tiny-engine',
        context_length: options.maxModelLen,
        chunked_prefill_size: 8192,
        max_total_num_tokens: engine.poolTokens,
        max_req_input_len: engine.poolTokens - 5,
      })
    }
    if (kind === 'sglang' && route === 'POST /abort_request') {
      engine.aborted.push(body.rid)
      return send(res, 200, {})
    }
    if (kind === 'vllm' && route === 'GET /metrics') {
      res.writeHead(200, { 'content-type': 'text/plain; version=0.0.4' })
      return res.end(
        '# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n' +
          '# TYPE vllm:cache_config_info gauge\n' +
          `vllm:cache_config_info{block_size="16",cache_dtype="auto",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="${engine.poolTokens / 16}"} 1.0\n`,
      )
    }
    if (kind === 'vllm' && route === 'POST /tokenize') {
      engine.tokenizeCalls++
      const text: string =
        body.prompt ?? body.messages.map((m: { content: string }) => m.content).join(' ')
      const tokens = text
        .trim()
        .split(/\s+/)
        .map((_w, i) => i + 10)
      return send(res, 200, { count: tokens.length, max_model_len: options.maxModelLen, tokens })
    }
    const isChat = route === 'POST /v1/chat/completions'
    if (!isChat && route !== 'POST /v1/completions') {
      return send(res, 404, { detail: 'Not Found' })
    }
    const promptText: string =
      typeof body.prompt === 'string'
        ? body.prompt
        : (body.messages ?? []).map((m: { content: string }) => m.content).join(' ')
    const isSelfCheck = promptText.startsWith('kvfence isolation self-check')
    ;(isSelfCheck ? engine.selfChecks : engine.completions).push(body)
    if (!isSelfCheck) engine.completionHeaders.push(req.headers)
    const unexpected = Object.keys(body).filter((k) => !openAiFields.has(k))
    if (kind === 'openai' && unexpected.length > 0) {
      const fields = unexpected.map((k) => `'${k}'`).join(', ')
      return send(res, 422, { detail: `Unexpected fields in the request: {${fields}}` })
    }
    if (engine.failure === 'bad-request') {
      return send(res, 400, errorBody(400, 'temperature must be in [0, 2], got 7.0'))
    }
    if (engine.failure === 'server-error' || (engine.failure !== null && !body.stream)) {
      return send(res, 500, errorBody(500, 'CUDA error: an illegal memory access was encountered'))
    }
    const words = engineReplyText(options.numTokens).match(/\S+ /g)!
    const base = {
      id: `${isChat ? 'chatcmpl' : 'cmpl'}-engine`,
      object: isChat ? 'chat.completion' : 'text_completion',
      created: 1_767_000_000,
      model: 'tiny-engine',
    }
    const usage = {
      prompt_tokens: 4,
      total_tokens: 4 + words.length,
      completion_tokens: words.length,
      prompt_tokens_details:
        engine.prefixCache === null
          ? null
          : {
              cached_tokens: cachedWords(
                cache,
                engine.saltIgnoredOn.has(isChat ? 'chat' : 'completion')
                  ? cacheKey('shared', body)
                  : cacheKey(engine.prefixCache, body),
                promptText,
              ),
            },
      ...(kind === 'sglang' ? { reasoning_tokens: 0 } : {}),
    }
    if (!body.stream) {
      const text = words.join('')
      const choice = isChat
        ? {
            index: 0,
            message:
              kind === 'sglang'
                ? { role: 'assistant', content: text, reasoning_content: null, tool_calls: null }
                : {
                    role: 'assistant',
                    content: text,
                    refusal: null,
                    annotations: null,
                    audio: null,
                    function_call: null,
                    tool_calls: [],
                    reasoning_content: null,
                  },
            logprobs: null,
            finish_reason: 'length',
          }
        : { index: 0, text, logprobs: null, finish_reason: 'length' }
      return send(
        res,
        200,
        kind === 'sglang'
          ? { ...base, choices: [{ ...choice, matched_stop: null }], usage, metadata: null }
          : {
              ...base,
              choices: [
                { ...choice, stop_reason: null, ...(isChat ? {} : { prompt_logprobs: null }) },
              ],
              service_tier: null,
              system_fingerprint: null,
              usage,
              ...(isChat ? { prompt_logprobs: null } : {}),
              kv_transfer_params: null,
            },
      )
    }
    res.writeHead(200, { 'content-type': 'text/event-stream' })
    let isClosed = false
    res.on('close', () => (isClosed = true))
    const chunkBase = { ...base, object: isChat ? 'chat.completion.chunk' : 'text_completion' }
    const event = (value: unknown) => res.write(`data: ${JSON.stringify(value)}\n\n`)
    /** One streamed choice: SGLang dumps every field, vLLM only those set. */
    const streamChoice = (piece: string, finish: string | null, isFirst: boolean) => {
      if (isChat) {
        const delta =
          kind === 'sglang'
            ? {
                role: isFirst ? 'assistant' : null,
                content: piece,
                reasoning_content: null,
                tool_calls: null,
              }
            : isFirst
              ? { role: 'assistant', content: piece }
              : { content: piece }
        return kind === 'sglang'
          ? { index: 0, delta, logprobs: null, finish_reason: finish, matched_stop: null }
          : {
              index: 0,
              delta,
              logprobs: null,
              finish_reason: finish,
              ...(finish === null ? {} : { stop_reason: null }),
            }
      }
      return kind === 'sglang'
        ? { index: 0, text: piece, logprobs: null, finish_reason: finish, matched_stop: null }
        : { index: 0, text: piece, logprobs: null, finish_reason: finish, stop_reason: null }
    }
    const isUsageStreamed = body.stream_options?.include_usage === true
    const chunk = (choices: unknown[]) =>
      kind === 'sglang'
        ? { ...chunkBase, choices, usage: null }
        : { ...chunkBase, choices, ...(isUsageStreamed ? { usage: null } : {}) }
    if (engine.failure === 'stream-error-at-start') {
      event(streamErrorBody('out of memory while scheduling the request'))
      return res.end('data: [DONE]\n\n')
    }
    if (isChat) event(chunk([streamChoice('', null, true)]))
    for (const [i, word] of words.entries()) {
      if (isClosed) return
      if (engine.failure === 'stream-error' && i === 1) {
        event(streamErrorBody('CUDA error: an illegal memory access was encountered'))
        return res.end('data: [DONE]\n\n')
      }
      const finish = i === words.length - 1 ? 'length' : null
      event(chunk([streamChoice(word, finish, false)]))
      await new Promise((r) => setTimeout(r, options.tokenDelayMs ?? 0))
    }
    if (isUsageStreamed) {
      const { prompt_tokens, completion_tokens, total_tokens } = usage
      event({
        ...chunkBase,
        choices: [],
        usage: { prompt_tokens, total_tokens, completion_tokens },
      })
    }
    res.end(kind === 'openai' ? undefined : 'data: [DONE]\n\n')
  })
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r))
  engine.url = `http://127.0.0.1:${(server.address() as AddressInfo).port}`
  engine.close = async () => {
    server.closeAllConnections()
    await new Promise((r) => server.close(r))
  }
  return engine
}

/** The prefix-cache key of a request: its salt when the cache is salted, else one for all. */
function cacheKey(prefixCache: 'salted' | 'shared', body: { cache_salt?: unknown }): string {
  return prefixCache === 'salted' ? String(body.cache_salt ?? '') : ''
}

/** Words of `text` shared as a prefix with the longest match among earlier prompts under `key`;
 *  records `text` under it. */
function cachedWords(cache: Map<string, string[][]>, key: string, text: string): number {
  const words = text.trim().split(/\s+/)
  const earlier = cache.get(key) ?? []
  let best = 0
  for (const seen of earlier) {
    let n = 0
    while (n < words.length && n < seen.length && words[n] === seen[n]) n++
    best = Math.max(best, n)
  }
  cache.set(key, [...earlier, words])
  return best
}
