/** The audited endpoint, seen from outside: a base URL, a model id, the tenants' keys and one
 *  budget-checked way to send requests. Speaks plain HTTP to any OpenAI-compatible server
 *  (kvfence, SGLang, vLLM, ...). Knows nothing of how the server works inside. */
import { z } from 'zod'
import { Budget } from './budget.js'
import type { Ledger } from './ledger.js'
import type { Tenant } from './types.js'

// ─── Raw HTTP ────────────────────────────────────────────────────────────────────────────────

/** Why a request got no usable (or no complete) HTTP answer: `aborted`, the auditor cut it on
 *  purpose; `timeout`, the request's timeout or the budget's deadline cut it; `truncated`, the
 *  body grew past its cap (a stream that never ends, a server ignoring `max_tokens`) and was
 *  cut there, so the answer was never seen whole. */
export type Failure = 'network' | 'timeout' | 'aborted' | 'truncated'

export interface HttpResult {
  /** HTTP status; null when no response arrived (see `failure`). */
  readonly status: number | null
  readonly failure: Failure | null
  /** e.g. `ECONNREFUSED`; never contains a key. */
  readonly failureDetail: string | null
  readonly contentType: string
  readonly body: string
  /** Milliseconds from sending to the first byte of the response body; null without a body. */
  readonly firstByteMs: number | null
  /** This request's number in the audit (1 = the first request sent). */
  readonly requestNumber: number
  /** Milliseconds from the audit's start to the end of this request. */
  readonly atMs: number
}

export interface GetOptions {
  /** Whose key to send; none when omitted. */
  readonly tenant?: Tenant
  /** Cut the request this many ms after sending (0: right after the request is written). */
  readonly abortAfterMs?: number
  /** Cut the request after this many body chunks have arrived. */
  readonly abortAfterChunks?: number
  /** Largest body read (bytes, default {@link maxBodyBytes}); past it the request is cut and its
   *  failure is `truncated`. */
  readonly maxBodyBytes?: number
  /** More request headers (a client request id such as `x-request-id`); never `authorization`,
   *  which only `tenant` sets. */
  readonly headers?: Readonly<Record<string, string>>
  /** Called once when the response body's first byte arrives (a stream's first event): a probe
   *  sends what must overlap a request in flight then. */
  readonly onFirstByte?: () => void
}

// ─── Completions ─────────────────────────────────────────────────────────────────────────────

export interface CompletionRequest {
  readonly tenant: Tenant
  readonly prompt: string
  readonly maxTokens: number
  readonly stream: boolean
  /** Cut the request on purpose (see {@link GetOptions}); the result's failure is `aborted`. */
  readonly abortAfterMs?: number
  readonly abortAfterChunks?: number
  /** False for a prompt sent to be refused (over the context or the KV pool); default true. A
   *  valid request that fails is an availability finding; one that is never answered, a tool
   *  error. */
  readonly isValid?: boolean
  /** More body fields (the cache-fields probe's); never `prompt`, `max_tokens` or `model`. */
  readonly extraFields?: Readonly<Record<string, unknown>>
  /** The sender's estimate of the prompt's tokens, for when the answer reports none (what the
   *  prompt ceiling and the outage finding go by). */
  readonly estimatedPromptTokens?: number
  /** More request headers, and a call at the first byte (see {@link GetOptions}). */
  readonly headers?: Readonly<Record<string, string>>
  readonly onFirstByte?: () => void
}

/** One server-sent event of a streamed answer, in the order it arrived: its `id` (OpenAI's
 *  `cmpl-…`/`chatcmpl-…`, null when the event has none) and the text it carried. */
export interface StreamChunk {
  readonly id: string | null
  readonly text: string
}

export interface CompletionResult {
  readonly status: number | null
  readonly failure: Failure | 'bad_response' | 'stream_error' | null
  /** Generated text (possibly partial when the stream broke). */
  readonly text: string
  /** `usage.prompt_tokens` when the server reported it. */
  readonly promptTokens: number | null
  /** `usage.prompt_tokens_details.cached_tokens` when the server reported it. */
  readonly cachedTokens: number | null
  /** Milliseconds from sending to the first byte of a 2xx body (for a stream: the first token's
   *  event, the TTFT seen from outside). */
  readonly ttftMs: number | null
  /** This request's number in the audit, and when it ended (ms since the audit's start): where a
   *  finding was first seen. */
  readonly requestNumber: number
  readonly atMs: number
  /** Why no HTTP answer came, when none did (`ECONNREFUSED`, ...; see `HttpResult`); absent or
   *  null otherwise. */
  readonly failureDetail?: string | null
  /** OpenAI `error.code` (or `error.type`, or a numeric code as text). */
  readonly errorCode: string | null
  /** The server's error message, keys scrubbed, at most 200 characters. */
  readonly errorMessage: string | null
  /** The answer's `id` (of a whole answer, or of a stream's first event that has one); absent or
   *  null when it had none. A response cache hands back the stored answer with its old id. */
  readonly responseId?: string | null
  /** A streamed answer's events one by one (streams.ts checks them); absent for a whole answer. */
  readonly chunks?: readonly StreamChunk[]
}

/** What became of a request, as far as isolation is concerned:
 *  - `accepted`: a 2xx answer (for an invalid prompt, this is the dangerous path);
 *  - `rejected`: a 4xx that refuses the request itself (not auth, not a missing model, not a
 *    rate limit), or an in-stream error of that kind;
 *  - `failed`: anything else (5xx, timeouts, connection errors, auth errors): tells nothing.
 *  A 2xx cut at its size cap (`truncated`) is still `accepted` (the server took the request);
 *  where the answer's content is judged, use {@link isAnsweredWhole}. */
export type Outcome = 'accepted' | 'rejected' | 'failed'

const notARejection = new Set([401, 403, 404, 408, 429, 499])

export function outcomeOf(result: CompletionResult): Outcome {
  const { status } = result
  if (status === null) return 'failed'
  if (status >= 200 && status < 300) {
    if (result.failure !== 'stream_error') return 'accepted'
    return isRejectionCode(result.errorCode) ? 'rejected' : 'failed'
  }
  if (status >= 400 && status < 500 && !notARejection.has(status)) return 'rejected'
  return 'failed'
}

/** True for an accepted answer that was read to its end (or cut on purpose by the auditor): not
 *  `truncated` at its size cap, so its text can be judged. A probe that calls an answer clean
 *  must have read it whole. */
export function isAnsweredWhole(result: CompletionResult): boolean {
  return outcomeOf(result) === 'accepted' && result.failure !== 'truncated'
}

function isRejectionCode(code: string | null): boolean {
  if (code === null) return false
  const numeric = Number(code)
  if (Number.isInteger(numeric))
    return numeric >= 400 && numeric < 500 && !notARejection.has(numeric)
  return /context_length|invalid_request|badrequest|too_long|too_many_tokens/i.test(code)
}

// ─── Wire shapes (parsed at the boundary, loosely: servers differ) ───────────────────────────

const Usage = z.looseObject({
  prompt_tokens: z.number().int().nonnegative().optional(),
  prompt_tokens_details: z
    .looseObject({ cached_tokens: z.number().int().nonnegative().nullish() })
    .nullish(),
})
const Choice = z.looseObject({
  text: z.string().nullish(),
  message: z.looseObject({ content: z.string().nullish() }).nullish(),
})
const CompletionBody = z.looseObject({
  id: z.unknown().optional(),
  choices: z.array(Choice).optional(),
  usage: Usage.nullish(),
})
const ErrorFields = z.looseObject({
  message: z.unknown().optional(),
  type: z.unknown().optional(),
  code: z.unknown().optional(),
})
/** OpenAI: `{error: {...}}`; vLLM/SGLang: `{object: "error", message, type, code}`. */
const ErrorBody = z.union([
  z.looseObject({ error: z.union([ErrorFields, z.string()]) }),
  ErrorFields.transform((error) => ({ error })),
])

// ─── The target ──────────────────────────────────────────────────────────────────────────────

export interface Target {
  /** Base URL without a trailing slash and without `/v1`. */
  readonly baseUrl: string
  readonly model: string | null
  readonly tenants: readonly Tenant[]
  /** Budget-checked GET of a path under the base URL (throws `BudgetExhaustedError`). */
  get(path: string, options?: GetOptions): Promise<HttpResult>
  /** Budget-checked POST of JSON (throws `BudgetExhaustedError`). */
  postJson(path: string, body: unknown, options?: GetOptions): Promise<HttpResult>
  /** Budget-checked POST of a raw body, e.g. malformed JSON (throws `BudgetExhaustedError`). */
  postRaw(
    path: string,
    body: string,
    contentType: string,
    options?: GetOptions,
  ): Promise<HttpResult>
  /** Budget-checked `POST /v1/completions` at temperature 0 (throws `BudgetExhaustedError`). */
  complete(request: CompletionRequest): Promise<CompletionResult>
  /** Budget-checked POST of a generation request on another entrypoint (chat, Responses,
   *  Messages, `/generate`, ...), recorded in the ledger under `POST path` as a completion is:
   *  `isAnswered` says whether a 2xx held an answer of the entrypoint's shape (one that did not
   *  is a `bad_response`). Throws `BudgetExhaustedError`. */
  postGeneration(
    path: string,
    body: unknown,
    options: GenerationOptions,
    isAnswered: (http: HttpResult) => boolean,
  ): Promise<HttpResult>
  /** Replaces every tenant key in `text` (for anything the server sends back that we keep). */
  scrub(text: string): string
}

/** How a generation request on any entrypoint is sent and counted. */
export interface GenerationOptions {
  readonly tenant: Tenant
  /** False for a request sent to learn whether the entrypoint is served (a 404 then is an
   *  answer, not a failure); default true. */
  readonly isValid?: boolean
  readonly maxBodyBytes?: number
  /** The prompt's text, `max_tokens` and whether it streams, for the outage watch and the prompt
   *  ceiling (as a completion's); absent: the body's JSON stands for the prompt's characters
   *  (and the answer grows no ceiling), 0 and false. */
  readonly prompt?: string
  readonly maxTokens?: number
  readonly stream?: boolean
  /** The prompt tokens the answer reported (null: none). */
  readonly promptTokensOf?: (http: HttpResult) => number | null
}

export interface TargetOptions {
  readonly baseUrl: string
  readonly model: string | null
  readonly tenants: readonly Tenant[]
  readonly budget: Budget
  /** Upper bound for one request; the budget's deadline may cut it shorter. */
  readonly requestTimeoutMs: number
  /** Where every completion's fate is recorded; none when omitted. */
  readonly ledger?: Ledger
  /** Called with every completion (and every generation request on another entrypoint) as it
   *  ends, after the ledger (the prompt ceiling and the outage watch); none when omitted. */
  readonly onCompletion?: (request: CompletionRequest, result: CompletionResult) => void
}

/** Largest response body read (bytes) unless a request asks for less; past it the request is
 *  cut and reported `truncated`. */
const maxBodyBytes = 8 * 1024 * 1024
/** A completion's body cap: room for `max_tokens` streamed events of up to 4 KiB each (an OpenAI
 *  or vLLM event with logprobs off is 150–400 bytes) plus 64 KiB for usage and errors. More is a
 *  stream that does not end at `max_tokens`. */
function completionBodyCap(maxTokens: number): number {
  return Math.min(maxBodyBytes, 64 * 1024 + Math.max(1, maxTokens) * 4096)
}
const maxErrorMessageChars = 200
/** How long a slot stays taken after the auditor cut its request (ms); servers notice a client
 *  disconnect within a few ms (measured: 1–4 ms on loopback). */
const abortGraceMs = 100

export function createTarget(options: TargetOptions): Target {
  const { baseUrl, model, tenants, budget, requestTimeoutMs, ledger, onCompletion } = options
  const keys = tenants.map((t) => t.key).filter((k) => k.length >= 4)

  const scrub = (text: string): string => {
    let out = text
    for (const key of keys) out = out.split(key).join('[key]')
    return out
  }

  const send = (path: string, init: RequestInit, opts: GetOptions): Promise<HttpResult> =>
    sendHttp({ baseUrl, budget, requestTimeoutMs, scrub }, path, init, opts)

  const get = (path: string, opts: GetOptions = {}): Promise<HttpResult> =>
    send(path, { method: 'GET' }, opts)

  const postRaw = (
    path: string,
    body: string,
    contentType: string,
    opts: GetOptions = {},
  ): Promise<HttpResult> =>
    send(path, { method: 'POST', headers: { 'content-type': contentType }, body }, opts)

  const postJson = (path: string, body: unknown, opts: GetOptions = {}): Promise<HttpResult> =>
    postRaw(path, JSON.stringify(body), 'application/json', opts)

  const complete = async (request: CompletionRequest): Promise<CompletionResult> => {
    const body: Record<string, unknown> = {
      ...request.extraFields,
      prompt: request.prompt,
      max_tokens: request.maxTokens,
      temperature: 0,
      stream: request.stream,
    }
    // No `stream_options`: not every OpenAI-compatible server accepts it, and streamed usage is
    // not needed.
    if (model !== null) body.model = model
    const http = await postJson('/v1/completions', body, {
      tenant: request.tenant,
      abortAfterMs: request.abortAfterMs,
      abortAfterChunks: request.abortAfterChunks,
      maxBodyBytes: completionBodyCap(request.maxTokens),
      headers: request.headers,
      onFirstByte: request.onFirstByte,
    })
    const result = parseCompletion(http, request.stream, scrub)
    const isDeadline = budget.remainingMs === 0
    ledger?.record(request.tenant.name, request.isValid ?? true, result, isDeadline, completionsAt)
    onCompletion?.(request, result)
    return result
  }

  const postGeneration = async (
    path: string,
    body: unknown,
    opts: GenerationOptions,
    isAnswered: (http: HttpResult) => boolean,
  ): Promise<HttpResult> => {
    const http = await postJson(path, body, {
      tenant: opts.tenant,
      maxBodyBytes: opts.maxBodyBytes,
    })
    const result = {
      ...generationResult(http, isAnswered(http)),
      promptTokens: opts.promptTokensOf?.(http) ?? null,
    }
    ledger?.record(
      opts.tenant.name,
      opts.isValid ?? true,
      result,
      budget.remainingMs === 0,
      `POST ${path}`,
    )
    // Every entrypoint counts in the outage watch and the prompt ceiling as completions do.
    const prompt = opts.prompt ?? JSON.stringify(body)
    onCompletion?.(
      {
        tenant: opts.tenant,
        prompt,
        maxTokens: opts.maxTokens ?? 0,
        stream: opts.stream ?? false,
        isValid: opts.isValid ?? true,
        // A body standing for the prompt bounds its size for the outage's evidence only: it
        // must not grow the prompt ceiling.
        ...(opts.prompt === undefined
          ? {}
          : { estimatedPromptTokens: Buffer.byteLength(prompt, 'utf8') + 4 }),
      },
      result,
    )
    return http
  }

  return Object.freeze({
    baseUrl,
    model,
    tenants,
    get,
    postJson,
    postRaw,
    complete,
    postGeneration,
    scrub,
  })
}

/** The ledger's endpoint for {@link Target.complete}. */
const completionsAt = 'POST /v1/completions'

/** What the ledger keeps of an answer on another entrypoint: its status and failure (a 2xx
 *  without an answer of the entrypoint's shape is a `bad_response`); its text is the probe's. */
function generationResult(http: HttpResult, isAnswered: boolean): CompletionResult {
  const isOk = http.status !== null && http.status >= 200 && http.status < 300
  return {
    status: http.status,
    failure: http.failure ?? (isOk && !isAnswered ? 'bad_response' : null),
    text: '',
    promptTokens: null,
    cachedTokens: null,
    ttftMs: isOk ? http.firstByteMs : null,
    requestNumber: http.requestNumber,
    atMs: http.atMs,
    failureDetail: http.failureDetail,
    errorCode: null,
    errorMessage: null,
  }
}

/** One HTTP request through the budget: the tenant's key as bearer token, cut at the request's
 *  time limit, the audit's deadline, an interruption, or on purpose (`abortAfterMs`,
 *  `abortAfterChunks`); the body read to its cap. Never throws for what the network does: a
 *  failure is in the result. */
function sendHttp(
  wire: {
    readonly baseUrl: string
    readonly budget: Budget
    readonly requestTimeoutMs: number
    readonly scrub: (text: string) => string
  },
  path: string,
  init: RequestInit,
  opts: GetOptions,
): Promise<HttpResult> {
  const { baseUrl, budget, requestTimeoutMs, scrub } = wire
  return budget.spend(async (remainingMs, requestNumber) => {
    const headers = new Headers(init.headers)
    for (const [name, value] of Object.entries(opts.headers ?? {}))
      if (name.toLowerCase() !== 'authorization') headers.set(name, value)
    if (opts.tenant) headers.set('authorization', `Bearer ${opts.tenant.key}`)
    const cut = new AbortController()
    // One plain controller with its own timer, not AbortSignal.any(AbortSignal.timeout(...)):
    // on Node 20 those composed signals can be garbage-collected before they fire, and the
    // request then hangs for ever (seen here under load; nodejs/node#55428).
    const stop = new AbortController()
    const deadline = setTimeout(
      () => stop.abort(new DOMException('request timed out', 'TimeoutError')),
      Math.min(requestTimeoutMs, remainingMs),
    )
    cut.signal.addEventListener('abort', () => stop.abort(new DOMException('cut', 'AbortError')))
    // An interrupted audit cuts what is in flight as its deadline would.
    const onStopped = () => stop.abort(new DOMException('audit interrupted', 'TimeoutError'))
    if (budget.isStopped) onStopped()
    else budget.stopped.addEventListener('abort', onStopped, { once: true })
    const signal = stop.signal
    const cutTimer =
      opts.abortAfterMs === undefined
        ? null
        : setTimeout(() => cut.abort(), Math.max(0, opts.abortAfterMs))
    const sentAt = performance.now()
    let status: number | null = null
    let contentType = ''
    const read: { body: string; firstByteMs: number | null } = { body: '', firstByteMs: null }
    // Settles when `signal` aborts, whatever fetch does: on Node 20 a fetch or a body read
    // aborted at the wrong moment can stay pending for ever, and with the deadline spent no
    // handle is left, so the process ended with exit code 13 in the middle of an audit.
    const onAbort = new Promise<never>((_, reject) => {
      const fail = () => reject(signal.reason)
      if (signal.aborted) fail()
      else signal.addEventListener('abort', fail, { once: true })
    })
    onAbort.catch(() => {})
    try {
      const res = await Promise.race([
        fetch(`${baseUrl}${path}`, { ...init, headers, signal }),
        onAbort,
      ])
      status = res.status
      contentType = res.headers.get('content-type') ?? ''
      const cap = opts.maxBodyBytes ?? maxBodyBytes
      const isTruncated = await Promise.race([
        readCapped(res, sentAt, read, opts.abortAfterChunks ?? null, cut, cap, opts.onFirstByte),
        onAbort,
      ])
      const atMs = Date.now() - budget.timeOrigin
      return {
        status,
        failure: isTruncated ? 'truncated' : null,
        failureDetail: isTruncated ? `body cut at ${cap} bytes: it did not end` : null,
        contentType,
        ...read,
        requestNumber,
        atMs,
      }
    } catch (err) {
      const isCut = cut.signal.aborted
      // The server sees a cut only when the disconnect reaches it: hold the concurrency slot a
      // little longer so that the budget's limit also holds from the server's side.
      if (isCut) await new Promise((r) => setTimeout(r, abortGraceMs))
      const isTimeout =
        err instanceof Error && (err.name === 'TimeoutError' || err.name === 'AbortError')
      return {
        // A cut stream keeps its status and what arrived before the cut.
        status: isCut ? status : null,
        failure: isCut ? 'aborted' : isTimeout ? 'timeout' : 'network',
        failureDetail: isCut ? 'cut by the auditor' : scrub(describeNetworkError(err)),
        contentType,
        ...read,
        requestNumber,
        atMs: Date.now() - budget.timeOrigin,
      }
    } finally {
      if (cutTimer) clearTimeout(cutTimer)
      clearTimeout(deadline)
      budget.stopped.removeEventListener('abort', onStopped)
    }
  })
}

/** Reads the body into `into` (at most `capBytes`), noting when its first byte came; aborts `cut`
 *  after `abortAfterChunks` chunks. Resolves true when the body went past `capBytes` (it is then
 *  cancelled: a stream that never ends must not be read until the deadline, and a huge text
 *  makes every later scan of it slow). Throws when the body is cut. */
async function readCapped(
  res: Response,
  sentAt: number,
  into: { body: string; firstByteMs: number | null },
  abortAfterChunks: number | null,
  cut: AbortController,
  capBytes: number,
  onFirstByte?: () => void,
): Promise<boolean> {
  if (!res.body) return false
  const decoder = new TextDecoder()
  let numBytes = 0
  let numChunks = 0
  if (abortAfterChunks === 0) cut.abort()
  for await (const chunk of res.body as unknown as AsyncIterable<Uint8Array>) {
    if (into.firstByteMs === null) {
      into.firstByteMs = Math.round((performance.now() - sentAt) * 1000) / 1000
      onFirstByte?.()
    }
    numBytes += chunk.byteLength
    if (numBytes > capBytes) {
      // Keep what fits; leaving the loop cancels the body (the connection is dropped).
      into.body += decoder.decode(chunk.subarray(0, chunk.byteLength - (numBytes - capBytes)))
      return true
    }
    into.body += decoder.decode(chunk, { stream: true })
    if (abortAfterChunks !== null && ++numChunks >= abortAfterChunks) {
      // Cut here, not at the next read (which may never settle): leaving the loop cancels the
      // body, and the caller sees the cut.
      cut.abort()
      into.body += decoder.decode()
      throw new DOMException('cut by the auditor', 'AbortError')
    }
  }
  into.body += decoder.decode()
  return false
}

function describeNetworkError(err: unknown): string {
  if (!(err instanceof Error)) return String(err)
  const cause = (err as { cause?: unknown }).cause
  if (cause instanceof Error) {
    const code = (cause as { code?: unknown }).code
    if (typeof code === 'string') return code
    // fetch refuses the Fetch standard's "bad ports" (1, 9, 25, 6000, …) before connecting.
    if (cause.message === 'bad port')
      return 'fetch refuses to connect to this port (a "bad port" of the Fetch standard, https://fetch.spec.whatwg.org/#port-blocking): serve the endpoint on another port'
    return cause.message
  }
  return err.message
}

// ─── Parsing a completion answer (JSON or server-sent events) ────────────────────────────────

/** What the body alone tells; the request's number and time come from the HTTP result. */
type ParsedBody = Omit<CompletionResult, 'requestNumber' | 'atMs'>

function parseCompletion(
  http: HttpResult,
  isStream: boolean,
  scrub: (text: string) => string,
): CompletionResult {
  const base = {
    status: http.status,
    requestNumber: http.requestNumber,
    atMs: http.atMs,
    promptTokens: null,
    cachedTokens: null,
    ttftMs: null,
    errorCode: null,
    errorMessage: null,
  }
  if (http.status === null)
    return { ...base, failure: http.failure, failureDetail: http.failureDetail, text: '' }
  const isOk = http.status >= 200 && http.status < 300
  if (!isOk) return { ...base, ...parseError(tryJson(http.body), scrub), failure: null, text: '' }
  const isSse = isStream || http.contentType.includes('text/event-stream')
  const parsed = isSse ? parseEvents(http, scrub) : parseJsonCompletion(http, scrub)
  // A cut request stays `aborted` (or `truncated`) whatever arrived before the cut.
  const failure =
    http.failure === 'aborted' || http.failure === 'truncated' ? http.failure : parsed.failure
  return {
    ...parsed,
    failure,
    ttftMs: http.firstByteMs,
    requestNumber: http.requestNumber,
    atMs: http.atMs,
  }
}

function parseJsonCompletion(http: HttpResult, scrub: (t: string) => string): ParsedBody {
  const json = tryJson(http.body)
  const parsed = CompletionBody.safeParse(json)
  if (!parsed.success || !parsed.data.choices) {
    // A 2xx without choices: keep whatever text there is, so a detector can still read it.
    return {
      status: http.status,
      failure: 'bad_response',
      text: http.body.slice(0, 64 * 1024),
      promptTokens: null,
      cachedTokens: null,
      ttftMs: null,
      ...parseError(json, scrub),
    }
  }
  return {
    status: http.status,
    failure: null,
    text: parsed.data.choices.map(choiceText).join(''),
    promptTokens: parsed.data.usage?.prompt_tokens ?? null,
    cachedTokens: parsed.data.usage?.prompt_tokens_details?.cached_tokens ?? null,
    ttftMs: null,
    errorCode: null,
    errorMessage: null,
    responseId: typeof parsed.data.id === 'string' ? parsed.data.id : null,
  }
}

function parseEvents(http: HttpResult, scrub: (t: string) => string): ParsedBody {
  let text = ''
  let promptTokens: number | null = null
  let cachedTokens: number | null = null
  let streamError: { errorCode: string | null; errorMessage: string | null } | null = null
  const chunks: StreamChunk[] = []
  for (const line of http.body.split(/\r?\n/)) {
    if (!line.startsWith('data:')) continue
    const data = line.slice(5).trim()
    if (data === '' || data === '[DONE]') continue
    const json = tryJson(data)
    if (json !== null && typeof json === 'object' && 'error' in json) {
      streamError = parseError(json, scrub)
      continue
    }
    const parsed = CompletionBody.safeParse(json)
    if (!parsed.success) continue
    const chunkText = (parsed.data.choices ?? []).map(choiceText).join('')
    chunks.push({ id: typeof parsed.data.id === 'string' ? parsed.data.id : null, text: chunkText })
    text += chunkText
    promptTokens = parsed.data.usage?.prompt_tokens ?? promptTokens
    cachedTokens = parsed.data.usage?.prompt_tokens_details?.cached_tokens ?? cachedTokens
  }
  const responseId = chunks.find((c) => c.id !== null)?.id ?? null
  const common = {
    status: http.status,
    text,
    promptTokens,
    cachedTokens,
    ttftMs: null,
    responseId,
    chunks,
  }
  if (streamError) return { ...common, failure: 'stream_error', ...streamError }
  return {
    ...common,
    failure: null,
    errorCode: null,
    errorMessage: null,
  }
}

function choiceText(choice: z.infer<typeof Choice>): string {
  return choice.text ?? choice.message?.content ?? ''
}

function parseError(
  json: unknown,
  scrub: (t: string) => string,
): { errorCode: string | null; errorMessage: string | null } {
  const parsed = ErrorBody.safeParse(json)
  if (!parsed.success) return { errorCode: null, errorMessage: null }
  const fields = parsed.data.error
  if (typeof fields === 'string') {
    return { errorCode: null, errorMessage: scrub(fields).slice(0, maxErrorMessageChars) }
  }
  const code = fields.code
  const type = fields.type
  const errorCode =
    typeof code === 'string' && code !== ''
      ? code
      : typeof code === 'number'
        ? String(code)
        : typeof type === 'string'
          ? type
          : null
  const message = typeof fields.message === 'string' ? fields.message : null
  return {
    errorCode,
    errorMessage: message === null ? null : scrub(message).slice(0, maxErrorMessageChars),
  }
}

export function tryJson(text: string): unknown {
  try {
    return JSON.parse(text)
  } catch {
    return null
  }
}
