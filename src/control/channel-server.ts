/** The worker's end of the control channel (wire format: channel-frames.ts): the HTTP Upgrade
 *  `GET /internal/channel` (`Upgrade: kvfence-control/1`) on the worker's control port, checked
 *  as the worker's other `/internal/*` route is (mutual TLS in the handshake, then the cluster
 *  token, before the switch), then one stream per request step the router opens. A `cancel`
 *  frame, or the connection closing, aborts a stream's request (G8).
 *  Knows frames, streams and the upgrade; the work is the service's (src/engine/worker-server.ts
 *  gives it the worker's, test stand-ins theirs). */
import type http from 'node:http'
import { STATUS_CODES } from 'node:http'
import type https from 'node:https'
import type { Duplex } from 'node:stream'
import { KvfenceError } from '../common/errors.js'
import {
  ChannelFrameError,
  encodeFrame,
  encodeJsonFrame,
  FrameReader,
  parseJsonPayload,
  type Frame,
  tuneChannelSocket,
} from './channel-frames.js'
import { clusterTokenHeader, isClusterTokenValid } from './cluster-token.js'
import {
  GenerateRequest,
  PrefillRequest,
  type DecodeEvent,
  type PrefillResult,
} from './messages.js'

/** The path and protocol of the upgrade. */
export const channelPath = '/internal/channel'
export const channelProtocol = 'kvfence-control/1'

/** Where a decode stream's events go. */
export interface EventSink {
  /** False once the router cancelled the stream or the connection closed. */
  readonly isOpen: boolean
  /** Sends `event` (a no-op once closed). */
  write(event: DecodeEvent): void
}

/** What a worker serves over the channel. */
export interface ChannelService {
  /** A decode worker's work on one request: events to `sink`; a throw before the first event is
   *  the worker's refusal (the stream's `failed` frame), after it the service writes an `error`
   *  event itself.
   *  `closed` aborts when the router cancels or the connection closes. Absent on a prefill
   *  worker (the stream fails with `not_found`). */
  generate?(request: GenerateRequest, closed: AbortSignal, sink: EventSink): Promise<void>
  /** A prefill worker's work on one request: its result, or a throw (the `failed` frame). */
  prefill?(request: PrefillRequest, closed: AbortSignal): Promise<PrefillResult>
}

/** Options of {@link acceptChannels}. */
export interface ChannelServerOptions {
  /** The token the upgrade must carry (header `x-kvfence-cluster-token`); null = none needed. */
  clusterToken: string | null
  /** Hears a connection that failed (a malformed frame, a socket error): for the log. */
  onConnectionError?: (err: Error) => void
}

/** The channels a server holds. */
export interface ChannelCount {
  /** Channel connections open now. */
  readonly numOpen: number
}

/** After closing a channel, how long its last frames may take to flush before the socket is
 *  destroyed (a router that does not read must not keep the server from closing), ms. */
const closeGraceMs = 1_000

/** Serves the control channel on `server` (its 'upgrade' event): upgrades to any other path or
 *  protocol are answered 404, a missing or wrong cluster token 401, both as JSON errors.
 *  Closing `server` (`server.close()`) closes every channel connection too, as a worker's exit
 *  does: each open stream's request is aborted (G8), the frames already produced are flushed, and
 *  the router fails the streams it still had open with `worker_unavailable`. Upgraded sockets are
 *  outside what `server.close()` ends, and it would not call back while one is open, so this
 *  wraps `server.close` of this server. Upgrades after the close (until it listens again) are
 *  dropped. */
export function acceptChannels(
  server: http.Server | https.Server,
  service: ChannelService,
  options: ChannelServerOptions,
): ChannelCount {
  const count = { numOpen: 0 }
  /** Each open connection's closer. */
  const closers = new Set<() => void>()
  let isClosing = false
  const closeServer = server.close.bind(server)
  server.close = (callback?: (err?: Error) => void) => {
    isClosing = true
    for (const close of [...closers]) close()
    closeServer(callback)
    return server
  }
  server.on('listening', () => (isClosing = false)) // listening again after a close
  server.on('upgrade', (req: http.IncomingMessage, socket: Duplex, head: Buffer) => {
    if (isClosing) return void socket.destroy()
    const path = (req.url ?? '/').split('?')[0]
    const protocol = String(req.headers.upgrade ?? '').toLowerCase()
    if (req.method !== 'GET' || path !== channelPath || protocol !== channelProtocol) {
      return refuseUpgrade(
        socket,
        new KvfenceError('not_found', `no upgrade to ${protocol} on ${req.method} ${path}`),
      )
    }
    if (
      options.clusterToken !== null &&
      !isClusterTokenValid(options.clusterToken, req.headers[clusterTokenHeader])
    ) {
      return refuseUpgrade(
        socket,
        new KvfenceError('invalid_api_key', 'control-plane request without the cluster token'),
      )
    }
    socket.write(
      `HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: ${channelProtocol}\r\n\r\n`,
    )
    count.numOpen++
    const close = serveConnection(socket, head, service, options)
    closers.add(close)
    socket.once('close', () => {
      count.numOpen--
      closers.delete(close)
    })
  })
  return count
}

function refuseUpgrade(socket: Duplex, err: KvfenceError): void {
  const body = JSON.stringify({ error: { code: err.code, message: err.message } })
  socket.end(
    `HTTP/1.1 ${err.status} ${STATUS_CODES[err.status] ?? 'Error'}\r\n` +
      `Content-Type: application/json\r\nContent-Length: ${Buffer.byteLength(body)}\r\n` +
      `Connection: close\r\n\r\n${body}`,
  )
}

/** One stream's state on the worker. */
interface StreamState {
  readonly closed: AbortController
  isOpen: boolean
}

/** Reads the router's frames on `socket` and runs each stream's request. Returns the
 *  connection's closer: it aborts every open stream's request, flushes the frames already
 *  produced, and ends the socket (destroyed after {@link closeGraceMs} if the router does not
 *  read). */
function serveConnection(
  socket: Duplex,
  head: Buffer,
  service: ChannelService,
  options: ChannelServerOptions,
): () => void {
  tuneChannelSocket(socket)
  const streams = new Map<number, StreamState>()
  const reader = new FrameReader()
  const { write, flush } = frameWriter(socket)
  let isConnectionOpen = true

  const closeStream = (id: number, state: StreamState) => {
    state.isOpen = false
    if (streams.get(id) === state) streams.delete(id)
  }
  const fail = (id: number, state: StreamState, err: unknown) => {
    if (!state.isOpen) return
    const e = asKvfenceError(err)
    write(encodeJsonFrame('failed', id, { error: { code: e.code, message: e.message } }))
    closeStream(id, state)
  }

  const onFrame = (frame: Frame) => {
    const id = frame.stream
    if (frame.kind === 'cancel') {
      const state = streams.get(id)
      if (state !== undefined) {
        closeStream(id, state)
        state.closed.abort()
      }
      return
    }
    if (frame.kind !== 'generate' && frame.kind !== 'prefill') {
      throw new ChannelFrameError(`a ${frame.kind} frame from the router (stream ${id})`)
    }
    if (streams.has(id)) throw new ChannelFrameError(`stream ${id} opened twice`)
    const state: StreamState = { closed: new AbortController(), isOpen: true }
    streams.set(id, state)
    const body = parseJsonPayload(frame)
    if (frame.kind === 'generate') {
      const sink: EventSink = {
        get isOpen() {
          return state.isOpen
        },
        write(event) {
          if (!state.isOpen) return
          write(
            event.type === 'token' && event.logprobs === undefined
              ? encodeFrame('token', id, event.tokenId)
              : encodeJsonFrame('event', id, event),
          )
          if (event.type === 'done' || event.type === 'error') closeStream(id, state)
        },
      }
      void (async () => {
        if (service.generate === undefined) throw notServed('generate')
        const request = GenerateRequest.parse(body)
        await service.generate(request, state.closed.signal, sink)
        // A service that ended without `done` or `error`: the stream fails, as the router
        // would fail a stream that ended without `done`.
        if (state.isOpen)
          fail(id, state, new KvfenceError('internal_error', 'generate ended without done'))
      })().catch((err: unknown) => fail(id, state, err))
    } else {
      void (async () => {
        if (service.prefill === undefined) throw notServed('prefill')
        const request = PrefillRequest.parse(body)
        const result = await service.prefill(request, state.closed.signal)
        if (!state.isOpen) return
        write(encodeJsonFrame('result', id, result))
        closeStream(id, state)
      })().catch((err: unknown) => fail(id, state, err))
    }
  }

  const closeAll = () => {
    if (!isConnectionOpen) return
    isConnectionOpen = false
    for (const [id, state] of streams) {
      closeStream(id, state)
      state.closed.abort()
    }
  }
  const onData = (chunk: Buffer) => {
    try {
      for (const frame of reader.push(chunk)) onFrame(frame)
    } catch (err) {
      options.onConnectionError?.(err as Error)
      closeAll()
      socket.destroy()
    }
  }
  socket.on('data', onData)
  socket.on('error', (err) => options.onConnectionError?.(err))
  socket.on('close', closeAll)
  // An upgraded socket of an HTTP server is half-open: the router's end (its process stopped, its
  // channel closed) would otherwise leave this side open and its requests running.
  socket.on('end', () => {
    closeAll()
    socket.destroy()
  })
  if (head.length > 0) onData(head)
  return () => {
    closeAll()
    flush()
    socket.end(() => socket.destroy())
    setTimeout(() => socket.destroy(), closeGraceMs).unref()
  }
}

/** Frames out on one socket. */
export interface FrameWriter {
  /** Queues `frame`; the frames of one event-loop turn go in one socket write. */
  write(frame: Buffer): void
  /** Writes the queued frames now. Frames after the socket ended or was destroyed are dropped. */
  flush(): void
}

/** A {@link FrameWriter} on `socket`. */
export function frameWriter(socket: Duplex): FrameWriter {
  let pending: Buffer[] = []
  const flush = () => {
    const frames = pending
    pending = []
    if (frames.length === 0 || socket.destroyed || socket.writableEnded) return
    socket.write(frames.length === 1 ? frames[0] : Buffer.concat(frames))
  }
  return {
    write(frame) {
      if (pending.length === 0) setImmediate(flush)
      pending.push(frame)
    },
    flush,
  }
}

function notServed(what: string): KvfenceError {
  return new KvfenceError('not_found', `this worker does not ${what}`)
}

/** `err` as a KvfenceError: a zod parse error is `invalid_request`, anything else not coded
 *  `internal_error`. Also the worker's outcome label (src/engine/worker-server.ts). */
export function asKvfenceError(err: unknown): KvfenceError {
  if (err instanceof KvfenceError) return err
  if (err && typeof err === 'object' && 'issues' in err) {
    return new KvfenceError(
      'invalid_request',
      `invalid control message: ${(err as unknown as Error).message}`,
    )
  }
  return new KvfenceError('internal_error', err instanceof Error ? err.message : String(err))
}
