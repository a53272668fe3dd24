/** The receiving side (D) of one transfer connection, without the socket: bytes in through
 *  `push`, frames out through `io.write`. It verifies every transfer (G4, G10), receives its pages
 *  into the reservation the hooks hand out (straight into the reserved pages with `placePage`: a
 *  page is checked at its head, copied once from the socket's chunks, then its checksum verified
 *  where it landed; a page that fails ends the transfer), and ends every transfer it started
 *  exactly once: `complete` (then ACK) or `abort` (after NACK, ABORT, teardown or close) — and
 *  `abort` only once nothing more can be written into that reservation (G7).
 *  Knows frames, checks and the hooks' contract; knows nothing of TCP, pools or the model.
 *
 *  The checks, in the order they run, each with the guard that switches it (`always` = memory
 *  safety or protocol state, kept even with guards off):
 *  | check                                                   | reason                | guard  |
 *  | ------------------------------------------------------- | --------------------- | ------ |
 *  | first frame is HELLO with our version                   | unsupported_version / unexpected_frame | always |
 *  | frame decodes (stream-level errors close the connection)| bad_magic, ..., malformed_frame | always |
 *  | BEGIN's transfer id is new on this connection           | duplicate_transfer    | always |
 *  | the request is known (hooks.secretFor)                  | unknown_request       | G10    |
 *  | BEGIN's HMAC verifies                                   | bad_hmac              | G10    |
 *  | hooks.begin accepts the fields                          | (the hook's error)    | always |
 *  | the reservation's pageSize is a positive integer        | hook_failed           | always |
 *  | numTokens fits numPages pages of pageSize, last non-empty | counts_mismatch     | G4     |
 *  | PAGES/END name an active transfer                       | unknown_transfer      | always |
 *  | PAGES/END carry BEGIN's request id                      | request_mismatch      | always |
 *  | ordinal < numPages                                      | ordinal_out_of_range  | always |
 *  | payload is exactly pageBytes                            | page_bytes_mismatch   | always |
 *  | tokensOnPage ≤ pageSize                                 | page_overfull         | always |
 *  | pages arrive once each, in ordinal order                | page_out_of_order     | G4     |
 *  | tokensOnPage = min(pageSize, numTokens − ordinal·pageSize) | tokens_mismatch    | G4     |
 *  | xxh64(payload) = the page's checksum                    | checksum_mismatch     | G4     |
 *  | END comes after all numPages pages                      | incomplete            | G4     |
 *  | END's manifest = xxh64 of the received checksums        | manifest_mismatch     | G4     |
 *  | END's MAC verifies over ids, counts, received checksums, first token | bad_end_mac | G10 |
 *  | a frame arrives for each active transfer within stallTimeoutMs | stalled        | always |
 *  | HELLO arrives within stallTimeoutMs (connection)        | stalled               | always |
 *  | no HELLO/ACK/NACK after HELLO (connection)              | unexpected_frame      | always |
 *  Per-page token exactness plus the counts check imply that the tokens sum to numTokens. END's MAC
 *  covers the checksums as received; with G4 on they are the payloads' own, so the MAC binds the
 *  pages' bytes to the request's secret (a peer who sees the connection cannot splice in other
 *  pages); with G4 off it binds only the checksums claimed. */
import { KvfenceError } from '../common/errors.js'
import { EndMacBuilder, verifyBeginMac } from './auth.js'
import { ManifestHasher, pageChecksumOf } from './checksum.js'
import {
  PROTOCOL_VERSION,
  ZERO_TRANSFER_ID,
  encodeAck,
  encodeHello,
  encodeNack,
  type AbortFrame,
  type BeginFields,
  type BeginFrame,
  type EndFrame,
  type Frame,
  type FrameError,
  type PageEntryHead,
  type PagesFrame,
  type PagesHead,
} from './frames.js'
import { FrameParser, type PagesSink } from './parser.js'
import { asKvfenceError, refusal, TransferError } from './refusals.js'

// ─── The hooks' contract ────────────────────────────────────────────────────────────────────────

/** What the receiver asks of the decode worker. */
export interface ReceiverHooks {
  /** The router-issued secret for a request D has been told about, or undefined (→ NACK). */
  secretFor(requestId: string): Buffer | undefined
  /** A BEGIN whose HMAC verified. Return the reservation that takes its pages, or throw a
   *  KvfenceError to refuse (→ NACK, and no `abort`: nothing was reserved). */
  begin(info: BeginInfo): Reservation
}

/** A verified BEGIN's fields (those its MAC covers). Ids are 32 lowercase hex digits. */
export type BeginInfo = BeginFields

/** Pages reserved on D for one transfer. */
export interface Reservation {
  /** Tokens per page of the pool; bounds `tokensOnPage` of every page (a page never overfills). */
  readonly pageSize: number
  /** Copy a page's payload (pageBytes bytes, tokensOnPage tokens) into the pool; ordinal in
   *  [0, numPages). `payload` is valid only during the call. May throw (→ NACK + `abort`). */
  writePage(ordinal: number, tokensOnPage: number, payload: Uint8Array): void
  /** Optional, the copy-free path: claim page `ordinal` for `tokensOnPage` tokens and return the
   *  byte views its payload goes to (in payload order, lengths summing to pageBytes: the page's
   *  slices of the pool). The receiver copies the payload from the socket's chunks straight into
   *  them and verifies it there; a page that fails verification ends the transfer (NACK, then
   *  `abort`), so bytes that landed are never used. Without it, the payload is received into a
   *  scratch page and handed to `writePage`. May throw (→ NACK + `abort`). */
  placePage?(ordinal: number, tokensOnPage: number): readonly Uint8Array[]
  /** END verified; called before ACK is sent. May throw KvfenceError (→ NACK, then `abort`). */
  complete(firstTokenId: number): void
  /** The transfer is over without success (NACK sent, ABORT received, connection torn down,
   *  server closed). Called exactly once, and only when no further writePage can happen for this
   *  transfer (deferred release, G7). Never called after a `complete` that returned. */
  abort(reason: KvfenceError): void
}

// ─── Configuration and counters ─────────────────────────────────────────────────────────────────

/** Where the receiver reports refusals (pino-compatible: `log.warn(fields, message)`). */
export interface TransferLog {
  warn(fields: Record<string, unknown>, message: string): void
}

/** The receiver's settings, built once by `receiverConfig` (receiver.ts) and frozen. */
export interface ReceiverConfig {
  /** G4: verify ordering, completeness, token counts, checksums and manifest. */
  readonly verifyManifest: boolean
  /** G10: verify BEGIN's and END's MACs under the request's secret. */
  readonly verifyAuth: boolean
  /** Cap on one frame, header included, bytes. */
  readonly maxFrameBytes: number
  /** A transfer (or a connection awaiting HELLO) with no frame for this long is refused, ms. */
  readonly stallTimeoutMs: number
  /** Ended transfer ids remembered per connection, so late frames are dropped, not NACKed. */
  readonly maxEndedIds: number
  readonly log: TransferLog
  /** Fault injection only (`lost-ack`): complete transfers but never send their ACK, as if it were
   *  lost on the way to P. */
  readonly dropAcks: boolean
}

/** Counts kept across all sessions of one server. Invariant:
 *  numStarted = numCompleted + numAborted + (transfers still active). */
export interface ReceiverCounters {
  /** Transfers `begin` returned a reservation for. */
  numStarted: number
  numCompleted: number
  numAborted: number
  /** NACKs sent (including those for transfers never started). */
  numRefused: number
}

/** How a session talks to its connection. */
export interface ReceiveIo {
  /** Queue bytes to the peer. */
  write(bytes: Uint8Array): void
  /** Flush what was queued, then close the connection. */
  close(): void
}

// ─── The session ────────────────────────────────────────────────────────────────────────────────

/** Connection phases. Only this class assigns them. */
type SessionPhase = 'awaiting_hello' | 'open' | 'closed'

interface ActiveTransfer {
  readonly info: BeginInfo
  readonly reservation: Reservation
  /** Pages written; in G4 mode also the next ordinal expected. */
  numPagesWritten: number
  readonly manifest: ManifestHasher
  /** END's MAC under the request's secret, fed each page's checksum as written (G10; null when
   *  authentication is off). */
  readonly endMac: EndMacBuilder | null
  readonly timer: NodeJS.Timeout
  /** False once the transfer left `transfers`; hooks may end it re-entrantly. */
  isOpen: boolean
}

/** The page whose payload is arriving: its head, and where it goes. */
interface Arriving {
  readonly entry: PageEntryHead
  readonly views: readonly Uint8Array[]
  /** The views are the reservation's own (placePage); else `scratch`, for writePage. */
  readonly isPlaced: boolean
}

/** One connection's receiving side. */
export class ReceiveSession {
  private phase: SessionPhase = 'awaiting_hello'
  private readonly transfers = new Map<string, ActiveTransfer>()
  /** Ids of transfers that ended on this connection, oldest first (bounded). */
  private readonly endedIds = new Set<string>()
  private readonly parser: FrameParser
  private readonly helloTimer: NodeJS.Timeout
  /** The transfer of the PAGES frame being received, and its page in progress. */
  private receiving: ActiveTransfer | null = null
  private arriving: Arriving | null = null
  /** Receives a payload for a reservation without `placePage`; grown to pageBytes, reused. */
  private scratch: Uint8Array = new Uint8Array(0)

  constructor(
    private readonly hooks: ReceiverHooks,
    private readonly config: ReceiverConfig,
    private readonly io: ReceiveIo,
    private readonly counters: ReceiverCounters,
  ) {
    this.parser = new FrameParser(
      {
        frame: (f) => this.onFrame(f),
        error: (e, isFatal) => this.onFrameError(e, isFatal),
        pages: this.pagesSink,
      },
      { maxFrameBytes: config.maxFrameBytes },
    )
    this.helloTimer = setTimeout(
      () => this.fail(refusal('stalled', `no HELLO within ${config.stallTimeoutMs} ms`)),
      config.stallTimeoutMs,
    ).unref()
  }

  /** Transfers in flight on this connection. */
  get numActiveTransfers(): number {
    return this.transfers.size
  }

  /** Whether the session has ended (it ignores further input). */
  get isClosed(): boolean {
    return this.phase === 'closed'
  }

  /** Feed bytes received from the peer. Never throws: a failure inside closes this connection. */
  push(chunk: Uint8Array): void {
    if (this.phase === 'closed') return
    try {
      this.parser.push(chunk)
    } catch (err) {
      this.fail(asKvfenceError(err, 'receiver'))
    }
  }

  /** The connection is gone (peer closed, network error, server shutting down): abort every
   *  transfer in flight with `reason`. Idempotent; sends nothing. */
  teardown(reason: KvfenceError): void {
    this.shut(reason)
  }

  /** Assert this session's invariants. @throws Error naming the broken invariant. */
  check(): void {
    if (this.phase === 'closed' && this.transfers.size !== 0)
      throw new Error(`closed session still holds ${this.transfers.size} transfers`)
    if (this.endedIds.size > this.config.maxEndedIds)
      throw new Error(`${this.endedIds.size} ended ids remembered, cap ${this.config.maxEndedIds}`)
    for (const [id, t] of this.transfers) {
      if (!t.isOpen) throw new Error(`transfer ${id} is listed but not open`)
      if (this.endedIds.has(id)) throw new Error(`transfer ${id} is both active and ended`)
      if (this.config.verifyManifest && t.numPagesWritten > t.info.numPages)
        throw new Error(`transfer ${id} wrote ${t.numPagesWritten} of ${t.info.numPages} pages`)
    }
  }

  // ─── Frames ───────────────────────────────────────────────────────────────────────────────────

  private onFrame(frame: Frame): void {
    if (this.phase === 'closed') return
    if (this.phase === 'awaiting_hello') {
      if (frame.kind !== 'hello')
        return this.fail(
          refusal('unexpected_frame', `first frame must be HELLO, got ${frame.kind}`),
        )
      if (frame.version !== PROTOCOL_VERSION)
        return this.fail(
          refusal(
            'unsupported_version',
            `peer speaks version ${frame.version}, receiver speaks ${PROTOCOL_VERSION}`,
          ),
        )
      clearTimeout(this.helloTimer)
      this.phase = 'open'
      this.io.write(encodeHello({ version: PROTOCOL_VERSION }))
      return
    }
    switch (frame.kind) {
      case 'begin':
        return this.onBegin(frame)
      case 'pages':
        return this.onPages(frame)
      case 'end':
        return this.onEnd(frame)
      case 'abort':
        return this.onAbort(frame)
      case 'hello':
      case 'ack':
      case 'nack':
        return this.fail(
          refusal('unexpected_frame', `a receiver does not accept ${frame.kind} here`),
        )
    }
  }

  private onFrameError(error: FrameError, isFatal: boolean): void {
    if (this.phase === 'closed') return
    const err = refusal(error.reason, error.message)
    const id = error.transferId
    if (!isFatal && this.phase === 'open' && id !== null && id !== ZERO_TRANSFER_ID)
      return this.refuse(id, err)
    this.fail(err)
  }

  private onBegin(frame: BeginFrame): void {
    const id = frame.transferId
    if (this.transfers.has(id) || this.endedIds.has(id))
      return this.refuse(
        id,
        refusal('duplicate_transfer', `transfer ${id} was already begun on this connection`),
      )
    let endMac: EndMacBuilder | null = null
    if (this.config.verifyAuth) {
      let secret: Buffer | undefined
      try {
        secret = this.hooks.secretFor(frame.requestId)
      } catch (err) {
        return this.refuse(id, asKvfenceError(err, 'secretFor'))
      }
      if (secret === undefined)
        return this.refuse(
          id,
          refusal('unknown_request', `request ${frame.requestId} is not expected here`),
        )
      if (!verifyBeginMac(secret, frame, frame.mac))
        return this.refuse(id, refusal('bad_hmac', `transfer ${id} for request ${frame.requestId}`))
      endMac = new EndMacBuilder(secret, frame)
    }
    const info: BeginInfo = Object.freeze({
      transferId: id,
      requestId: frame.requestId,
      tenant: frame.tenant,
      numTokens: frame.numTokens,
      numPages: frame.numPages,
      pageBytes: frame.pageBytes,
    })
    let reservation: Reservation
    try {
      reservation = this.hooks.begin(info)
    } catch (err) {
      return this.refuse(id, asKvfenceError(err, 'begin'))
    }
    if (this.phase === 'closed') {
      // The hook tore the connection down re-entrantly: the reservation was never tracked.
      this.counters.numStarted++
      this.counters.numAborted++
      return this.safeAbort(
        reservation,
        refusal('connection_closed', `during BEGIN of transfer ${id}`),
        id,
      )
    }
    const t: ActiveTransfer = {
      info,
      reservation,
      numPagesWritten: 0,
      manifest: new ManifestHasher(),
      endMac,
      timer: setTimeout(
        () =>
          this.refuse(
            id,
            refusal('stalled', `transfer ${id}: no frame for ${this.config.stallTimeoutMs} ms`),
          ),
        this.config.stallTimeoutMs,
      ).unref(),
      isOpen: true,
    }
    this.transfers.set(id, t)
    this.counters.numStarted++
    const { pageSize } = reservation
    if (!Number.isInteger(pageSize) || pageSize < 1)
      return this.refuse(
        id,
        refusal('hook_failed', `reservation.pageSize is ${pageSize}`, 'internal_error'),
      )
    if (this.config.verifyManifest) {
      const { numTokens, numPages } = info
      if (numTokens > numPages * pageSize || numTokens <= (numPages - 1) * pageSize)
        return this.refuse(
          id,
          refusal(
            'counts_mismatch',
            `${numTokens} tokens cannot fill ${numPages} pages of ${pageSize} tokens`,
          ),
        )
    }
  }

  /** PAGES frames, streamed by the parser: the transfer is looked up at the frame's head, each
   *  page is checked at its entry's head (before any payload byte is copied), received into its
   *  views, then verified (checksum) and counted. Every hook returns "skip" once the transfer or
   *  the connection ended. */
  private readonly pagesSink: PagesSink = {
    begin: (head) => this.onPagesHead(head),
    page: (entry) => this.onPageHead(entry),
    pageDone: () => this.onPageDone(),
  }

  private onPagesHead(head: PagesHead): boolean {
    this.receiving = null
    this.arriving = null
    if (this.phase !== 'open') {
      if (this.phase === 'awaiting_hello')
        this.fail(refusal('unexpected_frame', 'first frame must be HELLO, got pages'))
      return false
    }
    const t = this.activeFor({ kind: 'pages', ...head })
    if (t === undefined) return false
    t.timer.refresh()
    this.receiving = t
    return true
  }

  private onPageHead(entry: PageEntryHead): readonly Uint8Array[] | null {
    const t = this.receiving
    if (t === null || !t.isOpen) return null
    const id = t.info.transferId
    const refused = this.checkPage(t, entry)
    if (refused !== null) {
      this.refuse(id, refused)
      return null
    }
    if (t.reservation.placePage === undefined) {
      if (this.scratch.length !== entry.payloadBytes)
        this.scratch = new Uint8Array(entry.payloadBytes)
      this.arriving = { entry, views: [this.scratch], isPlaced: false }
      return this.arriving.views
    }
    let views: readonly Uint8Array[]
    try {
      views = t.reservation.placePage(entry.ordinal, entry.tokensOnPage)
    } catch (err) {
      this.refuse(id, asKvfenceError(err, 'placePage'))
      return null
    }
    if (!t.isOpen) return null
    let numBytes = 0
    for (const view of views) numBytes += view instanceof Uint8Array ? view.length : NaN
    if (numBytes !== entry.payloadBytes) {
      this.refuse(
        id,
        refusal(
          'hook_failed',
          `placePage(${entry.ordinal}) gave ${numBytes} bytes for a ${entry.payloadBytes}-byte page`,
          'internal_error',
        ),
      )
      return null
    }
    this.arriving = { entry, views, isPlaced: true }
    return views
  }

  private onPageDone(): boolean {
    const t = this.receiving
    const page = this.arriving
    this.arriving = null
    if (t === null || page === null || !t.isOpen) return false
    const { entry } = page
    const id = t.info.transferId
    if (this.config.verifyManifest) {
      const got = pageChecksumOf(page.views)
      if (got !== entry.checksum) {
        this.refuse(
          id,
          refusal(
            'checksum_mismatch',
            `transfer ${id} page ${entry.ordinal}: want ${hex64(entry.checksum)}, got ${hex64(got)}`,
          ),
        )
        return false
      }
    }
    if (!page.isPlaced) {
      try {
        t.reservation.writePage(entry.ordinal, entry.tokensOnPage, page.views[0])
      } catch (err) {
        this.refuse(id, asKvfenceError(err, 'writePage'))
        return false
      }
      if (!t.isOpen) return false
    }
    t.numPagesWritten++
    t.manifest.add(entry.checksum)
    t.endMac?.add(entry.checksum)
    return true
  }

  /** A PAGES frame the parser delivered whole (it streams every frame that can hold a page, so
   *  this one is only reached by a sink without streaming): fed through the same steps. */
  private onPages(frame: PagesFrame): void {
    if (!this.onPagesHead({ ...frame, numPagesInFrame: frame.pages.length })) return
    for (const page of frame.pages) {
      const entry = { ...page, payloadBytes: page.payload.length }
      const views = this.onPageHead(entry)
      if (views === null) return
      let at = 0
      for (const view of views) {
        view.set(page.payload.subarray(at, at + view.length))
        at += view.length
      }
      if (!this.onPageDone()) return
    }
  }

  /** The refusal a page earns from its entry's head, or null if its payload may be received. */
  private checkPage(t: ActiveTransfer, page: PageEntryHead): KvfenceError | null {
    const { transferId: id, numPages, pageBytes, numTokens } = t.info
    const { pageSize } = t.reservation
    const { ordinal, tokensOnPage, payloadBytes } = page
    if (ordinal >= numPages)
      return refusal(
        'ordinal_out_of_range',
        `transfer ${id} page ${ordinal}: the reservation has ${numPages} pages`,
      )
    if (payloadBytes !== pageBytes)
      return refusal(
        'page_bytes_mismatch',
        `transfer ${id} page ${ordinal}: ${payloadBytes} bytes, want ${pageBytes}`,
      )
    if (tokensOnPage > pageSize)
      return refusal(
        'page_overfull',
        `transfer ${id} page ${ordinal}: ${tokensOnPage} tokens, a page holds ${pageSize}`,
      )
    if (!this.config.verifyManifest) return null
    if (ordinal !== t.numPagesWritten)
      return refusal(
        'page_out_of_order',
        `transfer ${id}: want page ${t.numPagesWritten}, got ${ordinal}`,
      )
    const wantTokens = Math.min(pageSize, numTokens - ordinal * pageSize)
    if (tokensOnPage !== wantTokens)
      return refusal(
        'tokens_mismatch',
        `transfer ${id} page ${ordinal}: ${tokensOnPage} tokens, want ${wantTokens}`,
      )
    return null
  }

  private onEnd(frame: EndFrame): void {
    const t = this.activeFor(frame)
    if (t === undefined) return
    const id = t.info.transferId
    if (this.config.verifyManifest) {
      if (t.numPagesWritten !== t.info.numPages)
        return this.refuse(
          id,
          refusal(
            'incomplete',
            `transfer ${id}: END after ${t.numPagesWritten} of ${t.info.numPages} pages`,
          ),
        )
      const got = t.manifest.digest()
      if (got !== frame.manifestChecksum)
        return this.refuse(
          id,
          refusal(
            'manifest_mismatch',
            `transfer ${id}: manifest ${hex64(frame.manifestChecksum)}, pages give ${hex64(got)}`,
          ),
        )
    }
    // G10: the pages and first token are the request's own, not another transfer's spliced in.
    if (t.endMac !== null && !t.endMac.verify(frame.firstTokenId, frame.mac))
      return this.refuse(
        id,
        refusal('bad_end_mac', `transfer ${id} for request ${t.info.requestId}: END's MAC`),
      )
    this.end(t)
    try {
      t.reservation.complete(frame.firstTokenId)
    } catch (err) {
      const refused = asKvfenceError(err, 'complete')
      this.nack(id, refused)
      this.counters.numAborted++
      return this.safeAbort(t.reservation, refused, id)
    }
    this.counters.numCompleted++
    if (this.phase !== 'closed' && !this.config.dropAcks)
      this.io.write(encodeAck({ transferId: id }))
  }

  private onAbort(frame: AbortFrame): void {
    const t = this.transfers.get(frame.transferId)
    if (t === undefined) return // already ended here (e.g. NACKed while P was aborting)
    this.end(t)
    this.counters.numAborted++
    this.safeAbort(
      t.reservation,
      refusal('aborted_by_sender', frame.reason || 'no reason given', 'request_aborted'),
      frame.transferId,
    )
  }

  /** The active transfer a PAGES/END frame belongs to, or undefined after dealing with a frame for
   *  an unknown transfer (NACK), a transfer that already ended (dropped) or a request id that is
   *  not BEGIN's (NACK + abort). */
  private activeFor(
    frame: Pick<PagesFrame | EndFrame, 'kind' | 'transferId' | 'requestId'>,
  ): ActiveTransfer | undefined {
    const id = frame.transferId
    const t = this.transfers.get(id)
    if (t === undefined) {
      if (!this.endedIds.has(id))
        this.refuse(id, refusal('unknown_transfer', `${frame.kind} for transfer ${id}`))
      return undefined
    }
    if (frame.requestId !== t.info.requestId) {
      this.refuse(
        id,
        refusal(
          'request_mismatch',
          `${frame.kind} of transfer ${id} names request ${frame.requestId}, BEGIN named ${t.info.requestId}`,
        ),
      )
      return undefined
    }
    return t
  }

  // ─── Ending transfers and the connection (the only places that do) ───────────────────────────

  /** Take `t` out of the active set: no frame reaches its reservation after this. */
  private end(t: ActiveTransfer): void {
    if (this.receiving === t) {
      // Ended mid-frame (stall timer): not one more byte may land in pages it no longer holds.
      this.receiving = null
      this.arriving = null
      this.parser.skipPages()
    }
    t.isOpen = false
    clearTimeout(t.timer)
    this.transfers.delete(t.info.transferId)
    this.remember(t.info.transferId)
  }

  private remember(id: string): void {
    this.endedIds.add(id)
    if (this.endedIds.size > this.config.maxEndedIds) {
      const oldest = this.endedIds.values().next().value
      if (oldest !== undefined) this.endedIds.delete(oldest)
    }
  }

  /** NACK transfer `id` with `err`; if it was active, end it and abort its reservation. */
  private refuse(id: string, err: KvfenceError): void {
    if (this.phase === 'closed') return
    const t = this.transfers.get(id)
    if (t !== undefined) this.end(t)
    else this.remember(id)
    this.nack(id, err)
    if (t !== undefined) {
      this.counters.numAborted++
      this.safeAbort(t.reservation, err, id)
    }
  }

  private nack(id: string, err: KvfenceError): void {
    this.counters.numRefused++
    this.config.log.warn(
      { transferId: id, code: err.code, reason: err instanceof TransferError ? err.reason : null },
      'transfer refused',
    )
    if (this.phase !== 'closed')
      this.io.write(encodeNack({ transferId: id, code: err.code, message: err.message }))
  }

  private safeAbort(reservation: Reservation, err: KvfenceError, id: string): void {
    try {
      reservation.abort(err)
    } catch (hookErr) {
      this.config.log.warn({ transferId: id, err: String(hookErr) }, 'reservation.abort threw')
    }
  }

  /** The connection cannot go on: NACK every active transfer and the connection, abort them all,
   *  close. */
  private fail(err: KvfenceError): void {
    if (this.phase === 'closed') return
    for (const id of this.transfers.keys()) this.nack(id, err)
    this.nack(ZERO_TRANSFER_ID, err)
    this.shut(err)
    this.io.close()
  }

  private shut(err: KvfenceError): void {
    if (this.phase === 'closed') return
    this.phase = 'closed'
    clearTimeout(this.helloTimer)
    for (const t of [...this.transfers.values()]) {
      this.end(t)
      this.counters.numAborted++
      this.safeAbort(t.reservation, err, t.info.transferId)
    }
  }
}

function hex64(value: bigint): string {
  return `0x${value.toString(16).padStart(16, '0')}`
}
