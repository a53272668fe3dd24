/** The audited endpoint, seen from outside: a base URL, a model id, the tenants' keys and one
 *  budget-checked way to send requests. Speaks plain HTTP to any OpenAI-compatible server
 *  (kvfence, SGLang, vLLM, ...). Knows nothing of how the server works inside. */
import { z } from 'zod'
import { Budget } from './budget.js'
import type { Tenant } from './types.js'

// ─── Raw HTTP ────────────────────────────────────────────────────────────────────────────────

/** Why a request got no usable HTTP answer. */
export type Failure = 'network' | 'timeout'

export interface HttpResult {
  /** HTTP status; null when no response arrived (see `failure`). */
  readonly status: number | null
  readonly failure: Failure | null
  /** e.g. `ECONNREFUSED`; never contains a key. */
  readonly failureDetail: string | null
  readonly contentType: string
  readonly body: string
}

export interface GetOptions {
  /** Whose key to send; none when omitted. */
  readonly tenant?: Tenant
}

// ─── Completions ─────────────────────────────────────────────────────────────────────────────

export interface CompletionRequest {
  readonly tenant: Tenant
  readonly prompt: string
  readonly maxTokens: number
  readonly stream: boolean
}

export interface CompletionResult {
  readonly status: number | null
  readonly failure: Failure | 'bad_response' | 'stream_error' | null
  /** Generated text (possibly partial when the stream broke). */
  readonly text: string
  /** `usage.prompt_tokens` when the server reported it. */
  readonly promptTokens: number | null
  /** OpenAI `error.code` (or `error.type`, or a numeric code as text). */
  readonly errorCode: string | null
  /** The server's error message, keys scrubbed, at most 200 characters. */
  readonly errorMessage: string | null
}

/** What became of a request, as far as isolation is concerned:
 *  - `accepted`: a 2xx answer (for an invalid prompt, this is the dangerous path);
 *  - `rejected`: a 4xx that refuses the request itself (not auth, not a missing model, not a
 *    rate limit), or an in-stream error of that kind;
 *  - `failed`: anything else (5xx, timeouts, connection errors, auth errors): tells nothing. */
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

function isRejectionCode(code: string | null): boolean {
  if (code === null) return false
  const numeric = Number(code)
  if (Number.isInteger(numeric))
    return numeric >= 400 && numeric < 500 && !notARejection.has(numeric)
  return /context_length|invalid_request|badrequest|too_long|too_many_tokens/i.test(code)
}

// ─── Wire shapes (parsed at the boundary, loosely: servers differ) ───────────────────────────

const Usage = z.looseObject({ prompt_tokens: z.number().int().nonnegative().optional() })
const Choice = z.looseObject({
  text: z.string().nullish(),
  message: z.looseObject({ content: z.string().nullish() }).nullish(),
})
const CompletionBody = z.looseObject({
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
  /** Budget-checked `POST /v1/completions` at temperature 0 (throws `BudgetExhaustedError`). */
  complete(request: CompletionRequest): Promise<CompletionResult>
  /** Replaces every tenant key in `text` (for anything the server sends back that we keep). */
  scrub(text: string): string
}

export interface TargetOptions {
  readonly baseUrl: string
  readonly model: string | null
  readonly tenants: readonly Tenant[]
  readonly budget: Budget
  /** Upper bound for one request; the budget's deadline may cut it shorter. */
  readonly requestTimeoutMs: number
}

/** Largest response body read (bytes); the rest is dropped. */
const maxBodyBytes = 8 * 1024 * 1024
const maxErrorMessageChars = 200

export function createTarget(options: TargetOptions): Target {
  const { baseUrl, model, tenants, budget, requestTimeoutMs } = options
  const keys = tenants.map((t) => t.key).filter((k) => k.length >= 4)

  const scrub = (text: string): string => {
    let out = text
    for (const key of keys) out = out.split(key).join('[key]')
    return out
  }

  const send = (path: string, init: RequestInit, tenant: Tenant | undefined): Promise<HttpResult> =>
    budget.spend(async (remainingMs) => {
      const headers = new Headers(init.headers)
      if (tenant) headers.set('authorization', `Bearer ${tenant.key}`)
      const signal = AbortSignal.timeout(Math.min(requestTimeoutMs, remainingMs))
      try {
        const res = await fetch(`${baseUrl}${path}`, { ...init, headers, signal })
        const body = await readCapped(res)
        return {
          status: res.status,
          failure: null,
          failureDetail: null,
          contentType: res.headers.get('content-type') ?? '',
          body,
        }
      } catch (err) {
        const isTimeout =
          err instanceof Error && (err.name === 'TimeoutError' || err.name === 'AbortError')
        return {
          status: null,
          failure: isTimeout ? 'timeout' : 'network',
          failureDetail: scrub(describeNetworkError(err)),
          contentType: '',
          body: '',
        }
      }
    })

  const get = (path: string, opts: GetOptions = {}): Promise<HttpResult> =>
    send(path, { method: 'GET' }, opts.tenant)

  const postJson = (path: string, body: unknown, opts: GetOptions = {}): Promise<HttpResult> =>
    send(
      path,
      {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify(body),
      },
      opts.tenant,
    )

  const complete = async (request: CompletionRequest): Promise<CompletionResult> => {
    const body: Record<string, unknown> = {
      prompt: request.prompt,
      max_tokens: request.maxTokens,
      temperature: 0,
      stream: request.stream,
    }
    // No `stream_options`: not every OpenAI-compatible server accepts it, and streamed usage is
    // not needed.
    if (model !== null) body.model = model
    const http = await postJson('/v1/completions', body, { tenant: request.tenant })
    return parseCompletion(http, request.stream, scrub)
  }

  return Object.freeze({ baseUrl, model, tenants, get, postJson, complete, scrub })
}

async function readCapped(res: Response): Promise<string> {
  if (!res.body) return ''
  const decoder = new TextDecoder()
  let text = ''
  let numBytes = 0
  for await (const chunk of res.body as unknown as AsyncIterable<Uint8Array>) {
    numBytes += chunk.byteLength
    if (numBytes > maxBodyBytes) break
    text += decoder.decode(chunk, { stream: true })
  }
  return text + decoder.decode()
}

function describeNetworkError(err: unknown): string {
  if (!(err instanceof Error)) return String(err)
  const cause = (err as { cause?: unknown }).cause
  if (cause instanceof Error) {
    const code = (cause as { code?: unknown }).code
    return typeof code === 'string' ? code : cause.message
  }
  return err.message
}

// ─── Parsing a completion answer (JSON or server-sent events) ────────────────────────────────

function parseCompletion(
  http: HttpResult,
  isStream: boolean,
  scrub: (text: string) => string,
): CompletionResult {
  const base = { status: http.status, promptTokens: null, errorCode: null, errorMessage: null }
  if (http.status === null) return { ...base, failure: http.failure, text: '' }
  const isOk = http.status >= 200 && http.status < 300
  if (!isOk) return { ...base, ...parseError(tryJson(http.body), scrub), failure: null, text: '' }
  const isSse = isStream || http.contentType.includes('text/event-stream')
  return isSse ? parseEvents(http, scrub) : parseJsonCompletion(http, scrub)
}

function parseJsonCompletion(http: HttpResult, scrub: (t: string) => string): CompletionResult {
  const json = tryJson(http.body)
  const parsed = CompletionBody.safeParse(json)
  if (!parsed.success || !parsed.data.choices) {
    // A 2xx without choices: keep whatever text there is, so a detector can still read it.
    return {
      status: http.status,
      failure: 'bad_response',
      text: http.body.slice(0, 64 * 1024),
      promptTokens: null,
      ...parseError(json, scrub),
    }
  }
  return {
    status: http.status,
    failure: null,
    text: parsed.data.choices.map(choiceText).join(''),
    promptTokens: parsed.data.usage?.prompt_tokens ?? null,
    errorCode: null,
    errorMessage: null,
  }
}

function parseEvents(http: HttpResult, scrub: (t: string) => string): CompletionResult {
  let text = ''
  let promptTokens: number | null = null
  let streamError: { errorCode: string | null; errorMessage: string | null } | null = null
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
    text += (parsed.data.choices ?? []).map(choiceText).join('')
    promptTokens = parsed.data.usage?.prompt_tokens ?? promptTokens
  }
  if (streamError)
    return { status: http.status, failure: 'stream_error', text, promptTokens, ...streamError }
  return {
    status: http.status,
    failure: null,
    text,
    promptTokens,
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
