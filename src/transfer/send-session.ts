/** The sending side (P) of one transfer connection, without the socket: frames out through
 *  `io.write`, bytes in through `push`. It runs every transfer on the connection: BEGIN, PAGES
 *  read page by page straight into reused send buffers, or written from P's own memory as page
 *  views (`viewPage`, through `io.writev`), under a byte budget (G9), END with the
 *  manifest (G4) and its MAC (G10); and it settles each transfer exactly once — on ACK, NACK,
 *  abort, stall or teardown — and only once no `readPage` of it can follow and the socket holds
 *  none of its page views, so P may unpin its pages then (G7). The mirror of session.ts; sender.ts holds the socket.
 *  Knows frames, the byte budget and transfers' phases; knows nothing of TCP, pools or the model:
 *  pages are read through {@link OutgoingTransfer.readPage}.
 *
 *  The checks, each with the reason a transfer (or the connection) fails for and the guard that
 *  switches it (`always` = protocol state or memory bound, never switched off):
 *  | check                                                     | reason                  | guard  |
 *  | --------------------------------------------------------- | ----------------------- | ------ |
 *  | the transfer's fields encode, its secret is ≥ 16 bytes, one page fits a frame (before any read; `prepareBegin`) | TypeError / RangeError | always |
 *  | the transfer id is not already in flight here             | duplicate_transfer      | always |
 *  | the connection is not closed                              | (why it closed)         | always |
 *  | D's first frame is HELLO (a connection NACK fails all)    | unexpected_frame / D's reason | always |
 *  | D's HELLO carries our version                             | unsupported_version     | always |
 *  | D's frames decode                                         | bad_magic, ..., malformed_frame | always |
 *  | D sends only HELLO (once), ACK and NACK                   | unexpected_frame        | always |
 *  | an ACK comes after END was queued                         | unexpected_ack          | always |
 *  | a NACK ends its transfer; a zero-id NACK the connection   | D's reason (else refused_by_receiver) | always |
 *  | bytes built or queued ≤ maxBytesInFlight (else the pump waits) | —                  | G9     |
 *  | pages per PAGES frame ≤ maxPagesPerFrame and ≤ the frame cap | —                    | G9     |
 *  | progress (a frame built, or the ACK after END) within stallTimeoutMs | stalled (the others on the connection: connection_closed) | always |
 *  | the caller's signal has not aborted (then ABORT is sent)  | aborted_by_sender       | always |
 *  Every failure stops the transfer's pump at its next check; ABORT is queued only after the pump
 *  returned, so that D sees no frame of the transfer after it. */
import { KvfenceError } from '../common/errors.js'
import { beginMac, EndMacBuilder } from './auth.js'
import { ManifestHasher, pageChecksum, pageChecksumOf } from './checksum.js'
import {
  HEADER_BYTES,
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

// ─── What is sent ───────────────────────────────────────────────────────────────────────────────

/** One transfer P sends to D: BEGIN's fields (ids are 32 lowercase hex digits) and the rest. */
export interface OutgoingTransfer extends BeginFields {
  /** The router-issued per-request secret (≥ 16 bytes); BEGIN and END carry MACs under it. */
  secret: Buffer
  firstTokenId: number
  /** Copy page `ordinal`'s payload into dst (dst.length === pageBytes); return tokens on that page. */
  readPage(ordinal: number, dst: Uint8Array): number
  /** Optional, the copy-free path: page `ordinal`'s payload as views of P's own memory (in payload
   *  order, lengths summing to pageBytes) and the tokens on it. The views are hashed where they
   *  lie and handed to the socket as they are; they must not change until the transfer settles
   *  (it settles only once every write of them reached the kernel or was dropped with the
   *  connection). Used instead of `readPage` when the connection can write a list of chunks. */
  viewPage?(ordinal: number): { tokensOnPage: number; views: readonly Uint8Array[] }
  /** Fault injection only: which ordinals to actually send (default: all, in order). */
  ordinalsToSend?: number[]
  /** Fault injection only: flip one bit in each payload after its checksum was computed (the top
   *  exponent bit of the payload's middle float32). */
  corruptPayload?: boolean
}

/** Validate `t` and build its BEGIN bytes (MAC included); no page is read.
 *  @throws TypeError/RangeError on malformed ids, tenant or counts, a first token that is not a
 *  u32, a secret shorter than 16 bytes, a page too large for a frame of `maxFrameBytes` bytes, or
 *  an ordinal to send that is not a u32. */
export function prepareBegin(t: OutgoingTransfer, maxFrameBytes: number): Buffer {
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
  if (pagesFrameBytes(1, t.pageBytes) > maxFrameBytes)
    throw new RangeError(
      `a page of ${t.pageBytes} bytes does not fit a frame of ${maxFrameBytes} bytes`,
    )
  for (const ordinal of t.ordinalsToSend ?? [])
    if (!Number.isInteger(ordinal) || ordinal < 0 || ordinal > 0xffff_ffff)
      throw new RangeError(`ordinalsToSend holds ${ordinal}, not a u32`)
  return encodeBegin({ ...fields, mac: beginMac(t.secret, fields) })
}

/** The refusal of transfer `transferId` when the caller's `signal` aborted it. */
export function abortedError(transferId: string, signal: AbortSignal): KvfenceError {
  const why =
    signal.reason instanceof Error ? signal.reason.message : String(signal.reason ?? 'aborted')
  return refusal('aborted_by_sender', `transfer ${transferId}: ${why}`, 'request_aborted')
}

// ─── Configuration, counters, io ────────────────────────────────────────────────────────────────

/** The session's settings (the sender's frozen config, `senderConfig` in sender.ts). */
export interface SendSessionConfig {
  /** G9: most pages in one PAGES frame. */
  readonly maxPagesPerFrame: number
  /** G9: most bytes built or queued but not yet handed to the kernel, per connection. */
  readonly maxBytesInFlight: number
  /** Frames are coalesced into writes of this many bytes (a larger frame is written alone). */
  readonly writeBytes: number
  /** Largest frame sent, header included, bytes. */
  readonly maxFrameBytes: number
  /** A transfer making no progress for this long fails, and its connection is closed, ms. */
  readonly stallTimeoutMs: number
}

/** Counts kept across all sessions of one client. */
export interface SenderCounters {
  /** io.write calls (PAGES-carrying buffers and control frames). */
  numWrites: number
  numBytesWritten: number
  /** Send buffers allocated. */
  numBuffersAllocated: number
  /** Most bytes of send buffers outstanding at once on one connection. */
  maxBytesInFlight: number
}

/** How a send session talks to its connection. */
export interface SendIo {
  /** Queue `bytes` to the peer. `onWritten`, if given, runs once the bytes were handed to the
   *  kernel (or dropped with the connection): only then may that memory be reused. */
  write(bytes: Uint8Array, onWritten?: () => void): void
  /** Optional: queue `chunks` in order as one write (corked, so the kernel gets them in one
   *  writev); `onWritten` as for {@link write}, once all of them were handed over or dropped. */
  writev?(chunks: readonly Uint8Array[], onWritten: () => void): void
  /** Close the connection now; what is queued may be lost. */
  destroy(): void
  /** Whether transfers are in flight, so that the connection may keep the process alive. */
  setBusy(isBusy: boolean): void
}

// ─── The session ────────────────────────────────────────────────────────────────────────────────

/** A transfer's phases on P. Only SendSession assigns them. */
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
  /** Writes of the transfer's page views not yet handed to the kernel (copy-free path), and who
   *  waits for them to reach 0 before the transfer settles for its caller. */
  numUnwritten: number
  onAllWritten: (() => void) | null
  readonly outcome: Promise<KvfenceError | null>
  settle(err: KvfenceError | null): void
  readonly timer: NodeJS.Timeout
}

/** What END carries about the pages sent, built page by page in send order. */
interface PageDigests {
  readonly manifest: ManifestHasher
  readonly endMac: EndMacBuilder
}

/** Connection phases. Only SendSession assigns them. */
type ConnectionPhase = 'awaiting_hello' | 'open' | 'closed'

/** One connection's sending side, multiplexing transfers by id. HELLO is queued on creation. */
export class SendSession {
  private phase: ConnectionPhase = 'awaiting_hello'
  private readonly parser: FrameParser
  private readonly buffers: SendBuffers
  private readonly transfers = new Map<string, Outgoing>()
  /** The buffer frames are being added to, and its filled length. */
  private current: Buffer | null = null
  private numUsed = 0
  /** A PAGES frame is being built in `current`: control frames wait in `deferred`. */
  private isEncoding = false
  private readonly deferred: Buffer[] = []
  private closeReason: KvfenceError | null = null

  /** @param name the peer, for messages (e.g. "127.0.0.1:7001"). */
  constructor(
    private readonly config: SendSessionConfig,
    private readonly io: SendIo,
    private readonly counters: SenderCounters,
    private readonly name: string,
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
    this.writeRaw(encodeHello({ version: PROTOCOL_VERSION }))
  }

  /** Whether the connection is over (later transfers fail at once). */
  get isClosed(): boolean {
    return this.phase === 'closed'
  }

  /** Transfers registered and not yet finished. */
  get numActiveTransfers(): number {
    return this.transfers.size
  }

  /** Bytes of send buffers outstanding now. */
  get numBytesInFlight(): number {
    return this.buffers.numInUseBytes
  }

  /** Send `t` (its BEGIN bytes from {@link prepareBegin}). Resolves on ACK; rejects with a
   *  KvfenceError on NACK (message = D's "<reason>: <detail> [decode worker: code]"), teardown,
   *  stall, a duplicate transfer id, or when `signal` aborts (`request_aborted`, ABORT sent).
   *  Settles only after the last `readPage` call returned and every write of its page views was
   *  handed to the kernel or dropped with the connection. */
  async send(t: OutgoingTransfer, begin: Buffer, signal?: AbortSignal): Promise<void> {
    const s = this.start(t, begin)
    const onAbort = (): void => this.fail(s, abortedError(t.transferId, signal!), true)
    signal?.addEventListener('abort', onAbort, { once: true })
    try {
      await this.pump(s)
      const err = await s.outcome
      // The socket may still hold views of P's pages: they stay pinned until it let go of them.
      await this.allWritten(s)
      if (err !== null) throw err
    } finally {
      signal?.removeEventListener('abort', onAbort)
      this.finish(s)
    }
  }

  /** Feed bytes received from the peer. */
  push(chunk: Uint8Array): void {
    this.parser.push(chunk)
  }

  /** The connection is gone: fail every transfer on it with `reason`. Idempotent; sends nothing. */
  teardown(reason: KvfenceError): void {
    this.shut(reason)
  }

  /** End the connection now (`io.destroy`); every transfer on it fails with `reason`. */
  destroy(reason: KvfenceError): void {
    this.shut(reason)
    this.io.destroy()
  }

  /** Assert this session's invariants. @throws Error naming what broke. */
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

  // ─── Transfers ────────────────────────────────────────────────────────────────────────────────

  /** Register a transfer. @throws KvfenceError (`duplicate_transfer`) on an id in flight here. */
  private start(t: OutgoingTransfer, begin: Buffer): Outgoing {
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
      numUnwritten: 0,
      onAllWritten: null,
      outcome,
      settle,
      timer: setTimeout(() => this.onStall(s), this.config.stallTimeoutMs),
    }
    this.transfers.set(t.transferId, s)
    this.io.setBusy(true)
    if (this.phase === 'closed')
      this.fail(
        s,
        this.closeReason ?? refusal('connection_closed', `${this.name} is closed`),
        false,
      )
    return s
  }

  /** Forget a settled transfer; tell the connection when none is left. */
  private finish(s: Outgoing): void {
    clearTimeout(s.timer)
    if (this.transfers.get(s.t.transferId) === s) this.transfers.delete(s.t.transferId)
    if (this.transfers.size === 0) this.io.setBusy(false)
  }

  /** Build and queue all of `s`'s frames. Never rejects; returns once no readPage can follow. */
  private async pump(s: Outgoing): Promise<void> {
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
      const isCopyFree = this.isCopyFree(t)
      // Copy-free frames are at most half the budget, so the next is built while one is written.
      const maxViewed = Math.max(
        1,
        Math.min(maxPerFrame, Math.floor(this.config.maxBytesInFlight / 2 / entryBytes)),
      )
      while (numSent < numToSend) {
        if (s.failure !== null || this.isClosed) return
        if (isCopyFree) {
          const numPages = Math.min(maxViewed, numToSend - numSent)
          const numBuilt = await this.sendViews(s, numSent, numPages, digests)
          if (s.failure !== null || numBuilt === 0) return
          numSent += numBuilt
          s.timer.refresh()
          continue
        }
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
        s.timer.refresh()
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
      s.timer.refresh()
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
  private fail(s: Outgoing, err: KvfenceError, sendAbort: boolean): void {
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

  /** Transfer `s` made no progress for stallTimeoutMs: D stopped reading, or stopped answering, on
   *  this connection. Frames are delivered in order, so every transfer queued behind `s` would
   *  stall as well, and the next transfer too: fail `s` (`stalled`), end the connection, and fail
   *  the transfers sharing it (`connection_closed`). The client opens a new connection for the
   *  next transfer; D, seeing this one close, aborts every transfer it had on it. No ABORT is sent:
   *  D may not be reading, and its teardown ends the transfer as well. */
  private onStall(s: Outgoing): void {
    if (s.phase === 'settled') {
      // Settled, but the socket has held its page views for stallTimeoutMs: D stopped reading.
      if (s.numUnwritten > 0)
        this.destroy(
          refusal(
            'connection_closed',
            `connection to ${this.name} closed: transfer ${s.t.transferId}'s pages were not taken for ${this.config.stallTimeoutMs} ms`,
          ),
        )
      return
    }
    const { transferId } = s.t
    const ms = this.config.stallTimeoutMs
    this.fail(s, refusal('stalled', `transfer ${transferId}: no progress for ${ms} ms`), false)
    this.destroy(
      refusal(
        'connection_closed',
        `connection to ${this.name} closed: transfer ${transferId} made no progress for ${ms} ms`,
      ),
    )
  }

  // ─── Frames in ────────────────────────────────────────────────────────────────────────────────

  private onFrame(frame: Frame): void {
    if (this.phase === 'closed') return
    if (this.phase === 'awaiting_hello') return this.onFirstFrame(frame)
    switch (frame.kind) {
      case 'ack':
        return this.onAck(frame.transferId)
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

  private onFirstFrame(frame: Frame): void {
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
  }

  private onAck(transferId: string): void {
    const s = this.transfers.get(transferId)
    if (s === undefined || s.failure !== null || s.phase === 'settled') return
    if (s.phase !== 'awaiting_ack')
      return this.fail(
        s,
        refusal('unexpected_ack', `transfer ${transferId} was ACKed before its END`),
        true,
      )
    s.phase = 'settled'
    s.settle(null)
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

  /** Whether `t`'s pages go out as views of P's memory: it offers them, the connection writes
   *  lists of chunks, and no fault needs a private copy to corrupt. */
  private isCopyFree(t: OutgoingTransfer): boolean {
    return t.viewPage !== undefined && this.io.writev !== undefined && t.corruptPayload !== true
  }

  /** Send one PAGES frame of `numPages` pages (from send position `first`) as views of P's memory:
   *  its heads in one small buffer, each payload as the views `viewPage` names, hashed where they
   *  lie, all in one corked write under a byte reservation (G9). Returns the pages sent; 0 (nothing
   *  written) if the transfer failed or the connection closed first.
   *  @throws RangeError if `viewPage` gives views that do not sum to pageBytes. */
  private async sendViews(
    s: Outgoing,
    first: number,
    numPages: number,
    digests: PageDigests,
  ): Promise<number> {
    const { t } = s
    const frameBytes = pagesFrameBytes(numPages, t.pageBytes)
    if (!this.buffers.tryReserve(frameBytes) && !(await this.buffers.reserve(frameBytes, s)))
      return 0
    const heads = Buffer.allocUnsafe(HEADER_BYTES + PAGES_HEAD_BYTES + numPages * PAGE_HEAD_BYTES)
    const chunks: Uint8Array[] = [heads.subarray(0, HEADER_BYTES + PAGES_HEAD_BYTES)]
    let headAt = HEADER_BYTES + PAGES_HEAD_BYTES
    let isWritten = false
    this.isEncoding = true
    try {
      for (let i = 0; i < numPages && s.failure === null; i++) {
        const ordinal = t.ordinalsToSend?.[first + i] ?? first + i
        const { tokensOnPage, views } = t.viewPage!(ordinal)
        let numBytes = 0
        for (const view of views) numBytes += view.length
        if (numBytes !== t.pageBytes)
          throw new RangeError(`viewPage(${ordinal}) gave ${numBytes} bytes, want ${t.pageBytes}`)
        const checksum = pageChecksumOf(views)
        writePageHead(heads, headAt, ordinal, tokensOnPage, t.pageBytes, checksum)
        chunks.push(heads.subarray(headAt, headAt + PAGE_HEAD_BYTES), ...views)
        headAt += PAGE_HEAD_BYTES
        digests.manifest.add(checksum)
        digests.endMac.add(checksum)
      }
      if (s.failure !== null || this.isClosed) return 0
      writeHeader(heads, 0, 'pages', frameBytes - HEADER_BYTES)
      writePagesHead(heads, HEADER_BYTES, t.transferId, t.requestId, numPages)
      this.flush() // what was queued before (BEGIN) goes first
      s.numUnwritten++
      this.counters.numWrites++
      this.counters.numBytesWritten += frameBytes
      this.counters.maxBytesInFlight = Math.max(
        this.counters.maxBytesInFlight,
        this.buffers.numInUseBytes,
      )
      isWritten = true
      this.io.writev!(chunks, () => {
        this.buffers.unreserve(frameBytes)
        if (--s.numUnwritten === 0) s.onAllWritten?.()
      })
      return numPages
    } finally {
      if (!isWritten) this.buffers.unreserve(frameBytes)
      this.isEncoding = false
      this.appendDeferred()
    }
  }

  /** Resolves once no write of `s`'s page views is pending. */
  private allWritten(s: Outgoing): Promise<void> {
    if (s.numUnwritten === 0) return Promise.resolve()
    return new Promise((resolve) => (s.onAllWritten = resolve))
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

  /** Hand `current` to the connection; it returns to the pool once written. */
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
    this.io.write(buffer.subarray(0, numBytes), () => this.buffers.release(buffer))
  }

  private writeRaw(frame: Buffer): void {
    if (this.phase === 'closed') return
    this.counters.numWrites++
    this.counters.numBytesWritten += frame.length
    this.io.write(frame)
  }

  /** The connection is over: fail every transfer, drop the buffers. Idempotent. */
  private shut(reason: KvfenceError): void {
    if (this.phase === 'closed') return
    this.phase = 'closed'
    this.closeReason = reason
    if (this.current !== null) this.buffers.release(this.current)
    this.current = null
    this.numUsed = 0
    this.deferred.length = 0
    this.buffers.close()
    for (const s of this.transfers.values()) this.fail(s, reason, false)
  }
}
