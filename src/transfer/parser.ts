/** Streaming frame parser: feed it the chunks a socket delivers, in any sizes; it hands out whole
 *  frames. Frames wholly inside one chunk are decoded in place (no copy); a frame that spans chunks
 *  is assembled in one reused buffer, grown at most to the frame cap.
 *  Knows frame boundaries and caps; knows nothing of transfers, hooks or sockets. Never throws on
 *  input: malformed bytes are reported as a coded {@link FrameError}.
 *
 *  Lifetime: a frame (its payload and MAC views) is valid only during the `frame` callback; copy
 *  what must outlive it. */
import {
  DEFAULT_MAX_FRAME_BYTES,
  HEADER_BYTES,
  decodeFrame,
  readHeader,
  type Frame,
  type FrameError,
} from './frames.js'

/** Where the parser delivers its output. */
export interface FrameSink {
  /** A whole, well-formed frame; its views are valid only during this call. */
  frame(frame: Frame): void
  /** A malformed frame. `isFatal`: the stream lost sync (bad header, frame over the cap) and the
   *  parser now ignores all further input; otherwise the frame's bytes were skipped and parsing
   *  goes on with the next frame. */
  error(error: FrameError, isFatal: boolean): void
}

/** Parser options. */
export interface FrameParserOptions {
  /** Cap on a whole frame (header + body), bytes; a larger declared frame is fatal. Default 64 MiB. */
  maxFrameBytes?: number
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

  /** Bytes held of a frame not yet complete. */
  get numBufferedBytes(): number {
    return this.numAssembled
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
  }

  /** Feed the next chunk of the stream. Delivers every frame completed by it, in order, through
   *  the sink. Never throws on malformed input (a sink that throws propagates its own error). */
  push(chunk: Uint8Array): void {
    let pos = 0
    while (pos < chunk.length && !this.hasFailed) {
      if (this.numAssembled === 0) {
        // Fast path: a frame starting at `pos`, possibly whole in this chunk.
        const available = chunk.length - pos
        if (available < HEADER_BYTES) {
          this.stash(chunk, pos, available, HEADER_BYTES)
          pos += available
          continue
        }
        const frameBytes = this.frameBytesAt(chunk, pos)
        if (frameBytes === null) return
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
        const frameBytes = this.frameBytesAt(this.assembly, 0)
        if (frameBytes === null) return
        this.numWanted = frameBytes
        this.grow(frameBytes)
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

  /** Whole-frame bytes declared by the header at `offset`, or null after reporting a fatal error. */
  private frameBytesAt(bytes: Uint8Array, offset: number): number | null {
    const head = readHeader(bytes, offset, this.maxFrameBytes)
    if (!head.ok) {
      this.hasFailed = true
      this.numAssembled = 0
      this.numWanted = 0
      this.sink.error(head.error, true)
      return null
    }
    return HEADER_BYTES + head.header.bodyBytes
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
