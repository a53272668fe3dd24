/** The prefill worker's side of the transfer: a client for one decode worker address, holding one
 *  TCP connection to it, opened on first use (HELLO first), reopened after a teardown, and shared
 *  by every transfer to that address (multiplexed by transfer id). Each transfer is BEGIN
 *  (authenticated, G10), bounded PAGES batches built in place in reused send buffers under a byte
 *  budget (G9), and END with the manifest (G4) and its MAC (G10); it settles on ACK, NACK, abort,
 *  stall or teardown —
 *  and only once no more reads of its pages can happen, so P may unpin them then (G7).
 *  Knows sockets and frames; knows nothing of pools or the model: pages are read through
 *  {@link OutgoingTransfer.readPage}. */
import net from 'node:net'
import { KvfenceError } from '../errors.js'
import { beginMac, EndMacBuilder } from './auth.js'
import { ManifestHasher, pageChecksum } from './checksum.js'
import {
  DEFAULT_MAX_FRAME_BYTES,
  HEADER_BYTES,
  MAX_PAGES_PER_FRAME,
  PAGES_HEAD_BYTES,
  PAGE_HEAD_BYTES,
  PROTOCOL_VERSION,
  ZERO_TRANSFER_ID,
  encodeAbort,
  encodeBegin,
  encodeBeginFields,
  encodeEnd,
  encodeHello,
  pagesFrameBytes,
  writeHeader,
  writePageHead,
  writePagesHead,
  type BeginFields,
  type Frame,
} from './frames.js'
import { FrameParser } from './parser.js'
import { asKvfenceError, refusal, refusalFromWire } from './refusals.js'
import { SendBuffers } from './send-buffers.js'

/** One transfer P sends to D: BEGIN's fields (ids are 32 lowercase hex digits) and the rest. */
export interface OutgoingTransfer extends BeginFields {
  /** The router-issued per-request secret (≥ 16 bytes); BEGIN carries its HMAC. */
  secret: Buffer
  firstTokenId: number
  /** Copy page `ordinal`'s payload into dst (dst.length === pageBytes); return tokens on that page. */
  readPage(ordinal: number, dst: Uint8Array): number
  /** Fault injection only: which ordinals to actually send (default: all, in order). */
  ordinalsToSend?: number[]
  /** Fault injection only: flip one bit in each payload after its checksum was computed (the top
   *  exponent bit of the payload's middle float32). */
  corruptPayload?: boolean
}

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
  /** A transfer making no progress (no frame built, no ACK after END) for this long is aborted, ms.
   *  Default 30 000. */
  stallTimeoutMs?: number
  /** Connecting to a decode worker gives up after this long, ms. Default 5 000. */
  connectTimeoutMs?: number
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
  })
  const positive = (
    name: Exclude<keyof SenderConfig, 'host'>,
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

interface ClientCounters {
  numWrites: number
  numBytesWritten: number
  numBuffersAllocated: number
  maxBytesInFlight: number
}

/** P's transfer client for one decode worker address; safe to share among concurrent requests. */
export class TransferClient {
  private readonly config: SenderConfig
  private peer: Peer | null = null
  private readonly counters: ClientCounters = {
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

  /** Send `t`'s pages to the decode worker. Resolves on ACK. Rejects with a KvfenceError:
   *  `transfer_failed` on NACK (message = the receiver's "<reason>: <detail> [decode worker: code]"),
   *  connection teardown or stall; `request_aborted` when `signal` aborts (an ABORT frame is sent).
   *  Settles only after the last `readPage` call has returned: P may unpin its pages then.
   *  Rejects with TypeError/RangeError, before any page is read, on a malformed transfer (ids,
   *  counts, secret shorter than 16 bytes, a page too large for one frame). */
  async send(t: OutgoingTransfer, signal?: AbortSignal): Promise<void> {
    const begin = this.prepareBegin(t)
    if (signal?.aborted) throw abortedError(t.transferId, signal)
    if (this.isClosed)
      throw refusal('client_closed', `transfer ${t.transferId}: the client is closed`)
    const peer = this.connection()
    const s = peer.start(t, begin)
    const onAbort = (): void => peer.fail(s, abortedError(t.transferId, signal!), true)
    signal?.addEventListener('abort', onAbort, { once: true })
    try {
      await peer.pump(s)
      const err = await s.outcome
      if (err !== null) throw err
    } finally {
      signal?.removeEventListener('abort', onAbort)
      peer.finish(s)
    }
  }

  /** Close the connection; transfers in flight reject (`client_closed`) once their reads stopped.
   *  Resolves once the socket is closed. Later sends reject. Idempotent. */
  async close(): Promise<void> {
    this.isClosed = true
    const peer = this.peer
    if (peer === null) return
    peer.destroy(refusal('client_closed', 'the transfer client is closing'))
    await peer.closed
  }

  /** Counters since creation and current gauges. */
  get stats(): TransferClientStats {
    const peer = this.peer
    return {
      ...this.counters,
      numConnections: peer === null || peer.isClosed ? 0 : 1,
      numActiveTransfers: peer?.numActiveTransfers ?? 0,
      numBytesInFlight: peer?.numBytesInFlight ?? 0,
    }
  }

  /** Assert the connection's invariants. @throws Error naming what broke. */
  check(): void {
    this.peer?.check()
  }

  /** Validate `t` and build its BEGIN bytes (MAC included). @throws TypeError/RangeError. */
  private prepareBegin(t: OutgoingTransfer): Buffer {
    const fields: BeginFields = {
      transferId: t.transferId,
      requestId: t.requestId,
      tenant: t.tenant,
      numTokens: t.numTokens,
      numPages: t.numPages,
      pageBytes: t.pageBytes,
    }
    encodeBeginFields(fields) // throws on malformed fields
    if (!Number.isInteger(t.firstTokenId) || t.firstTokenId < 0 || t.firstTokenId > 0xffff_ffff)
      throw new RangeError(`firstTokenId must be a u32, got ${t.firstTokenId}`)
    if (pagesFrameBytes(1, t.pageBytes) > this.config.maxFrameBytes)
      throw new RangeError(
        `a page of ${t.pageBytes} bytes does not fit a frame of ${this.config.maxFrameBytes} bytes`,
      )
    for (const ordinal of t.ordinalsToSend ?? [])
      if (!Number.isInteger(ordinal) || ordinal < 0 || ordinal > 0xffff_ffff)
        throw new RangeError(`ordinalsToSend holds ${ordinal}, not a u32`)
    return encodeBegin({ ...fields, mac: beginMac(t.secret, fields) })
  }

  /** The open connection, or a new one after a teardown. */
  private connection(): Peer {
    if (this.peer === null || this.peer.isClosed) this.peer = new Peer(this.config, this.counters)
    return this.peer
  }
}

function abortedError(transferId: string, signal: AbortSignal): KvfenceError {
  const why =
    signal.reason instanceof Error ? signal.reason.message : String(signal.reason ?? 'aborted')
  return refusal('aborted_by_sender', `transfer ${transferId}: ${why}`, 'request_aborted')
}

// ─── One connection ─────────────────────────────────────────────────────────────────────────────

/** A transfer's phases on P. Only Peer assigns them. */
type SendPhase = 'sending' | 'awaiting_ack' | 'settled'

interface Outgoing {
  readonly t: OutgoingTransfer
  readonly begin: Buffer
  phase: SendPhase
  /** Set once, by `fail`; the pump stops at its next check. */
  failure: KvfenceError | null
  /** The pump must send ABORT when it stops (the failure came while it was running). */
  needsAbortFrame: boolean
  /** True once the pump returned: no readPage call can happen any more. */
  isPumpDone: boolean
  readonly outcome: Promise<KvfenceError | null>
  settle(err: KvfenceError | null): void
  timer: NodeJS.Timeout | null
}

/** What END carries about the pages sent, built page by page in send order. */
interface PageDigests {
  readonly manifest: ManifestHasher
  readonly endMac: EndMacBuilder
}

/** Connection phases. Only Peer assigns them. */
type PeerPhase = 'awaiting_hello' | 'open' | 'closed'

/** One TCP connection to one decode worker, multiplexing transfers. */
class Peer {
  private phase: PeerPhase = 'awaiting_hello'
  private readonly socket: net.Socket
  private readonly parser: FrameParser
  private readonly buffers: SendBuffers
  private readonly transfers = new Map<string, Outgoing>()
  /** The buffer frames are being added to, and its filled length. */
  private current: Buffer | null = null
  private numUsed = 0
  /** A PAGES frame is being built in `current`: control frames wait in `deferred`. */
  private isEncoding = false
  private readonly deferred: Buffer[] = []
  private connectTimer: NodeJS.Timeout | null
  private closeReason: KvfenceError | null = null
  /** Resolves when the socket has closed. */
  readonly closed: Promise<void>

  constructor(
    private readonly config: SenderConfig,
    private readonly counters: ClientCounters,
  ) {
    this.buffers = new SendBuffers(
      config.writeBytes,
      Math.max(config.maxBytesInFlight, config.writeBytes),
      () => {
        counters.numBuffersAllocated++
      },
    )
    this.parser = new FrameParser(
      {
        frame: (f) => this.onFrame(f),
        error: (e) => this.destroy(refusal(e.reason, `from ${this.name}: ${e.message}`)),
      },
      { maxFrameBytes: 64 * 1024 },
    )
    this.socket = net.connect({ host: config.host, port: config.port, noDelay: true })
    this.socket.setKeepAlive(true, 10_000)
    this.connectTimer = setTimeout(
      () =>
        this.destroy(
          refusal(
            'connection_closed',
            `could not connect to ${this.name} within ${config.connectTimeoutMs} ms`,
          ),
        ),
      config.connectTimeoutMs,
    )
    this.socket.once('connect', () => this.clearConnectTimer())
    this.socket.on('data', (chunk: Buffer) => this.parser.push(chunk))
    this.socket.on('error', (err) => {
      this.closeReason ??= refusal('connection_closed', `to ${this.name}: ${err.message}`)
    })
    this.closed = new Promise((resolve) =>
      this.socket.once('close', () => {
        this.shut(
          this.closeReason ?? refusal('connection_closed', `${this.name} closed the connection`),
        )
        resolve()
      }),
    )
    this.writeRaw(encodeHello({ version: PROTOCOL_VERSION }))
  }

  get name(): string {
    return `${this.config.host}:${this.config.port}`
  }

  get isClosed(): boolean {
    return this.phase === 'closed'
  }

  get numActiveTransfers(): number {
    return this.transfers.size
  }

  get numBytesInFlight(): number {
    return this.buffers.numInUseBytes
  }

  /** Register a transfer. @throws KvfenceError (`transfer_failed`) on a transfer id in use here. */
  start(t: OutgoingTransfer, begin: Buffer): Outgoing {
    if (this.transfers.has(t.transferId))
      throw refusal(
        'duplicate_transfer',
        `transfer ${t.transferId} is already in flight to ${this.name}`,
      )
    let settle!: (err: KvfenceError | null) => void
    const outcome = new Promise<KvfenceError | null>((resolve) => (settle = resolve))
    const s: Outgoing = {
      t,
      begin,
      phase: 'sending',
      failure: null,
      needsAbortFrame: false,
      isPumpDone: false,
      outcome,
      settle,
      timer: null,
    }
    s.timer = setTimeout(
      () =>
        this.fail(
          s,
          refusal(
            'stalled',
            `transfer ${t.transferId}: no progress for ${this.config.stallTimeoutMs} ms`,
          ),
          true,
        ),
      this.config.stallTimeoutMs,
    )
    this.transfers.set(t.transferId, s)
    this.socket.ref()
    if (this.phase === 'closed')
      this.fail(
        s,
        this.closeReason ?? refusal('connection_closed', `${this.name} is closed`),
        false,
      )
    return s
  }

  /** Forget a settled transfer; let the process exit if the connection is idle. */
  finish(s: Outgoing): void {
    if (s.timer !== null) clearTimeout(s.timer)
    if (this.transfers.get(s.t.transferId) === s) this.transfers.delete(s.t.transferId)
    if (this.transfers.size === 0) this.socket.unref()
  }

  /** Build and queue all of `s`'s frames. Never rejects; returns once no readPage can follow. */
  async pump(s: Outgoing): Promise<void> {
    const { t } = s
    try {
      if (s.failure !== null) return
      this.appendControl(s.begin)
      const ordinals = t.ordinalsToSend
      const numToSend = ordinals?.length ?? t.numPages
      const entryBytes = PAGE_HEAD_BYTES + t.pageBytes
      const maxPerFrame = Math.min(
        this.config.maxPagesPerFrame,
        Math.floor((this.config.maxFrameBytes - HEADER_BYTES - PAGES_HEAD_BYTES) / entryBytes),
      )
      const digests: PageDigests = {
        manifest: new ManifestHasher(),
        endMac: new EndMacBuilder(t.secret, t),
      }
      let numSent = 0
      const minBytes = pagesFrameBytes(1, t.pageBytes)
      while (numSent < numToSend) {
        if (s.failure !== null || this.isClosed) return
        if (!this.makeRoom(minBytes)) {
          if (!(await this.waitForBuffer(s, minBytes))) return
          continue // re-check synchronously: other transfers ran meanwhile
        }
        const numFitting = Math.floor(
          (this.current!.length - this.numUsed - HEADER_BYTES - PAGES_HEAD_BYTES) / entryBytes,
        )
        const numPages = Math.min(maxPerFrame, numToSend - numSent, numFitting)
        const numBuilt = this.buildPages(s, numSent, numPages, digests)
        if (s.failure !== null || numBuilt === 0) return
        numSent += numBuilt
        s.timer?.refresh()
      }
      const end = encodeEnd({
        transferId: t.transferId,
        requestId: t.requestId,
        manifestChecksum: digests.manifest.digest(),
        firstTokenId: t.firstTokenId,
        mac: digests.endMac.digest(t.firstTokenId),
      })
      s.phase = 'awaiting_ack'
      this.appendControl(end)
      s.timer?.refresh()
    } catch (err) {
      this.fail(s, asKvfenceError(err, `sending transfer ${t.transferId}`), true)
    } finally {
      s.isPumpDone = true
      if (s.needsAbortFrame) {
        s.needsAbortFrame = false
        this.appendControl(
          encodeAbort({ transferId: t.transferId, reason: s.failure?.message ?? 'aborted' }),
        )
      }
      this.flush()
    }
  }

  /** End transfer `s` with `err` (first call wins): stop its pump, settle it, and send ABORT if
   *  `sendAbort` and the connection is up. */
  fail(s: Outgoing, err: KvfenceError, sendAbort: boolean): void {
    if (s.failure !== null || s.phase === 'settled') return
    s.failure = err
    s.phase = 'settled'
    this.buffers.cancel(s)
    if (sendAbort && this.phase !== 'closed') {
      if (s.isPumpDone) {
        this.appendControl(encodeAbort({ transferId: s.t.transferId, reason: err.message }))
        this.flush()
      } else {
        s.needsAbortFrame = true
      }
    }
    s.settle(err)
  }

  /** Close the connection now; every transfer on it fails with `reason`. */
  destroy(reason: KvfenceError): void {
    this.closeReason ??= reason
    this.shut(reason)
    this.socket.destroy()
  }

  /** Assert this connection's invariants. @throws Error naming what broke. */
  check(): void {
    this.buffers.check()
    if (this.phase === 'closed' && this.current !== null)
      throw new Error(`closed connection ${this.name} holds a buffer`)
    if (this.current !== null && this.numUsed > this.current.length)
      throw new Error(`${this.numUsed} bytes used of a ${this.current.length}-byte buffer`)
    for (const [id, s] of this.transfers) {
      if (s.t.transferId !== id) throw new Error(`transfer ${s.t.transferId} listed as ${id}`)
      if (s.failure !== null && s.phase !== 'settled')
        throw new Error(`transfer ${id} failed but is not settled`)
      if (s.isPumpDone && s.phase === 'sending')
        throw new Error(`transfer ${id} stopped sending without END or failure`)
    }
  }

  // ─── Frames in ────────────────────────────────────────────────────────────────────────────────

  private onFrame(frame: Frame): void {
    if (this.phase === 'closed') return
    if (this.phase === 'awaiting_hello') {
      if (frame.kind === 'nack' && frame.transferId === ZERO_TRANSFER_ID)
        return this.destroy(refusalFromWire(frame.message))
      if (frame.kind !== 'hello')
        return this.destroy(
          refusal('unexpected_frame', `${this.name} sent ${frame.kind} before HELLO`),
        )
      if (frame.version !== PROTOCOL_VERSION)
        return this.destroy(
          refusal(
            'unsupported_version',
            `${this.name} speaks version ${frame.version}, sender speaks ${PROTOCOL_VERSION}`,
          ),
        )
      this.phase = 'open'
      return
    }
    switch (frame.kind) {
      case 'ack': {
        const s = this.transfers.get(frame.transferId)
        if (s === undefined || s.failure !== null || s.phase === 'settled') return
        if (s.phase !== 'awaiting_ack')
          return this.fail(
            s,
            refusal('unexpected_ack', `transfer ${frame.transferId} was ACKed before its END`),
            true,
          )
        s.phase = 'settled'
        s.settle(null)
        return
      }
      case 'nack': {
        if (frame.transferId === ZERO_TRANSFER_ID)
          return this.destroy(refusalFromWire(frame.message))
        const s = this.transfers.get(frame.transferId)
        if (s === undefined) return // already settled here
        return this.fail(
          s,
          refusalFromWire(frame.message, `${frame.message} [decode worker: ${frame.code}]`),
          false,
        )
      }
      case 'hello':
      case 'begin':
      case 'pages':
      case 'end':
      case 'abort':
        return this.destroy(
          refusal('unexpected_frame', `${this.name} sent ${frame.kind} to a sender`),
        )
    }
  }

  // ─── Frames out ───────────────────────────────────────────────────────────────────────────────

  /** Make `current` hold at least `minBytes` free bytes now, flushing it and taking a fresh
   *  buffer if needed. False if the budget is spent (call {@link waitForBuffer}). */
  private makeRoom(minBytes: number): boolean {
    if (this.current !== null && this.current.length - this.numUsed >= minBytes) return true
    this.flush()
    const buffer = this.buffers.tryAcquire(minBytes)
    if (buffer === null) return false
    this.useBuffer(buffer)
    return true
  }

  /** Wait until a buffer is free (the socket drained) and make it `current`. False if `s` failed or
   *  the connection closed meanwhile. The caller re-checks the room synchronously. */
  private async waitForBuffer(s: Outgoing, minBytes: number): Promise<boolean> {
    const buffer = await this.buffers.acquire(minBytes, s)
    if (buffer === null) return false
    if (s.failure !== null || this.isClosed) {
      this.buffers.release(buffer)
      return false
    }
    if (this.current !== null && this.current.length - this.numUsed >= minBytes) {
      this.buffers.release(buffer) // another transfer opened a buffer with room meanwhile
      return true
    }
    this.flush()
    this.useBuffer(buffer)
    return true
  }

  private useBuffer(buffer: Buffer): void {
    this.current = buffer
    this.numUsed = 0
    this.counters.maxBytesInFlight = Math.max(
      this.counters.maxBytesInFlight,
      this.buffers.numInUseBytes,
    )
  }

  /** Build one PAGES frame of up to `numPages` pages (from send position `first`) at the end of
   *  `current`, reading each page straight into the frame. Returns the pages built; 0 (frame
   *  discarded) if the transfer failed or the connection closed while reading. */
  private buildPages(s: Outgoing, first: number, numPages: number, digests: PageDigests): number {
    const { t } = s
    const buffer = this.current!
    const start = this.numUsed
    let offset = start + HEADER_BYTES + PAGES_HEAD_BYTES
    let numBuilt = 0
    this.isEncoding = true
    try {
      for (; numBuilt < numPages && s.failure === null; numBuilt++) {
        const ordinal = t.ordinalsToSend?.[first + numBuilt] ?? first + numBuilt
        const payloadStart = offset + PAGE_HEAD_BYTES
        const payload = buffer.subarray(payloadStart, payloadStart + t.pageBytes)
        const tokensOnPage = t.readPage(ordinal, payload)
        const checksum = pageChecksum(payload)
        // The top exponent bit of the middle float32 (little-endian): a flip that changes the value
        // by ~2^±128, as a real bit error can; a low mantissa bit would change no token downstream.
        if (t.corruptPayload === true)
          payload[Math.min(((payload.length >> 3) << 2) + 3, payload.length - 1)] ^= 0x40
        writePageHead(buffer, offset, ordinal, tokensOnPage, t.pageBytes, checksum)
        digests.manifest.add(checksum)
        digests.endMac.add(checksum)
        offset = payloadStart + t.pageBytes
      }
      if (s.failure !== null || this.current !== buffer || numBuilt === 0) return 0
      writeHeader(buffer, start, 'pages', offset - start - HEADER_BYTES)
      writePagesHead(buffer, start + HEADER_BYTES, t.transferId, t.requestId, numBuilt)
      this.numUsed = offset
      return numBuilt
    } finally {
      this.isEncoding = false
      this.appendDeferred()
    }
  }

  /** Queue a small control frame after everything queued so far. */
  private appendControl(frame: Buffer): void {
    if (this.phase === 'closed') return
    if (this.isEncoding) {
      this.deferred.push(frame)
      return
    }
    if (this.current !== null && this.current.length - this.numUsed >= frame.length) {
      frame.copy(this.current, this.numUsed)
      this.numUsed += frame.length
      return
    }
    this.flush()
    this.writeRaw(frame)
  }

  private appendDeferred(): void {
    if (this.deferred.length === 0) return
    for (const frame of this.deferred.splice(0)) this.appendControl(frame)
    this.flush()
  }

  /** Hand `current` to the socket; it returns to the pool when written. */
  private flush(): void {
    const buffer = this.current
    if (buffer === null) return
    const numBytes = this.numUsed
    this.current = null
    this.numUsed = 0
    if (numBytes === 0 || this.phase === 'closed') {
      this.buffers.release(buffer)
      return
    }
    this.counters.numWrites++
    this.counters.numBytesWritten += numBytes
    this.socket.write(buffer.subarray(0, numBytes), () => this.buffers.release(buffer))
  }

  private writeRaw(frame: Buffer): void {
    if (this.phase === 'closed') return
    this.counters.numWrites++
    this.counters.numBytesWritten += frame.length
    this.socket.write(frame)
  }

  private clearConnectTimer(): void {
    if (this.connectTimer !== null) clearTimeout(this.connectTimer)
    this.connectTimer = null
  }

  /** The connection is over: fail every transfer, drop the buffers. Idempotent. */
  private shut(reason: KvfenceError): void {
    if (this.phase === 'closed') return
    this.phase = 'closed'
    this.clearConnectTimer()
    if (this.current !== null) this.buffers.release(this.current)
    this.current = null
    this.numUsed = 0
    this.deferred.length = 0
    this.buffers.close()
    for (const s of this.transfers.values()) this.fail(s, reason, false)
  }
}
