/** Node's own refusals of what is not an HTTP request it can read (the server's `clientError`:
 *  headers over the size limit, a malformed request line or header, headers that took too long),
 *  answered in the OpenAI error shape like every other refusal — Node's default answer is a
 *  status line with an empty body, which an OpenAI client reports as an unknown error.
 *  Knows sockets, Node's parser error codes and the error table; knows nothing of routes, tenants
 *  or workers. Never echoes or logs the offending bytes (they may hold an API key). */
import http from 'node:http'
import type { Duplex } from 'node:stream'
import type { Logger } from 'pino'
import { KvfenceError, toOpenAiError } from '../errors.js'

/** The error a client is told for Node's `clientError` `err`, as Node's default handler picks
 *  its status (431 for headers over the limit, 413 for an oversized chunk extension, 408 for a
 *  request not received in time, 400 otherwise); `maxHeaderBytes` is the server's limit. */
export function clientErrorOf(err: NodeJS.ErrnoException, maxHeaderBytes: number): KvfenceError {
  switch (err.code) {
    case 'HPE_HEADER_OVERFLOW':
      return new KvfenceError(
        'headers_too_large',
        `the request's headers exceed the limit of ${maxHeaderBytes} bytes`,
      )
    case 'HPE_CHUNK_EXTENSIONS_OVERFLOW':
      return new KvfenceError(
        'payload_too_large',
        "a chunk extension of the request's body is too large",
      )
    case 'ERR_HTTP_REQUEST_TIMEOUT':
      return new KvfenceError('request_timeout', 'the request was not received in time')
    default: {
      // llhttp's reason is a fixed sentence ("Invalid header value char"), never client bytes.
      const reason = (err as { reason?: unknown }).reason
      const why = typeof reason === 'string' && reason !== '' ? `: ${reason}` : ''
      return new KvfenceError(
        'invalid_request',
        `the request is not valid HTTP/1.1 (${err.code ?? 'unknown'}${why})`,
      )
    }
  }
}

/** Answers `err` on `socket` with its status and OpenAI error body, then closes the connection;
 *  a socket that cannot be written any more (the client reset it), or one whose previous
 *  response is already under way (an answer written now would corrupt it), is only closed —
 *  as Node's default handler does. For `server.on('clientError', …)`. */
export function answerClientError(
  err: NodeJS.ErrnoException,
  socket: Duplex,
  maxHeaderBytes: number,
  log: Logger,
): void {
  // Node's own test of an in-flight response (its default handler makes the same one).
  const inFlight = (socket as { _httpMessage?: { headersSent?: boolean } | null })._httpMessage
  if (err.code === 'ECONNRESET' || !socket.writable || inFlight?.headersSent === true) {
    socket.destroy()
    return
  }
  const error = clientErrorOf(err, maxHeaderBytes)
  log.info(
    { status: error.status, code: error.code, parserCode: err.code },
    'request refused by the HTTP parser',
  )
  const body = JSON.stringify(toOpenAiError(error))
  const head = [
    `HTTP/1.1 ${error.status} ${http.STATUS_CODES[error.status] ?? ''}`,
    'content-type: application/json',
    `content-length: ${Buffer.byteLength(body)}`,
    'connection: close',
  ]
  // The parser cannot resume after an error: the connection ends with the answer.
  socket.end(`${head.join('\r\n')}\r\n\r\n${body}`, () => socket.destroy())
}
