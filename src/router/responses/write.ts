/** The answer to a Responses request on the client's response, from the text either backend
 *  generates: one `Response` body, or a stream of `ResponseStreamEvent`s (`event:` and `data:`
 *  lines, numbered by `sequence_number`, ending after `response.completed` as OpenAI's streams
 *  do, with no `[DONE]`). Every piece passes the response sentinel before the client sees it.
 *  A finished response is handed to `onFinished` (which stores it).
 *  Knows the Responses bodies and SSE; knows nothing of workers, engines or tenants' keys. */
import type { ServerResponse } from 'node:http'
import type { AnswerEnd, AnswerGeneration, AnswerWriter, GenerationJob } from '../backend.js'
import { coalesceWrites, drained, sendJson } from '../api/http.js'
import { endingError, publicError } from '../api/public-errors.js'
import { startSse } from '../api/responses.js'
import {
  type ResponseShape,
  closingEvents,
  deltaEvent,
  openingEvents,
  responseObject,
  responseUsage,
} from './render.js'

/** A finished response and its text, for the store. */
export type OnFinished = (response: ReturnType<typeof responseObject>, text: string) => void

/** The writer of one Responses request. */
export function responsesWriter(shape: ResponseShape, onFinished: OnFinished): AnswerWriter {
  return {
    write: (job, generate) =>
      job.parsed.isStream
        ? writeStream(job, shape, generate, onFinished)
        : writeWhole(job, shape, generate, onFinished),
  }
}

/** The final Response of a generation that ended as `end`, with `text`. */
function finalResponse(job: GenerationJob, shape: ResponseShape, end: AnswerEnd, text: string) {
  job.outcome.numCompletionTokens = end.numCompletionTokens
  job.outcome.finishReason = end.finishReason
  const usage = responseUsage(
    job.outcome.numPromptTokens,
    end.numCompletionTokens,
    end.cachedTokens,
  )
  return responseObject(shape, { reason: end.finishReason, text, usage })
}

async function writeWhole(
  job: GenerationJob,
  shape: ResponseShape,
  generate: AnswerGeneration,
  onFinished: OnFinished,
): Promise<void> {
  let text = ''
  // The sentinel sees every piece; in block mode it throws before the body is sent.
  const end = await generate((piece, tokenIds) => {
    text += job.answerCheck.push(piece, tokenIds)
    return undefined
  })
  text += job.answerCheck.finish()
  const response = finalResponse(job, shape, end, text)
  onFinished(response, text)
  sendJson(job.res, 200, response)
}

/** SSE. Headers go out with the first text, so that a refusal before any output is still a
 *  plain HTTP error; a failure after it is an `error` event, then the end of the stream. */
async function writeStream(
  job: GenerationJob,
  shape: ResponseShape,
  generate: AnswerGeneration,
  onFinished: OnFinished,
): Promise<void> {
  const { res } = job
  const events = eventWriter(res)
  let isStarted = false
  let text = ''
  const start = (): Promise<void> | undefined => {
    if (isStarted) return undefined
    isStarted = true
    startSse(res, {}, true)
    coalesceWrites(res)
    return events.writeAll(openingEvents(shape))
  }
  const send = (piece: string): Promise<void> | undefined => {
    if (piece === '') return undefined
    text += piece
    const opening = start()
    const write = () => events.write(deltaEvent(shape, piece))
    return opening === undefined ? write() : opening.then(write)
  }
  try {
    const end = await generate((piece, tokenIds) => send(job.answerCheck.push(piece, tokenIds)))
    await send(job.answerCheck.finish())
    const response = finalResponse(job, shape, end, text)
    await start()
    await events.writeAll(closingEvents(shape, text, response))
    onFinished(response, text)
    res.end()
  } catch (err) {
    if (!isStarted) throw err
    const error = publicError(endingError(err, job.signal), job.rid)
    job.outcome.status = error.status
    job.logFailure(error)
    if (!res.destroyed && !res.writableEnded) {
      void events.write({
        type: 'error',
        code: error.code,
        message: error.message,
        param: error.param,
      })
      res.end()
    }
  }
}

/** Writes events with their `sequence_number`, as `event: TYPE` and `data: JSON`. Each write
 *  returns a promise only when the socket is full. */
function eventWriter(res: ServerResponse) {
  let sequenceNumber = 0
  const write = (event: Record<string, unknown>): Promise<void> | undefined => {
    const line = `event: ${String(event.type)}\ndata: ${JSON.stringify({ ...event, sequence_number: sequenceNumber++ })}\n\n`
    if (res.destroyed || res.writableEnded || res.write(line)) return undefined
    return drained(res)
  }
  return {
    write,
    async writeAll(list: Record<string, unknown>[]): Promise<void> {
      for (const event of list) await write(event)
    },
  }
}
