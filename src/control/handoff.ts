/** The P/D hand-off: the order of one request's steps across a decode worker (D) and a prefill
 *  worker (P), and the checks that decide whether D's tokens may leave.
 *
 *  1. D reserves pages for the prompt (its first event, `reserved`).
 *  2. P is asked to prefill, given D's transfer address and the request's transfer secret (G10);
 *     P sends the KV to D, and D verifies the whole manifest before it decodes (G4).
 *  3. D's first token is held until P's result confirms it ({@link checkPrefill}); later tokens
 *     pass as they come.
 *  4. D's `done` is checked against what was streamed ({@link checkDone}), then yielded.
 *  Any failure, the client's abort, or the consumer leaving early aborts the one signal both sides
 *  were given, which ends the request on both workers (G8).
 *
 *  Knows the control-plane messages (messages.ts) and the two sides as small interfaces; knows
 *  nothing of HTTP, sockets, URLs' meaning, pools or text. */
import { KvfenceError, isErrorCode, type ErrorCode } from '../common/errors.js'
import type {
  DecodeEvent,
  GenerateRequest,
  PrefillRequest,
  PrefillResult,
  TokenLogprobs,
} from './messages.js'

/** What {@link handOff} yields: the decode worker's tokens, then one `done`. */
export type GenerationEvent =
  | {
      type: 'token'
      tokenId: number
      /** Only when the request asked for log-probabilities (the first token's come from the
       *  prefill worker's result). */
      logprobs?: TokenLogprobs
    }
  | {
      type: 'done'
      finishReason: 'stop' | 'length'
      promptTokens: number
      completionTokens: number
      /** Prompt tokens served from a prefix cache, when a worker reports it (the prefill
       *  worker's count, else the decode worker's). */
      cachedTokens?: number
      /** Pages the prefill worker transferred for this request. */
      numTransferredPages: number
    }

/** D's `reserved` event: pages are held for the prompt, and where P is to send the KV. */
export type ReservedEvent = Extract<DecodeEvent, { type: 'reserved' }>
/** D's last event: how the request ended and what it counted. */
export type DoneEvent = Extract<DecodeEvent, { type: 'done' }>

/** Where a prefill worker sends a request's KV pages (D's transfer receiver). */
export interface TransferAddress {
  host: string
  port: number
}

/** The decode worker of one request, as the hand-off drives it. */
export interface DecodeSide {
  /** How messages name this worker (the router: its control URL). */
  readonly name: string
  /** Starts `request` on the worker and yields its events: `reserved` first, then `token`s, then
   *  `done` (an `error` event ends the request). Throws a {@link KvfenceError} when the worker
   *  refuses or fails; once `signal` aborts, the worker drops the request and the iteration
   *  ends soon after (by throwing). */
  generate(request: GenerateRequest, signal: AbortSignal): AsyncIterable<DecodeEvent>
  /** Where P must send this request's KV, given D's `reserved` event. Throws a
   *  {@link KvfenceError} when it cannot tell. */
  transferAddress(reserved: ReservedEvent, signal: AbortSignal): Promise<TransferAddress>
}

/** The prefill worker of one request, as the hand-off drives it. */
export interface PrefillSide {
  /** How messages name this worker (the router: its control URL). */
  readonly name: string
  /** Prefills `request` and sends its KV to `request.decode`; resolves once D acknowledged every
   *  page. Throws a {@link KvfenceError} on any failure; once `signal` aborts, the worker drops
   *  the prefill and its transfer (G8). */
  prefill(request: PrefillRequest, signal: AbortSignal): Promise<PrefillResult>
}

/** Options of {@link handOff}. */
export interface HandoffOptions {
  /** The client's signal: aborting it ends the request on both workers with `request_aborted`. */
  signal: AbortSignal
  /** Run {@link checkPrefill}, {@link checkDone} and {@link checkCachedTokens}; false only in the
   *  incident's configuration (guards off). Default true. */
  guardsEnabled?: boolean
  /** Longest silence from D (no event, counted from before its request starts), in ms; the
   *  request then fails with `worker_unavailable`. Absent = no limit. */
  idleTimeoutMs?: number
  /** Hears the error the hand-off is about to throw (before it is thrown): a transport's own
   *  bookkeeping, without a generator layer of its own around every token. */
  onFailure?: (error: KvfenceError) => void
}

/** An error a worker reported (its error reply or an `error` event). Its message names the worker
 *  (and may name pages or peers): it is for the operator's log; a client is told only the code
 *  and a fixed sentence, even for a 4xx. */
export class WorkerReportedError extends KvfenceError {
  constructor(code: ErrorCode, message: string) {
    super(code, message)
    this.name = 'WorkerReportedError'
  }
}

/** Runs `request` through `decode` and `prefill` in the order of this module's header. Yields
 *  D's tokens (the first only after P's result was checked against it, carrying P's
 *  log-probabilities of it) and a final `done`; throws a {@link KvfenceError} on any failure,
 *  never a normal `done` after one. The first failure wins: P's error, the client's abort or the
 *  idle timeout over the error D reports as it is aborted. */
export async function* handOff(
  request: GenerateRequest,
  decode: DecodeSide,
  prefill: PrefillSide,
  options: HandoffOptions,
): AsyncGenerator<GenerationEvent, void> {
  const rid = request.requestId
  const guardsEnabled = options.guardsEnabled ?? true
  const ending = requestEnding(rid, decode.name, options)
  let isFinished = false
  try {
    ending.touch()
    let prefillResult: Promise<PrefillResult> | null = null
    let numTokens = 0
    let done: DoneEvent | null = null
    // Read to the end of D's events even after `done` (its last): anything after it is a
    // protocol error, and a transport may reuse its connection only once the reply has ended.
    for await (const event of decode.generate(request, ending.signal)) {
      ending.touch()
      if (done !== null) throw protocolError(decode.name, rid, `a ${event.type} event after done`)
      switch (event.type) {
        case 'reserved': {
          if (prefillResult !== null)
            throw protocolError(decode.name, rid, 'a second reserved event')
          const address = await decode.transferAddress(event, ending.signal)
          prefillResult = prefill.prefill(prefillRequest(request, address), ending.signal)
          prefillResult.catch((err: unknown) =>
            ending.fail(asKvfenceError(err, `prefill worker ${prefill.name}`)),
          )
          break
        }
        case 'token':
          if (prefillResult === null)
            throw protocolError(decode.name, rid, 'a token before reserved')
          if (numTokens >= request.maxTokens) {
            throw protocolError(decode.name, rid, `more than maxTokens ${request.maxTokens} tokens`)
          }
          if (numTokens === 0) {
            // No output leaves before P's result confirmed this request's transfer.
            const result = await prefillResult
            if (guardsEnabled) {
              checkPrefill(result, event.tokenId, request, prefill.name, decode.name)
            }
            numTokens++
            // P sampled the first token: its log-probabilities are P's too.
            yield result.firstTokenLogprobs === undefined
              ? event
              : { ...event, logprobs: result.firstTokenLogprobs }
            break
          }
          numTokens++
          yield event
          break
        case 'done':
          if (prefillResult === null) throw protocolError(decode.name, rid, 'done before reserved')
          done = event
          break
        case 'error':
          throw new WorkerReportedError(
            isErrorCode(event.code) ? event.code : 'internal_error',
            `decode worker ${decode.name}: ${event.code}: ${event.message}`,
          )
      }
    }
    if (done === null || prefillResult === null) {
      throw new KvfenceError(
        'worker_unavailable',
        `decode worker ${decode.name} ended request ${rid} without a done event`,
      )
    }
    const result = await prefillResult
    if (guardsEnabled) checkDone(done, numTokens, request, decode.name)
    isFinished = true // both sides have ended: nothing left to abort
    yield doneEvent(done, result, guardsEnabled, rid, prefill.name)
  } catch (err) {
    const error = ending.failure() ?? asKvfenceError(err, `decode worker ${decode.name}`)
    options.onFailure?.(error)
    throw error
  } finally {
    ending.dispose(isFinished)
  }
}

/** The one signal both sides of a request are given, and the first failure recorded: the
 *  client's abort, the idle timeout, or P's error (D's comes as an exception instead). */
interface RequestEnding {
  readonly signal: AbortSignal
  /** Records `err` unless a failure was recorded already, and aborts both sides. */
  fail(err: KvfenceError): void
  /** The first failure recorded, if any. */
  failure(): KvfenceError | null
  /** D was heard from: restarts the idle timer. */
  touch(): void
  /** Stops listening and timing; aborts both sides unless the request finished. */
  dispose(isFinished: boolean): void
}

function requestEnding(rid: string, decodeName: string, options: HandoffOptions): RequestEnding {
  const { signal, idleTimeoutMs } = options
  const inner = new AbortController()
  let failure: KvfenceError | null = null
  const fail = (err: KvfenceError) => {
    failure ??= err
    inner.abort()
  }
  const onClientAbort = () =>
    fail(new KvfenceError('request_aborted', `request ${rid} was aborted by the client`))
  if (signal.aborted) onClientAbort()
  else signal.addEventListener('abort', onClientAbort, { once: true })
  // One timer per request, not one per event: an event only notes the time it came, and the
  // timer, when it fires, waits out what is left of the silence since then.
  let idleTimer: NodeJS.Timeout | undefined
  let lastHeardMs = 0
  const onIdleTimer = () => {
    const silentMs = performance.now() - lastHeardMs
    if (silentMs < idleTimeoutMs!) {
      idleTimer = setTimeout(onIdleTimer, idleTimeoutMs! - silentMs)
      return
    }
    fail(
      new KvfenceError(
        'worker_unavailable',
        `decode worker ${decodeName} sent nothing for ${idleTimeoutMs} ms (request ${rid})`,
      ),
    )
  }
  return {
    signal: inner.signal,
    fail,
    failure: () => failure,
    touch() {
      if (idleTimeoutMs === undefined) return
      lastHeardMs = performance.now()
      idleTimer ??= setTimeout(onIdleTimer, idleTimeoutMs)
    },
    dispose(isFinished) {
      clearTimeout(idleTimer)
      signal.removeEventListener('abort', onClientAbort)
      if (!isFinished) inner.abort()
    },
  }
}

/** The `done` yielded for D's `done` and P's result. Prefix-cache hits happen on P: only it knows
 *  how many prompt tokens were cached (D's count is the fallback). */
function doneEvent(
  done: DoneEvent,
  result: PrefillResult,
  guardsEnabled: boolean,
  rid: string,
  prefillName: string,
): GenerationEvent {
  const cachedTokens = result.cachedTokens ?? done.cachedTokens
  if (guardsEnabled) checkCachedTokens(cachedTokens, done.promptTokens, rid, prefillName)
  return {
    type: 'done',
    finishReason: done.finishReason,
    promptTokens: done.promptTokens,
    completionTokens: done.completionTokens,
    ...(cachedTokens === undefined ? {} : { cachedTokens }),
    numTransferredPages: result.numPages,
  }
}

/** What P is asked: the request's prompt, tenant, sampling and transfer secret, and D's address. */
function prefillRequest(request: GenerateRequest, decode: TransferAddress): PrefillRequest {
  return {
    requestId: request.requestId,
    tenant: request.tenant,
    promptTokenIds: request.promptTokenIds,
    sampling: request.sampling,
    transferSecret: request.transferSecret,
    ...(request.prefixCachePartition && { prefixCachePartition: request.prefixCachePartition }),
    decode,
  }
}

// ---------------------------------------------------------------------------------------------
// Checks (defence in depth behind the workers' own guards; off with guards off)

/** P's result must be for this request, cover the whole prompt, and name the same first token as
 *  D's first token event; otherwise D's output is of unknown origin. Rules out a first token taken
 *  from another request's metadata under load (sglang#17259, #22716: here D's token would differ
 *  from P's, or P's result would name another request) and a transfer reported complete for less
 *  than the prompt (Mooncake #3406; the incident's one-token placeholder, sglang#30233). The
 *  control messages carry no transfer id: D checks it on every frame (G4). Pure; throws
 *  `guard_violation` naming every mismatch. */
export function checkPrefill(
  result: PrefillResult,
  firstTokenId: number,
  request: GenerateRequest,
  prefillName: string,
  decodeName: string,
): void {
  const rid = request.requestId
  const numPromptTokens = request.promptTokenIds.length
  const problems: string[] = []
  if (result.requestId !== rid) problems.push(`prefill answered for request ${result.requestId}`)
  if (result.numTokens !== numPromptTokens) {
    problems.push(`prefill sent ${result.numTokens} prompt tokens, want ${numPromptTokens}`)
  }
  if (result.firstTokenId !== firstTokenId) {
    problems.push(`first token ${firstTokenId} from decode, ${result.firstTokenId} from prefill`)
  }
  if (problems.length > 0) {
    throw new KvfenceError(
      'guard_violation',
      `request ${rid} (prefill ${prefillName}, decode ${decodeName}): ${problems.join('; ')}`,
    )
  }
}

/** D's `done` must count the prompt the router sent and the `numTokens` tokens D streamed. Rules
 *  out an end reported complete that does not match what arrived (the token stream's twin of
 *  Mooncake PR #3406, "complete" before all data landed): another completion count means tokens
 *  were lost or added between D and the client; another prompt count means D's sequence is not
 *  this request's. Pure; throws `guard_violation` naming every mismatch. */
export function checkDone(
  done: DoneEvent,
  numTokens: number,
  request: GenerateRequest,
  decodeName: string,
): void {
  const numPromptTokens = request.promptTokenIds.length
  const problems: string[] = []
  if (done.promptTokens !== numPromptTokens) {
    problems.push(`decode counted ${done.promptTokens} prompt tokens, want ${numPromptTokens}`)
  }
  if (done.completionTokens !== numTokens) {
    problems.push(
      `decode counted ${done.completionTokens} completion tokens, streamed ${numTokens}`,
    )
  }
  if (problems.length > 0) {
    throw new KvfenceError(
      'guard_violation',
      `request ${request.requestId} (decode ${decodeName}): ${problems.join('; ')}`,
    )
  }
}

/** Cached prompt tokens, when reported (OpenAI's `cached_tokens`), lie in `[0, numPromptTokens)`:
 *  the last prompt token always runs through prefill, since its logits give the first token, so
 *  a count that covers the whole prompt is a false report. Pure; throws `internal_error`. */
export function checkCachedTokens(
  cachedTokens: number | undefined,
  numPromptTokens: number,
  rid: string,
  prefillName: string,
): void {
  if (cachedTokens !== undefined && !(cachedTokens >= 0 && cachedTokens < numPromptTokens)) {
    throw protocolError(
      prefillName,
      rid,
      `cachedTokens ${cachedTokens} outside [0, ${numPromptTokens})`,
    )
  }
}

function protocolError(name: string, rid: string, what: string): KvfenceError {
  return new KvfenceError('internal_error', `decode worker ${name} sent ${what} for request ${rid}`)
}

function asKvfenceError(err: unknown, where: string): KvfenceError {
  if (err instanceof KvfenceError) return err
  return new KvfenceError(
    'worker_unavailable',
    `${where}: ${err instanceof Error ? err.message : String(err)}`,
  )
}
