/** The decode worker's transfer endpoint: a TCP server that gives each connection a
 *  {@link ReceiveSession} and tears sessions down with their sockets. With `tls`, each connection
 *  first completes a mutual TLS 1.3 handshake against the cluster CA (src/link/tls.ts): a peer without a
 *  certificate from it is dropped then, and no session ever sees a byte of it.
 *  Knows sockets, TLS and the receiver's configuration; the checks live in receive-session.ts, the pool behind
 *  the {@link ReceiverHooks}. A misbehaving peer can end its own connection, never the server. */
import net from 'node:net'
import tls from 'node:tls'
import type { KvfenceError } from '../common/errors.js'
import { logRefusedHandshakes, serverTlsOptions, type TlsMaterial } from '../link/tls.js'
import { DEFAULT_MAX_FRAME_BYTES, HEADER_BYTES } from './frames.js'
import { refusal } from './refusals.js'
import {
  ReceiveSession,
  type ReceiverConfig,
  type ReceiverCounters,
  type ReceiverHooks,
  type TransferLog,
} from './receive-session.js'

export type {
  BeginInfo,
  ReceiverConfig,
  ReceiverCounters,
  ReceiverHooks,
  Reservation,
  TransferLog,
} from './receive-session.js'

/** Options of {@link TransferServer}; each default sits beside its field. */
export interface TransferServerOptions {
  /** G4: verify ordering, completeness, token counts, checksums and manifest. Default true.
   *  False is the unsafe mode that reproduces the incident: whatever arrived is ACKed. */
  verifyManifest?: boolean
  /** G10: verify BEGIN's and END's MACs under the request's secret. Default true. */
  verifyAuth?: boolean
  /** Cap on one frame, header included, bytes. Default 64 MiB. */
  maxFrameBytes?: number
  /** A transfer with no frame for this long is refused (NACK + abort), ms. Default 30 000. */
  stallTimeoutMs?: number
  /** Ended transfer ids remembered per connection (late frames for them are dropped). Default 4096. */
  maxEndedIds?: number
  /** Where refusals are reported. Default: nowhere. */
  log?: TransferLog
  /** Fault injection only (`lost-ack`): never send ACKs. Default false. */
  dropAcks?: boolean
  /** Mutual TLS against the cluster CA (loadTlsMaterial in src/link/tls.ts). Default: plaintext. */
  tls?: TlsMaterial
}

const silentLog: TransferLog = { warn: () => {} }

/** After refusing a connection, how long its NACKs may take to flush before the socket is destroyed, ms. */
const closeGraceMs = 1_000

/** The receiver's frozen configuration from `options`. Logs (warn) every guard turned off.
 *  @throws RangeError on a non-positive limit. */
export function receiverConfig(options: TransferServerOptions = {}): ReceiverConfig {
  const config: ReceiverConfig = Object.freeze({
    verifyManifest: options.verifyManifest ?? true,
    verifyAuth: options.verifyAuth ?? true,
    maxFrameBytes: options.maxFrameBytes ?? DEFAULT_MAX_FRAME_BYTES,
    stallTimeoutMs: options.stallTimeoutMs ?? 30_000,
    maxEndedIds: options.maxEndedIds ?? 4096,
    log: options.log ?? silentLog,
    dropAcks: options.dropAcks ?? false,
  })
  if (!Number.isInteger(config.maxFrameBytes) || config.maxFrameBytes < HEADER_BYTES + 64)
    throw new RangeError(
      `maxFrameBytes must be an integer ≥ ${HEADER_BYTES + 64}, got ${config.maxFrameBytes}`,
    )
  if (!(config.stallTimeoutMs > 0))
    throw new RangeError(`stallTimeoutMs must be > 0, got ${config.stallTimeoutMs}`)
  if (!Number.isInteger(config.maxEndedIds) || config.maxEndedIds < 1)
    throw new RangeError(`maxEndedIds must be an integer ≥ 1, got ${config.maxEndedIds}`)
  if (!config.verifyManifest)
    config.log.warn({ guard: 'G4' }, 'UNSAFE: transfer manifest verification is off')
  if (!config.verifyAuth)
    config.log.warn({ guard: 'G10' }, 'UNSAFE: transfer authentication is off')
  return config
}

/** Counters and gauges of a {@link TransferServer}. */
export interface TransferServerStats extends ReceiverCounters {
  numConnections: number
  numActiveTransfers: number
}

/** D's transfer server: a `net.Server` (listen with `server.listen(port, host, cb)`; port 0 picks
 *  a free one, read back from `.port`) that verifies transfers and hands their pages to the hooks. */
export class TransferServer extends net.Server {
  private readonly config: ReceiverConfig
  private readonly sessions = new Map<net.Socket, ReceiveSession>()
  private readonly counters: ReceiverCounters = {
    numStarted: 0,
    numCompleted: 0,
    numAborted: 0,
    numRefused: 0,
  }
  private isClosing = false
  /** Runs the handshake of each accepted connection when TLS is on (it never listens itself). */
  private readonly tlsServer: tls.Server | null
  /** Accepted TCP sockets under TLS (in the handshake or carrying a session), so that closing
   *  the server need not wait for a handshake's timeout. */
  private readonly tlsSockets = new Set<net.Socket>()

  /** @throws RangeError on bad options. */
  constructor(
    private readonly hooks: ReceiverHooks,
    options: TransferServerOptions = {},
  ) {
    super({ noDelay: true })
    this.config = receiverConfig(options)
    this.tlsServer = options.tls === undefined ? null : this.handshakes(options.tls)
    this.on('connection', (socket: net.Socket) => {
      if (this.tlsServer === null) return this.onConnection(socket)
      this.tlsSockets.add(socket)
      socket.once('close', () => this.tlsSockets.delete(socket))
      this.tlsServer.emit('connection', socket)
    })
    // Accept errors (e.g. EMFILE) are logged; listen errors still reach the caller's 'error' listener.
    this.on('error', (err) => this.config.log.warn({ err: String(err) }, 'transfer server error'))
  }

  /** Whether connections run over mutual TLS. */
  get isTls(): boolean {
    return this.tlsServer !== null
  }

  /** The TCP port the server listens on. @throws Error if it is not listening. */
  get port(): number {
    const address = this.address()
    if (address === null || typeof address === 'string')
      throw new Error('transfer server is not listening')
    return address.port
  }

  /** Counters since start, and current gauges. */
  get stats(): TransferServerStats {
    let numActiveTransfers = 0
    for (const session of this.sessions.values()) numActiveTransfers += session.numActiveTransfers
    return { ...this.counters, numConnections: this.sessions.size, numActiveTransfers }
  }

  /** Tear down every connection now: each in-flight transfer gets `abort(reason)` before this
   *  returns; the peers see their connections close. The server keeps listening. */
  destroyConnections(
    reason: KvfenceError = refusal('connection_closed', 'closed by the receiver'),
  ): void {
    for (const [socket, session] of [...this.sessions]) {
      session.teardown(reason)
      socket.destroy()
    }
    for (const socket of [...this.tlsSockets]) socket.destroy()
  }

  /** Stop listening and tear down every connection (in-flight transfers get `abort` before this
   *  returns); `callback` runs once the server is closed. */
  override close(callback?: (err?: Error) => void): this {
    this.isClosing = true
    super.close(callback)
    this.destroyConnections(refusal('server_closed', 'the transfer server is shutting down'))
    return this
  }

  /** Assert the invariants of every session and the counters. @throws Error naming what broke. */
  check(): void {
    let numActive = 0
    for (const session of this.sessions.values()) {
      session.check()
      numActive += session.numActiveTransfers
    }
    const { numStarted, numCompleted, numAborted } = this.counters
    if (numStarted !== numCompleted + numAborted + numActive)
      throw new Error(
        `transfers leaked or ended twice: ${numStarted} started != ${numCompleted} completed + ${numAborted} aborted + ${numActive} active`,
      )
  }

  /** A TLS server fed the accepted sockets: only a connection whose handshake succeeded, the
   *  client's certificate verified against the CA, reaches {@link onConnection}. */
  private handshakes(material: TlsMaterial): tls.Server {
    const server = tls.createServer(serverTlsOptions(material))
    server.on('secureConnection', (socket: tls.TLSSocket) => this.onConnection(socket))
    logRefusedHandshakes(server, 'transfer connection', this.config.log)
    return server
  }

  private onConnection(socket: net.Socket): void {
    if (this.isClosing) {
      socket.destroy()
      return
    }
    socket.setNoDelay(true)
    socket.setKeepAlive(true, 10_000)
    const peer = `${socket.remoteAddress}:${socket.remotePort}`
    const session = new ReceiveSession(
      this.hooks,
      this.config,
      {
        write: (bytes) => {
          if (!socket.destroyed && socket.writable) socket.write(bytes)
        },
        close: () => {
          if (socket.destroyed) return
          socket.end(() => socket.destroy())
          // A peer that does not read must not keep a half-closed socket alive.
          setTimeout(() => socket.destroy(), closeGraceMs).unref()
        },
      },
      this.counters,
    )
    this.sessions.set(socket, session)
    let lastError: Error | null = null
    socket.on('data', (chunk: Buffer) => session.push(chunk))
    socket.on('error', (err) => {
      lastError = err
    })
    socket.on('close', () => {
      this.sessions.delete(socket)
      const why = lastError ? `: ${lastError.message}` : ''
      session.teardown(refusal('connection_closed', `connection from ${peer} closed${why}`))
    })
  }
}
