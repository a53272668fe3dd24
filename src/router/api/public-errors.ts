/** What a client is told about a failure: the code, a fixed sentence and the request id for a
 *  server-side one; the workers' own message (which may name pages, requests or peers) is logged
 *  only. Knows error codes; knows nothing of HTTP or workers. */
import { KvfenceError, type ErrorCode } from '../../common/errors.js'
import { LimitError } from '../admission/limit-error.js'
import { WorkerReportedError } from '../../control/worker-client.js'

/** The fixed sentence of each server-side code. */
const publicMessages: Partial<Record<ErrorCode, string>> = {
  capacity_exhausted: 'The server has no free KV capacity for this request right now; retry later.',
  worker_unavailable: 'A worker is unavailable; retry later.',
  shutting_down: 'The server is shutting down; retry the request on another instance.',
  transfer_failed: 'The KV transfer between workers failed; the request was stopped.',
  guard_violation: 'A KV integrity guard stopped this request.',
  answer_withheld: "The router's response sentinel withheld this answer.",
  request_aborted: 'The request was aborted.',
  internal_error: 'Internal error.',
}

/** The error a client sees for `err` of request `rid`: the router's own refusals (limits, 4xx)
 *  as they are, a worker's refusal and every server-side failure as a fixed sentence. */
export function publicError(err: KvfenceError, rid: string): KvfenceError {
  if (err instanceof LimitError) return err // the router's own words, with its Retry-After
  if (err instanceof WorkerReportedError && err.status < 500) {
    const sentence =
      err.code === 'context_length_exceeded'
        ? "The prompt and max_tokens exceed what the workers' KV pools can hold."
        : 'A worker refused this request.'
    return new KvfenceError(err.code, `${sentence} (request ${rid})`, null)
  }
  if (err.status < 500 && err.code !== 'request_aborted') return err
  const sentence = publicMessages[err.code] ?? 'Internal error.'
  return new KvfenceError(err.code, `${sentence} (request ${rid})`, null)
}

/** The error a request ended with: the reason its `signal` was aborted with when that is a
 *  {@link KvfenceError} (the router itself ended the request, e.g. at the drain's deadline —
 *  the backend then reports only `request_aborted`), else `err`. */
export function endingError(err: unknown, signal: AbortSignal): KvfenceError {
  if (signal.aborted && signal.reason instanceof KvfenceError) return signal.reason
  return asKvfenceError(err)
}

/** `err` as a {@link KvfenceError} (`internal_error` when it is none). */
export function asKvfenceError(err: unknown): KvfenceError {
  if (err instanceof KvfenceError) return err
  return new KvfenceError('internal_error', messageOf(err))
}

/** An error's message, whatever was thrown. */
export function messageOf(err: unknown): string {
  return err instanceof Error ? err.message : String(err)
}
