/** The router's end of the control channel (wire format: channel-frames.ts; the worker's end:
 *  channel-server.ts): one connection per worker, opened by an HTTP Upgrade
 *  (`GET /internal/channel`, `Upgrade: kvfence-control/1`) over the worker's TLS and with the
 *  cluster token, every request a stream numbered here. The connection closing fails every open
 *  stream with `worker_unavailable`; the next request opens a new one.
 *  Knows sockets, frames and streams; parses what the worker sends with messages.ts's schemas;
 *  knows nothing of the hand-off's checks (handoff.ts) or of OpenAI shapes. */
import http from 'node:http'
import https from 'node:https'
import type { Duplex } from 'node:stream'
import { z } from 'zod'
import {
  ChannelFrameError,
  encodeJsonFrame,
  encodeFrame,
  FrameReader,
  maxPayloadBytes,
  parseJsonPayload,
  tokenIdOf,
  type Frame,
  tuneChannelSocket,
} from './channel-frames.js'
import { channelPath, channelProtocol, frameWriter } from './channel-server.js'
import { clusterTokenHeader } from './cluster-token.js'
import {
  DecodeEvent,
  PrefillResult,
  type GenerateRequest,
  type PrefillRequest,
} from './messages.js'
import { KvfenceError } from '../common/errors.js'
import { clientTlsOptions, type TlsMaterial } from '../link/tls.js'
import { abortError } from './abort.js'
import { issueText } from './error-text.js'

/** One open channel to one worker. */
export interface ControlChannel {
  /** Opens a decode stream for `request`; its events, parsed. Ends after `done` or an `error`
   *  event; throws what {@link ChannelOptions.refusal} makes of a `failed` frame, or
   *  `worker_unavailable` when the connection closes. Aborting `signal` (or leaving the iteration)
   *  sends `cancel`, and the iteration throws an `AbortError`. */
  generate(request: GenerateRequest, signal: AbortSignal): AsyncIterableIterator<DecodeEvent>
  /** Opens a prefill stream for `request`; its result, parsed. Same failures as `generate`. */
  prefill(request: PrefillRequest, signal: AbortSignal): Promise<PrefillResult>
  /** Whether the connection is still open (a closed channel is never reused). */
  readonly isOpen: boolean
  close(): void
}

/** How to reach a worker's channel. */
export interface ChannelOptions {
  /** The worker's base URL (`http://host:port` or `https://…`); names it in messages. */
  url: string
  /** `prefill worker` or `decode worker`, for messages. */
  role: 'prefill' | 'decode'
  tls: TlsMaterial | null
  clusterToken: string | null
  /** Deadline of the upgrade, ms. */
  connectTimeoutMs: number
  /** The error for the worker's refusal of the upgrade with `status` (401/403 the cluster token,
   *  404 a peer without the channel), or of a stream (`failed`, status undefined) with `body` (`{ error: { code, message } }`). */
  refusal(status: number | undefined, body: unknown): KvfenceError
}

/** Opens the channel to `options.url`: the open channel, or a throw (a plain Error when it
 *  cannot connect, the {@link ChannelOptions.refusal} of any answer but the switch). */
export function openChannel(options: ChannelOptions): Promise<ControlChannel> {
  const base = new URL(options.url)
  const hostname = base.hostname.replace(/^\[(.*)\]$/, '$1')
  const isTls = base.protocol === 'https:'
  const headers: http.OutgoingHttpHeaders = {
    connection: 'Upgrade',
    upgrade: channelProtocol,
    ...(options.clusterToken === null ? {} : { [clusterTokenHeader]: options.clusterToken }),
  }
  const requestOptions: https.RequestOptions = {
    hostname,
    port: base.port,
    path: channelPath,
    method: 'GET',
    headers,
    agent: false,
    timeout: options.connectTimeoutMs,
    ...(isTls && options.tls !== null ? clientTlsOptions(options.tls, hostname) : {}),
  }
  const where = `${options.role} worker ${options.url}`
  return new Promise((resolve, reject) => {
    const req = (isTls ? https.request : http.request)(requestOptions)
    req.on('upgrade', (res, socket, head) => {
      req.setTimeout(0)
      socket.setTimeout(0)
      const protocol = String(res.headers.upgrade ?? '').toLowerCase()
      if (protocol !== channelProtocol) {
        socket.destroy()
        return reject(
          new Error(`the upgrade switched to ${JSON.stringify(protocol)}, not ${channelProtocol}`),
        )
      }
      resolve(channelOn(socket, head, where, options))
    })
    req.on('response', (res) => {
      const chunks: Buffer[] = []
      let numBytes = 0
      res.on('data', (chunk: Buffer) => {
        numBytes += chunk.length
        if (numBytes > maxPayloadBytes) {
          return req.destroy(new Error(`a refusal of the upgrade over ${maxPayloadBytes} bytes`))
        }
        chunks.push(chunk)
      })
      res.on('error', reject)
      res.on('end', () => {
        let body: unknown = null
        try {
          body = JSON.parse(Buffer.concat(chunks).toString('utf8'))
        } catch {
          // not JSON: the refusal names the status alone
        }
        reject(options.refusal(res.statusCode, body))
      })
    })
    req.on('timeout', () =>
      req.destroy(new Error(`no answer to the upgrade in ${options.connectTimeoutMs} ms`)),
    )
    req.on('error', (err) => reject(err))
    req.end()
  })
}

/** A stream's receiver: what its frames do. */
interface StreamReceiver {
  onFrame(frame: Frame): void
  /** The connection failed: `err` ends the stream. */
  onClose(err: KvfenceError): void
}

const WorkerFailure = z.object({ error: z.object({ code: z.string(), message: z.string() }) })

function channelOn(
  socket: Duplex,
  head: Buffer,
  where: string,
  options: ChannelOptions,
): ControlChannel {
  tuneChannelSocket(socket)
  const streams = new Map<number, StreamReceiver>()
  const reader = new FrameReader()
  const { write } = frameWriter(socket)
  let nextStream = 1
  let isOpen = true
  let closeError = new KvfenceError('worker_unavailable', `${where}: control channel closed`)

  const fail = (err: KvfenceError) => {
    if (!isOpen) return
    isOpen = false
    closeError = err
    const receivers = [...streams.values()]
    streams.clear()
    for (const receiver of receivers) receiver.onClose(err)
    socket.destroy()
  }
  const onData = (chunk: Buffer) => {
    try {
      for (const frame of reader.push(chunk)) {
        const receiver = streams.get(frame.stream)
        // A stream cancelled here may still get frames the worker sent before it heard.
        if (receiver !== undefined) receiver.onFrame(frame)
      }
    } catch (err) {
      const e =
        err instanceof KvfenceError
          ? new KvfenceError(err.code, `${where}: ${err.message}`)
          : new KvfenceError('internal_error', `${where}: ${String(err)}`)
      fail(e)
    }
  }
  socket.on('data', onData)
  socket.on('error', (err) =>
    fail(new KvfenceError('worker_unavailable', `${where}: control channel: ${err.message}`)),
  )
  socket.on('close', () => fail(closeError))
  socket.on('end', () => fail(closeError)) // the worker's end: never half-open
  if (head.length > 0) onData(head)

  /** A free stream number (u32, wrapping; never one still open). */
  const openStream = (receiver: StreamReceiver): number => {
    if (!isOpen) throw closeError
    let id = nextStream
    while (streams.has(id)) id = (id % 0xffff_ffff) + 1
    nextStream = (id % 0xffff_ffff) + 1
    streams.set(id, receiver)
    return id
  }
  const cancel = (id: number) => {
    if (streams.delete(id) && isOpen) write(encodeFrame('cancel', id, null))
  }
  /** The stream's refusal (`failed`), parsed. */
  const refusalOf = (frame: Frame): KvfenceError => {
    const parsed = WorkerFailure.safeParse(parseJsonPayload(frame))
    if (!parsed.success) {
      throw new ChannelFrameError(`a failed frame on stream ${frame.stream} without { error }`)
    }
    return options.refusal(undefined, parsed.data)
  }

  const forget = (id: number) => void streams.delete(id)
  /** A stream's view of this channel; its `send` writes `request` as the stream's first frame. */
  const hostOf = (kind: 'generate' | 'prefill', request: object): StreamHost => ({
    openStream,
    cancel,
    forget,
    refusalOf,
    where,
    send: (id) => write(encodeJsonFrame(kind, id, request)),
  })

  return {
    get isOpen() {
      return isOpen
    },
    close: () => fail(new KvfenceError('worker_unavailable', `${where}: control channel closed`)),
    generate: (request, signal) => decodeStream(request, signal, hostOf('generate', request)),
    prefill: (request, signal) => prefillStream(request, signal, hostOf('prefill', request)),
  }
}

/** The result of one prefill stream: `result` resolves it, `failed` or the connection's failure
 *  rejects it; aborting `signal` sends `cancel` and rejects with an `AbortError`. */
function prefillStream(
  request: PrefillRequest,
  signal: AbortSignal,
  host: StreamHost,
): Promise<PrefillResult> {
  return new Promise<PrefillResult>((resolve, reject) => {
    if (signal.aborted) return reject(abortError(signal))
    let id = 0
    const onAbort = () => {
      host.cancel(id)
      reject(abortError(signal))
    }
    const settle = () => signal.removeEventListener('abort', onAbort)
    id = host.openStream({
      onFrame(frame) {
        // The worker ended the stream; a frame that breaks the format fails it too (and,
        // thrown on, the connection).
        host.forget(id)
        settle()
        try {
          if (frame.kind === 'failed') return reject(host.refusalOf(frame))
          if (frame.kind !== 'result') {
            throw new ChannelFrameError(`a ${frame.kind} frame on prefill stream ${id}`)
          }
          const parsed = PrefillResult.safeParse(parseJsonPayload(frame))
          if (!parsed.success) {
            const why = issueText(parsed.error.issues[0])
            return reject(
              new KvfenceError('internal_error', `${host.where}: unexpected reply (${why})`),
            )
          }
          resolve(parsed.data)
        } catch (err) {
          reject(new KvfenceError('internal_error', `${host.where}: ${(err as Error).message}`))
          throw err
        }
      },
      onClose(err) {
        settle()
        reject(err)
      },
    })
    signal.addEventListener('abort', onAbort, { once: true })
    try {
      host.send(id)
    } catch (err) {
      host.forget(id) // never sent: nothing to cancel
      settle()
      reject(err as Error)
    }
  })
}

/** What a stream needs of its channel. */
interface StreamHost {
  openStream(receiver: StreamReceiver): number
  /** Forgets stream `id` and tells the worker to abort it. */
  cancel(id: number): void
  /** Forgets stream `id`, which the worker ended. */
  forget(id: number): void
  refusalOf(frame: Frame): KvfenceError
  send(id: number): void
  where: string
}

/** The events of one decode stream, as an iterator fed by frames: the stream opens on the first
 *  pull; events queue until pulled; `done` or an `error` event ends it. */
function decodeStream(
  request: GenerateRequest,
  signal: AbortSignal,
  host: StreamHost,
): AsyncIterableIterator<DecodeEvent> {
  const queue: DecodeEvent[] = []
  let failure: Error | null = null
  let isEnded = false // `done`/`error` queued, a failure, or closed by the consumer
  let id = 0 // 0: not yet opened
  let waiting: {
    resolve: (r: IteratorResult<DecodeEvent>) => void
    reject: (e: Error) => void
  } | null = null

  /** Ends the stream: `err` (thrown once the events before it were pulled), or normally. */
  const end = (err: Error | null) => {
    if (isEnded) return
    isEnded = true
    failure = err
    signal.removeEventListener('abort', onAbort)
    if (waiting !== null && queue.length === 0) {
      const w = waiting
      waiting = null
      if (failure !== null) w.reject(failure)
      else w.resolve({ value: undefined, done: true })
    }
  }
  const push = (event: DecodeEvent) => {
    if (waiting !== null) {
      const w = waiting
      waiting = null
      w.resolve({ value: event, done: false })
    } else queue.push(event)
  }
  const onAbort = () => {
    if (id !== 0) host.cancel(id)
    queue.length = 0
    end(abortError(signal))
  }
  const receiver: StreamReceiver = {
    onFrame(frame) {
      if (frame.kind === 'token') return push({ type: 'token', tokenId: tokenIdOf(frame) })
      if (frame.kind === 'failed') {
        const refusal = host.refusalOf(frame) // a throw leaves the stream to the connection's failure
        host.forget(id)
        return end(refusal)
      }
      if (frame.kind !== 'event') {
        throw new ChannelFrameError(`a ${frame.kind} frame on decode stream ${id}`)
      }
      const parsed = DecodeEvent.safeParse(parseJsonPayload(frame))
      if (!parsed.success) {
        throw new ChannelFrameError(
          `an invalid event on stream ${id} (${issueText(parsed.error.issues[0])})`,
        )
      }
      const event = parsed.data
      push(event)
      if (event.type === 'done' || event.type === 'error') {
        host.forget(id)
        end(null)
      }
    },
    onClose(err) {
      end(err)
    },
  }
  const open = () => {
    if (signal.aborted) return onAbort()
    try {
      id = host.openStream(receiver)
    } catch (err) {
      return end(err as Error)
    }
    signal.addEventListener('abort', onAbort, { once: true })
    try {
      host.send(id)
    } catch (err) {
      host.forget(id) // never sent: nothing to cancel
      end(err as Error)
    }
  }

  const iterator: AsyncIterableIterator<DecodeEvent> = {
    next() {
      if (id === 0 && !isEnded) open()
      if (queue.length > 0) return Promise.resolve({ value: queue.shift()!, done: false })
      if (failure !== null) return Promise.reject(failure)
      if (isEnded) return Promise.resolve({ value: undefined, done: true })
      return new Promise((resolve, reject) => (waiting = { resolve, reject }))
    },
    return() {
      if (!isEnded && id !== 0) host.cancel(id)
      queue.length = 0
      end(null)
      return Promise.resolve({ value: undefined, done: true })
    },
    [Symbol.asyncIterator]: () => iterator,
  }
  return iterator
}
