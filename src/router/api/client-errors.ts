/** Node's own refusals of what is not an HTTP request it can read (the server's `clientError`:
 *  headers over the size limit, a malformed request line or header, headers that took too long),
 *  and plain HTTP sent to the HTTPS port, answered in the OpenAI error shape like every other
 *  refusal — Node's default answer is a status line with an empty body (or, on the HTTPS port, a
 *  closed connection), which an OpenAI client reports as an unknown error.
 *  Knows sockets, Node's parser error codes and the error table; knows nothing of routes, tenants
 *  or workers. Never echoes or logs the offending bytes (they may hold an API key). */
import assert from 'node:assert/strict'
import http from 'node:http'
import type https from 'node:https'
import type { Socket } from 'node:net'
import type { Duplex } from 'node:stream'
import type { Logger } from 'pino'
import { KvfenceError, toOpenAiError } from '../../common/errors.js'

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
  // The parser cannot resume after an error: the connection ends with the answer.
  socket.end(errorResponse(error), () => socket.destroy())
}

/** `error` as a whole HTTP/1.1 response that closes the connection: status line, JSON headers and
 *  the OpenAI error body. */
function errorResponse(error: KvfenceError): string {
  const body = JSON.stringify(toOpenAiError(error))
  const head = [
    `HTTP/1.1 ${error.status} ${http.STATUS_CODES[error.status] ?? ''}`,
    'content-type: application/json',
    `content-length: ${Buffer.byteLength(body)}`,
    'connection: close',
  ]
  return `${head.join('\r\n')}\r\n\r\n${body}`
}

/** The first byte of every TLS connection: a record of content type handshake, the ClientHello
 *  (RFC 8446 §5.1; TLS 1.2 the same, RFC 5246 §6.2.1). */
const tlsHandshakeRecord = 0x16

/** Makes the HTTPS `server` answer a client that speaks plain HTTP to it (an `http://` URL for an
 *  `https://` router) with 400 and an OpenAI error body saying the port speaks HTTPS, as nginx
 *  does ("The plain HTTP request was sent to HTTPS port"): without it, OpenSSL refuses the
 *  handshake and the client gets a closed connection and no reason. Each connection's first bytes
 *  are peeked before TLS sees them: a handshake record goes on to TLS (the bytes put back, which
 *  Node's TLS socket reads first), anything else is answered and closed. A connection that sends
 *  nothing for `server.headersTimeout` ms is closed. Call before `listen`. */
export function answerPlainHttpOnHttps(server: https.Server, log: Logger): void {
  const listeners = server.listeners('connection')
  // node:tls's server starts TLS on each socket in its one 'connection' listener.
  assert.equal(listeners.length, 1, `an HTTPS server has ${listeners.length} connection listeners`)
  const [startTls] = listeners as ((socket: Socket) => void)[]
  server.removeListener('connection', startTls)
  server.on('connection', (socket: Socket) => {
    const onTimeout = () => socket.destroy()
    socket.setTimeout(server.headersTimeout, onTimeout)
    socket.once('readable', () => {
      socket.setTimeout(0)
      socket.off('timeout', onTimeout)
      const first = socket.read() as Buffer | null
      if (first === null) return void socket.destroy() // closed before a byte
      if (first[0] === tlsHandshakeRecord) {
        socket.unshift(first)
        return startTls.call(server, socket)
      }
      const error = new KvfenceError(
        'invalid_request',
        'The plain HTTP request was sent to an HTTPS port: this router speaks HTTPS only; use an https:// URL',
      )
      log.info({ status: error.status, code: error.code }, 'plain HTTP on the HTTPS port refused')
      // The rest of the request is read and dropped: closing with it unread would send a reset,
      // which can reach the client before the answer does.
      socket.resume()
      socket.end(errorResponse(error))
      socket.setTimeout(server.headersTimeout, onTimeout)
    })
  })
}
