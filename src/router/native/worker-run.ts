/** A request on kvfence's workers, as text: the workers' token events (a request refused for a
 *  momentarily full KV pool tried again until the queue's wait runs out, G2), detokenized into
 *  pieces of text that end before any stop string, with the tokens' log-probabilities.
 *  Knows the worker client's events, the tokenizer and stop strings; knows nothing of HTTP. */
import type { Logger } from 'pino'
import type { GenerateRequest } from '../../control/messages.js'
import { KvfenceError } from '../../common/errors.js'
import { randomHex } from '../../common/random-hex.js'
import type { Tokenizer } from '../../model/tokenizer.js'
import { type Outcome, markToken } from '../backend.js'
import { LimitError } from '../admission/limit-error.js'
import { type Limiter } from '../admission/limits.js'
import { type RoomTurn } from '../admission/queue-limits.js'
import type { GeneratedLogprobs } from '../api/logprobs.js'
import type { RouterMetrics } from '../metrics/metrics.js'
import type { FinishReason } from '../api/responses.js'
import { TextStream } from '../tokenize/text-stream.js'
import {
  type GenerationEvent,
  PoolFullError,
  type WorkerClient,
} from '../../control/worker-client.js'

/** What running a request on the workers needs. */
export interface WorkerRunDeps {
  tokenizer: Tokenizer
  workers: WorkerClient
  /** For waiting on a full KV pool: in arrival order, within the request's one wait bound. */
  limiter: Pick<Limiter, 'maxQueueWaitMs' | 'waitForRoom'>
  metrics: RouterMetrics
}

/** One request on the workers. */
export interface WorkerRun {
  request: GenerateRequest
  /** Stop strings: the text ends before the first one found. */
  stop: readonly string[]
  signal: AbortSignal
  log: Logger
  /** Filled as tokens arrive: times, the completion's token count and (with `logContent`) text. */
  outcome: Outcome
}

/** How a generation ended. `logprobs` are those of tokens after the last piece of text. */
export interface GenerationResult {
  finishReason: FinishReason
  numCompletionTokens: number
  cachedTokens: number
  logprobs: GeneratedLogprobs[]
}

/** Hears each piece of an answer's text, with the log-probabilities (when asked for; else none)
 *  and the ids of the tokens received since the previous piece. Returns a promise only when the
 *  next piece must wait for it (the client's socket is full), else undefined: most pieces go
 *  out without a turn of the microtask queue. */
export type OnText = (
  text: string,
  logprobs: GeneratedLogprobs[],
  tokenIds: readonly number[],
) => Promise<void> | undefined

/** Runs the request on the workers, feeding every piece of new text to `onText` — and, at the
 *  end, the ids of tokens that added no text (an empty piece), so that every token is heard.
 *  Leaving early (a stop string) closes both worker requests. */
export async function runGeneration(
  deps: WorkerRunDeps,
  run: WorkerRun,
  onText: OnText,
): Promise<GenerationResult> {
  const text = new TextStream((ids) => deps.tokenizer.decode(ids), run.stop)
  const isLogprobs = run.request.sampling.numLogprobs != null
  let pending: GeneratedLogprobs[] = []
  let pendingIds: number[] = []
  const emit = (piece: string): Promise<void> | undefined => {
    if (run.outcome.content) run.outcome.content.completion += piece
    const logprobs = pending
    const ids = pendingIds
    pending = []
    pendingIds = []
    return onText(piece, logprobs, ids)
  }
  const started = await startWorkerEvents(deps, run)
  if (started === null) {
    throw new KvfenceError('internal_error', `request ${run.request.requestId} ended without done`)
  }
  const { first, events } = started
  // The events' one consumer, without a generator between it and the workers' events: a leave
  // (a stop string, an error) closes both worker requests (G8), even at the first event.
  try {
    for (let next = first; !next.done; next = await events.next()) {
      const event = next.value
      if (event.type === 'token') {
        markToken(run.outcome)
        if (isLogprobs) pending.push(logprobsOf(event, run.request.requestId, text.numTokens))
        const step = text.push(event.tokenId)
        pendingIds.push(event.tokenId)
        run.outcome.numCompletionTokens = text.numTokens
        if (step.text !== '' || (step.isStopped && pendingIds.length > 0)) {
          const wait = emit(step.text)
          if (wait !== undefined) await wait
        }
        if (step.isStopped) {
          return {
            finishReason: 'stop',
            numCompletionTokens: text.numTokens,
            cachedTokens: 0,
            logprobs: pending,
          }
        }
      } else {
        const rest = text.finish()
        if (rest.text !== '' || pendingIds.length > 0) await emit(rest.text)
        deps.metrics.transfers.inc({ status: 'ok' })
        deps.metrics.transferPages.inc(event.numTransferredPages)
        return {
          finishReason: event.finishReason,
          numCompletionTokens: event.completionTokens,
          cachedTokens: event.cachedTokens ?? 0,
          logprobs: pending,
        }
      }
    }
  } finally {
    await events.return()
  }
  throw new KvfenceError('internal_error', `request ${run.request.requestId} ended without done`)
}

/** A token event's log-probabilities; `internal_error` when the worker sent none. */
function logprobsOf(
  event: Extract<GenerationEvent, { type: 'token' }>,
  requestId: string,
  index: number,
): GeneratedLogprobs {
  if (event.logprobs === undefined) {
    throw new KvfenceError(
      'internal_error',
      `request ${requestId}: a worker sent token ${index} without log-probabilities`,
    )
  }
  return { tokenId: event.tokenId, logprobs: event.logprobs }
}

/** The workers' first event for a request, and the rest to come. */
interface StartedEvents {
  first: IteratorResult<GenerationEvent, void>
  events: AsyncGenerator<GenerationEvent, void>
}

/** Starts the request on the workers: its first event and the rest. A request refused because a KV pool (decode or prefill)
 *  is momentarily full, before any token, is tried again when its turn for room comes (in
 *  arrival order, as running requests end: the limiter's `waitForRoom`), until its wait in all
 *  (queue and pool) reaches `maxQueueWaitMs`; then 503 with `Retry-After` (G2). Each retry goes
 *  out under a fresh request id and transfer secret: the previous attempt's decode request was
 *  closed before the refusal surfaced, but the decode worker may not have seen that close yet,
 *  and must never match a transfer to a reservation of another attempt. */
async function startWorkerEvents(
  deps: WorkerRunDeps,
  run: WorkerRun,
): Promise<StartedEvents | null> {
  const { limiter, metrics } = deps
  let waitedMs = 0 // in turns for room, the tries not counted
  for (let attempt = 0; ; attempt++) {
    let turn: RoomTurn
    const waitStartMs = performance.now()
    try {
      turn = await limiter.waitForRoom(run.signal, attempt > 0)
    } catch (err) {
      if (err instanceof LimitError) metrics.admissionRejections.inc({ reason: 'pool_full' })
      throw err
    }
    waitedMs += performance.now() - waitStartMs
    if (attempt > 0) metrics.poolFullRetries.inc()
    const request = attempt === 0 ? run.request : freshAttempt(run.request)
    if (attempt > 0) run.log.debug({ attempt, workerRid: request.requestId }, 'retrying')
    const events = deps.workers.generate(request, run.signal)
    let first: IteratorResult<GenerationEvent, void>
    try {
      first = await events.next()
    } catch (err) {
      const isPoolFull = err instanceof PoolFullError
      turn.end(isPoolFull)
      if (!isPoolFull) throw err
      run.log.debug({ detail: err.message }, 'KV pool full; waiting for room')
      continue
    }
    turn.end(false)
    metrics.poolWaitSeconds.observe({ tenant: run.request.tenant }, waitedMs / 1000)
    return first.done ? null : { first, events }
  }
}

/** `request` under a fresh request id and transfer secret, for a retry. */
function freshAttempt(request: GenerateRequest): GenerateRequest {
  return {
    ...request,
    requestId: randomHex(16),
    transferSecret: randomHex(32),
  }
}
