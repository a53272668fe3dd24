/** Gateway mode: the router in front of another engine's OpenAI API (SGLang, vLLM), adding what
 *  the engine may lack — the safe rejection path. At start and periodically it discovers what the
 *  engine can really hold, advertises no more (G1), counts each prompt with the engine's own
 *  tokenizer and refuses over-capacity prompts with 400 before they reach the engine (G2), sets
 *  the request id itself, keys the engine's prefix cache by tenant (`cache_salt`, per tenant), and
 *  aborts on the engine when the client goes away (G8).
 *
 *  Discovery (the engines' documented shapes):
 *  - SGLang `GET /server_info` (older: `/get_server_info`): `max_total_num_tokens` (KV pool,
 *    top-level or in `internal_states[0]`), `max_req_input_len`, `context_length`;
 *    abort: `POST /abort_request {"rid"}`; the request id is sent as `rid`.
 *  - vLLM `GET /metrics` `vllm:cache_config_info{num_gpu_blocks, block_size}` (KV pool =
 *    blocks × block size); closing the connection aborts the request.
 *  - both: `GET /v1/models` `max_model_len`; tokens: `POST /tokenize` `{model, prompt|messages}`
 *    → `{count}` (or `tokens`), unless a `tokenizer.json` directory is given.
 *  Knows the engines' HTTP APIs and OpenAI bodies; knows nothing of tenants' keys or kvfence's
 *  workers. */
import { createHmac, randomBytes } from 'node:crypto'
import http from 'node:http'
import https from 'node:https'
import type { ServerResponse } from 'node:http'
import type { Logger } from 'pino'
import { KvfenceError, toOpenAiError } from '../errors.js'
import { type Tokenizer, loadTokenizer } from '../model/tokenizer.js'
import { chatPromptTokenIds, completionPromptTokenIds } from './admission.js'
import {
  type RelayHeader,
  isErrorEvent,
  openAiChunk,
  openAiError,
  openAiUsage,
  openAiWhole,
} from './engine-replies.js'
import { coalesceWrites, drained, readReplyText, sendJson } from './http.js'
import { samplesOf } from './prometheus-text.js'
import type { FinishReason } from './responses.js'
import type { ParsedChatRequest, ParsedCompletionRequest } from './schemas.js'

/** Engines the gateway knows how to discover and abort on. */
export type BackendKind = 'sglang' | 'vllm'

/** Options of {@link startGateway}. */
export interface GatewayOptions {
  kind: BackendKind
  /** The engine's base URL, e.g. `http://10.0.0.5:30000`. */
  url: string
  /** The model id the engine serves (sent as `model`); default: the first of its `/v1/models`. */
  backendModel?: string
  /** Served model name (in `/v1/models` and responses); default: the engine's model id, so that
   *  clients keep the name they used against the engine. */
  servedModel?: string
  /** A directory with the engine's `tokenizer.json` (+ `tokenizer_config.json`); default: the
   *  engine's `/tokenize`. */
  tokenizerDir?: string
  /** Advertised context window; default: what the engine can hold. */
  contextWindow?: number
  /** Clamp an over-large window instead of refusing to start (G1). */
  clampContext: boolean
  /** False = allow advertising more than the engine holds (the incident's configuration). */
  guardsEnabled: boolean
  /** How often to re-discover capacity, ms (default 30 000; 0 = only at start). */
  discoveryIntervalMs?: number
  /** Bearer key for the engine's API, if it wants one (never a tenant's key). */
  apiKey?: string
  /** Deadline of discovery and tokenize calls, ms (default 5 000). */
  timeoutMs?: number
  log: Logger
}

/** What the engine said about itself. */
export interface BackendCapacity {
  /** KV pool in tokens. */
  capacityTokens: number
  /** Longest sequence the model allows (`context_length` / `max_model_len`), when reported. */
  maxModelLen: number | null
  /** Longest prompt the engine accepts (`max_req_input_len`), when reported. */
  maxInputTokens: number | null
}

/** One request to proxy; the router has authenticated, parsed and admitted it. */
export interface ProxyRequest {
  endpoint: 'chat' | 'completion'
  /** The client's body, already validated (no internal fields). */
  body: Record<string, unknown>
  rid: string
  tenant: string
  /** Completion tokens admitted (sent as the engine's limit). */
  maxTokens: number
  isStream: boolean
  res: ServerResponse
  signal: AbortSignal
  /** Called for each generated chunk of text. */
  onToken(): void
  log: Logger
}

/** How a proxied request ended. */
export interface ProxyOutcome {
  status: number
  numCompletionTokens: number
  finishReason: FinishReason | null
  /** The completion text (kept for `--log-content` only). */
  text: string
}

/** A running gateway. */
export interface Gateway {
  readonly kind: BackendKind
  readonly url: string
  /** The model name clients use: the configured one, or the engine's model id. */
  readonly servedModel: string
  /** The context window advertised now (≤ what the engine holds, unless guards are off). */
  contextWindow(): number
  /** For `/server_info`. */
  info(): { kind: BackendKind; url: string; contextWindow: number } & BackendCapacity
  /** The prompt's token count by the engine's own tokenizer; throws `context_length_exceeded`
   *  (400) when it exceeds the engine's longest accepted input. */
  countPromptTokens(
    endpoint: 'chat' | 'completion',
    parsed: ParsedChatRequest | ParsedCompletionRequest,
    signal: AbortSignal,
  ): Promise<number>
  /** Sends the request to the engine and its answer to the client. */
  proxy(request: ProxyRequest): Promise<ProxyOutcome>
  /** Re-reads the engine's capacity now (also done every `discoveryIntervalMs`). */
  rediscover(): Promise<void>
  close(): void
}

const defaultIntervalMs = 30_000
const maxReplyBytes = 16 * 1024 * 1024
const validFinishReasons = new Set(['stop', 'length', 'content_filter', 'tool_calls'])

/** Discovers the engine's capacity, decides the window (G1) and returns the gateway. Throws
 *  `worker_unavailable` when the engine does not answer or reports no capacity, and
 *  `guard_violation` when `contextWindow` exceeds what it holds (without clamping). */
export async function startGateway(options: GatewayOptions): Promise<Gateway> {
  const base = normalize(options.url)
  const timeoutMs = options.timeoutMs ?? 5_000
  const agent = base.startsWith('https:')
    ? new https.Agent({ keepAlive: true })
    : new http.Agent({ keepAlive: true })
  const headers: Record<string, string> =
    options.apiKey === undefined ? {} : { authorization: `Bearer ${options.apiKey}` }
  const tokenizer: Tokenizer | null =
    options.tokenizerDir === undefined ? null : loadTokenizer(options.tokenizerDir)

  const call = (path: string, method: 'GET' | 'POST', body: unknown, signal?: AbortSignal) =>
    request(
      agent,
      `${base}${path}`,
      method,
      headers,
      body,
      signal ?? AbortSignal.timeout(timeoutMs),
    )

  let backendModel = options.backendModel ?? null
  let capacity = await discover()
  let window = decideWindow(capacity, true)
  // discover() has thrown unless the engine named its model.
  const servedModel = options.servedModel ?? (backendModel as string | null) ?? 'model'

  async function discover(): Promise<BackendCapacity> {
    const models = await call('/v1/models', 'GET', null).catch(() => null)
    const listed = models?.status === 200 ? asObject(json(models.body))?.data : undefined
    const entries = Array.isArray(listed) ? listed.map(asObject) : []
    backendModel ??= typeof entries[0]?.id === 'string' ? (entries[0].id as string) : null
    const entry = entries.find((e) => e?.id === backendModel)
    let maxModelLen = positive(entry?.max_model_len)
    let capacityTokens: number | null = null
    let maxInputTokens: number | null = null
    if (options.kind === 'sglang') {
      let res = await call('/server_info', 'GET', null).catch(() => null)
      if (res?.status !== 200) res = await call('/get_server_info', 'GET', null).catch(() => null)
      const info = res?.status === 200 ? asObject(json(res.body)) : null
      const states = Array.isArray(info?.internal_states) ? info.internal_states : []
      const state = asObject(states[0])
      capacityTokens = positive(info?.max_total_num_tokens) ?? positive(state?.max_total_num_tokens)
      maxInputTokens = positive(info?.max_req_input_len) ?? positive(state?.max_req_input_len)
      maxModelLen = positive(info?.context_length) ?? maxModelLen
    } else {
      const res = await call('/metrics', 'GET', null).catch(() => null)
      if (res?.status === 200) {
        const [sample] = samplesOf(res.body, 'vllm:cache_config_info')
        const numBlocks = positive(Number(sample?.labels.num_gpu_blocks))
        const blockSize = positive(Number(sample?.labels.block_size))
        if (numBlocks !== null && blockSize !== null) capacityTokens = numBlocks * blockSize
      }
    }
    if (backendModel === null) {
      throw new KvfenceError(
        'worker_unavailable',
        `${options.kind} backend ${base}: no model listed at /v1/models`,
      )
    }
    if (capacityTokens === null) {
      const where =
        options.kind === 'sglang'
          ? '/server_info or /get_server_info max_total_num_tokens'
          : '/metrics vllm:cache_config_info'
      throw new KvfenceError(
        'worker_unavailable',
        `${options.kind} backend ${base}: cannot read its KV capacity (${where})`,
      )
    }
    return { capacityTokens, maxModelLen, maxInputTokens }
  }

  /** G1 over the engine's numbers. At start an over-large window is refused (or clamped); later
   *  the window follows the engine down (with a warning), never above the operator's wish. */
  function decideWindow(c: BackendCapacity, isStart: boolean): number {
    const effective = Math.min(c.capacityTokens, c.maxModelLen ?? Infinity)
    const requested = options.contextWindow
    if (requested === undefined || requested <= effective) return requested ?? effective
    const excess = `context window ${requested} exceeds what ${options.kind} backend ${base} holds: ${effective} tokens (KV pool ${c.capacityTokens}, max_model_len ${c.maxModelLen ?? 'unknown'})`
    if (!options.guardsEnabled) {
      options.log.warn(`UNSAFE: ${excess}; guards are disabled`)
      return requested
    }
    if (isStart && !options.clampContext) {
      throw new KvfenceError(
        'guard_violation',
        `G1: ${excess}; lower the context window to ${effective} or pass --clamp-context`,
      )
    }
    options.log.warn(`G1: ${excess}; clamped to ${effective}`)
    return effective
  }

  async function rediscover(): Promise<void> {
    try {
      const next = await discover()
      const nextWindow = decideWindow(next, false)
      if (nextWindow !== window || next.capacityTokens !== capacity.capacityTokens) {
        options.log.info(
          { capacityTokens: next.capacityTokens, contextWindow: nextWindow },
          'backend capacity changed',
        )
      }
      capacity = next
      window = nextWindow
    } catch (err) {
      options.log.warn(
        { detail: messageOf(err) },
        'backend capacity discovery failed; keeping the last',
      )
    }
  }

  // One salt per tenant, HMAC-SHA-256 of its name under a secret drawn at start: stable for the
  // router's life (a tenant keeps its cache hits), different for every tenant, and not computable
  // by anyone who can read the engine's requests or logs.
  const saltSecret = randomBytes(32)
  const salts = new Map<string, string>()
  const cacheSaltOf = (tenant: string): string => {
    let salt = salts.get(tenant)
    if (salt === undefined) {
      salt = createHmac('sha256', saltSecret).update(tenant).digest('base64url')
      salts.set(tenant, salt)
    }
    return salt
  }

  const intervalMs = options.discoveryIntervalMs ?? defaultIntervalMs
  const timer = intervalMs > 0 ? setInterval(() => void rediscover(), intervalMs) : null
  timer?.unref()

  async function countPromptTokens(
    endpoint: 'chat' | 'completion',
    parsed: ParsedChatRequest | ParsedCompletionRequest,
    signal: AbortSignal,
  ): Promise<number> {
    let numTokens: number
    if (endpoint === 'completion' && 'tokenIds' in (parsed as ParsedCompletionRequest).prompt) {
      numTokens = ((parsed as ParsedCompletionRequest).prompt as { tokenIds: number[] }).tokenIds
        .length
    } else if (tokenizer !== null) {
      numTokens =
        endpoint === 'chat'
          ? chatPromptTokenIds(tokenizer, (parsed as ParsedChatRequest).messages).length
          : completionPromptTokenIds(tokenizer, (parsed as ParsedCompletionRequest).prompt).length
    } else {
      const body =
        endpoint === 'chat'
          ? { model: backendModel, messages: (parsed as ParsedChatRequest).messages }
          : {
              model: backendModel,
              prompt: ((parsed as ParsedCompletionRequest).prompt as { text: string }).text,
            }
      let res
      try {
        res = await call(
          '/tokenize',
          'POST',
          body,
          AbortSignal.any([signal, AbortSignal.timeout(timeoutMs)]),
        )
      } catch (err) {
        throw new KvfenceError('worker_unavailable', `backend ${base}/tokenize: ${messageOf(err)}`)
      }
      const reply = res.status === 200 ? asObject(json(res.body)) : null
      const count =
        positive(reply?.count) ?? (Array.isArray(reply?.tokens) ? reply.tokens.length : null)
      if (count === null) {
        throw new KvfenceError(
          'worker_unavailable',
          `backend ${base}/tokenize did not count the prompt (HTTP ${res.status}); configure tokenizerDir`,
        )
      }
      numTokens = count
    }
    const maxInput = capacity.maxInputTokens
    if (options.guardsEnabled && maxInput !== null && numTokens > maxInput) {
      throw new KvfenceError(
        'context_length_exceeded',
        `This model accepts at most ${maxInput} prompt tokens; your prompt has ${numTokens}. Please shorten it.`,
        endpoint === 'chat' ? 'messages' : 'prompt',
      )
    }
    return numTokens
  }

  async function proxy(p: ProxyRequest): Promise<ProxyOutcome> {
    const body: Record<string, unknown> = { ...p.body, model: backendModel }
    // The engine's prefix cache is shared by every tenant unless a salt separates them: vLLM and
    // SGLang both key it by `cache_salt` (a client cannot send one: schemas.ts refuses it).
    body.cache_salt = cacheSaltOf(p.tenant)
    // The engine may never generate past what admission counted.
    if (p.endpoint === 'chat' && body.max_completion_tokens != null) {
      body.max_completion_tokens = p.maxTokens
    } else body.max_tokens = p.maxTokens
    if (options.kind === 'sglang') body.rid = p.rid // so that it can be aborted by id
    const path = p.endpoint === 'chat' ? '/v1/chat/completions' : '/v1/completions'
    const onAbort = () => {
      if (options.kind !== 'sglang') return // vLLM aborts when the connection closes
      call('/abort_request', 'POST', { rid: p.rid }).then(
        (r) => p.log.info({ status: r.status }, 'aborted on the backend'),
        (err: unknown) => p.log.warn({ detail: messageOf(err) }, 'backend abort failed'),
      )
    }
    p.signal.addEventListener('abort', onAbort, { once: true })
    try {
      const upstream = await open(agent, `${base}${path}`, headers, body, p.signal)
      if (upstream.statusCode !== 200 || !p.isStream) {
        const text = await readReplyText(upstream, maxReplyBytes)
        return relayWhole(p, upstream.statusCode ?? 502, text)
      }
      return await relayStream(p, upstream)
    } catch (err) {
      if (p.signal.aborted) {
        throw new KvfenceError('request_aborted', `request ${p.rid} was aborted by the client`)
      }
      if (err instanceof KvfenceError) throw err
      throw new KvfenceError('worker_unavailable', `backend ${base}${path}: ${messageOf(err)}`)
    } finally {
      p.signal.removeEventListener('abort', onAbort)
    }
  }

  /** A whole (non-streamed, or error) reply, rebuilt in OpenAI's shape with the router's id and
   *  model name (engine-replies.ts). An engine's 4xx is passed on with its status; a 5xx or an
   *  unreadable answer is `worker_unavailable` (the engine's words go to the log, not to the
   *  tenant); an answer that ended in an abort is an error, never a normal finish
   *  (sglang#33507). */
  function relayWhole(p: ProxyRequest, status: number, text: string): ProxyOutcome {
    const reply = asObject(json(text))
    if (status !== 200) {
      const error = openAiError(reply, status)
      if (status >= 400 && status < 500) {
        sendJson(p.res, status, { error })
        return { status, numCompletionTokens: 0, finishReason: null, text: '' }
      }
      throw new KvfenceError(
        'worker_unavailable',
        `backend answered HTTP ${status}: ${error.message}`,
      )
    }
    const choices = Array.isArray(reply?.choices) ? reply.choices.map(asObject) : []
    const choice = choices[0]
    const finish = choice?.finish_reason
    if (reply === null || choice === null || !validFinishReasons.has(String(finish))) {
      throw new KvfenceError(
        'worker_unavailable',
        `backend reply for ${p.rid} has no valid finish_reason (${JSON.stringify(finish)})`,
      )
    }
    const usage = openAiUsage(reply.usage)
    const numCompletionTokens = usage?.completion_tokens ?? 0
    if (numCompletionTokens > 0) p.onToken()
    sendJson(p.res, 200, openAiWhole(reply, p.endpoint, relayHeader(p)))
    const message = asObject(choice.message)
    return {
      status: 200,
      numCompletionTokens,
      finishReason: finish as FinishReason,
      text: String(message?.content ?? choice.text ?? ''),
    }
  }

  /** The router's id and served model name for `p`'s bodies. */
  function relayHeader(p: ProxyRequest): RelayHeader {
    return {
      id: `${p.endpoint === 'chat' ? 'chatcmpl' : 'cmpl'}-${p.rid}`,
      model: servedModel,
    }
  }

  /** An SSE reply, event by event, each rebuilt in OpenAI's shape with the router's id and model
   *  name. An engine's error event or abort ends the stream with the router's own error event
   *  (no `[DONE]`), as a failure after the first token does natively. */
  async function relayStream(
    p: ProxyRequest,
    upstream: http.IncomingMessage,
  ): Promise<ProxyOutcome> {
    const header = relayHeader(p)
    const streamOptions = asObject(p.body.stream_options)
    const isUsageStreamed = streamOptions?.include_usage === true
    let isStarted = false
    let numChunks = 0
    let text = ''
    let finishReason: FinishReason | null = null
    let pending = ''
    const start = () => {
      if (isStarted) return
      isStarted = true
      p.res.writeHead(200, {
        'content-type': 'text/event-stream; charset=utf-8',
        'cache-control': 'no-cache',
        'x-accel-buffering': 'no',
      })
      coalesceWrites(p.res)
    }
    /** Ends the stream with an error event in OpenAI's shape (kvfence's code); before any output
     *  the failure is a plain HTTP error instead, as natively. */
    const fail = (detail: string): ProxyOutcome => {
      if (!isStarted) {
        upstream.destroy()
        throw new KvfenceError('worker_unavailable', `backend stream for ${p.rid}: ${detail}`)
      }
      p.log.warn({ detail }, 'backend stream failed')
      const error = new KvfenceError(
        'worker_unavailable',
        `The backend stopped the request (request ${p.rid}).`,
        null,
      )
      p.res.end(`data: ${JSON.stringify(toOpenAiError(error))}\n\n`)
      upstream.destroy()
      return { status: error.status, numCompletionTokens: numChunks, finishReason: null, text }
    }
    upstream.setEncoding('utf8')
    for await (const chunk of upstream as AsyncIterable<string>) {
      pending += chunk
      let end: number
      while ((end = pending.indexOf('\n\n')) !== -1) {
        const event = pending.slice(0, end)
        pending = pending.slice(end + 2)
        const data = event.startsWith('data: ') ? event.slice(6) : null
        if (data === null) continue
        if (data.trim() === '[DONE]') {
          start()
          p.res.write('data: [DONE]\n\n')
          continue
        }
        const value = asObject(json(data))
        if (value === null) continue
        if (isErrorEvent(value)) {
          const { message, type } = openAiError(value, 500)
          return fail(`backend error event (${type}): ${message}`)
        }
        for (const choice of Array.isArray(value.choices) ? value.choices.map(asObject) : []) {
          const delta = asObject(choice?.delta)
          const piece = delta?.content ?? choice?.text
          if (typeof piece === 'string' && piece !== '') {
            numChunks++
            p.onToken()
            text += piece
          }
          const finish = choice?.finish_reason
          if (finish != null) {
            // An engine-side abort is not a normal finish.
            if (!validFinishReasons.has(String(finish))) {
              return fail(`backend finished with ${JSON.stringify(finish)}`)
            }
            finishReason = finish as FinishReason
          }
        }
        start()
        const out = openAiChunk(value, p.endpoint, header, isUsageStreamed)
        if (!p.res.write(`data: ${JSON.stringify(out)}\n\n`)) await drained(p.res)
      }
    }
    if (!isStarted) throw new KvfenceError('worker_unavailable', 'backend stream was empty')
    p.res.end()
    return { status: 200, numCompletionTokens: numChunks, finishReason, text }
  }

  return {
    kind: options.kind,
    url: base,
    servedModel,
    contextWindow: () => window,
    info: () => ({ kind: options.kind, url: base, contextWindow: window, ...capacity }),
    countPromptTokens,
    proxy,
    rediscover,
    close() {
      if (timer !== null) clearInterval(timer)
      agent.destroy()
    },
  }
}

// ---------------------------------------------------------------------------------------------
// HTTP plumbing

function open(
  agent: http.Agent,
  url: string,
  headers: Record<string, string>,
  body: unknown,
  signal: AbortSignal,
): Promise<http.IncomingMessage> {
  return new Promise((resolve, reject) => {
    const text = JSON.stringify(body)
    const transport = url.startsWith('https:') ? https : http
    const req = transport.request(
      url,
      {
        method: 'POST',
        agent,
        signal,
        headers: {
          ...headers,
          'content-type': 'application/json',
          'content-length': Buffer.byteLength(text),
        },
      },
      resolve,
    )
    req.on('error', reject)
    req.end(text)
  })
}

async function request(
  agent: http.Agent,
  url: string,
  method: 'GET' | 'POST',
  headers: Record<string, string>,
  body: unknown,
  signal: AbortSignal,
): Promise<{ status: number; body: string }> {
  const res = await new Promise<http.IncomingMessage>((resolve, reject) => {
    const text = body === null ? null : JSON.stringify(body)
    const transport = url.startsWith('https:') ? https : http
    const req = transport.request(
      url,
      {
        method,
        agent,
        signal,
        headers:
          text === null
            ? headers
            : {
                ...headers,
                'content-type': 'application/json',
                'content-length': Buffer.byteLength(text),
              },
      },
      resolve,
    )
    req.on('error', reject)
    req.end(text ?? undefined)
  })
  return { status: res.statusCode ?? 0, body: await readReplyText(res, maxReplyBytes) }
}

function json(text: string): unknown {
  try {
    return JSON.parse(text)
  } catch {
    return null
  }
}

function asObject(value: unknown): Record<string, unknown> | null {
  return typeof value === 'object' && value !== null && !Array.isArray(value)
    ? (value as Record<string, unknown>)
    : null
}

function positive(value: unknown): number | null {
  return typeof value === 'number' && Number.isSafeInteger(value) && value > 0 ? value : null
}

function normalize(url: string): string {
  let parsed: URL
  try {
    parsed = new URL(url)
  } catch {
    throw new KvfenceError('config_invalid', `backend URL ${JSON.stringify(url)} is not a URL`)
  }
  if (parsed.protocol !== 'http:' && parsed.protocol !== 'https:') {
    throw new KvfenceError('config_invalid', `backend URL ${url} must use http: or https:`)
  }
  return `${parsed.origin}${parsed.pathname.replace(/\/+$/, '')}`
}

function messageOf(err: unknown): string {
  return err instanceof Error ? err.message : String(err)
}
