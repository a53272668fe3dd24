/** Gateway mode's generation for endpoints that write their own bodies (the Responses API): the
 *  admitted request is sent to the engine as a streamed chat completion (its messages, the
 *  tenant's `cache_salt`, the admitted token limit, the router's request id), and the text of the
 *  engine's chunks goes, piece by piece, to the endpoint's writer. Chat is used whatever the
 *  engine: every engine kvfence fronts serves it, and its salt is what the isolation self-check
 *  verified (SGLang, vLLM and llama.cpp's own `/v1/responses` differ in what they accept and
 *  store, and would keep a conversation on the engine, outside the tenant's reach rules).
 *  Knows the engine's chat endpoint and SSE; knows nothing of keys, limits or the client's body. */
import type http from 'node:http'
import { KvfenceError } from '../../common/errors.js'
import { type AnswerEnd, type GenerationJob, type OnAnswerText, markToken } from '../backend.js'
import type { FinishReason } from '../api/responses.js'
import { asObject, json, messageOf } from './engine-http.js'
import { isErrorEvent, openAiError, openAiUsage } from './engine-replies.js'
import type { RelayContext } from './relay.js'
import { enginePaths } from './self-check.js'

/** Runs `job` (a chat request) on the engine, giving each piece of text to `onText`; resolves
 *  with how it ended. Throws `request_aborted` when the client went away, `invalid_request` for
 *  the engine's refusal (4xx, its message), `worker_unavailable` when the engine failed. */
export async function relayText(
  c: RelayContext,
  job: GenerationJob,
  onText: OnAnswerText,
): Promise<AnswerEnd> {
  const path = enginePaths.chat
  const onAbort = () => c.engine.abort(c.http, job.rid, job.log)
  job.signal.addEventListener('abort', onAbort, { once: true })
  let upstream: http.IncomingMessage | null = null
  try {
    upstream = await c.http.open(path, engineChatBody(c, job), job.signal)
    if (upstream.statusCode !== 200) {
      throw refusal(upstream.statusCode ?? 502, await c.http.readWhole(upstream))
    }
    return await readStream(job, upstream, onText)
  } catch (err) {
    if (job.signal.aborted) {
      throw new KvfenceError('request_aborted', `request ${job.rid} was aborted by the client`)
    }
    if (err instanceof KvfenceError) throw err
    throw new KvfenceError('worker_unavailable', `backend ${c.http.base}${path}: ${messageOf(err)}`)
  } finally {
    job.signal.removeEventListener('abort', onAbort)
    upstream?.destroy()
  }
}

/** The chat body the engine runs: the request's messages and sampling, streamed with usage. */
function engineChatBody(c: RelayContext, job: GenerationJob): Record<string, unknown> {
  const { parsed } = job
  if (parsed.endpoint !== 'chat') throw new KvfenceError('internal_error', 'not a chat request')
  const body: Record<string, unknown> = {
    model: c.backendModel,
    messages: parsed.messages.map((m) => ({ role: m.role, content: m.content })),
    max_tokens: job.maxTokens,
    temperature: parsed.sampling.temperature,
    top_p: parsed.sampling.topP,
    stream: true,
    stream_options: { include_usage: true },
  }
  if (c.isSalted('chat')) body.cache_salt = c.cacheSaltOf(job.tenant)
  c.engine.nameRequest(body, job.rid)
  return body
}

/** The engine's refusal: a 4xx is the client's (`invalid_request` with the engine's message, as
 *  chat passes it on); anything else `worker_unavailable` (its words go to the log only). */
function refusal(status: number, text: string): KvfenceError {
  const error = openAiError(asObject(json(text)), status)
  if (status >= 400 && status < 500) {
    return new KvfenceError('invalid_request', error.message, error.param)
  }
  return new KvfenceError('worker_unavailable', `backend answered HTTP ${status}: ${error.message}`)
}

const finishReasons = new Map<unknown, FinishReason>([
  ['stop', 'stop'],
  ['length', 'length'],
  ['content_filter', 'content_filter'],
])

/** Reads the engine's SSE chunks to the end; the text of each goes to `onText`. */
async function readStream(
  job: GenerationJob,
  upstream: http.IncomingMessage,
  onText: OnAnswerText,
): Promise<AnswerEnd> {
  upstream.setEncoding('utf8')
  let pending = ''
  let numChunks = 0
  let finishReason: FinishReason | null = null
  let usage: ReturnType<typeof openAiUsage> = null
  for await (const chunk of upstream as AsyncIterable<string>) {
    pending += chunk.replaceAll('\r\n', '\n')
    let end: number
    while ((end = pending.indexOf('\n\n')) !== -1) {
      const event = pending.slice(0, end)
      pending = pending.slice(end + 2)
      const data = event.startsWith('data:') ? event.slice(5).trim() : null
      if (data === null || data === '[DONE]') continue
      const value = asObject(json(data))
      if (value === null) continue
      if (isErrorEvent(value)) {
        const { message, type } = openAiError(value, 500)
        throw new KvfenceError('worker_unavailable', `backend error event (${type}): ${message}`)
      }
      usage = openAiUsage(value.usage) ?? usage
      const choice = Array.isArray(value.choices) ? asObject(value.choices[0]) : null
      const piece = asObject(choice?.delta)?.content
      if (typeof piece === 'string' && piece !== '') {
        numChunks++
        markToken(job.outcome)
        if (job.outcome.content) job.outcome.content.completion += piece
        await onText(piece)
      }
      const finish = choice?.finish_reason
      if (finish != null) {
        finishReason = finishReasons.get(finish) ?? null
        // An engine-side abort (or a tool call this route never asks for) is not a normal end.
        if (finishReason === null) {
          throw new KvfenceError(
            'worker_unavailable',
            `backend finished with ${JSON.stringify(finish)}`,
          )
        }
      }
    }
  }
  if (finishReason === null) {
    throw new KvfenceError('worker_unavailable', 'the backend stream closed with no finish reason')
  }
  return {
    finishReason,
    numCompletionTokens: usage?.completion_tokens ?? numChunks,
    cachedTokens: usage?.prompt_tokens_details?.cached_tokens ?? 0,
  }
}
