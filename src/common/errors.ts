/** Coded errors shared by every part of kvfence, and the one table that maps codes to HTTP.
 *  Knows nothing of transports: the router and the workers turn a KvfenceError into a response. */

/** Every error code kvfence emits, with the HTTP status it maps to and the OpenAI error `type`. */
export const errorCodes = {
  invalid_request: { status: 400, type: 'invalid_request_error' },
  context_length_exceeded: { status: 400, type: 'invalid_request_error' },
  model_not_found: { status: 404, type: 'invalid_request_error' },
  invalid_api_key: { status: 401, type: 'authentication_error' },
  /** An operator action on a router where operator actions are off (no cluster token). */
  permission_denied: { status: 403, type: 'invalid_request_error' },
  not_found: { status: 404, type: 'invalid_request_error' },
  method_not_allowed: { status: 405, type: 'invalid_request_error' },
  /** The HTTP parser's limit on the request's headers (Node's `maxHeaderSize`). */
  headers_too_large: { status: 431, type: 'invalid_request_error' },
  /** The request did not arrive in time (Node's `headersTimeout` or `requestTimeout`). */
  request_timeout: { status: 408, type: 'invalid_request_error' },
  payload_too_large: { status: 413, type: 'invalid_request_error' },
  unsupported_media_type: { status: 415, type: 'invalid_request_error' },
  rate_limited: { status: 429, type: 'rate_limit_error' },
  capacity_exhausted: { status: 503, type: 'server_error' },
  worker_unavailable: { status: 503, type: 'server_error' },
  /** Gateway mode: the engine's isolation self-check refused this path (router/gateway/). */
  path_refused: { status: 503, type: 'server_error' },
  /** The router is draining before it stops: retry elsewhere (503 with Retry-After). */
  shutting_down: { status: 503, type: 'server_error' },
  request_aborted: { status: 499, type: 'server_error' },
  transfer_failed: { status: 502, type: 'server_error' },
  guard_violation: { status: 500, type: 'server_error' },
  /** The response sentinel (block mode) ended an answer holding another tenant's text. */
  answer_withheld: { status: 500, type: 'server_error' },
  internal_error: { status: 500, type: 'server_error' },
  /** A configuration file or flag is invalid (a CLI error: one line, exit 2; never an HTTP reply). */
  config_invalid: { status: 500, type: 'server_error' },
} as const

/** One of the codes of {@link errorCodes}. */
export type ErrorCode = keyof typeof errorCodes

/** An error with a stable machine-readable code; `message` names the offending values.
 *  `param` names the request field at fault (OpenAI's `error.param`), when there is one. */
export class KvfenceError extends Error {
  constructor(
    readonly code: ErrorCode,
    message: string,
    readonly param: string | null = null,
  ) {
    super(message)
    this.name = 'KvfenceError'
  }

  /** HTTP status for this error's code. */
  get status(): number {
    return errorCodes[this.code].status
  }
}

/** A request with a method the path does not take (HTTP 405); `allow` is the `Allow` header's
 *  value (RFC 9110 §15.5.6: the methods the path does take). */
export class MethodNotAllowedError extends KvfenceError {
  constructor(
    method: string,
    path: string,
    readonly allow: string,
  ) {
    super('method_not_allowed', `${method} is not allowed on ${path}; use ${allow}`)
  }
}

/** Whether `code` is a known {@link ErrorCode} (used when parsing errors from a peer). */
export function isErrorCode(code: unknown): code is ErrorCode {
  return typeof code === 'string' && Object.hasOwn(errorCodes, code)
}

/** The OpenAI error body (`ErrorResponse` in OpenAI's OpenAPI description) for an error. */
export function toOpenAiError(err: KvfenceError): {
  error: { message: string; type: string; param: string | null; code: string }
} {
  return {
    error: {
      message: err.message,
      type: errorCodes[err.code].type,
      param: err.param,
      code: err.code,
    },
  }
}
