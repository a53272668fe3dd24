/** Small `node:http` helpers for the router: bounded body reading, JSON responses, error responses,
 *  coalesced streaming writes.
 *  Knows HTTP and the OpenAI error body; knows nothing of tokens, workers or tenants. */
import type { IncomingMessage, Server, ServerResponse } from 'node:http'
import { KvfenceError, MethodNotAllowedError, toOpenAiError } from '../../common/errors.js'
import { readBodyText } from './body-text.js'
import { LimitError } from '../admission/limit-error.js'

/** Most JSON objects and arrays a request body may hold: a chat body at its bounds (2048
 *  messages, 2048 text parts, their lists) holds about 6,200; see {@link readJsonBody}. */
export const maxJsonContainers = 8192

/** `payload_too_large` for a body over `maxBytes`. */
function bodyTooLarge(maxBytes: number): KvfenceError {
  return new KvfenceError(
    'payload_too_large',
    `the request body exceeds the limit of ${maxBytes} bytes`,
  )
}

/** Answers `Expect: 100-continue` (the server's `checkContinue` event): a body declared over
 *  `maxBodyBytes` is refused at once with 413, before the client sends it (RFC 9110 §10.1.1: a
 *  server may answer with a final status instead of 100 Continue); any other request is told to
 *  continue and goes to `handler`. Without this Node invites every body, then the 413 follows. */
export function answerExpectContinue(
  server: Server,
  handler: (req: IncomingMessage, res: ServerResponse) => void,
  maxBodyBytes: number,
): void {
  server.on('checkContinue', (req: IncomingMessage, res: ServerResponse) => {
    const declared = Number(req.headers['content-length'])
    if (Number.isFinite(declared) && declared > maxBodyBytes) {
      return sendError(req, res, bodyTooLarge(maxBodyBytes))
    }
    res.writeContinue()
    handler(req, res)
  })
}

/** Reads the request body as JSON. Throws `payload_too_large` past `maxBytes` (checked against
 *  `content-length` first, then while reading), `invalid_request` for bytes that are not UTF-8
 *  (RFC 8259 §8.1), malformed JSON, or a body of more than {@link maxJsonContainers} objects and
 *  arrays (refused before parsing: a megabyte of `{}`s would hold the event loop every tenant
 *  shares, in the parse and then in the garbage collector), and
 *  `request_aborted` when the client closes the connection before the body's end (a client that
 *  left, not a server error: nothing can be sent to it any more). */
export async function readJsonBody(req: IncomingMessage, maxBytes: number): Promise<unknown> {
  const tooLarge = () => bodyTooLarge(maxBytes)
  const encoding = req.headers['content-encoding']?.trim().toLowerCase()
  if (encoding !== undefined && encoding !== '' && encoding !== 'identity') {
    // Not decompressed here: reading gzip bytes as JSON would fail obscurely, and reading a plain
    // body labelled gzip would accept what the client says it did not send (RFC 9110 §8.4: 415).
    throw new KvfenceError(
      'unsupported_media_type',
      `Content-Encoding ${encoding} is not supported: send the body uncompressed`,
    )
  }
  const declared = Number(req.headers['content-length'])
  if (Number.isFinite(declared) && declared > maxBytes) throw tooLarge()
  const tooManyContainers = () =>
    new KvfenceError(
      'invalid_request',
      `the request body holds more than ${maxJsonContainers} JSON objects and arrays`,
    )
  const { text } = await readBodyText(
    req,
    { maxBytes, maxContainers: maxJsonContainers },
    { tooLarge, tooManyContainers },
  )
  // Bytes that are not UTF-8 are refused, never replaced with U+FFFD behind the client's back.
  if (text === null)
    throw new KvfenceError('invalid_request', 'the request body is not valid UTF-8')
  if (text.trim() === '') throw new KvfenceError('invalid_request', 'the request body is empty')
  try {
    return JSON.parse(text)
  } catch (err) {
    throw new KvfenceError(
      'invalid_request',
      `the request body is not valid JSON: ${err instanceof Error ? err.message : String(err)}`,
    )
  }
}

/** Sends a JSON body with `status`. */
export function sendJson(
  res: ServerResponse,
  status: number,
  body: unknown,
  headers: Record<string, string> = {},
): void {
  const text = JSON.stringify(body)
  res.writeHead(status, {
    'content-type': 'application/json',
    'content-length': String(Buffer.byteLength(text)),
    ...headers,
  })
  res.end(text)
}

/** Codes whose refusal a later retry may cure: they carry `Retry-After`. */
const retriedCodes: ReadonlySet<string> = new Set([
  'capacity_exhausted',
  'rate_limited',
  'worker_unavailable',
  'shutting_down',
])

/** Sends the OpenAI error body for `err` with the status of its code (`Retry-After` on
 *  `capacity_exhausted`, `rate_limited`, `worker_unavailable` and `shutting_down`: a
 *  {@link LimitError}'s seconds, else 1; instead
 *  `x-should-retry: false` for a LimitError no wait can cure). When a body was left unread (too large, or refused
 *  before reading) the connection is closed after the reply. */
export function sendError(
  req: IncomingMessage,
  res: ServerResponse,
  err: KvfenceError,
  headers: Record<string, string> = {},
): void {
  if (res.headersSent) {
    // An answer already ended (e.g. with an in-stream error event) keeps its last bytes.
    if (!res.writableEnded) res.destroy()
    return
  }
  const extra: Record<string, string> = { ...headers }
  if (err instanceof MethodNotAllowedError) extra.allow = err.allow
  if (err instanceof LimitError && err.retryAfterSec === null) {
    // Retrying the same request cannot succeed: tell the client not to (the openai SDKs obey
    // this header; without it they retry every 429, with Retry-After, twice).
    extra['x-should-retry'] = 'false'
  } else if (retriedCodes.has(err.code)) {
    extra['retry-after'] = String(err instanceof LimitError ? err.retryAfterSec : 1)
  }
  const hasBody =
    req.headers['transfer-encoding'] !== undefined ||
    (req.headers['content-length'] !== undefined && req.headers['content-length'] !== '0')
  if (hasBody && !req.readableEnded) extra.connection = 'close' // do not read an unwanted body
  req.resume()
  sendJson(res, err.status, toOpenAiError(err), extra)
}

/** Coalesces the writes to `res` made within one event-loop turn into one socket write: the first
 *  write of a turn corks the response, and a `setImmediate` uncorks it at the end of that turn
 *  (after the turn's I/O callbacks and the promise continuations they run), so no byte waits
 *  beyond the turn in which it was written and TTFT/TPOT are unchanged. Meant for SSE, where
 *  every token is one small `write` (one syscall and one TCP segment each, the router's largest
 *  per-token cost under many streams) while several often arrive in one turn. `end()` flushes at
 *  once (Node uncorks fully on end). Call it once per response, after the headers are set; the
 *  writes may come from any module (it wraps `res.write`, so callers need not know). */
export function coalesceWrites(res: ServerResponse): void {
  const write = res.write as (...args: unknown[]) => boolean
  let isCorked = false
  const uncork = () => {
    isCorked = false
    if (!res.writableEnded && !res.destroyed) res.uncork()
  }
  res.write = ((...args: unknown[]): boolean => {
    if (!isCorked && !res.writableEnded && !res.destroyed) {
      isCorked = true
      res.cork()
      if (uncorkAtTurnEnd.length === 0) setImmediate(uncorkAll)
      uncorkAtTurnEnd.push(uncork)
    }
    return write.apply(res, args)
  }) as ServerResponse['write']
}

/** The responses corked in this event-loop turn: one `setImmediate` uncorks them all at its end
 *  (not one per response: under many streams each token would cost an Immediate of its own). */
let uncorkAtTurnEnd: (() => void)[] = []

function uncorkAll(): void {
  const uncorks = uncorkAtTurnEnd
  uncorkAtTurnEnd = []
  for (const uncork of uncorks) uncork()
}

/** Resolves when `res` can take more writes again (`drain`) or is closed. */
export function drained(res: ServerResponse): Promise<void> {
  if (res.destroyed) return Promise.resolve()
  return new Promise((resolve) => {
    const done = () => {
      res.off('drain', done)
      res.off('close', done)
      resolve()
    }
    res.on('drain', done)
    res.on('close', done)
  })
}
