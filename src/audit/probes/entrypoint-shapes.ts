/** The generation entrypoints an engine may serve besides `POST /v1/completions`, as their public
 *  APIs define them: how to ask each for a short answer to a prompt, and how to read its text and
 *  its prompt and cached-token counts from the answer. Wire knowledge only (the probe that uses it
 *  is entrypoints.ts):
 *  - OpenAI completions (`prompt`, `max_tokens`) and chat (`messages`, `max_tokens`): `choices[]`,
 *    `usage.prompt_tokens_details.cached_tokens`;
 *  - OpenAI Responses (`input`, `max_output_tokens`): `output[]` items of type `message` with
 *    `output_text` parts, `usage.input_tokens_details.cached_tokens`; streamed, the
 *    `response.output_text.delta` events and the usage of `response.completed`
 *    (OpenAI's OpenAPI description of the Responses API; src/router/responses);
 *  - Anthropic messages (`model`, `max_tokens`, `messages`): `content[]` text blocks,
 *    `usage.input_tokens` (uncached only) and `usage.cache_read_input_tokens`;
 *  - Anthropic messages streamed (`stream: true`): `message_start` (its `message.usage`),
 *    `content_block_delta` text deltas, `message_stop`;
 *  - SGLang's native `/generate` (`text`, `sampling_params.max_new_tokens`, `rid`): `text`,
 *    `meta_info.prompt_tokens` and `meta_info.cached_tokens`; streamed (`stream: true`), events
 *    of the same shape whose `text` is the whole answer so far (SGLang's default; the
 *    `--incremental-streaming-output` server sends only the new part), then `data: [DONE]`;
 *  - llama.cpp's `/completion` (`prompt`, `n_predict`, `cache_prompt`): `content`,
 *    `timings.prompt_n` + `timings.cache_n` (newer servers) or `tokens_evaluated` and
 *    `tokens_cached`.
 *  Every request is at temperature 0. Knows nothing of tenants, budgets or verdicts. */
import type { HttpResult } from '../target.js'
import { tryJson } from '../target.js'

export const entrypointNames = [
  'completions',
  'chat',
  'responses',
  'responses-stream',
  'messages',
  'messages-stream',
  'generate',
  'generate-stream',
  'completion',
] as const
export type EntrypointName = (typeof entrypointNames)[number]

/** One entrypoint: where it is and how it is spoken to. */
export interface Entrypoint {
  readonly name: EntrypointName
  /** `POST` path under the base URL. */
  readonly path: string
  /** The body asking for at most `maxTokens` tokens after `prompt` (`model`: omitted when null). */
  body(prompt: string, maxTokens: number, model: string | null, requestId: string): unknown
}

/** What an answer of any entrypoint told. */
export interface EntrypointAnswer {
  readonly status: number | null
  /** True for a 2xx whose body was read whole and held an answer of the entrypoint's shape. */
  readonly isAnswered: boolean
  readonly text: string
  /** Prompt tokens in all (cached ones included), when the answer said. */
  readonly promptTokens: number | null
  /** Prompt tokens served from a cache, when the answer said. */
  readonly cachedTokens: number | null
  /** `id` of a Responses answer (for `previous_response_id`), else null. */
  readonly responseId: string | null
  /** Function calls a Responses answer made. */
  readonly functionCalls: readonly { callId: string; name: string; arguments: string }[]
}

const withModel = (model: string | null): Record<string, unknown> =>
  model === null ? {} : { model }

const responsesBody: Entrypoint['body'] = (prompt, maxTokens, model) => ({
  ...withModel(model),
  input: prompt,
  max_output_tokens: maxTokens,
  temperature: 0,
})

const messagesBody: Entrypoint['body'] = (prompt, maxTokens, model) => ({
  // Anthropic's API requires a model; a server with one model takes any id.
  model: model ?? 'default',
  max_tokens: maxTokens,
  messages: [{ role: 'user', content: prompt }],
  temperature: 0,
})

const generateBody: Entrypoint['body'] = (prompt, maxTokens, _model, requestId) => ({
  text: prompt,
  sampling_params: { max_new_tokens: maxTokens, temperature: 0 },
  rid: requestId,
})

/** The streamed entrypoints: the same path as their plain twin, with `stream: true`. */
export const streamedEntrypoints: Readonly<Partial<Record<EntrypointName, EntrypointName>>> = {
  'responses-stream': 'responses',
  'messages-stream': 'messages',
  'generate-stream': 'generate',
}

export const entrypoints: Readonly<Record<EntrypointName, Entrypoint>> = {
  completions: {
    name: 'completions',
    path: '/v1/completions',
    body: (prompt, maxTokens, model) => ({
      ...withModel(model),
      prompt,
      max_tokens: maxTokens,
      temperature: 0,
    }),
  },
  chat: {
    name: 'chat',
    path: '/v1/chat/completions',
    body: (prompt, maxTokens, model) => ({
      ...withModel(model),
      messages: [{ role: 'user', content: prompt }],
      max_tokens: maxTokens,
      temperature: 0,
    }),
  },
  responses: {
    name: 'responses',
    path: '/v1/responses',
    body: (...args) => responsesBody(...args),
  },
  'responses-stream': {
    name: 'responses-stream',
    path: '/v1/responses',
    body: (...args) => ({ ...(responsesBody(...args) as object), stream: true }),
  },
  messages: {
    name: 'messages',
    path: '/v1/messages',
    body: (...args) => messagesBody(...args),
  },
  'messages-stream': {
    name: 'messages-stream',
    path: '/v1/messages',
    body: (...args) => ({ ...(messagesBody(...args) as object), stream: true }),
  },
  generate: {
    name: 'generate',
    path: '/generate',
    body: (...args) => generateBody(...args),
  },
  'generate-stream': {
    name: 'generate-stream',
    path: '/generate',
    body: (...args) => ({ ...(generateBody(...args) as object), stream: true }),
  },
  completion: {
    name: 'completion',
    path: '/completion',
    body: (prompt, maxTokens) => ({
      prompt,
      n_predict: maxTokens,
      cache_prompt: true,
      temperature: 0,
    }),
  },
}

/** Reads `http` as an answer of `entrypoint`. */
export function parseEntrypointAnswer(name: EntrypointName, http: HttpResult): EntrypointAnswer {
  const none: EntrypointAnswer = {
    status: http.status,
    isAnswered: false,
    text: '',
    promptTokens: null,
    cachedTokens: null,
    responseId: null,
    functionCalls: [],
  }
  const isOk = http.status !== null && http.status >= 200 && http.status < 300
  if (!isOk || http.failure !== null) return none
  const isSse = http.contentType.includes('text/event-stream')
  const json = isSse ? null : tryJson(http.body)
  if (isSse) return { ...none, ...parseEvents(http.body) }
  if (json === null || typeof json !== 'object') return none
  const plainName = (streamedEntrypoints[name] ?? name) as keyof typeof readers
  const read = readers[plainName](json as Json)
  return read === null ? none : { ...none, ...read, isAnswered: true }
}

type Json = Record<string, unknown>
type Read = Pick<
  EntrypointAnswer,
  'text' | 'promptTokens' | 'cachedTokens' | 'responseId' | 'functionCalls'
>

const num = (v: unknown): number | null =>
  typeof v === 'number' && Number.isFinite(v) && v >= 0 ? v : null
const obj = (v: unknown): Json => (v !== null && typeof v === 'object' ? (v as Json) : {})
const str = (v: unknown): string => (typeof v === 'string' ? v : '')
const plain = (text: string, promptTokens: number | null, cachedTokens: number | null): Read => ({
  text,
  promptTokens,
  cachedTokens,
  responseId: null,
  functionCalls: [],
})

const readers: Readonly<
  Record<
    Exclude<EntrypointName, 'responses-stream' | 'messages-stream' | 'generate-stream'>,
    (j: Json) => Read | null
  >
> = {
  completions: readChoices,
  chat: readChoices,
  responses: readResponse,
  messages: (j) => {
    if (!Array.isArray(j.content)) return null
    const text = j.content.map((b) => (obj(b).type === 'text' ? str(obj(b).text) : '')).join('')
    const usage = obj(j.usage)
    const cached = num(usage.cache_read_input_tokens)
    const input = num(usage.input_tokens)
    // Anthropic's input_tokens counts only the tokens after the last cache read or write.
    const prompt =
      input === null ? null : input + (cached ?? 0) + (num(usage.cache_creation_input_tokens) ?? 0)
    return plain(text, prompt, cached)
  },
  generate: (j) => {
    if (typeof j.text !== 'string') return null
    const meta = obj(j.meta_info)
    return plain(j.text, num(meta.prompt_tokens), num(meta.cached_tokens))
  },
  completion: (j) => {
    if (typeof j.content !== 'string') return null
    const timings = obj(j.timings)
    const cacheN = num(timings.cache_n)
    const promptN = num(timings.prompt_n)
    if (cacheN !== null && promptN !== null) return plain(j.content, promptN + cacheN, cacheN)
    return plain(j.content, num(j.tokens_evaluated), num(j.tokens_cached))
  },
}

function readChoices(j: Json): Read | null {
  if (!Array.isArray(j.choices)) return null
  const text = j.choices.map((c) => str(obj(c).text) || str(obj(obj(c).message).content)).join('')
  const usage = obj(j.usage)
  return plain(text, num(usage.prompt_tokens), num(obj(usage.prompt_tokens_details).cached_tokens))
}

function readResponse(j: Json): Read | null {
  if (!Array.isArray(j.output)) return null
  let text = ''
  const functionCalls: { callId: string; name: string; arguments: string }[] = []
  for (const item of j.output.map(obj)) {
    if (item.type === 'message' && Array.isArray(item.content))
      text += item.content.map((p) => str(obj(p).text)).join('')
    if (item.type === 'function_call')
      functionCalls.push({
        callId: str(item.call_id),
        name: str(item.name),
        arguments: str(item.arguments),
      })
  }
  const usage = obj(j.usage)
  return {
    text,
    promptTokens: num(usage.input_tokens),
    cachedTokens: num(obj(usage.input_tokens_details).cached_tokens),
    responseId: typeof j.id === 'string' ? j.id : null,
    functionCalls,
  }
}

/** A stream's text and counts, from whichever of these events it carries: Responses
 *  (`response.output_text.delta`, usage on `response.completed`), Anthropic
 *  (`content_block_delta`, usage on `message_start`), OpenAI chunks (`choices[]`), SGLang
 *  `/generate` (`text` and `meta_info`: the whole answer so far in each event, or only the new
 *  part; an event whose text starts with what was read so far replaces it). A stream that
 *  carried an error event, or no completion event, is not an answer. */
function parseEvents(body: string): Partial<EntrypointAnswer> {
  let text = ''
  let isDone = false
  let read: Read | null = null
  for (const line of body.split(/\r?\n/)) {
    if (!line.startsWith('data:')) continue
    const data = line.slice(5).trim()
    if (data === '[DONE]') isDone = true
    const event = obj(tryJson(data))
    if ('error' in event || event.type === 'error' || event.type === 'response.failed')
      return { isAnswered: false, text }
    if (event.type === 'response.output_text.delta') text += str(event.delta)
    if (event.type === 'content_block_delta') text += str(obj(event.delta).text)
    if (event.type === 'message_start')
      read = readers.messages({ content: [], ...obj(event.message) })
    if (Array.isArray(event.choices)) text += readChoices(event)?.text ?? ''
    if (typeof event.text === 'string' && 'meta_info' in event) {
      text = event.text.startsWith(text) ? event.text : text + event.text
      read = readers.generate(event)
    }
    if (event.type === 'response.completed' || event.type === 'response.incomplete') {
      read = readResponse(obj(event.response))
      isDone = true
    }
    if (event.type === 'message_stop') isDone = true
  }
  return {
    isAnswered: isDone,
    text,
    promptTokens: read?.promptTokens ?? null,
    cachedTokens: read?.cachedTokens ?? null,
    responseId: read?.responseId ?? null,
  }
}
