/** `POST /v1/responses` bodies (OpenAI's `CreateResponse`), parsed once at the boundary, and the
 *  chat request a parsed body becomes: the Responses API runs as chat through the model's chat
 *  template, on either backend.
 *  Knows the Responses request fields; knows nothing of tenants, stores or backends. */
import { z } from 'zod'
import { KvfenceError } from '../../common/errors.js'
import type { ChatMessage } from '../../model/tokenizer.js'
import type { InputMessage } from './input-items.js'
import {
  type InertField,
  type ParsedChatRequest,
  checkFields,
  maxChatContentParts,
  maxChatMessages,
  parseWith,
} from '../api/schemas.js'

/** A parsed `POST /v1/responses` body. */
export interface ParsedResponsesRequest {
  model: string
  /** `instructions`: a system message before everything else, for this response only (a
   *  continued response does not inherit its predecessor's, as OpenAI's do not). */
  instructions: string | null
  /** This turn's input as chat messages (a string input is one user message). */
  input: ChatMessage[]
  /** True when `input` was given as one string (then errors name `input`, not an item). */
  inputIsText: boolean
  /** The same input as the request gave it, parts apart (what `input_items` lists). */
  inputMessages: InputMessage[]
  /** `max_output_tokens`; null = the rest of the window. */
  maxOutputTokens: number | null
  temperature: number
  topP: number
  previousResponseId: string | null
  /** `store` (default true, as OpenAI's). */
  store: boolean
  isStream: boolean
  /** `metadata`, echoed in the response. */
  metadata: Record<string, string>
}

/** One text part of an input message: `input_text`, or `output_text` in an assistant message
 *  given back from an earlier response's `output`. */
const TextPart = z.object({
  type: z.enum(['input_text', 'output_text']),
  text: z.string(),
  annotations: z.array(z.unknown()).max(0).optional(),
  logprobs: z.array(z.unknown()).optional(),
})

/** A message item (`EasyInputMessage`, `InputMessage` or an `OutputMessage` given back). */
const MessageItem = z.strictObject({
  type: z.literal('message').optional(),
  role: z.enum(['user', 'assistant', 'system', 'developer']),
  content: z.union([z.string(), z.array(TextPart).min(1)], {
    error: 'content must be a string or a non-empty list of input_text parts',
  }),
  id: z.string().optional(),
  status: z.enum(['in_progress', 'completed', 'incomplete']).optional(),
})

const safeInt = z.number().int().min(1).max(Number.MAX_SAFE_INTEGER)

const CreateResponseBody = z.object({
  model: z.string().min(1),
  input: z.union([z.string(), z.array(MessageItem).min(1).max(maxChatMessages)], {
    error: 'input must be a string or a non-empty list of message items',
  }),
  instructions: z.string().nullish(),
  max_output_tokens: safeInt.nullish(),
  temperature: z.number().min(0).max(2).nullish(),
  top_p: z.number().gt(0).max(1).nullish(),
  previous_response_id: z.string().nullish(),
  store: z.boolean().nullish(),
  stream: z.boolean().nullish(),
  metadata: z.record(z.string().max(64), z.string().max(512)).nullish(),
  user: z.string().nullish(),
})

const isNullish = (v: unknown) => v === null || v === undefined
const isEmpty = (v: unknown) => isNullish(v) || (Array.isArray(v) && v.length === 0)

/** Features of `CreateResponse` this server does not implement: accepted at their no-op value. */
const inertFields: Record<string, InertField> = {
  tools: { accepts: isEmpty, noOp: 'an empty list' },
  tool_choice: {
    accepts: (v) => isNullish(v) || v === 'none' || v === 'auto',
    noOp: '"none" or "auto"',
  },
  include: { accepts: isEmpty, noOp: 'an empty list' },
  truncation: { accepts: (v) => isNullish(v) || v === 'disabled', noOp: '"disabled"' },
  background: { accepts: (v) => isNullish(v) || v === false, noOp: 'false' },
  reasoning: { accepts: isNullish, noOp: 'null' },
  conversation: { accepts: isNullish, noOp: 'null' },
  top_logprobs: { accepts: (v) => isNullish(v) || v === 0, noOp: '0' },
  text: {
    accepts: (v) => {
      const format = (v as { format?: { type?: unknown } } | null | undefined)?.format
      return isNullish(v) || isNullish(format) || format?.type === 'text'
    },
    noOp: '{ "format": { "type": "text" } }',
  },
}

/** Parses a `POST /v1/responses` body; throws `invalid_request` naming the field at fault. */
export function parseResponsesRequest(body: unknown): ParsedResponsesRequest {
  const object = checkFields(body, Object.keys(CreateResponseBody.shape), inertFields)
  checkInputSize(object.input)
  const data = parseWith(CreateResponseBody, object)
  const inputMessages: InputMessage[] =
    typeof data.input === 'string'
      ? [{ role: 'user', parts: [{ type: 'input_text', text: data.input }] }]
      : data.input.map((m) => ({
          role: m.role,
          parts:
            typeof m.content === 'string'
              ? [{ type: m.role === 'assistant' ? 'output_text' : 'input_text', text: m.content }]
              : m.content.map((p) => ({ type: p.type, text: p.text })),
        }))
  return {
    model: data.model,
    instructions: data.instructions ?? null,
    input: inputMessages.map((m) => ({
      role: m.role,
      content: m.parts.map((p) => p.text).join(''),
    })),
    inputIsText: typeof data.input === 'string',
    inputMessages,
    maxOutputTokens: data.max_output_tokens ?? null,
    temperature: data.temperature ?? 1,
    topP: data.top_p ?? 1,
    previousResponseId: data.previous_response_id ?? null,
    store: data.store ?? true,
    isStream: data.stream ?? false,
    metadata: data.metadata ?? {},
  }
}

/** Refuses more than {@link maxChatContentParts} text parts over all input items before the
 *  schema walks them (as chat's messages are counted: a body of tiny parts would hold the event
 *  loop). */
function checkInputSize(input: unknown): void {
  if (!Array.isArray(input)) return
  let numParts = 0
  for (let i = 0; i < input.length; i++) {
    const content = (input[i] as { content?: unknown } | null)?.content
    if (Array.isArray(content)) numParts += content.length
    if (numParts <= maxChatContentParts && Array.isArray(content)) checkPartTypes(content, i)
    if (numParts > maxChatContentParts) {
      throw new KvfenceError(
        'invalid_request',
        `Invalid 'input[${i}].content': the input holds more than ${maxChatContentParts} text parts in all`,
        `input[${i}].content`,
      )
    }
  }
}

/** Refuses a part of a kind this text-only server cannot take (`input_image`, `input_file`,
 *  `input_audio`), naming the part and its kind: the schema's union would otherwise answer only
 *  that `input` is not a list of message items. */
function checkPartTypes(content: readonly unknown[], i: number): void {
  for (const [j, part] of content.entries()) {
    const type = (part as { type?: unknown } | null)?.type
    if (typeof type !== 'string' || type === 'input_text' || type === 'output_text') continue
    throw new KvfenceError(
      'invalid_request',
      `input[${i}].content[${j}] is an ${JSON.stringify(type)} part: this server's model takes text only (input_text parts)`,
      `input[${i}].content[${j}].type`,
    )
  }
}

/** The chat request a Responses request runs as: `instructions` (a system message), then the
 *  stored conversation it continues (`history`), then this turn's input. */
export function chatRequestOf(
  parsed: ParsedResponsesRequest,
  history: readonly ChatMessage[],
): ParsedChatRequest {
  const instructions: ChatMessage[] =
    parsed.instructions === null ? [] : [{ role: 'system', content: parsed.instructions }]
  return {
    endpoint: 'chat',
    model: parsed.model,
    maxTokens: parsed.maxOutputTokens,
    maxTokensParam: 'max_output_tokens',
    sampling: {
      temperature: parsed.temperature,
      topP: parsed.topP,
      topK: null,
      minP: 0,
      presencePenalty: 0,
      frequencyPenalty: 0,
      seed: null,
      numLogprobs: null,
    },
    stop: [],
    stopTokenIds: [],
    ignoreEos: false,
    isStream: parsed.isStream,
    isUsageStreamed: false,
    messages: [...instructions, ...history, ...parsed.input],
    promptParam: 'input',
    messageParams: [
      ...instructions.map(() => 'instructions'),
      ...history.map(() => 'previous_response_id'),
      ...parsed.input.map((_, i) => (parsed.inputIsText ? 'input' : `input[${i}].content`)),
    ],
  }
}
