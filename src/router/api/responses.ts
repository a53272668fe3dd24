/** OpenAI response bodies (`chat.completion`, `chat.completion.chunk`, `text_completion`,
 *  `list`/`model`) built from plain values, and the SSE framing of a stream.
 *  Knows OpenAI's response shapes; knows nothing of workers, tokens or tenants. */
import assert from 'node:assert/strict'
import type { ServerResponse } from 'node:http'
import { drained } from './http.js'
import type { ChatLogprobs, CompletionLogprobs } from './logprobs.js'

/** OpenAI's `finish_reason` values the router passes on: `stop` (end of sequence or a stop
 *  string), `length` (max_tokens reached), `content_filter` (an engine behind a gateway withheld
 *  output; kvfence's own workers never produce it). */
export type FinishReason = 'stop' | 'length' | 'content_filter'

/** OpenAI's `usage`. */
export interface Usage {
  prompt_tokens: number
  completion_tokens: number
  total_tokens: number
  /** `cached_tokens`: prompt tokens whose KV came from a prefix cache (0 without one). */
  prompt_tokens_details: { cached_tokens: number }
}

/** What every response of one request shares. */
export interface ResponseHeader {
  /** `chatcmpl-…` or `cmpl-…`. */
  id: string
  /** Unix seconds. */
  created: number
  model: string
}

/** `usage` for the given counts. */
export function usageOf(
  numPromptTokens: number,
  numCompletionTokens: number,
  numCachedTokens = 0,
): Usage {
  return {
    prompt_tokens: numPromptTokens,
    completion_tokens: numCompletionTokens,
    total_tokens: numPromptTokens + numCompletionTokens,
    prompt_tokens_details: { cached_tokens: numCachedTokens },
  }
}

/** A non-streamed `chat.completion`; `logprobs` null unless the client asked for them. */
export function chatCompletion(
  h: ResponseHeader,
  text: string,
  finishReason: FinishReason,
  usage: Usage,
  logprobs: ChatLogprobs | null = null,
) {
  return {
    id: h.id,
    object: 'chat.completion' as const,
    created: h.created,
    model: h.model,
    choices: [
      {
        index: 0,
        message: { role: 'assistant' as const, content: text, refusal: null },
        logprobs,
        finish_reason: finishReason,
      },
    ],
    usage,
  }
}

/** One `chat.completion.chunk` with one choice. `usage` is present (null) only when the client
 *  asked for a usage chunk; `logprobs` are those of the tokens whose text this chunk carries. */
export function chatChunk(
  h: ResponseHeader,
  delta: { role?: 'assistant'; content?: string },
  finishReason: FinishReason | null,
  isUsageStreamed: boolean,
  logprobs: ChatLogprobs | null = null,
) {
  return {
    id: h.id,
    object: 'chat.completion.chunk' as const,
    created: h.created,
    model: h.model,
    choices: [{ index: 0, delta, logprobs, finish_reason: finishReason }],
    ...(isUsageStreamed ? { usage: null } : {}),
  }
}

/** The last chunk of a chat stream with `include_usage`: no choices, the usage. */
export function chatUsageChunk(h: ResponseHeader, usage: Usage) {
  return {
    id: h.id,
    object: 'chat.completion.chunk' as const,
    created: h.created,
    model: h.model,
    choices: [],
    usage,
  }
}

/** A `text_completion` (streamed chunks have the same shape). `usage` is given for a
 *  non-streamed response and absent (undefined) on chunks: OpenAI's completion schema has no
 *  null usage, unlike the chat chunk's. `logprobs` null unless the client asked for them. */
export function textCompletion(
  h: ResponseHeader,
  text: string,
  finishReason: FinishReason | null,
  usage: Usage | null | undefined,
  logprobs: CompletionLogprobs | null = null,
) {
  return {
    id: h.id,
    object: 'text_completion' as const,
    created: h.created,
    model: h.model,
    choices: [{ index: 0, text, logprobs, finish_reason: finishReason }],
    ...(usage === undefined ? {} : { usage }),
  }
}

/** The last chunk of a completions stream with `include_usage`. */
export function textUsageChunk(h: ResponseHeader, usage: Usage) {
  return {
    id: h.id,
    object: 'text_completion' as const,
    created: h.created,
    model: h.model,
    choices: [],
    usage,
  }
}

/** `GET /v1/models`: the one served model (`max_model_len` as in vLLM). */
export function modelList(model: string, created: number, maxModelLen: number) {
  return { object: 'list' as const, data: [modelCard(model, created, maxModelLen)] }
}

/** One `model` object. */
export function modelCard(model: string, created: number, maxModelLen: number) {
  return {
    id: model,
    object: 'model' as const,
    created,
    owned_by: 'kvfence',
    max_model_len: maxModelLen,
  }
}

// ---------------------------------------------------------------------------------------------
// SSE

/** Sets the headers of an SSE stream; sends them at once unless `isSentWithFirstEvent` (then
 *  they leave with the first event, in one socket write when writes are coalesced). */
export function startSse(
  res: ServerResponse,
  extraHeaders: Record<string, string>,
  isSentWithFirstEvent = false,
): void {
  res.writeHead(200, {
    'content-type': 'text/event-stream; charset=utf-8',
    'cache-control': 'no-cache',
    'x-accel-buffering': 'no',
    ...extraHeaders,
  })
  if (!isSentWithFirstEvent) res.flushHeaders()
}

/** Writes one `data: {json}` event. Undefined when the response takes more at once; else a
 *  promise that resolves when it can (or is closed). Not a promise every time: a stream awaits
 *  each event, and a settled promise still costs every token of every stream a turn of the
 *  microtask queue. */
export function writeSse(res: ServerResponse, value: unknown): Promise<void> | undefined {
  return writeRaw(res, sseEvent(value))
}

/** The `data: {json}\n\n` event of `value`. */
export function sseEvent(value: unknown): string {
  return `data: ${JSON.stringify(value)}\n\n`
}

/** Builds `data: {json}\n\n` events that differ from one body only in one string field: the
 *  body is serialized once (with a placeholder) and each event is the text around it joined with
 *  the new string's JSON, byte for byte what {@link writeSse} would write for that body. For the
 *  chunks of a stream, which share everything but their text. `bodyWith(s)` returns the body
 *  with `s` in that field (it must appear nowhere else). */
export function sseTemplate(bodyWith: (text: string) => unknown): (text: string) => string {
  const placeholder = '\u0000kvfence-text\u0000'
  const json = JSON.stringify(bodyWith(placeholder))
  const quoted = JSON.stringify(placeholder)
  const at = json.indexOf(quoted)
  assert(at !== -1 && json.indexOf(quoted, at + 1) === -1, 'the placeholder must appear once')
  const before = `data: ${json.slice(0, at)}`
  const after = `${json.slice(at + quoted.length)}\n\n`
  return (text) => before + JSON.stringify(text) + after
}

/** Writes an event already framed (`data: …\n\n`); undefined or a promise, as {@link writeSse}. */
export function writeSseText(res: ServerResponse, event: string): Promise<void> | undefined {
  return writeRaw(res, event)
}

/** Writes the final `data: [DONE]` and ends the response. */
export function endSse(res: ServerResponse): void {
  res.end('data: [DONE]\n\n')
}

function writeRaw(res: ServerResponse, text: string): Promise<void> | undefined {
  if (res.destroyed || res.writableEnded || res.write(text)) return undefined
  return drained(res)
}
