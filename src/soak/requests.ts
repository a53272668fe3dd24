/** One soak request, sent the two ways a real client ends early: the official `openai` client
 *  (whole or streamed, optionally aborted with an AbortController at a chosen time), or a raw TCP
 *  socket that writes the HTTP request (sometimes only part of it) and is destroyed mid-request.
 *  Knows HTTP and the OpenAI shapes; knows nothing of the cluster's insides. */
import net from 'node:net'
import OpenAI from 'openai'
import type { SoakRequest } from './oracle.js'
import type { Outcome } from './types.js'

/** The model name the soak asks for. */
export interface Target {
  routerUrl: string
  model: string
}

/** Send `req` with the `openai` client. `abortAfterMs` (if set) aborts it then. Never throws:
 *  every ending is an {@link Outcome}. `timeoutMs` bounds the whole request (a request still open
 *  then is a `hung` error). */
export async function sendWithClient(
  target: Target,
  apiKey: string,
  req: SoakRequest,
  opts: { stream: boolean; abortAfterMs: number | null; timeoutMs: number },
): Promise<Outcome> {
  const client = new OpenAI({
    baseURL: `${target.routerUrl}/v1`,
    apiKey,
    maxRetries: 0,
    timeout: opts.timeoutMs,
  })
  const ctl = new AbortController()
  const abortTimer =
    opts.abortAfterMs === null ? null : setTimeout(() => ctl.abort(), opts.abortAfterMs)
  const hangTimer = setTimeout(() => ctl.abort(new Error('hung')), opts.timeoutMs)
  let text = ''
  let completionTokens: number | null = null
  let hadOutput = false
  try {
    if (req.endpoint === 'completion') {
      const body = {
        model: target.model,
        prompt: req.prompt,
        max_tokens: req.maxTokens,
        temperature: 0,
      }
      if (opts.stream) {
        const stream = await client.completions.create(
          { ...body, stream: true, stream_options: { include_usage: true } },
          { signal: ctl.signal },
        )
        for await (const chunk of stream) {
          const piece = chunk.choices[0]?.text ?? ''
          if (piece) hadOutput = true
          text += piece
          if (chunk.usage) completionTokens = chunk.usage.completion_tokens
        }
      } else {
        const res = await client.completions.create(body, { signal: ctl.signal })
        text = res.choices[0]?.text ?? ''
        completionTokens = res.usage?.completion_tokens ?? null
      }
    } else {
      const body = {
        model: target.model,
        messages: [{ role: 'user' as const, content: req.prompt }],
        max_tokens: req.maxTokens,
        temperature: 0,
      }
      if (opts.stream) {
        const stream = await client.chat.completions.create(
          { ...body, stream: true, stream_options: { include_usage: true } },
          { signal: ctl.signal },
        )
        for await (const chunk of stream) {
          const piece = chunk.choices[0]?.delta?.content ?? ''
          if (piece) hadOutput = true
          text += piece
          if (chunk.usage) completionTokens = chunk.usage.completion_tokens
        }
      } else {
        const res = await client.chat.completions.create(body, { signal: ctl.signal })
        text = res.choices[0]?.message?.content ?? ''
        completionTokens = res.usage?.completion_tokens ?? null
      }
    }
    // The `openai` client ends an aborted stream's iteration without an error: look at the signal.
    if (ctl.signal.aborted) return abortedOutcome(ctl.signal, hadOutput, text)
    // Usage was asked for: a stream that ended without it was cut short, not finished.
    if (opts.stream && completionTokens === null)
      return { kind: 'error', errorKind: 'stream_truncated', hadOutput, text }
    return { kind: 'completed', text, completionTokens }
  } catch (err) {
    if (ctl.signal.aborted) return abortedOutcome(ctl.signal, hadOutput, text)
    return { kind: 'error', errorKind: errorKindOf(err, hadOutput), hadOutput, text }
  } finally {
    if (abortTimer) clearTimeout(abortTimer)
    clearTimeout(hangTimer)
  }
}

/** A request the soak's own signal ended: by the planned abort, or by the hang deadline. */
function abortedOutcome(signal: AbortSignal, hadOutput: boolean, text: string): Outcome {
  const isHung = signal.reason instanceof Error && signal.reason.message === 'hung'
  if (isHung) return { kind: 'error', errorKind: 'hung', hadOutput, text }
  return { kind: 'aborted', how: 'client_abort' }
}

/** The error kind of an `openai` client failure: the OpenAI error code (`stream_error:` prefixed
 *  when output had already begun), `http_<status>` without a code, `connection`, or `timeout`. */
export function errorKindOf(err: unknown, hadOutput: boolean): string {
  if (err instanceof OpenAI.APIConnectionTimeoutError) return 'timeout'
  if (err instanceof OpenAI.APIConnectionError) return 'connection'
  if (err instanceof OpenAI.APIError) {
    const code = typeof err.code === 'string' ? err.code : `http_${err.status ?? 'none'}`
    return hadOutput || err.status === undefined ? `stream_error:${code}` : code
  }
  return `client:${err instanceof Error ? err.name : typeof err}`
}

/** Send `req` on a raw socket and destroy the socket: after writing only part of the request
 *  (`partial`), or `afterMs` after writing all of it. Resolves once the socket is closed. */
export function sendAndDisconnect(
  target: Target,
  apiKey: string,
  req: SoakRequest,
  opts: { stream: boolean; afterMs: number; partial: boolean },
): Promise<Outcome> {
  const url = new URL(target.routerUrl)
  const path = req.endpoint === 'chat' ? '/v1/chat/completions' : '/v1/completions'
  const body = JSON.stringify({
    model: target.model,
    ...(req.endpoint === 'chat'
      ? { messages: [{ role: 'user', content: req.prompt }] }
      : { prompt: req.prompt }),
    max_tokens: req.maxTokens,
    temperature: 0,
    stream: opts.stream,
  })
  const head =
    `POST ${path} HTTP/1.1\r\nhost: ${url.host}\r\nauthorization: Bearer ${apiKey}\r\n` +
    `content-type: application/json\r\ncontent-length: ${Buffer.byteLength(body)}\r\n\r\n`
  const bytes = Buffer.from(head + body)
  return new Promise((resolve) => {
    const socket = net.connect({ host: url.hostname, port: Number(url.port) })
    const done = () => resolve({ kind: 'aborted', how: 'client_disconnect' })
    socket.once('close', done)
    socket.on('error', () => {}) // the close that follows settles it
    socket.on('data', () => {}) // read and drop whatever arrives before the cut
    socket.once('connect', () => {
      if (opts.partial) {
        socket.write(bytes.subarray(0, Math.max(1, Math.floor(bytes.length / 2))))
        setTimeout(() => socket.destroy(), opts.afterMs)
      } else {
        socket.write(bytes)
        setTimeout(() => socket.destroy(), opts.afterMs)
      }
    })
  })
}
