/** Gateway mode's translation of an engine's reply bodies into OpenAI's shapes (the schemas of
 *  OpenAI's published OpenAPI description: CreateCompletionResponse,
 *  CreateChatCompletionResponse, CreateChatCompletionStreamResponse, ErrorResponse). SGLang and
 *  vLLM answer in OpenAI-like bodies with their own extras and nulls where OpenAI has none
 *  (SGLang `matched_stop`, `metadata`, `tool_calls: null`, `usage: null` in every chunk; vLLM
 *  `stop_reason`, `kv_transfer_params`, `system_fingerprint: null`, `annotations: null`; both
 *  `prompt_tokens_details: null` and errors whose `code` is the HTTP status). Each body is rebuilt
 *  from the fields OpenAI defines, with OpenAI's types: engine-only fields never reach a tenant
 *  (some describe the engine's internals). Sources: sglang/srt/entrypoints/openai/protocol.py,
 *  vllm/entrypoints/openai/protocol.py.
 *  Knows the bodies; knows nothing of HTTP, tenants or the engines' other endpoints. */

/** What the router puts in every body it relays. */
export interface RelayHeader {
  /** `chatcmpl-…` or `cmpl-…`, the router's own id. */
  id: string
  /** The served model name. */
  model: string
}

/** OpenAI's error object (`{error: …}` of ErrorResponse). */
export interface OpenAiErrorObject {
  message: string
  type: string
  param: string | null
  code: string | null
}

/** Token counts in OpenAI's shape (CompletionUsage). */
export interface OpenAiUsage {
  prompt_tokens: number
  completion_tokens: number
  total_tokens: number
  prompt_tokens_details?: { cached_tokens: number }
}

type Json = Record<string, unknown>

const chatRoles = new Set(['developer', 'system', 'user', 'assistant', 'tool'])
const openAiClientErrorTypes = new Set([
  'invalid_request_error',
  'authentication_error',
  'permission_error',
  'not_found_error',
  'rate_limit_error',
])

/** A whole (non-streamed) completion or chat completion, rebuilt: id and model from `header`,
 *  `created` from the engine when it is a Unix time (else now), then per choice `index`,
 *  `message` {role, content, refusal, tool_calls when any} or `text`, `logprobs`,
 *  `finish_reason` as given (the caller has checked it), and the usage. */
export function openAiWhole(
  reply: Json,
  endpoint: 'chat' | 'completion',
  header: RelayHeader,
): Json {
  const choices = arrayOf(reply.choices).map((value, i) => {
    const choice = objectOf(value) ?? {}
    const index = intOr(choice.index, i)
    if (endpoint === 'completion') {
      return {
        index,
        text: stringOr(choice.text, ''),
        logprobs: objectOf(choice.logprobs),
        finish_reason: choice.finish_reason,
      }
    }
    const message = objectOf(choice.message) ?? {}
    const toolCalls = arrayOf(message.tool_calls)
    return {
      index,
      message: {
        role: 'assistant',
        content: typeof message.content === 'string' ? message.content : null,
        refusal: typeof message.refusal === 'string' ? message.refusal : null,
        ...(toolCalls.length > 0 ? { tool_calls: toolCalls } : {}),
      },
      logprobs: chatLogprobs(choice.logprobs),
      finish_reason: choice.finish_reason,
    }
  })
  const usage = openAiUsage(reply.usage)
  return {
    ...common(reply, endpoint === 'chat' ? 'chat.completion' : 'text_completion', header),
    choices,
    ...(usage === null ? {} : { usage }),
  }
}

/** One streamed chunk, rebuilt like {@link openAiWhole}: per choice `index`, `delta` (role,
 *  content, refusal, tool_calls, each only when the engine gave one) or `text`, `logprobs`,
 *  `finish_reason` (null until the last). Chat chunks carry `usage: null` when the client asked
 *  for usage (`isUsageStreamed`), as OpenAI's do, and the usage where the engine sent it;
 *  completion chunks only the latter (the legacy schema has no null usage). */
export function openAiChunk(
  reply: Json,
  endpoint: 'chat' | 'completion',
  header: RelayHeader,
  isUsageStreamed: boolean,
): Json {
  const choices = arrayOf(reply.choices).map((value, i) => {
    const choice = objectOf(value) ?? {}
    const index = intOr(choice.index, i)
    const finishReason = typeof choice.finish_reason === 'string' ? choice.finish_reason : null
    if (endpoint === 'completion') {
      return {
        index,
        text: stringOr(choice.text, ''),
        logprobs: objectOf(choice.logprobs),
        finish_reason: finishReason,
      }
    }
    const delta = objectOf(choice.delta) ?? {}
    const toolCalls = arrayOf(delta.tool_calls)
    return {
      index,
      delta: {
        ...(typeof delta.role === 'string' && chatRoles.has(delta.role)
          ? { role: delta.role }
          : {}),
        ...(typeof delta.content === 'string' ? { content: delta.content } : {}),
        ...(typeof delta.refusal === 'string' ? { refusal: delta.refusal } : {}),
        ...(toolCalls.length > 0 ? { tool_calls: toolCalls } : {}),
      },
      logprobs: chatLogprobs(choice.logprobs),
      finish_reason: finishReason,
    }
  })
  const usage = openAiUsage(reply.usage)
  const usageField =
    usage !== null ? { usage } : endpoint === 'chat' && isUsageStreamed ? { usage: null } : {}
  return {
    ...common(reply, endpoint === 'chat' ? 'chat.completion.chunk' : 'text_completion', header),
    choices,
    ...usageField,
  }
}

/** Token counts in OpenAI's shape, or null when the engine sent none (or not as integers).
 *  `cached_tokens` is kept when the engine reports it. */
export function openAiUsage(value: unknown): OpenAiUsage | null {
  const usage = objectOf(value)
  if (usage === null) return null
  const numPromptTokens = usage.prompt_tokens
  const numCompletionTokens = usage.completion_tokens ?? 0 // vLLM: Optional, 0 by default
  const numTotalTokens = usage.total_tokens
  if (![numPromptTokens, numCompletionTokens, numTotalTokens].every(isCount)) return null
  const cached = objectOf(usage.prompt_tokens_details)?.cached_tokens
  return {
    prompt_tokens: numPromptTokens as number,
    completion_tokens: numCompletionTokens as number,
    total_tokens: numTotalTokens as number,
    ...(isCount(cached) ? { prompt_tokens_details: { cached_tokens: cached } } : {}),
  }
}

/** The error of an engine's error body in OpenAI's shape: found in `error` (vLLM, and both
 *  engines' in-stream errors) or at the top level (SGLang's `{object: "error", …}`; FastAPI's
 *  `{detail}`). The engine's `code` is kept only when it is a string (both engines put the HTTP
 *  status there); a type that is not one of OpenAI's client-error types becomes
 *  `invalid_request_error` for a 4xx `status` and `server_error` otherwise. */
export function openAiError(body: unknown, status: number): OpenAiErrorObject {
  const top = objectOf(body)
  const error = objectOf(top?.error) ?? top ?? {}
  const message =
    typeof error.message === 'string'
      ? error.message
      : typeof error.detail === 'string'
        ? error.detail
        : `the backend answered HTTP ${status}`
  const isClientError = status >= 400 && status < 500
  return {
    message,
    type:
      typeof error.type === 'string' && openAiClientErrorTypes.has(error.type)
        ? error.type
        : isClientError
          ? 'invalid_request_error'
          : 'server_error',
    param: typeof error.param === 'string' ? error.param : null,
    code: typeof error.code === 'string' ? error.code : null,
  }
}

/** Whether a streamed value is an error event (`{"error": …}`) rather than a chunk. */
export function isErrorEvent(value: Json): boolean {
  return objectOf(value.error) !== null
}

// ---------------------------------------------------------------------------------------------

function common(reply: Json, object: string, header: RelayHeader): Json {
  const created = reply.created
  return {
    id: header.id,
    object,
    created: isCount(created) ? created : Math.floor(Date.now() / 1000),
    model: header.model,
    ...(typeof reply.system_fingerprint === 'string'
      ? { system_fingerprint: reply.system_fingerprint }
      : {}),
  }
}

/** Chat logprobs as OpenAI has them: `{content, refusal}` (SGLang sends only `content`). */
function chatLogprobs(value: unknown): Json | null {
  const logprobs = objectOf(value)
  if (logprobs === null) return null
  return {
    content: Array.isArray(logprobs.content) ? logprobs.content : null,
    refusal: Array.isArray(logprobs.refusal) ? logprobs.refusal : null,
  }
}

function objectOf(value: unknown): Json | null {
  return typeof value === 'object' && value !== null && !Array.isArray(value)
    ? (value as Json)
    : null
}

function arrayOf(value: unknown): unknown[] {
  return Array.isArray(value) ? value : []
}

function intOr(value: unknown, fallback: number): number {
  return isCount(value) ? value : fallback
}

function stringOr(value: unknown, fallback: string): string {
  return typeof value === 'string' ? value : fallback
}

function isCount(value: unknown): value is number {
  return typeof value === 'number' && Number.isSafeInteger(value) && value >= 0
}
