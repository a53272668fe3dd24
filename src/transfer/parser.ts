/** Streaming frame parser: feed it the chunks a socket delivers, in any sizes; it hands out whole
 *  frames. Frames wholly inside one chunk are decoded in place (no copy); a frame that spans chunks
 *  is assembled in one reused buffer, grown at most to the frame cap.
 *
 *  With a {@link PagesSink}, PAGES frames are not assembled: their heads are parsed as they arrive
 *  and each page's payload is copied once, straight from the socket's chunks into the views the
 *  sink names for it (the reserved pages of the pool), whatever the chunks' sizes.
 *  Knows frame boundaries and caps; knows nothing of transfers, hooks or sockets. Never throws on
 *  input: malformed bytes are reported as a coded {@link FrameError}.
 *
 *  Lifetime: a frame (its payload and MAC views) is valid only during the `frame` callback; copy
 *  what must outlive it. */
import {
  DEFAULT_MAX_FRAME_BYTES,
  HEADER_BYTES,
  PAGES_HEAD_BYTES,
  PAGE_HEAD_BYTES,
  decodeFrame,
  decodePagesHead,
  readHeader,
  readPageEntryHead,
  type Frame,
  type FrameError,
  type FrameHeader,
  type PageEntryHead,
  type PagesHead,
} from './frames.js'

/** Where the parser delivers its output. */
export interface FrameSink {
  /** A whole, well-formed frame; its views are valid only during this call. */
  frame(frame: Frame): void
  /** A malformed frame. `isFatal`: the stream lost sync (bad header, frame over the cap) and the
   *  parser now ignores all further input; otherwise the frame's bytes were skipped and parsing
   *  goes on with the next frame. */
  error(error: FrameError, isFatal: boolean): void
  /** If present, PAGES frames are streamed through it instead of being delivered whole. */
  pages?: PagesSink
}

/** Receives a PAGES frame piece by piece, in stream order. Any call may return "skip" (false or
 *  null): the rest of that frame's bytes are then consumed unseen. A malformation found mid-frame
 *  (an entry truncated or overrunning the body, bytes after the last entry) is reported through
 *  {@link FrameSink.error} (not fatal) after the entries before it were delivered. */
export interface PagesSink {
  /** A PAGES frame's ids and page count, once its first 34 body bytes are in. */
  begin(head: PagesHead): boolean
  /** The next entry's head; return the views its payload is copied into (their lengths summing to
   *  `payloadBytes`), or null to skip the rest of the frame. */
  page(entry: PageEntryHead): readonly Uint8Array[] | null
  /** The payload of the entry begun last is wholly in its views. */
  pageDone(): boolean
}

/** Parser options. */
export interface FrameParserOptions {
  /** Cap on a whole frame (header + body), bytes; a larger declared frame is fatal. Default 64 MiB. */
  maxFrameBytes?: number
}

/** A PAGES frame being streamed: where in its body the parser is. */
interface Streaming {
  readonly sink: PagesSink
  /** Body bytes not yet consumed. */
  numBodyLeft: number
  readonly numBodyBytes: number
  /** 'head' and 'entry' collect bytes in `small`; 'payload' copies into `views`. */
  part: 'head' | 'entry' | 'payload' | 'skip'
  numSmall: number
  numPagesInFrame: number
  /** Known once the body's head is in; named by a mid-frame malformation. */
  transferId: string | null
  index: number
  views: readonly Uint8Array[]
  view: number
  viewOffset: number
}

/** A streaming parser for one connection's byte stream. */
export class FrameParser {
  private readonly maxFrameBytes: number
  /** Bytes of a frame that spans chunks: header first, then body. Reused across frames. */
  private assembly: Buffer = Buffer.alloc(0)
  /** Bytes of `assembly` filled so far. */
  private numAssembled = 0
  /** Whole-frame bytes wanted in `assembly`, or 0 while its header is still incomplete. */
  private numWanted = 0
  private hasFailed = false
  /** The PAGES frame being streamed, if any; its heads are collected in `small`. */
  private streaming: Streaming | null = null
  private readonly small = Buffer.alloc(PAGES_HEAD_BYTES)

  constructor(
    private readonly sink: FrameSink,
    options: FrameParserOptions = {},
  ) {
    this.maxFrameBytes = options.maxFrameBytes ?? DEFAULT_MAX_FRAME_BYTES
    if (!Number.isInteger(this.maxFrameBytes) || this.maxFrameBytes < HEADER_BYTES + 64)
      throw new RangeError(
        `maxFrameBytes must be an integer ≥ ${HEADER_BYTES + 64}, got ${this.maxFrameBytes}`,
      )
  }

  /** Whether a fatal error stopped the parser. */
  get isFailed(): boolean {
    return this.hasFailed
  }

  /** Bytes held of a frame not yet complete (a streamed PAGES frame holds at most its current
   *  head; its payloads are already in their views). */
  get numBufferedBytes(): number {
    return this.numAssembled + (this.streaming?.numSmall ?? 0)
  }

  /** Stop delivering the PAGES frame being streamed: the rest of its bytes are consumed unseen, and
   *  nothing more is copied into the views handed out for it (their owner may have let go of
   *  them). No effect between frames. */
  skipPages(): void {
    const s = this.streaming
    if (s === null) return
    s.part = 'skip'
    s.views = []
  }

  /** Assert the parser's invariants. @throws Error naming the broken one. */
  check(): void {
    if (this.numAssembled > this.assembly.length)
      throw new Error(`${this.numAssembled} bytes held in a ${this.assembly.length}-byte buffer`)
    if (this.numWanted !== 0 && this.numAssembled >= this.numWanted)
      throw new Error(`a whole frame of ${this.numWanted} bytes was held back`)
    if (this.numWanted === 0 && this.numAssembled >= HEADER_BYTES)
      throw new Error(`a whole header is held without its frame length`)
    if (this.numWanted > this.maxFrameBytes) throw new Error(`waiting for a frame over the cap`)
    if (this.hasFailed && this.numAssembled !== 0) throw new Error('a failed parser holds bytes')
    const s = this.streaming
    if (s !== null && (this.numAssembled !== 0 || s.numBodyLeft <= 0 || s.numSmall >= 34))
      throw new Error(`a streamed PAGES frame is in a broken state (${s.part}, ${s.numBodyLeft})`)
  }

  /** Feed the next chunk of the stream. Delivers every frame completed by it, in order, through
   *  the sink. Never throws on malformed input (a sink that throws propagates its own error). */
  push(chunk: Uint8Array): void {
    let pos = 0
    while (pos < chunk.length && !this.hasFailed) {
      if (this.streaming !== null) {
        pos = this.stream(this.streaming, chunk, pos)
        continue
      }
      if (this.numAssembled === 0) {
        // Fast path: a frame starting at `pos`, possibly whole in this chunk.
        const available = chunk.length - pos
        if (available < HEADER_BYTES) {
          this.stash(chunk, pos, available, HEADER_BYTES)
          pos += available
          continue
        }
        const header = this.headerAt(chunk, pos)
        if (header === null) return
        if (this.startStreaming(header)) {
          pos += HEADER_BYTES
          continue
        }
        const frameBytes = HEADER_BYTES + header.bodyBytes
        if (available >= frameBytes) {
          this.deliver(chunk.subarray(pos, pos + frameBytes))
          pos += frameBytes
          continue
        }
        this.numWanted = frameBytes
        this.stash(chunk, pos, available, frameBytes)
        pos += available
        continue
      }
      if (this.numWanted === 0) {
        // Completing a header split across chunks.
        const take = Math.min(HEADER_BYTES - this.numAssembled, chunk.length - pos)
        this.assembly.set(chunk.subarray(pos, pos + take), this.numAssembled)
        this.numAssembled += take
        pos += take
        if (this.numAssembled < HEADER_BYTES) continue
        const header = this.headerAt(this.assembly, 0)
        if (header === null) return
        if (this.startStreaming(header)) {
          this.numAssembled = 0
          continue
        }
        this.numWanted = HEADER_BYTES + header.bodyBytes
        this.grow(this.numWanted)
      }
      const take = Math.min(this.numWanted - this.numAssembled, chunk.length - pos)
      this.assembly.set(chunk.subarray(pos, pos + take), this.numAssembled)
      this.numAssembled += take
      pos += take
      if (this.numAssembled === this.numWanted) {
        const frame = this.assembly.subarray(0, this.numWanted)
        this.numAssembled = 0
        this.numWanted = 0
        this.deliver(frame)
      }
    }
  }

  /** The header at `offset`, or null after reporting a fatal error. */
  private headerAt(bytes: Uint8Array, offset: number): FrameHeader | null {
    const head = readHeader(bytes, offset, this.maxFrameBytes)
    if (!head.ok) {
      this.hasFailed = true
      this.numAssembled = 0
      this.numWanted = 0
      this.streaming = null
      this.sink.error(head.error, true)
      return null
    }
    return head.header
  }

  /** Stream the frame of `header` if it is PAGES, the sink takes pages, and its body can hold an
   *  entry (a shorter one is assembled, and decodeFrame reports it). */
  private startStreaming(header: FrameHeader): boolean {
    const sink = this.sink.pages
    if (sink === undefined || header.kind !== 'pages') return false
    if (header.bodyBytes < PAGES_HEAD_BYTES + PAGE_HEAD_BYTES + 1) return false
    this.streaming = {
      sink,
      numBodyLeft: header.bodyBytes,
      numBodyBytes: header.bodyBytes,
      part: 'head',
      numSmall: 0,
      numPagesInFrame: 0,
      transferId: null,
      index: 0,
      views: [],
      view: 0,
      viewOffset: 0,
    }
    return true
  }

  /** Consume bytes of the streamed frame `s` from `chunk` at `pos`; returns the new position. */
  private stream(s: Streaming, chunk: Uint8Array, pos: number): number {
    const end = Math.min(chunk.length, pos + s.numBodyLeft)
    while (pos < end && this.streaming === s) {
      if (s.part === 'payload') {
        const view = s.views[s.view]
        const take = Math.min(view.length - s.viewOffset, end - pos)
        view.set(chunk.subarray(pos, pos + take), s.viewOffset)
        pos += take
        s.numBodyLeft -= take
        s.viewOffset += take
        if (s.viewOffset === view.length) {
          s.view++
          s.viewOffset = 0
          while (s.view < s.views.length && s.views[s.view].length === 0) s.view++
          if (s.view === s.views.length) this.onPayloadDone(s)
        }
      } else if (s.part === 'skip') {
        const take = end - pos
        pos += take
        s.numBodyLeft -= take
      } else {
        const want = s.part === 'head' ? PAGES_HEAD_BYTES : PAGE_HEAD_BYTES
        const take = Math.min(want - s.numSmall, end - pos, s.numBodyLeft)
        this.small.set(chunk.subarray(pos, pos + take), s.numSmall)
        s.numSmall += take
        pos += take
        s.numBodyLeft -= take
        if (s.numSmall === want) {
          s.numSmall = 0
          if (s.part === 'head') this.onPagesHead(s)
          else this.onEntryHead(s)
        }
      }
      if (s.numBodyLeft === 0 && this.streaming === s) this.streaming = null
    }
    return pos
  }

  private onPagesHead(s: Streaming): void {
    const decoded = decodePagesHead(this.small)
    if (!decoded.ok) return this.malformed(s, decoded.error)
    s.numPagesInFrame = decoded.head.numPagesInFrame
    s.transferId = decoded.head.transferId
    s.part = s.sink.begin(decoded.head) ? 'entry' : 'skip'
    if (s.part === 'entry') this.checkEntryFits(s)
  }

  /** An entry head must fit in what is left of the body (else: malformed, as decodeFrame says). */
  private checkEntryFits(s: Streaming): void {
    if (s.numBodyLeft >= PAGE_HEAD_BYTES) return
    this.malformedEntry(
      s,
      readPageEntryHead(this.small, 0, s.index, s.numPagesInFrame, s.numBodyLeft, this.at(s)),
    )
  }

  private onEntryHead(s: Streaming): void {
    const bodyOffset = this.at(s) - PAGE_HEAD_BYTES
    const entry = readPageEntryHead(
      this.small,
      0,
      s.index,
      s.numPagesInFrame,
      s.numBodyLeft + PAGE_HEAD_BYTES,
      bodyOffset,
    )
    if (typeof entry === 'string') return this.malformedEntry(s, entry)
    const views = s.sink.page(entry)
    if (views === null) {
      s.part = 'skip'
      return
    }
    let numBytes = 0
    for (const view of views) numBytes += view.length
    if (numBytes !== entry.payloadBytes)
      throw new RangeError(
        `page views hold ${numBytes} bytes, the payload is ${entry.payloadBytes}`,
      )
    s.views = views
    s.view = 0
    s.viewOffset = 0
    s.part = 'payload'
    while (s.view < views.length && views[s.view].length === 0) s.view++
  }

  private onPayloadDone(s: Streaming): void {
    s.views = []
    s.index++
    if (!s.sink.pageDone()) s.part = 'skip'
    else if (s.index < s.numPagesInFrame) {
      s.part = 'entry'
      this.checkEntryFits(s)
    } else s.part = 'skip' // the last entry's head checked that no bytes follow it
  }

  /** Byte offset within the body of the next byte to consume. */
  private at(s: Streaming): number {
    return s.numBodyBytes - s.numBodyLeft
  }

  private malformedEntry(s: Streaming, entry: PageEntryHead | string): void {
    const message = typeof entry === 'string' ? entry : `page entry ${s.index} is truncated`
    this.malformed(s, {
      reason: 'malformed_frame',
      message: `pages frame: ${message}`,
      transferId: s.transferId,
    })
  }

  private malformed(s: Streaming, error: FrameError): void {
    s.part = 'skip'
    this.sink.error(error, false)
  }

  private stash(chunk: Uint8Array, pos: number, count: number, capacity: number): void {
    this.grow(capacity)
    this.assembly.set(chunk.subarray(pos, pos + count), this.numAssembled)
    this.numAssembled += count
  }

  private grow(capacity: number): void {
    if (this.assembly.length >= capacity) return
    const next = Buffer.allocUnsafe(
      Math.max(capacity, Math.min(this.assembly.length * 2, this.maxFrameBytes)),
    )
    next.set(this.assembly.subarray(0, this.numAssembled))
    this.assembly = next
  }

  private deliver(bytes: Uint8Array): void {
    const decoded = decodeFrame(bytes, this.maxFrameBytes)
    if (decoded.ok) this.sink.frame(decoded.frame)
    else this.sink.error(decoded.error, false)
  }
}
