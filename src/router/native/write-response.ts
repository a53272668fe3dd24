/** The answer to a natively generated request, on the client's response: one JSON body, or SSE.
 *  Knows the response and the OpenAI bodies (through response-bodies.ts); knows nothing of workers. */
import { toOpenAiError } from '../../common/errors.js'
import type { GenerationJob } from '../backend.js'
import { coalesceWrites, sendJson } from '../api/http.js'
import type { GeneratedLogprobs } from '../api/logprobs.js'
import { endingError, publicError } from '../api/public-errors.js'
import {
  endSse,
  sseEvent,
  sseTemplate,
  startSse,
  usageOf,
  writeSse,
  writeSseText,
} from '../api/responses.js'
import type { GenerationResult, OnText } from './worker-run.js'
import type { ResponseBodies } from './response-bodies.js'

/** Runs a generation, giving each piece of text to `onText`, as {@link runGeneration} does. */
export type Generate = (onText: OnText) => Promise<GenerationResult>

/** One JSON body once the generation has ended. */
export async function writeWholeResponse(
  job: GenerationJob,
  bodies: ResponseBodies,
  generate: Generate,
): Promise<void> {
  let text = ''
  const logprobs: GeneratedLogprobs[] = []
  // The sentinel sees every piece; in block mode it throws before the body is sent.
  const result = await generate((piece, pieceLogprobs, tokenIds) => {
    text += job.answerCheck.push(piece, tokenIds)
    logprobs.push(...pieceLogprobs)
    return undefined
  })
  text += job.answerCheck.finish()
  logprobs.push(...result.logprobs)
  const usage = usageOf(
    job.outcome.numPromptTokens,
    result.numCompletionTokens,
    result.cachedTokens,
  )
  job.outcome.numCompletionTokens = result.numCompletionTokens
  job.outcome.finishReason = result.finishReason
  sendJson(job.res, 200, bodies.whole(text, result.finishReason, usage, logprobs))
}

/** SSE. Headers go out with the first text, so that a refusal before any output (capacity,
 *  a failed prefill) is still a plain HTTP error; a failure after it is an in-stream error
 *  event followed by the end of the stream, never a normal finish. */
export async function writeStreamedResponse(
  job: GenerationJob,
  bodies: ResponseBodies,
  generate: Generate,
): Promise<void> {
  const { res } = job
  let isStarted = false
  // Each step below returns a promise only when the client's socket is full (see OnText).
  const start = (): Promise<void> | undefined => {
    if (isStarted) return undefined
    isStarted = true
    // Called with the first text in hand: the headers leave with it, in the same socket write
    // as every other event of this event-loop turn.
    startSse(res, {}, true)
    coalesceWrites(res)
    const opening = bodies.opening()
    return opening === null ? undefined : writeSse(res, opening)
  }
  // Without log-probabilities every piece's chunk is the same but for its text: serialized once.
  const pieceEvent =
    job.parsed.sampling.numLogprobs == null ? sseTemplate((text) => bodies.piece(text, [])) : null
  // The sentinel releases text (all of it, but in block mode what a suspect run may still
  // take); log-probabilities wait with their text.
  let heldLogprobs: GeneratedLogprobs[] = []
  const writePiece = (piece: string): Promise<void> | undefined => {
    const event =
      pieceEvent !== null ? pieceEvent(piece) : sseEvent(bodies.piece(piece, heldLogprobs))
    heldLogprobs = []
    return writeSseText(res, event)
  }
  const send = (piece: string, logprobs: GeneratedLogprobs[]): Promise<void> | undefined => {
    heldLogprobs = heldLogprobs.length === 0 ? logprobs : [...heldLogprobs, ...logprobs]
    if (piece === '') return undefined
    const opening = start()
    return opening === undefined ? writePiece(piece) : opening.then(() => writePiece(piece))
  }
  try {
    const result = await generate((piece, logprobs, tokenIds) =>
      send(job.answerCheck.push(piece, tokenIds), logprobs),
    )
    await send(job.answerCheck.finish(), [])
    job.outcome.numCompletionTokens = result.numCompletionTokens
    job.outcome.finishReason = result.finishReason
    await start()
    await writeSse(res, bodies.last(result.finishReason, [...heldLogprobs, ...result.logprobs]))
    if (job.parsed.isUsageStreamed) {
      const { numPromptTokens } = job.outcome
      await writeSse(
        res,
        bodies.usage(usageOf(numPromptTokens, result.numCompletionTokens, result.cachedTokens)),
      )
    }
    endSse(res)
  } catch (err) {
    if (!isStarted) throw err
    const error = endingError(err, job.signal)
    job.outcome.status = error.status
    job.logFailure(error)
    if (!res.destroyed && !res.writableEnded) {
      res.end(`data: ${JSON.stringify(toOpenAiError(publicError(error, job.rid)))}\n\n`)
    }
  }
}
