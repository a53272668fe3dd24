/** The prefill worker's side of the transfer, as a socket: a client for one decode worker address,
 *  holding one TCP connection to it, opened on first use, reopened after a teardown or a stalled
 *  transfer (which closes it), and shared by every transfer to that address (multiplexed by
 *  transfer id). The protocol — HELLO, each
 *  transfer's frames under the byte budget (G9), ACK/NACK, settling each transfer once only after
 *  its reads stopped (G7) — lives in send-session.ts, as the receiver's lives in session.ts.
 *  With `tls`, the connection is mutual TLS 1.3 against the cluster CA (src/link/tls.ts).
 *  Knows sockets, TLS, addresses and timeouts of connecting; knows nothing of pools or the model. */
import net from 'node:net'
import tls from 'node:tls'
import type { KvfenceError } from '../common/errors.js'
import { clientTlsOptions, describeTlsError, type TlsMaterial } from '../link/tls.js'
import { DEFAULT_MAX_FRAME_BYTES, MAX_PAGES_PER_FRAME } from './frames.js'
import { refusal } from './refusals.js'
import {
  abortedError,
  prepareBegin,
  SendSession,
  type OutgoingTransfer,
  type SenderCounters,
} from './send-session.js'

export type { OutgoingTransfer } from './send-session.js'

/** Options of {@link TransferClient}; each default sits beside its field. */
export interface TransferClientOptions {
  /** The decode worker's transfer address. */
  host: string
  port: number
  /** G9: most pages in one PAGES frame. Default 8. */
  maxPagesPerFrame?: number
  /** G9: most bytes per connection built or queued but not yet handed to the kernel. Default 4 MiB. */
  maxBytesInFlight?: number
  /** Frames are coalesced into writes of this many bytes (a frame larger than this is written
   *  alone). Default 256 KiB. */
  writeBytes?: number
  /** Largest frame sent, header included, bytes; must not exceed the receiver's cap. Default 64 MiB. */
  maxFrameBytes?: number
  /** A transfer making no progress (no frame built, no ACK after END) for this long fails
   *  (`stalled`) and closes the connection: the transfers sharing it fail (`connection_closed`),
   *  and the next transfer opens a new one. ms. Default 30 000. */
  stallTimeoutMs?: number
  /** Connecting to a decode worker (TLS handshake included) gives up after this long, ms.
   *  Default 5 000. */
  connectTimeoutMs?: number
  /** Mutual TLS against the cluster CA (loadTlsMaterial in src/link/tls.ts). Default: plaintext. */
  tls?: TlsMaterial
}

/** The client's frozen configuration. */
export interface SenderConfig {
  readonly host: string
  readonly port: number
  readonly maxPagesPerFrame: number
  readonly maxBytesInFlight: number
  readonly writeBytes: number
  readonly maxFrameBytes: number
  readonly stallTimeoutMs: number
  readonly connectTimeoutMs: number
  /** Null: plaintext. */
  readonly tls: TlsMaterial | null
}

/** The sender's frozen configuration from `options`. @throws RangeError on an out-of-range value. */
export function senderConfig(options: TransferClientOptions): SenderConfig {
  const config: SenderConfig = Object.freeze({
    host: options.host,
    port: options.port,
    maxPagesPerFrame: options.maxPagesPerFrame ?? 8,
    maxBytesInFlight: options.maxBytesInFlight ?? 4 * 1024 * 1024,
    writeBytes: options.writeBytes ?? 256 * 1024,
    maxFrameBytes: options.maxFrameBytes ?? DEFAULT_MAX_FRAME_BYTES,
    stallTimeoutMs: options.stallTimeoutMs ?? 30_000,
    connectTimeoutMs: options.connectTimeoutMs ?? 5_000,
    tls: options.tls ?? null,
  })
  const positive = (
    name: Exclude<keyof SenderConfig, 'host' | 'tls'>,
    max = Number.MAX_SAFE_INTEGER,
  ): void => {
    const value = config[name]
    if (!Number.isInteger(value) || value < 1 || value > max)
      throw new RangeError(`${name} must be an integer in [1, ${max}], got ${value}`)
  }
  if (typeof config.host !== 'string' || config.host.length === 0)
    throw new RangeError('host must be a non-empty string')
  positive('port', 65535)
  positive('maxPagesPerFrame', MAX_PAGES_PER_FRAME)
  positive('maxBytesInFlight')
  positive('writeBytes')
  positive('maxFrameBytes')
  positive('stallTimeoutMs')
  positive('connectTimeoutMs')
  return config
}

/** Counters and gauges of a {@link TransferClient}. */
export interface TransferClientStats {
  numConnections: number
  numActiveTransfers: number
  /** socket.write calls for PAGES-carrying buffers and control frames. */
  numWrites: number
  numBytesWritten: number
  /** Send buffers allocated, over all connections ever opened. */
  numBuffersAllocated: number
  /** Bytes of send buffers outstanding now / at most at once on one connection. */
  numBytesInFlight: number
  maxBytesInFlight: number
}

/** P's transfer client for one decode worker address; safe to share among concurrent requests. */
export class TransferClient {
  private readonly config: SenderConfig
  private connection: Connection | null = null
  private readonly counters: SenderCounters = {
    numWrites: 0,
    numBytesWritten: 0,
    numBuffersAllocated: 0,
    maxBytesInFlight: 0,
  }
  private isClosed = false

  /** @throws RangeError on a bad address or an out-of-range option. */
  constructor(options: TransferClientOptions) {
    this.config = senderConfig(options)
  }

  /** Send `t`'s pages to the decode worker. Resolves on ACK. Rejects with a KvfenceError
   *  (a TransferError, whose `reason` names the check): `transfer_failed` on NACK (message = the
   *  receiver's "<reason>: <detail> [decode worker: code]"), connection teardown or stall;
   *  `request_aborted` when `signal` aborts (an ABORT frame is sent).
   *  Settles only after the last `readPage` call has returned and the socket let go of every page
   *  view (`viewPage`) it was given: P may unpin its pages then.
   *  Rejects with TypeError/RangeError, before any page is read, on a malformed transfer (ids,
   *  counts, secret shorter than 16 bytes, a page too large for one frame). */
  async send(t: OutgoingTransfer, signal?: AbortSignal): Promise<void> {
    const begin = prepareBegin(t, this.config.maxFrameBytes)
    if (signal?.aborted) throw abortedError(t.transferId, signal)
    if (this.isClosed)
      throw refusal('client_closed', `transfer ${t.transferId}: the client is closed`)
    if (this.connection === null || this.connection.session.isClosed)
      this.connection = new Connection(this.config, this.counters)
    await this.connection.session.send(t, begin, signal)
  }

  /** Close the connection; transfers in flight reject (`client_closed`) once their reads stopped.
   *  Resolves once the socket is closed. Later sends reject. Idempotent. */
  async close(): Promise<void> {
    this.isClosed = true
    const connection = this.connection
    if (connection === null) return
    connection.session.destroy(refusal('client_closed', 'the transfer client is closing'))
    await connection.closed
  }

  /** Counters since creation and current gauges. */
  get stats(): TransferClientStats {
    const session = this.connection?.session
    return {
      ...this.counters,
      numConnections: session === undefined || session.isClosed ? 0 : 1,
      numActiveTransfers: session?.numActiveTransfers ?? 0,
      numBytesInFlight: session?.numBytesInFlight ?? 0,
    }
  }

  /** Assert the connection's invariants. @throws Error naming what broke. */
  check(): void {
    this.connection?.session.check()
  }
}

/** One TCP (or TLS) connection to one decode worker and the send session running on it. */
class Connection {
  readonly session: SendSession
  /** Resolves when the socket has closed. */
  readonly closed: Promise<void>
  private readonly socket: net.Socket
  /** Why the socket failed, if it reported an error before closing. */
  private errorReason: KvfenceError | null = null

  constructor(config: SenderConfig, counters: SenderCounters) {
    const name = `${config.host}:${config.port}`
    const address = { host: config.host, port: config.port, noDelay: true }
    this.socket =
      config.tls === null
        ? net.connect(address)
        : tls.connect({ ...address, ...clientTlsOptions(config.tls, config.host) })
    this.socket.setKeepAlive(true, 10_000)
    const socket = this.socket
    this.session = new SendSession(
      config,
      {
        write: (bytes, onWritten) => {
          socket.write(bytes, onWritten)
        },
        writev: (chunks, onWritten) => {
          socket.cork()
          const last = chunks.length - 1
          for (let i = 0; i < last; i++) socket.write(chunks[i])
          socket.write(chunks[last], onWritten)
          socket.uncork()
        },
        destroy: () => socket.destroy(),
        setBusy: (isBusy) => (isBusy ? socket.ref() : socket.unref()),
      },
      counters,
      name,
    )
    const connectTimer = setTimeout(
      () =>
        this.session.destroy(
          refusal(
            'connection_closed',
            `could not connect to ${name} within ${config.connectTimeoutMs} ms`,
          ),
        ),
      config.connectTimeoutMs,
    )
    socket.once(config.tls === null ? 'connect' : 'secureConnect', () => clearTimeout(connectTimer))
    let hasReply = false
    socket.on('data', (chunk: Buffer) => {
      hasReply = true
      this.session.push(chunk)
    })
    socket.on('error', (err) => {
      this.errorReason ??= refusal(
        'connection_closed',
        `transfer to ${name}: ${describeTlsError(err)}`,
      )
    })
    this.closed = new Promise((resolve) =>
      socket.once('close', () => {
        clearTimeout(connectTimer)
        // In TLS 1.3 the server checks the client's certificate after the client's side of the
        // handshake is done; a refused certificate shows here only as a close before D's HELLO.
        const closed =
          config.tls !== null && !hasReply
            ? `transfer to ${name}: TLS handshake failed: the receiver closed the connection before its HELLO (does it trust this part's certificate?)`
            : `${name} closed the connection`
        this.session.teardown(this.errorReason ?? refusal('connection_closed', closed))
        resolve()
      }),
    )
  }
}
