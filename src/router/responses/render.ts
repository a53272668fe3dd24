/** The Responses API's bodies (OpenAI's `Response`, its `OutputMessage` and the
 *  `ResponseStreamEvent`s of a stream), built from plain values. One output item: the assistant's
 *  message with one `output_text` part.
 *  Knows the Responses shapes; knows nothing of HTTP, tenants or backends. */
import type { FinishReason } from '../api/responses.js'

/** What every body of one response shares. */
export interface ResponseShape {
  /** `resp_…`. */
  id: string
  /** `msg_…`: the id of the output message. */
  messageId: string
  /** Unix seconds. */
  createdAt: number
  model: string
  instructions: string | null
  maxOutputTokens: number | null
  previousResponseId: string | null
  store: boolean
  temperature: number
  topP: number
  metadata: Record<string, string>
}

/** OpenAI's `ResponseUsage`. */
export interface ResponseUsage {
  input_tokens: number
  input_tokens_details: { cached_tokens: number; cache_write_tokens: number }
  output_tokens: number
  output_tokens_details: { reasoning_tokens: number }
  total_tokens: number
}

/** `ResponseUsage` of the given counts. */
export function responseUsage(
  numInputTokens: number,
  numOutputTokens: number,
  numCachedTokens: number,
): ResponseUsage {
  return {
    input_tokens: numInputTokens,
    input_tokens_details: { cached_tokens: numCachedTokens, cache_write_tokens: 0 },
    output_tokens: numOutputTokens,
    output_tokens_details: { reasoning_tokens: 0 },
    total_tokens: numInputTokens + numOutputTokens,
  }
}

/** The status a finish reason gives a response: `completed` at the end of the answer, else
 *  `incomplete` with OpenAI's reason. */
export function statusOf(finish: FinishReason): {
  status: 'completed' | 'incomplete'
  incompleteReason: 'max_output_tokens' | 'content_filter' | null
} {
  if (finish === 'length') return { status: 'incomplete', incompleteReason: 'max_output_tokens' }
  if (finish === 'content_filter')
    return { status: 'incomplete', incompleteReason: 'content_filter' }
  return { status: 'completed', incompleteReason: null }
}

/** The output message: `text` so far and the item's status. */
export function outputMessage(
  s: ResponseShape,
  text: string | null,
  status: 'in_progress' | 'completed' | 'incomplete',
) {
  return {
    id: s.messageId,
    type: 'message' as const,
    status,
    role: 'assistant' as const,
    content: text === null ? [] : [outputText(text)],
  }
}

/** One `output_text` part. */
export function outputText(text: string) {
  return { type: 'output_text' as const, text, annotations: [], logprobs: [] }
}

/** A `Response` object. `finish` null while in progress (no output yet, no usage). */
export function responseObject(
  s: ResponseShape,
  finish: { reason: FinishReason; text: string; usage: ResponseUsage } | null,
) {
  const done = finish === null ? null : statusOf(finish.reason)
  return {
    id: s.id,
    object: 'response' as const,
    created_at: s.createdAt,
    status: done?.status ?? ('in_progress' as const),
    completed_at: done?.status === 'completed' ? Math.floor(Date.now() / 1000) : null,
    error: null,
    incomplete_details: done?.incompleteReason == null ? null : { reason: done.incompleteReason },
    instructions: s.instructions,
    max_output_tokens: s.maxOutputTokens,
    model: s.model,
    output: finish === null || done === null ? [] : [outputMessage(s, finish.text, done.status)],
    parallel_tool_calls: true,
    previous_response_id: s.previousResponseId,
    reasoning: { effort: null, summary: null },
    store: s.store,
    temperature: s.temperature,
    text: { format: { type: 'text' as const } },
    tool_choice: 'auto' as const,
    tools: [],
    top_p: s.topP,
    truncation: 'disabled' as const,
    // Absent, not null, until there is one: the spec's `usage` (and `user`) are not nullable.
    ...(finish === null ? {} : { usage: finish.usage }),
    metadata: s.metadata,
  }
}

/** The events that open a stream, before the first text: the response created and in
 *  progress, its message item and text part added. */
export function openingEvents(s: ResponseShape): Record<string, unknown>[] {
  const inProgress = responseObject(s, null)
  const where = { item_id: s.messageId, output_index: 0, content_index: 0 }
  return [
    { type: 'response.created', response: inProgress },
    { type: 'response.in_progress', response: inProgress },
    {
      type: 'response.output_item.added',
      output_index: 0,
      item: outputMessage(s, null, 'in_progress'),
    },
    { type: 'response.content_part.added', ...where, part: outputText('') },
  ]
}

/** The event carrying a piece of text. */
export function deltaEvent(s: ResponseShape, delta: string): Record<string, unknown> {
  return {
    type: 'response.output_text.delta',
    item_id: s.messageId,
    output_index: 0,
    content_index: 0,
    delta,
    logprobs: [],
  }
}

/** The events that close a stream: the text, part and item done, then the response completed
 *  (or incomplete). `response` is the final Response object. */
export function closingEvents(
  s: ResponseShape,
  text: string,
  response: ReturnType<typeof responseObject>,
): Record<string, unknown>[] {
  const where = { item_id: s.messageId, output_index: 0, content_index: 0 }
  const itemStatus = response.status === 'completed' ? 'completed' : 'incomplete'
  return [
    { type: 'response.output_text.done', ...where, text, logprobs: [] },
    { type: 'response.content_part.done', ...where, part: outputText(text) },
    {
      type: 'response.output_item.done',
      output_index: 0,
      item: outputMessage(s, text, itemStatus),
    },
    {
      type: response.status === 'completed' ? 'response.completed' : 'response.incomplete',
      response,
    },
  ]
}

/** `DELETE /v1/responses/{id}`'s body (as OpenAI's). */
export function deletedBody(id: string) {
  return { id, object: 'response' as const, deleted: true as const }
}
