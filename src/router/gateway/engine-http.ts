/** Gateway mode's HTTP client of one engine: JSON calls with a deadline over one keep-alive agent,
 *  the streamed POST of a generation, and the small readers of the engine's JSON.
 *  Knows URLs, the engine's API key and JSON; knows nothing of what the engine's answers mean. */
import http from 'node:http'
import https from 'node:https'
import { KvfenceError } from '../../common/errors.js'
import { readReplyText } from '../../common/reply-text.js'

/** Largest engine reply read whole, bytes. */
const maxReplyBytes = 16 * 1024 * 1024

/** An engine's reply, read whole. */
export interface EngineReply {
  status: number
  body: string
}

/** The client of one engine (see {@link createEngineHttp}). */
export interface EngineHttp {
  /** The engine's base URL, normalized (no trailing slash). */
  readonly base: string
  /** Deadline of discovery and tokenize calls, ms. */
  readonly timeoutMs: number
  /** A JSON call (`body` null: none) read whole; `signal` defaults to the deadline. Rejects with
   *  the transport's error. */
  call(
    path: string,
    method: 'GET' | 'POST',
    body: unknown,
    signal?: AbortSignal,
  ): Promise<EngineReply>
  /** POSTs `body` as JSON and resolves with the response unread (for streaming it on). */
  open(path: string, body: unknown, signal: AbortSignal): Promise<http.IncomingMessage>
  /** Reads a response of {@link EngineHttp.open} whole; throws past {@link maxReplyBytes}. */
  readWhole(res: http.IncomingMessage): Promise<string>
  /** Closes the pooled connections. */
  close(): void
}

/** A client of the engine at `url`; throws `config_invalid` when `url` is not an http(s) URL. */
export function createEngineHttp(
  url: string,
  apiKey: string | undefined,
  timeoutMs: number,
): EngineHttp {
  const base = normalize(url)
  const agent = base.startsWith('https:')
    ? new https.Agent({ keepAlive: true })
    : new http.Agent({ keepAlive: true })
  const headers: Record<string, string> =
    apiKey === undefined ? {} : { authorization: `Bearer ${apiKey}` }
  return {
    base,
    timeoutMs,
    async call(path, method, body, signal) {
      const res = await send(
        agent,
        `${base}${path}`,
        method,
        headers,
        body,
        signal ?? AbortSignal.timeout(timeoutMs),
      )
      return { status: res.statusCode ?? 0, body: await readReplyText(res, maxReplyBytes) }
    },
    open: (path, body, signal) => send(agent, `${base}${path}`, 'POST', headers, body, signal),
    readWhole: (res) => readReplyText(res, maxReplyBytes),
    close: () => agent.destroy(),
  }
}

/** Sends one request (`body` null: none, else JSON) and resolves with the response unread. A
 *  request that fails with ECONNRESET on a kept-alive connection before any answer is sent once
 *  more on a new one: the engine had closed that connection while it was idle (uvicorn closes it
 *  after a handler's exception, e.g. `transformers serve`'s 500 on `/v1/models`), so the request
 *  never reached it (Node's `request.reusedSocket` case). */
function send(
  agent: http.Agent,
  url: string,
  method: 'GET' | 'POST',
  headers: Record<string, string>,
  body: unknown,
  signal: AbortSignal,
  isRetry = false,
): Promise<http.IncomingMessage> {
  return new Promise((resolve, reject) => {
    const text = body === null ? null : JSON.stringify(body)
    const transport = url.startsWith('https:') ? https : http
    const req = transport.request(
      url,
      {
        method,
        agent,
        signal,
        headers:
          text === null
            ? headers
            : {
                ...headers,
                'content-type': 'application/json',
                'content-length': Buffer.byteLength(text),
              },
      },
      resolve,
    )
    req.on('error', (err: NodeJS.ErrnoException) => {
      if (!isRetry && req.reusedSocket && err.code === 'ECONNRESET' && !signal.aborted) {
        send(agent, url, method, headers, body, signal, true).then(resolve, reject)
      } else reject(err)
    })
    req.end(text ?? undefined)
  })
}

/** `text` parsed as JSON, or null when it is not JSON. */
export function json(text: string): unknown {
  try {
    return JSON.parse(text)
  } catch {
    return null
  }
}

/** `value` when it is a plain object, else null. */
export function asObject(value: unknown): Record<string, unknown> | null {
  return typeof value === 'object' && value !== null && !Array.isArray(value)
    ? (value as Record<string, unknown>)
    : null
}

/** `value` when it is a positive safe integer, else null. */
export function positive(value: unknown): number | null {
  return typeof value === 'number' && Number.isSafeInteger(value) && value > 0 ? value : null
}

/** An error's message, whatever was thrown. */
export function messageOf(err: unknown): string {
  return err instanceof Error ? err.message : String(err)
}

function normalize(url: string): string {
  let parsed: URL
  try {
    parsed = new URL(url)
  } catch {
    throw new KvfenceError('config_invalid', `backend URL ${JSON.stringify(url)} is not a URL`)
  }
  if (parsed.protocol !== 'http:' && parsed.protocol !== 'https:') {
    throw new KvfenceError('config_invalid', `backend URL ${url} must use http: or https:`)
  }
  return `${parsed.origin}${parsed.pathname.replace(/\/+$/, '')}`
}
