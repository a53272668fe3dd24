/** The OpenAI request bodies kvfence accepts, parsed once at the boundary into typed values.
 *  Every refusal is a {@link KvfenceError} whose `param` names the offending field.
 *  Knows OpenAI's request fields; knows nothing of tokens, tenants or workers. */
import { z } from 'zod'
import type { Sampling } from '../../control/messages.js'
import { KvfenceError } from '../../common/errors.js'
import type { ChatMessage } from '../../model/tokenizer.js'
import { maxStopStrings } from '../tokenize/text-stream.js'

/** What both endpoints ask of generation, after parsing. */
export interface GenerationParams {
  model: string
  /** Tokens to generate at most; null = the rest of the context window (vLLM's rule). */
  maxTokens: number | null
  /** The field `maxTokens` came from (for error messages). */
  maxTokensParam: 'max_tokens' | 'max_completion_tokens' | 'max_output_tokens'
  /** Validated; `numLogprobs` set when the response carries log-probabilities. */
  sampling: Sampling
  /** Stop strings (non-empty); the output ends before the first one found. */
  stop: string[]
  /** vLLM's `stop_token_ids`: generation stops after any of these (besides EOS), finish reason
   *  `stop`. Non-negative; checked against the vocabulary by {@link checkStopTokenIds}. */
  stopTokenIds: number[]
  /** vLLM's and SGLang's `ignore_eos`: the model's EOS token does not end the output. */
  ignoreEos: boolean
  isStream: boolean
  /** `stream_options.include_usage`: a last chunk with `usage`. */
  isUsageStreamed: boolean
}

/** A parsed `POST /v1/chat/completions` body. */
export interface ParsedChatRequest extends GenerationParams {
  endpoint: 'chat'
  messages: ChatMessage[]
  /** The field the messages came from, for errors' `param`: `input` for a Responses request run
   *  as chat (then `instructions` and the continued conversation count in it too); absent:
   *  `messages`. */
  promptParam?: 'input'
  /** For errors about one message: the field each message came from (`instructions`,
   *  `previous_response_id` for the continued conversation, `input[0].content`); absent:
   *  `messages[i].content`. */
  messageParams?: string[]
}

/** A parsed `POST /v1/completions` body: one prompt, as text or as token ids. */
export interface ParsedCompletionRequest extends GenerationParams {
  endpoint: 'completion'
  prompt: { text: string } | { tokenIds: number[] }
}

/** A parsed body of either generation endpoint, tagged by the endpoint. */
export type ParsedRequest = ParsedChatRequest | ParsedCompletionRequest

/** The two generation endpoints. */
export type Endpoint = ParsedRequest['endpoint']

/** The parser of each endpoint's body. */
export const requestParsers: { readonly [E in Endpoint]: (body: unknown) => ParsedRequest } = {
  chat: (body) => parseChatRequest(body),
  completion: (body) => parseCompletionRequest(body),
}

/** The field holding each endpoint's prompt. */
const promptParams = { chat: 'messages', completion: 'prompt' } as const

/** The field holding a request's prompt, for errors' `param`. */
export function promptParamOf(parsed: ParsedRequest): 'messages' | 'prompt' | 'input' {
  return (
    (parsed.endpoint === 'chat' ? parsed.promptParam : undefined) ?? promptParams[parsed.endpoint]
  )
}

/** The characters of a request's prompt text (0 for a prompt given as token ids). */
export function promptNumChars(parsed: ParsedRequest): number {
  if (parsed.endpoint === 'chat') return parsed.messages.reduce((n, m) => n + m.content.length, 0)
  return 'text' in parsed.prompt ? parsed.prompt.text.length : 0
}

/** A request's prompt as logged with `logContent`: the messages, the text or the token ids —
 *  never the rest of the body. */
export function loggedPromptOf(parsed: ParsedRequest): unknown {
  if (parsed.endpoint === 'chat') return parsed.messages
  return 'text' in parsed.prompt ? parsed.prompt.text : parsed.prompt.tokenIds
}

// ---------------------------------------------------------------------------------------------
// Fields

/** Fields only kvfence itself may set (or other engines' internal fields): a client sending one
 *  is refused, never ignored (vllm#53347: a client-chosen cache salt; sglang PR #19035 and vLLM
 *  PR #27987: client-chosen request ids colliding across clients). */
export const internalFields = [
  'cache_salt',
  'kv_transfer_params',
  'bootstrap_host',
  'bootstrap_port',
  'bootstrap_room',
  'rid',
  'request_id',
] as const

/** Known OpenAI fields that do not change the output: accepted and ignored. */
const ignoredFields = new Set([
  'metadata',
  'store',
  'service_tier',
  'safety_identifier',
  'prompt_cache_key',
  'prompt_cache_retention',
  'parallel_tool_calls',
  'reasoning_effort',
  'verbosity',
])

const isNullish = (v: unknown) => v === null || v === undefined
const isFalse = (v: unknown) => isNullish(v) || v === false
const isEmpty = (v: unknown) =>
  isNullish(v) ||
  (Array.isArray(v) && v.length === 0) ||
  (typeof v === 'object' && v !== null && Object.keys(v).length === 0)

/** `logit_bias`'s no-op value: no map, or an empty one (a list is not a map). */
const isEmptyMap = (v: unknown) =>
  isNullish(v) || (typeof v === 'object' && !Array.isArray(v) && Object.keys(v!).length === 0)

/** A known OpenAI feature kvfence does not implement: accepted only at its no-op value. */
export interface InertField {
  /** Whether `v` is the no-op value. */
  accepts: (v: unknown) => boolean
  /** The accepted values, for the error message. */
  noOp: string
}

const bestOfOne: InertField = { accepts: (v) => isNullish(v) || v === 1, noOp: '1' }
const noLogitBias: InertField = { accepts: isEmptyMap, noOp: 'an empty map' }

/** Known OpenAI features kvfence does not implement: accepted only at their no-op value. */
const chatInertFields: Record<string, InertField> = {
  logit_bias: noLogitBias,
  tools: { accepts: isEmpty, noOp: 'an empty list' },
  tool_choice: {
    accepts: (v) => isNullish(v) || v === 'none' || v === 'auto',
    noOp: '"none" or "auto"',
  },
  functions: { accepts: isEmpty, noOp: 'an empty list' },
  function_call: {
    accepts: (v) => isNullish(v) || v === 'none' || v === 'auto',
    noOp: '"none" or "auto"',
  },
  response_format: {
    accepts: (v) =>
      isNullish(v) || (typeof v === 'object' && (v as { type?: unknown }).type === 'text'),
    noOp: '{ "type": "text" }',
  },
  modalities: {
    accepts: (v) => isNullish(v) || (Array.isArray(v) && v.every((m) => m === 'text')),
    noOp: '["text"]',
  },
  audio: { accepts: isNullish, noOp: 'null' },
  prediction: { accepts: isNullish, noOp: 'null' },
  web_search_options: { accepts: isNullish, noOp: 'null' },
  // vLLM's and SGLang's chat requests take it; their serving benchmarks send `best_of: 1`.
  best_of: bestOfOne,
}

const completionInertFields: Record<string, InertField> = {
  logit_bias: noLogitBias,
  echo: { accepts: isFalse, noOp: 'false' },
  suffix: { accepts: (v) => isNullish(v) || v === '', noOp: '""' },
  best_of: bestOfOne,
}

/** Most alternatives per token of chat's `top_logprobs` (OpenAI's limit). */
export const maxChatTopLogprobs = 20
/** Most alternatives per token of the completions' `logprobs` (OpenAI's limit). */
export const maxCompletionLogprobs = 5

const safeInt = z.number().int().min(-Number.MAX_SAFE_INTEGER).max(Number.MAX_SAFE_INTEGER)

const commonFields = {
  model: z.string().min(1),
  max_tokens: safeInt.min(1).nullish(),
  temperature: z.number().min(0).max(2).nullish(),
  top_p: z.number().gt(0).max(1).nullish(),
  n: safeInt.min(1).nullish(),
  stop: z
    .union([z.string(), z.array(z.string()).max(maxStopStrings)], {
      error: `stop must be a string or a list of at most ${maxStopStrings} strings`,
    })
    .nullish(),
  seed: safeInt.nullish(),
  // vLLM's extensions: top_k -1 or 0 turns it off.
  top_k: safeInt.min(-1).nullish(),
  min_p: z.number().min(0).max(1).nullish(),
  presence_penalty: z.number().min(-2).max(2).nullish(),
  frequency_penalty: z.number().min(-2).max(2).nullish(),
  stop_token_ids: z.array(safeInt.min(0)).nullish(),
  // OpenAI's end-user id: accepted and not used, but a string like OpenAI's.
  user: z.string().nullish(),
  // vLLM's and SGLang's extension (their serving benchmarks always send it): do not stop at EOS.
  ignore_eos: z.boolean().nullish(),
  stream: z.boolean().nullish(),
  stream_options: z
    .object({ include_usage: z.boolean().nullish(), include_obfuscation: z.boolean().nullish() })
    .nullish(),
}

const TextPart = z.strictObject({ type: z.literal('text'), text: z.string() })

/** Fields of OpenAI's chat messages this server does not take (it has no tools, functions or
 *  audio): refused by name rather than dropped, since the model would see another conversation. */
const unsupportedMessageFields = new Set([
  'tool_calls',
  'tool_call_id',
  'function_call',
  'audio',
  'refusal',
])

// Strict, like OpenAI's own validation: a misspelt field (`contnet`, `nmae`) is an error, not
// silently ignored.
const Message = z.strictObject({
  role: z.enum(['system', 'developer', 'user', 'assistant', 'tool']),
  content: z.union([z.string(), z.array(TextPart).min(1)], {
    error: 'content must be a string or a non-empty list of text parts ({ type: "text", text })',
  }),
  name: z.string().optional(),
})

/** A chat body's fields but its messages. */
const ChatFields = z.object({
  ...commonFields,
  max_completion_tokens: safeInt.min(1).nullish(),
  logprobs: z.boolean().nullish(),
  top_logprobs: safeInt.min(0).max(maxChatTopLogprobs).nullish(),
})

const ChatBody = ChatFields.extend({
  messages: z.array(Message).min(1, 'messages must hold at least one message'),
})

const messageRoles: ReadonlySet<unknown> = new Set(Message.shape.role.options)

/** `messages` as {@link Message} parses them, when every message is the common case (an object
 *  of a known role, string content and at most a string name, nothing else); else null, and the
 *  schema parses them, naming any fault. Walking the schema costs microseconds per message, and
 *  two thousand messages' worth is the event loop every tenant shares. */
function plainMessages(messages: unknown): z.infer<typeof Message>[] | null {
  if (!Array.isArray(messages) || messages.length === 0) return null
  const out: z.infer<typeof Message>[] = []
  for (const m of messages as unknown[]) {
    if (typeof m !== 'object' || m === null || Object.getPrototypeOf(m) !== Object.prototype) {
      return null
    }
    const { role, content, name } = m as Record<string, unknown>
    let numKeys = 2
    if (name !== undefined) {
      if (typeof name !== 'string') return null
      numKeys++
    }
    if (!messageRoles.has(role) || typeof content !== 'string') return null
    if (Object.keys(m).length !== numKeys) return null
    out.push({
      role: role as z.infer<typeof Message>['role'],
      content,
      ...(name === undefined ? {} : { name }),
    })
  }
  return out
}

const CompletionBody = z.object({
  ...commonFields,
  prompt: z.unknown(),
  logprobs: safeInt.min(0).max(maxCompletionLogprobs).nullish(),
})

// ---------------------------------------------------------------------------------------------
// Parsers

/** Most messages of a chat request: OpenAI's (and Azure OpenAI's) limit. */
export const maxChatMessages = 2048
/** Most text parts (`content` given as a list) over all of a chat request's messages. */
export const maxChatContentParts = 2048

/** Refuses a chat body with more than {@link maxChatMessages} messages or
 *  {@link maxChatContentParts} text parts, before the schema validates each of them: a body of
 *  tens of thousands of tiny messages fits in the body limit, and validating them (then rendering
 *  them through the chat template) would hold the event loop every tenant shares for most of a
 *  second. A count only: each message's shape is the schema's to check. */
function checkChatSize(object: Record<string, unknown>): void {
  const { messages } = object
  if (!Array.isArray(messages)) return
  if (messages.length > maxChatMessages) {
    throw new KvfenceError(
      'invalid_request',
      `Invalid 'messages': array too long. Expected an array with maximum length ${maxChatMessages}, but got an array with length ${messages.length} instead.`,
      'messages',
    )
  }
  let numParts = 0
  for (let i = 0; i < messages.length; i++) {
    const content = (messages[i] as { content?: unknown } | null)?.content
    if (!Array.isArray(content)) continue
    numParts += content.length
    if (numParts > maxChatContentParts) {
      throw new KvfenceError(
        'invalid_request',
        `Invalid 'messages[${i}].content': the messages hold more than ${maxChatContentParts} text parts in all`,
        `messages[${i}].content`,
      )
    }
  }
}

/** Parses a chat completions body; throws `invalid_request` naming the field at fault (also for
 *  more than {@link maxChatMessages} messages or {@link maxChatContentParts} text parts). */
export function parseChatRequest(body: unknown): ParsedChatRequest {
  const object = checkFields(body, Object.keys(ChatBody.shape), chatInertFields)
  checkChatSize(object)
  const messages = plainMessages(object.messages)
  const data =
    messages === null ? parseWith(ChatBody, object) : { ...parseWith(ChatFields, object), messages }
  if (data.logprobs !== true && (data.top_logprobs ?? 0) > 0) {
    throw new KvfenceError(
      'invalid_request',
      'top_logprobs may only be set when logprobs is true',
      'top_logprobs',
    )
  }
  const numLogprobs = data.logprobs === true ? (data.top_logprobs ?? 0) : null
  const useCompletionTokens = !isNullish(data.max_completion_tokens)
  return {
    endpoint: 'chat',
    ...generationParams(data, numLogprobs),
    maxTokens: useCompletionTokens ? data.max_completion_tokens! : (data.max_tokens ?? null),
    maxTokensParam: useCompletionTokens ? 'max_completion_tokens' : 'max_tokens',
    messages: data.messages.map((m) => ({
      role: m.role,
      content: typeof m.content === 'string' ? m.content : m.content.map((p) => p.text).join(''),
      // Given to the chat template (as vLLM does); most templates do not use it.
      ...(m.name === undefined ? {} : { name: m.name }),
    })),
  }
}

/** Parses a completions body; throws `invalid_request` naming the field at fault. */
export function parseCompletionRequest(body: unknown): ParsedCompletionRequest {
  const object = checkFields(body, Object.keys(CompletionBody.shape), completionInertFields)
  const data = parseWith(CompletionBody, object)
  return {
    endpoint: 'completion',
    ...generationParams(data, data.logprobs ?? null),
    maxTokens: data.max_tokens ?? null,
    maxTokensParam: 'max_tokens',
    prompt: parsePrompt(data.prompt),
  }
}

/** What both endpoints share; `numLogprobs` is the endpoint's own reading of its logprobs fields. */
function generationParams(
  data: z.infer<typeof CompletionBody> | z.infer<typeof ChatBody>,
  numLogprobs: number | null,
) {
  if (!isNullish(data.n) && data.n !== 1) {
    throw new KvfenceError('invalid_request', `n = ${data.n} is not supported: only n = 1`, 'n')
  }
  const isStream = data.stream ?? false
  if (!isStream && !isNullish(data.stream_options)) {
    throw new KvfenceError(
      'invalid_request',
      'stream_options may only be set when stream is true',
      'stream_options',
    )
  }
  const stop = parseStop(data.stop)
  return {
    model: data.model,
    sampling: {
      temperature: data.temperature ?? 1,
      topP: data.top_p ?? 1,
      topK: isNullish(data.top_k) || data.top_k! <= 0 ? null : data.top_k!,
      minP: data.min_p ?? 0,
      presencePenalty: data.presence_penalty ?? 0,
      frequencyPenalty: data.frequency_penalty ?? 0,
      seed: data.seed ?? null,
      numLogprobs,
    },
    stop,
    stopTokenIds: data.stop_token_ids ?? [],
    ignoreEos: data.ignore_eos ?? false,
    isStream,
    isUsageStreamed: isStream && (data.stream_options?.include_usage ?? false),
  }
}

/** `stop` as a list (a single string is a list of one; absent or null, none). An empty string is
 *  refused (400, param `stop`): it would match before any text, so no completion could be honoured
 *  with it, and silently dropping it would hide the client's bug. */
function parseStop(stop: string | string[] | null | undefined): string[] {
  const stops = typeof stop === 'string' ? [stop] : (stop ?? [])
  const empty = stops.indexOf('')
  if (empty !== -1) {
    const which = typeof stop === 'string' ? 'stop' : `stop[${empty}]`
    throw new KvfenceError(
      'invalid_request',
      `Invalid value for 'stop': ${which} is an empty string; a stop string must have at least one character`,
      'stop',
    )
  }
  return stops
}

/** Refuses a `stop_token_ids` entry outside a vocabulary of `vocabSize` tokens (400 naming
 *  `stop_token_ids[i]`); the router checks against its tokenizer, which the parser does not know. */
export function checkStopTokenIds(ids: readonly number[], vocabSize: number): void {
  const bad = ids.findIndex((id) => id >= vocabSize)
  if (bad === -1) return
  throw new KvfenceError(
    'invalid_request',
    `Invalid value for 'stop_token_ids[${bad}]': token id ${ids[bad]} is out of range: the vocabulary has ${vocabSize} tokens`,
    `stop_token_ids[${bad}]`,
  )
}

/** One prompt: a non-empty string, or non-empty token ids; a one-element list of either. */
function parsePrompt(prompt: unknown): ParsedCompletionRequest['prompt'] {
  const isTokenIds = (v: unknown): v is number[] =>
    Array.isArray(v) && v.length > 0 && v.every((id) => Number.isSafeInteger(id) && id >= 0)
  let one = prompt
  if (Array.isArray(prompt) && prompt.length > 0 && !isTokenIds(prompt)) {
    if (prompt.length > 1) {
      throw new KvfenceError(
        'invalid_request',
        `a list of ${prompt.length} prompts is not supported: send one prompt per request`,
        'prompt',
      )
    }
    one = prompt[0]
  }
  if (typeof one === 'string') {
    if (one.length === 0)
      throw new KvfenceError('invalid_request', 'prompt must not be empty', 'prompt')
    return { text: one }
  }
  if (isTokenIds(one)) return { tokenIds: one }
  if (one === undefined || one === null) {
    throw new KvfenceError('invalid_request', 'prompt is required', 'prompt')
  }
  if (Array.isArray(one) && one.length === 0) {
    throw new KvfenceError('invalid_request', 'prompt must not be empty', 'prompt')
  }
  throw new KvfenceError(
    'invalid_request',
    'prompt must be a string or a list of non-negative integer token ids',
    'prompt',
  )
}

/** Refuses non-objects, internal fields, unknown fields and unsupported features (each a 400
 *  `invalid_request` naming the field); returns the body as an object. */
export function checkFields(
  body: unknown,
  supported: readonly string[],
  inert: Record<string, InertField>,
): Record<string, unknown> {
  if (typeof body !== 'object' || body === null || Array.isArray(body)) {
    throw new KvfenceError('invalid_request', 'the request body must be a JSON object')
  }
  const object = body as Record<string, unknown>
  for (const field of internalFields) {
    if (Object.hasOwn(object, field)) {
      throw new KvfenceError(
        'invalid_request',
        `${field} is an internal field set by the server and may not be sent by clients`,
        field,
      )
    }
  }
  for (const [field, value] of Object.entries(object)) {
    if (supported.includes(field) || ignoredFields.has(field)) continue
    if (Object.hasOwn(inert, field)) {
      if (inert[field].accepts(value)) continue
      throw new KvfenceError(
        'invalid_request',
        `${field} is not supported by this server (only its no-op value is accepted: ${inert[field].noOp})`,
        field,
      )
    }
    throw new KvfenceError(
      'invalid_request',
      `Unrecognized request argument supplied: ${field}`,
      field,
    )
  }
  return object
}

/** `value` parsed by `schema`; else a 400 `invalid_request` naming the first field at fault. */
export function parseWith<T extends z.ZodType>(schema: T, value: unknown): z.infer<T> {
  const parsed = schema.safeParse(value, { reportInput: true })
  if (parsed.success) return parsed.data
  // A field this server does not know says more than what else is wrong with the same message
  // (an assistant message with `tool_calls` usually has a null `content` too).
  const issue =
    parsed.error.issues.find((i) => i.code === 'unrecognized_keys') ?? parsed.error.issues[0]
  if (issue.code === 'unrecognized_keys') {
    const key = issue.keys[0]
    const param = `${paramOf(issue.path)}.${key}`
    throw new KvfenceError(
      'invalid_request',
      unsupportedMessageFields.has(key)
        ? `${param} is not supported by this server`
        : `Unrecognized request argument supplied: ${param}`,
      param,
    )
  }
  const param = paramOf(issue.path)
  const message =
    issue.code === 'invalid_type' && issue.input === undefined
      ? `${param} is required`
      : `Invalid value for '${param}': ${issue.message}`
  throw new KvfenceError('invalid_request', message, param === '' ? null : param)
}

/** OpenAI's spelling of a field path: `messages[0].content`. */
function paramOf(path: readonly PropertyKey[]): string {
  let param = ''
  for (const key of path) {
    param += typeof key === 'number' ? `[${key}]` : param === '' ? String(key) : `.${String(key)}`
  }
  return param
}
