/** Gateway mode's generation: an admitted request sent on to the engine, and the engine's answer
 *  relayed to the client, every body rebuilt in OpenAI's shape under the router's id and model
 *  name (engine-replies.ts). The engine never generates past what admission counted, its prefix
 *  cache is keyed by tenant, and the request is aborted on it when the client goes away (G8).
 *  Knows the engine's generation endpoints and SSE; knows nothing of keys, limits or admission. */
import { createHmac, randomBytes } from 'node:crypto'
import type http from 'node:http'
import { KvfenceError, toOpenAiError } from '../../common/errors.js'
import { type GenerationJob, markToken } from '../backend.js'
import { coalesceWrites, drained, sendJson } from '../api/http.js'
import { publicError } from '../api/public-errors.js'
import type { FinishReason } from '../api/responses.js'
import type { Endpoint } from '../api/schemas.js'
import { type EngineHttp, asObject, json, messageOf } from './engine-http.js'
import {
  isErrorEvent,
  openAiChunk,
  openAiError,
  openAiUsage,
  openAiWhole,
} from './engine-replies.js'
import type { Engine } from './engines.js'
import { enginePaths } from './self-check.js'

/** How a relayed request ended. */
interface RelayOutcome {
  status: number
  numCompletionTokens: number
  finishReason: FinishReason | null
  /** The completion text (kept for `--log-content` only). */
  text: string
}

/** What relaying needs to know of the engine. */
export interface RelayContext {
  http: EngineHttp
  engine: Engine
  backendModel: string
  /** The tenant's `cache_salt` (see {@link createCacheSalts}). */
  cacheSaltOf(tenant: string): string
  /** Whether the salt goes to the engine on `endpoint` (isolation.ts: not where the engine
   *  refuses it and the operator allowed the path unsalted). */
  isSalted(endpoint: Endpoint): boolean
}

const validFinishReasons = new Set(['stop', 'length', 'content_filter', 'tool_calls'])

/** Each tenant's `cache_salt`: HMAC-SHA-256 of its name under `secret` — the configured one
 *  (see ../tenants/salt-secret.ts: the same on every replica and across restarts), or, when null, one drawn
 *  here (stable for this process's life only). Different for every tenant (a tenant keeps its
 *  own cache hits), and not computable by anyone who can read the engine's requests or logs. */
export function createCacheSalts(secret: Uint8Array | null = null): (tenant: string) => string {
  const key = secret ?? randomBytes(32)
  const salts = new Map<string, string>()
  return (tenant) => {
    let salt = salts.get(tenant)
    if (salt === undefined) {
      salt = createHmac('sha256', key).update(tenant).digest('base64url')
      salts.set(tenant, salt)
    }
    return salt
  }
}

/** The `user` the engine sees for the tenant whose salt is `salt`: HMAC-SHA-256 of the client's
 *  under it, base64url (stable per tenant and user; another tenant's same name differs). */
export function scopedUser(salt: string, user: string): string {
  return `u-${createHmac('sha256', salt).update(user).digest('base64url')}`
}

/** Sends `job` to the engine and its answer to the client; fills `job.outcome` when the answer
 *  ends. Throws `request_aborted` when the client went away, `worker_unavailable` when the engine
 *  failed before any answer was sent. */
export async function relay(c: RelayContext, job: GenerationJob): Promise<void> {
  const path = enginePaths[job.parsed.endpoint]
  const onAbort = () => c.engine.abort(c.http, job.rid, job.log)
  job.signal.addEventListener('abort', onAbort, { once: true })
  let result: RelayOutcome
  try {
    const upstream = await c.http.open(path, engineBody(c, job), job.signal)
    if (upstream.statusCode !== 200 || !job.parsed.isStream) {
      const text = await c.http.readWhole(upstream)
      result = relayWhole(job, upstream.statusCode ?? 502, text)
    } else result = await relayStream(job, upstream)
  } catch (err) {
    if (job.signal.aborted) {
      // The router ended it (drain) when the signal's reason says so; otherwise the client left,
      // whatever the transport threw (an AbortError is not a server error: 499, not 500).
      const reason: unknown = job.signal.reason
      if (!(reason instanceof KvfenceError) || reason.code === 'request_aborted') {
        throw new KvfenceError('request_aborted', `request ${job.rid} was aborted by the client`)
      }
      // A started stream still ends with an error event.
      if (job.res.headersSent && !job.res.writableEnded) {
        job.res.end(`data: ${JSON.stringify(toOpenAiError(publicError(reason, job.rid)))}\n\n`)
      }
      throw reason
    }
    if (err instanceof KvfenceError) throw err
    throw new KvfenceError('worker_unavailable', `backend ${c.http.base}${path}: ${messageOf(err)}`)
  } finally {
    job.signal.removeEventListener('abort', onAbort)
  }
  job.outcome.status = result.status
  job.outcome.numCompletionTokens = result.numCompletionTokens
  job.outcome.finishReason = result.finishReason
  if (job.outcome.content) job.outcome.content.completion = result.text
}

/** The body sent to the engine: the client's, with the engine's model id, the tenant's cache
 *  salt, the admitted token limit and (where the engine aborts by id) the request id. */
function engineBody(c: RelayContext, job: GenerationJob): Record<string, unknown> {
  const body: Record<string, unknown> = { ...job.body, model: c.backendModel }
  // The engine's prefix cache is shared by every tenant unless a salt separates them: vLLM and
  // SGLang both key it by `cache_salt` (a client cannot send one: ../api/schemas.ts refuses it).
  if (c.isSalted(job.parsed.endpoint)) body.cache_salt = c.cacheSaltOf(job.tenant)
  // OpenAI's `user` names an end user of the tenant's: scoped to the tenant before the engine
  // sees it, so that two tenants' "bob" are two users there (nothing keyed by it can cross).
  if (typeof body.user === 'string') body.user = scopedUser(c.cacheSaltOf(job.tenant), body.user)
  if (job.parsed.endpoint === 'chat' && body.max_completion_tokens != null) {
    body.max_completion_tokens = job.maxTokens
  } else body.max_tokens = job.maxTokens
  c.engine.nameRequest(body, job.rid)
  return body
}

/** A whole (non-streamed, or error) reply, rebuilt. An engine's 4xx is passed on with its status;
 *  a 5xx or an unreadable answer is `worker_unavailable` (the engine's words go to the log, not
 *  to the tenant); an answer that ended in an abort is an error, never a normal finish
 *  (sglang#33507). */
function relayWhole(job: GenerationJob, status: number, text: string): RelayOutcome {
  const reply = asObject(json(text))
  if (status !== 200) {
    const error = openAiError(reply, status)
    if (status >= 400 && status < 500) {
      sendJson(job.res, status, { error })
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
      `backend reply for ${job.rid} has no valid finish_reason (${JSON.stringify(finish)})`,
    )
  }
  const usage = openAiUsage(reply.usage)
  const numCompletionTokens = usage?.completion_tokens ?? 0
  if (numCompletionTokens > 0) markToken(job.outcome)
  const message = asObject(choice.message)
  const answer = String(message?.content ?? choice.text ?? '')
  // The response sentinel reads the whole answer before it leaves (block mode throws here).
  job.answerCheck.push(answer)
  job.answerCheck.finish()
  sendJson(job.res, 200, openAiWhole(reply, job.parsed.endpoint, job.header))
  return {
    status: 200,
    numCompletionTokens,
    finishReason: finish as FinishReason,
    text: answer,
  }
}

/** An SSE reply, event by event, each rebuilt. An engine's error event or abort ends the stream
 *  with the router's own error event (no `[DONE]`), as a failure after the first token does
 *  natively; before any output the failure is a plain HTTP error instead. */
async function relayStream(
  job: GenerationJob,
  upstream: http.IncomingMessage,
): Promise<RelayOutcome> {
  const stream = createRelayedStream(job, upstream)
  upstream.setEncoding('utf8')
  let pending = ''
  for await (const chunk of upstream as AsyncIterable<string>) {
    pending += chunk
    let end: number
    while ((end = pending.indexOf('\n\n')) !== -1) {
      const event = pending.slice(0, end)
      pending = pending.slice(end + 2)
      let failure: string | null
      try {
        failure = await stream.relayEvent(event)
      } catch (err) {
        if (!(err instanceof KvfenceError && err.code === 'answer_withheld')) throw err
        return stream.withhold(err)
      }
      if (failure !== null) return stream.fail(failure)
    }
  }
  return stream.end()
}

/** The client's SSE response relayed from the engine's reply: headers at the first event, the text and finish
 *  reason seen so far. */
function createRelayedStream(job: GenerationJob, upstream: http.IncomingMessage) {
  const { res } = job
  const streamOptions = asObject(job.body.stream_options)
  const isUsageStreamed = streamOptions?.include_usage === true
  let isStarted = false
  let isDoneSent = false
  let numChunks = 0
  let text = ''
  let finishReason: FinishReason | null = null
  const start = () => {
    if (isStarted) return
    isStarted = true
    res.writeHead(200, {
      'content-type': 'text/event-stream; charset=utf-8',
      'cache-control': 'no-cache',
      'x-accel-buffering': 'no',
    })
    coalesceWrites(res)
  }
  /** Reads one event's choices; returns why the stream must fail, or null. */
  const readChoices = (value: Record<string, unknown>): string | null => {
    for (const choice of Array.isArray(value.choices) ? value.choices.map(asObject) : []) {
      const delta = asObject(choice?.delta)
      const piece = delta?.content ?? choice?.text
      let released = ''
      if (typeof piece === 'string' && piece !== '') {
        numChunks++
        markToken(job.outcome)
        text += piece
        // Block mode holds back what a suspect run may still take, or throws.
        released = job.answerCheck.push(piece)
      }
      const finish = choice?.finish_reason
      if (finish != null) released += job.answerCheck.finish()
      // The client gets the released text in this event's own field (the rest comes later).
      if (choice !== null && (released !== '' || typeof piece === 'string')) {
        if (delta !== null) delta.content = released
        else choice.text = released
      }
      if (finish != null) {
        // An engine-side abort is not a normal finish.
        if (!validFinishReasons.has(String(finish))) {
          return `backend finished with ${JSON.stringify(finish)}`
        }
        finishReason = finish as FinishReason
      }
    }
    return null
  }
  return {
    /** Relays one SSE event; returns why the stream must fail, or null. */
    async relayEvent(event: string): Promise<string | null> {
      const data = event.startsWith('data: ') ? event.slice(6) : null
      if (data === null) return null
      if (data.trim() === '[DONE]') {
        start()
        res.write('data: [DONE]\n\n')
        isDoneSent = true
        return null
      }
      const value = asObject(json(data))
      if (value === null) return null
      if (isErrorEvent(value)) {
        const { message, type } = openAiError(value, 500)
        return `backend error event (${type}): ${message}`
      }
      const failure = readChoices(value)
      if (failure !== null) return failure
      start()
      const out = openAiChunk(value, job.parsed.endpoint, job.header, isUsageStreamed)
      if (!res.write(`data: ${JSON.stringify(out)}\n\n`)) await drained(res)
      return null
    },
    /** Ends the stream with an error event in OpenAI's shape (kvfence's code); before any output
     *  throws `worker_unavailable` instead. */
    fail(detail: string): RelayOutcome {
      if (!isStarted) {
        upstream.destroy()
        throw new KvfenceError('worker_unavailable', `backend stream for ${job.rid}: ${detail}`)
      }
      job.log.warn({ detail }, 'backend stream failed')
      const error = new KvfenceError(
        'worker_unavailable',
        `The backend stopped the request (request ${job.rid}).`,
        null,
      )
      res.end(`data: ${JSON.stringify(toOpenAiError(error))}\n\n`)
      upstream.destroy()
      return { status: error.status, numCompletionTokens: numChunks, finishReason: null, text }
    },
    /** Ends the stream with the sentinel's error event (`answer_withheld`) and stops the engine's
     *  request; before any output throws the error instead (a plain HTTP error). */
    withhold(error: KvfenceError): RelayOutcome {
      upstream.destroy()
      if (!isStarted) throw error
      job.logFailure(error)
      res.end(`data: ${JSON.stringify(toOpenAiError(publicError(error, job.rid)))}\n\n`)
      return { status: error.status, numCompletionTokens: numChunks, finishReason: null, text }
    },
    /** Ends a stream the engine finished, always as OpenAI's end (`data: [DONE]`, which some
     *  engines omit: Hugging Face `transformers serve`); a stream that closed with neither a
     *  finish reason nor `[DONE]` was cut, and ends with an error event. Throws
     *  `worker_unavailable` when it sent nothing. */
    end(): RelayOutcome {
      if (!isStarted) throw new KvfenceError('worker_unavailable', 'backend stream was empty')
      if (!isDoneSent && finishReason === null) {
        return this.fail('the stream closed with neither a finish reason nor [DONE]')
      }
      res.end(isDoneSent ? undefined : 'data: [DONE]\n\n')
      return { status: 200, numCompletionTokens: numChunks, finishReason, text }
    },
  }
}
