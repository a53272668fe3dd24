/** Wire format of the P → D KV transfer: the frame table, its named constants, and pure symmetric
 *  encode/decode functions (plus in-place writers the sender uses to build PAGES frames directly
 *  in its reused send buffers).
 *  Knows bytes, ids, counts and checksums as numbers; knows nothing of sockets, pools, secrets,
 *  or what a tenant is. Decoding never throws: malformed bytes become a {@link FrameError}.
 *
 *  ## The frame table (docs/protocol.md has the same table and the state machines)
 *
 *  Every frame is an 8-byte header followed by `bodyBytes` bytes of body. Integers are unsigned
 *  big-endian. An id (transfer id, request id) is 16 raw bytes: the 32 lowercase hex digits of the
 *  id, decoded. Strings are length-prefixed UTF-8 (error codes are ASCII).
 *
 *  header (8 bytes)
 *  | off | size | field     | value                                                      |
 *  | --- | ---- | --------- | ---------------------------------------------------------- |
 *  | 0   | 2    | magic     | 0x4B 0x56 ("KV")                                           |
 *  | 2   | 1    | kind      | 1 HELLO, 2 BEGIN, 3 PAGES, 4 END, 5 ACK, 6 NACK, 7 ABORT   |
 *  | 3   | 1    | flags     | 0 (reserved; anything else is malformed)                   |
 *  | 4   | 4    | bodyBytes | u32: bytes of body after the header                        |
 *
 *  HELLO (P → D first, D → P answers) — body 2 bytes
 *  | 0   | 2    | version   | u16, {@link PROTOCOL_VERSION}                              |
 *
 *  BEGIN (P → D) — body 78 + n bytes
 *  | 0   | 16   | transferId   |                                                         |
 *  | 16  | 16   | requestId    |                                                         |
 *  | 32  | 4    | numTokens    | u32 ≥ 1: prompt tokens whose KV this transfer carries   |
 *  | 36  | 4    | numPages     | u32 ≥ 1                                                 |
 *  | 40  | 4    | pageBytes    | u32 ≥ 1: bytes of every page payload                    |
 *  | 44  | 2    | tenantBytes  | u16 n, 1..256                                           |
 *  | 46  | n    | tenant       | UTF-8                                                   |
 *  | 46+n| 32   | mac          | HMAC-SHA256(secret, BEGIN_MAC_CONTEXT ‖ body[0, 46+n))  |
 *
 *  PAGES (P → D) — body 34 + Σ (20 + payloadBytes)
 *  | 0   | 16   | transferId   |                                                         |
 *  | 16  | 16   | requestId    | must equal BEGIN's                                      |
 *  | 32  | 2    | numPagesInFrame | u16 k, 1..1024                                       |
 *  | 34  | ...  | k page entries, each:                                                  |
 *  |  +0 | 4    | ordinal      | u32: 0-based page index within the transfer             |
 *  |  +4 | 4    | tokensOnPage | u32                                                     |
 *  |  +8 | 4    | payloadBytes | u32 p ≥ 1 (must equal BEGIN's pageBytes)                |
 *  | +12 | 8    | checksum     | u64: xxh64(payload, seed 0)                             |
 *  | +20 | p    | payload      | for each layer, K then V rows of that page              |
 *
 *  END (P → D) — body 76 bytes
 *  | 0   | 16   | transferId   |                                                         |
 *  | 16  | 16   | requestId    | must equal BEGIN's                                      |
 *  | 32  | 8    | manifest     | u64: xxh64 of the pages' checksums (u64 BE each), in ordinal order |
 *  | 40  | 4    | firstTokenId | u32: the token prefill sampled                          |
 *  | 44  | 32   | mac          | HMAC-SHA256(secret, END_MAC_CONTEXT ‖ transferId ‖ requestId ‖ |
 *  |     |      |              |   numTokens u32 ‖ numPages u32 ‖ each page checksum u64, |
 *  |     |      |              |   in ordinal order ‖ firstTokenId u32) (auth.ts)        |
 *
 *  ACK (D → P) — body 16 bytes
 *  | 0   | 16   | transferId   |                                                         |
 *
 *  NACK (D → P) — body 19 + c + m bytes
 *  | 0   | 16   | transferId   | all zero: the whole connection is refused, then closed  |
 *  | 16  | 1    | codeBytes    | u8 c, 1..64                                             |
 *  | 17  | c    | code         | ASCII, an ErrorCode of src/common/errors.ts                    |
 *  | 17+c| 2    | messageBytes | u16 m, 0..1024                                          |
 *  | 19+c| m    | message      | UTF-8, "<reason>: <detail>"                             |
 *
 *  ABORT (P → D) — body 18 + m bytes
 *  | 0   | 16   | transferId   |                                                         |
 *  | 16  | 2    | reasonBytes  | u16 m, 0..1024                                          |
 *  | 18  | m    | reason       | UTF-8                                                   |
 */
import { randomBytes } from 'node:crypto'
import { isErrorCode, type ErrorCode } from '../common/errors.js'

// ─── Constants ──────────────────────────────────────────────────────────────────────────────────

/** The protocol version HELLO carries; a peer speaking another version is refused.
 *  2: END carries a MAC over the manifest (version 1's END had none). */
export const PROTOCOL_VERSION = 2
/** First two bytes of every frame: "KV". */
export const MAGIC = 0x4b56
/** Bytes of the frame header. */
export const HEADER_BYTES = 8
/** Bytes of a transfer id or request id on the wire (128 bits). */
export const ID_BYTES = 16
/** Bytes of BEGIN's and END's HMAC-SHA256. */
export const MAC_BYTES = 32
/** Longest tenant name, in UTF-8 bytes. */
export const MAX_TENANT_BYTES = 256
/** Longest NACK error code, in ASCII bytes. */
export const MAX_CODE_BYTES = 64
/** Longest NACK message or ABORT reason, in UTF-8 bytes (encoders truncate longer text). */
export const MAX_MESSAGE_BYTES = 1024
/** Most pages one PAGES frame may carry (the protocol's cap; the sender's default is 8). */
export const MAX_PAGES_PER_FRAME = 1024
/** Default cap on a whole frame (header + body), bytes: 64 MiB. */
export const DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024

/** Body bytes of HELLO. */
export const HELLO_BODY_BYTES = 2
/** Body bytes of BEGIN before the tenant. */
export const BEGIN_FIXED_BYTES = 46
/** Body bytes of PAGES before the first page entry. */
export const PAGES_HEAD_BYTES = 34
/** Bytes of one page entry before its payload. */
export const PAGE_HEAD_BYTES = 20
/** Body bytes of END. */
export const END_BODY_BYTES = 76
/** Body bytes of ACK. */
export const ACK_BODY_BYTES = 16

/** The transfer id a NACK carries when it refuses the whole connection. Never a real transfer id. */
export const ZERO_TRANSFER_ID = '0'.repeat(32)

/** Numeric frame kinds on the wire. */
export const frameKinds = {
  hello: 1,
  begin: 2,
  pages: 3,
  end: 4,
  ack: 5,
  nack: 6,
  abort: 7,
} as const

/** The name of a frame kind. */
export type FrameKind = keyof typeof frameKinds

const kindByNumber: readonly (FrameKind | undefined)[] = (() => {
  const table: (FrameKind | undefined)[] = []
  for (const [name, n] of Object.entries(frameKinds)) table[n] = name as FrameKind
  return table
})()

// ─── Frame values ───────────────────────────────────────────────────────────────────────────────

/** HELLO: the first frame each side sends on a connection. */
export interface HelloFrame {
  kind: 'hello'
  version: number
}

/** The fields of BEGIN that its MAC covers. Ids are 32 lowercase hex digits. */
export interface BeginFields {
  transferId: string
  requestId: string
  tenant: string
  numTokens: number
  numPages: number
  /** Bytes of every page payload. */
  pageBytes: number
}

/** BEGIN: announces a transfer and authenticates it. */
export interface BeginFrame extends BeginFields {
  kind: 'begin'
  /** HMAC-SHA256 over the fields ({@link MAC_BYTES} bytes). */
  mac: Uint8Array
}

/** One page of a PAGES frame. */
export interface PageEntry {
  /** 0-based page index within the transfer. */
  ordinal: number
  tokensOnPage: number
  /** xxh64 of `payload`, as the sender computed it. */
  checksum: bigint
  /** The page's KV bytes. In a decoded frame, a view valid only while the frame is handled. */
  payload: Uint8Array
}

/** PAGES: a bounded batch of one transfer's pages. */
export interface PagesFrame {
  kind: 'pages'
  transferId: string
  requestId: string
  pages: PageEntry[]
}

/** END: the sender's manifest; nothing more will be sent for this transfer. */
export interface EndFrame {
  kind: 'end'
  transferId: string
  requestId: string
  /** xxh64 over the pages' checksums in ordinal order (see checksum.ts). */
  manifestChecksum: bigint
  firstTokenId: number
  /** HMAC-SHA256 over the manifest ({@link MAC_BYTES} bytes; auth.ts `EndMacBuilder`). */
  mac: Uint8Array
}

/** ACK: the receiver verified and took the transfer. */
export interface AckFrame {
  kind: 'ack'
  transferId: string
}

/** NACK: the receiver refused the transfer (or, with {@link ZERO_TRANSFER_ID}, the connection). */
export interface NackFrame {
  kind: 'nack'
  transferId: string
  code: ErrorCode
  message: string
}

/** ABORT: the sender gives up on the transfer. */
export interface AbortFrame {
  kind: 'abort'
  transferId: string
  reason: string
}

/** Any frame. */
export type Frame =
  HelloFrame | BeginFrame | PagesFrame | EndFrame | AckFrame | NackFrame | AbortFrame

/** Why bytes did not decode. The first four are stream-level (the connection cannot go on);
 *  `malformed_frame` means the frame's boundaries are known, so only its transfer is affected. */
export type FrameErrorReason =
  'bad_magic' | 'bad_flags' | 'unknown_kind' | 'frame_too_large' | 'malformed_frame'

/** A coded decoding error; `transferId` is set when the frame's transfer id could be read. */
export interface FrameError {
  reason: FrameErrorReason
  message: string
  transferId: string | null
}

/** The outcome of {@link decodeFrame}. */
export type DecodeResult = { ok: true; frame: Frame } | { ok: false; error: FrameError }

/** A frame header: kind and body length. */
export interface FrameHeader {
  kind: FrameKind
  bodyBytes: number
}

// ─── Ids ────────────────────────────────────────────────────────────────────────────────────────

const hexIdPattern = /^[0-9a-f]{32}$/

/** Whether `id` is 32 lowercase hex digits (a transfer id or request id). */
export function isHexId(id: string): boolean {
  return hexIdPattern.test(id)
}

/** A fresh random 128-bit transfer id as 32 lowercase hex digits (never {@link ZERO_TRANSFER_ID}). */
export function newTransferId(): string {
  for (;;) {
    const id = randomBytes(ID_BYTES).toString('hex')
    if (id !== ZERO_TRANSFER_ID) return id
  }
}

// ─── Sizes ──────────────────────────────────────────────────────────────────────────────────────

/** Bytes of a whole PAGES frame (header included) carrying `numPages` pages of `pageBytes` each. */
export function pagesFrameBytes(numPages: number, pageBytes: number): number {
  return HEADER_BYTES + PAGES_HEAD_BYTES + numPages * (PAGE_HEAD_BYTES + pageBytes)
}

/** Largest body a frame of `kind` may declare; PAGES is bounded by `maxFrameBytes` (bytes). */
export function maxBodyBytes(kind: FrameKind, maxFrameBytes: number): number {
  switch (kind) {
    case 'hello':
      return HELLO_BODY_BYTES
    case 'begin':
      return BEGIN_FIXED_BYTES + MAX_TENANT_BYTES + MAC_BYTES
    case 'pages':
      return maxFrameBytes - HEADER_BYTES
    case 'end':
      return END_BODY_BYTES
    case 'ack':
      return ACK_BODY_BYTES
    case 'nack':
      return ID_BYTES + 1 + MAX_CODE_BYTES + 2 + MAX_MESSAGE_BYTES
    case 'abort':
      return ID_BYTES + 2 + MAX_MESSAGE_BYTES
  }
}

// ─── In-place writers (used by the encoders below and by the sender) ────────────────────────────

function asBuffer(bytes: Uint8Array): Buffer {
  return Buffer.isBuffer(bytes)
    ? bytes
    : Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength)
}

function writeId(dst: Buffer, offset: number, id: string): number {
  if (!isHexId(id))
    throw new TypeError(`id must be 32 lowercase hex digits, got ${JSON.stringify(id)}`)
  dst.write(id, offset, ID_BYTES, 'hex')
  return offset + ID_BYTES
}

function checkU32(name: string, value: number, min: number): void {
  if (!Number.isInteger(value) || value < min || value > 0xffff_ffff)
    throw new RangeError(`${name} must be an integer in [${min}, 2^32), got ${value}`)
}

/** Write a frame header at `offset` of `dst`; returns the offset after it.
 *  @throws RangeError if `bodyBytes` is not a u32. */
export function writeHeader(
  dst: Buffer,
  offset: number,
  kind: FrameKind,
  bodyBytes: number,
): number {
  checkU32('bodyBytes', bodyBytes, 0)
  dst.writeUInt16BE(MAGIC, offset)
  dst.writeUInt8(frameKinds[kind], offset + 2)
  dst.writeUInt8(0, offset + 3)
  dst.writeUInt32BE(bodyBytes, offset + 4)
  return offset + HEADER_BYTES
}

/** Write the start of a PAGES body (ids and page count) at `offset`; returns the offset after it.
 *  @throws TypeError on a malformed id, RangeError on a page count outside [1, 1024]. */
export function writePagesHead(
  dst: Buffer,
  offset: number,
  transferId: string,
  requestId: string,
  numPagesInFrame: number,
): number {
  if (
    !Number.isInteger(numPagesInFrame) ||
    numPagesInFrame < 1 ||
    numPagesInFrame > MAX_PAGES_PER_FRAME
  )
    throw new RangeError(
      `numPagesInFrame must be in [1, ${MAX_PAGES_PER_FRAME}], got ${numPagesInFrame}`,
    )
  offset = writeId(dst, offset, transferId)
  offset = writeId(dst, offset, requestId)
  dst.writeUInt16BE(numPagesInFrame, offset)
  return offset + 2
}

/** Write one page entry's head (everything but the payload) at `offset`; returns the offset of
 *  the payload, which the caller fills with `payloadBytes` bytes.
 *  @throws RangeError on counts that are not u32 or a checksum that is not u64. */
export function writePageHead(
  dst: Buffer,
  offset: number,
  ordinal: number,
  tokensOnPage: number,
  payloadBytes: number,
  checksum: bigint,
): number {
  checkU32('ordinal', ordinal, 0)
  checkU32('tokensOnPage', tokensOnPage, 0)
  checkU32('payloadBytes', payloadBytes, 1)
  dst.writeUInt32BE(ordinal, offset)
  dst.writeUInt32BE(tokensOnPage, offset + 4)
  dst.writeUInt32BE(payloadBytes, offset + 8)
  dst.writeBigUInt64BE(checksum, offset + 12)
  return offset + PAGE_HEAD_BYTES
}

/** `text` cut to at most `maxBytes` UTF-8 bytes, whole characters only. */
export function truncateUtf8(text: string, maxBytes: number): string {
  if (Buffer.byteLength(text) <= maxBytes) return text
  let cut = text.slice(0, maxBytes)
  while (Buffer.byteLength(cut) > maxBytes) cut = cut.slice(0, -1)
  return cut
}

// ─── Encoders ───────────────────────────────────────────────────────────────────────────────────

/** HELLO frame bytes. @throws RangeError if `version` is not a u16. */
export function encodeHello(frame: Omit<HelloFrame, 'kind'>): Buffer {
  if (!Number.isInteger(frame.version) || frame.version < 0 || frame.version > 0xffff)
    throw new RangeError(`version must be a u16, got ${frame.version}`)
  const out = Buffer.allocUnsafe(HEADER_BYTES + HELLO_BODY_BYTES)
  writeHeader(out, 0, 'hello', HELLO_BODY_BYTES)
  out.writeUInt16BE(frame.version, HEADER_BYTES)
  return out
}

/** The BEGIN body bytes that its MAC covers (everything before the MAC).
 *  @throws TypeError on a malformed id or tenant, RangeError on counts out of range. */
export function encodeBeginFields(fields: BeginFields): Buffer {
  const tenantBytes = Buffer.byteLength(fields.tenant)
  if (tenantBytes < 1 || tenantBytes > MAX_TENANT_BYTES)
    throw new TypeError(`tenant must be 1..${MAX_TENANT_BYTES} UTF-8 bytes, got ${tenantBytes}`)
  if (fields.transferId === ZERO_TRANSFER_ID)
    throw new TypeError('the zero transfer id is reserved')
  checkU32('numTokens', fields.numTokens, 1)
  checkU32('numPages', fields.numPages, 1)
  checkU32('pageBytes', fields.pageBytes, 1)
  const out = Buffer.allocUnsafe(BEGIN_FIXED_BYTES + tenantBytes)
  writeId(out, 0, fields.transferId)
  writeId(out, ID_BYTES, fields.requestId)
  out.writeUInt32BE(fields.numTokens, 32)
  out.writeUInt32BE(fields.numPages, 36)
  out.writeUInt32BE(fields.pageBytes, 40)
  out.writeUInt16BE(tenantBytes, 44)
  out.write(fields.tenant, BEGIN_FIXED_BYTES, 'utf8')
  return out
}

/** BEGIN frame bytes. @throws like {@link encodeBeginFields}, or TypeError if `mac` is not 32 bytes. */
export function encodeBegin(frame: Omit<BeginFrame, 'kind'>): Buffer {
  if (frame.mac.length !== MAC_BYTES)
    throw new TypeError(`mac must be ${MAC_BYTES} bytes, got ${frame.mac.length}`)
  const fields = encodeBeginFields(frame)
  const out = Buffer.allocUnsafe(HEADER_BYTES + fields.length + MAC_BYTES)
  writeHeader(out, 0, 'begin', fields.length + MAC_BYTES)
  fields.copy(out, HEADER_BYTES)
  out.set(frame.mac, HEADER_BYTES + fields.length)
  return out
}

/** PAGES frame bytes (the checksums are written as given, not recomputed).
 *  @throws TypeError on a malformed id, RangeError on counts out of range or no pages. */
export function encodePages(frame: Omit<PagesFrame, 'kind'>): Buffer {
  let bodyBytes = PAGES_HEAD_BYTES
  for (const page of frame.pages) bodyBytes += PAGE_HEAD_BYTES + page.payload.length
  const out = Buffer.allocUnsafe(HEADER_BYTES + bodyBytes)
  let offset = writeHeader(out, 0, 'pages', bodyBytes)
  offset = writePagesHead(out, offset, frame.transferId, frame.requestId, frame.pages.length)
  for (const page of frame.pages) {
    offset = writePageHead(
      out,
      offset,
      page.ordinal,
      page.tokensOnPage,
      page.payload.length,
      page.checksum,
    )
    out.set(page.payload, offset)
    offset += page.payload.length
  }
  return out
}

/** END frame bytes. @throws TypeError on a malformed id or a MAC that is not 32 bytes,
 *  RangeError on values out of range. */
export function encodeEnd(frame: Omit<EndFrame, 'kind'>): Buffer {
  checkU32('firstTokenId', frame.firstTokenId, 0)
  if (frame.mac.length !== MAC_BYTES)
    throw new TypeError(`mac must be ${MAC_BYTES} bytes, got ${frame.mac.length}`)
  const out = Buffer.allocUnsafe(HEADER_BYTES + END_BODY_BYTES)
  let offset = writeHeader(out, 0, 'end', END_BODY_BYTES)
  offset = writeId(out, offset, frame.transferId)
  offset = writeId(out, offset, frame.requestId)
  out.writeBigUInt64BE(frame.manifestChecksum, offset)
  out.writeUInt32BE(frame.firstTokenId, offset + 8)
  out.set(frame.mac, offset + 12)
  return out
}

/** ACK frame bytes. @throws TypeError on a malformed id. */
export function encodeAck(frame: Omit<AckFrame, 'kind'>): Buffer {
  const out = Buffer.allocUnsafe(HEADER_BYTES + ACK_BODY_BYTES)
  writeId(out, writeHeader(out, 0, 'ack', ACK_BODY_BYTES), frame.transferId)
  return out
}

/** NACK frame bytes; a message longer than {@link MAX_MESSAGE_BYTES} is truncated.
 *  @throws TypeError on a malformed id. */
export function encodeNack(frame: Omit<NackFrame, 'kind'>): Buffer {
  const message = truncateUtf8(frame.message, MAX_MESSAGE_BYTES)
  const codeBytes = Buffer.byteLength(frame.code, 'ascii')
  const messageBytes = Buffer.byteLength(message)
  const bodyBytes = ID_BYTES + 1 + codeBytes + 2 + messageBytes
  const out = Buffer.allocUnsafe(HEADER_BYTES + bodyBytes)
  let offset = writeId(out, writeHeader(out, 0, 'nack', bodyBytes), frame.transferId)
  out.writeUInt8(codeBytes, offset)
  offset += 1 + out.write(frame.code, offset + 1, 'ascii')
  out.writeUInt16BE(messageBytes, offset)
  out.write(message, offset + 2, 'utf8')
  return out
}

/** ABORT frame bytes; a reason longer than {@link MAX_MESSAGE_BYTES} is truncated.
 *  @throws TypeError on a malformed id. */
export function encodeAbort(frame: Omit<AbortFrame, 'kind'>): Buffer {
  const reason = truncateUtf8(frame.reason, MAX_MESSAGE_BYTES)
  const reasonBytes = Buffer.byteLength(reason)
  const bodyBytes = ID_BYTES + 2 + reasonBytes
  const out = Buffer.allocUnsafe(HEADER_BYTES + bodyBytes)
  const offset = writeId(out, writeHeader(out, 0, 'abort', bodyBytes), frame.transferId)
  out.writeUInt16BE(reasonBytes, offset)
  out.write(reason, offset + 2, 'utf8')
  return out
}

/** The bytes of any frame (dispatches on `kind`). @throws like the per-kind encoders. */
export function encodeFrame(frame: Frame): Buffer {
  switch (frame.kind) {
    case 'hello':
      return encodeHello(frame)
    case 'begin':
      return encodeBegin(frame)
    case 'pages':
      return encodePages(frame)
    case 'end':
      return encodeEnd(frame)
    case 'ack':
      return encodeAck(frame)
    case 'nack':
      return encodeNack(frame)
    case 'abort':
      return encodeAbort(frame)
  }
}

// ─── Decoders ───────────────────────────────────────────────────────────────────────────────────

/** Read and check the 8-byte header at `offset` (the caller guarantees 8 bytes are there).
 *  Returns the header, or a stream-level error: bad magic or flags, unknown kind, or a body longer
 *  than the kind allows under `maxFrameBytes` (bytes). Never throws. */
export function readHeader(
  bytes: Uint8Array,
  offset: number,
  maxFrameBytes: number,
): { ok: true; header: FrameHeader } | { ok: false; error: FrameError } {
  const b = asBuffer(bytes)
  const magic = b.readUInt16BE(offset)
  if (magic !== MAGIC)
    return fail(
      'bad_magic',
      `bad magic 0x${magic.toString(16).padStart(4, '0')} (want 0x${MAGIC.toString(16)})`,
    )
  const kindNumber = b.readUInt8(offset + 2)
  const kind = kindByNumber[kindNumber]
  if (kind === undefined) return fail('unknown_kind', `unknown frame kind ${kindNumber}`)
  const flags = b.readUInt8(offset + 3)
  if (flags !== 0)
    return fail('bad_flags', `${kind} frame has flags 0x${flags.toString(16)} (want 0)`)
  const bodyBytes = b.readUInt32BE(offset + 4)
  const max = maxBodyBytes(kind, maxFrameBytes)
  if (bodyBytes > max)
    return fail('frame_too_large', `${kind} frame body of ${bodyBytes} bytes exceeds ${max}`)
  return { ok: true, header: { kind, bodyBytes } }
}

function fail(
  reason: FrameErrorReason,
  message: string,
  transferId: string | null = null,
): {
  ok: false
  error: FrameError
} {
  return { ok: false, error: { reason, message, transferId } }
}

/** Decode one whole frame (header + body, exactly). Never throws: malformed bytes give a
 *  {@link FrameError}; `maxFrameBytes` (bytes) bounds PAGES as in {@link readHeader}.
 *  Payload and MAC views in the result alias `bytes`. */
export function decodeFrame(
  bytes: Uint8Array,
  maxFrameBytes = DEFAULT_MAX_FRAME_BYTES,
): DecodeResult {
  if (bytes.length < HEADER_BYTES)
    return fail('malformed_frame', `frame of ${bytes.length} bytes has no header`)
  const head = readHeader(bytes, 0, maxFrameBytes)
  if (!head.ok) return head
  const { kind, bodyBytes } = head.header
  const b = asBuffer(bytes).subarray(HEADER_BYTES)
  if (bodyBytes !== b.length)
    return fail(
      'malformed_frame',
      `${kind} header says ${bodyBytes} body bytes, frame has ${b.length}`,
      peekId(kind, b),
    )
  try {
    return decodeBody(kind, b)
  } catch (err) {
    // Unreachable by construction (every read is length-checked first); kept so a decoder bug
    // degrades to a coded error instead of a crash.
    return fail('malformed_frame', `${kind} frame: ${(err as Error).message}`, peekId(kind, b))
  }
}

function readId(b: Buffer, offset: number): string {
  return b.toString('hex', offset, offset + ID_BYTES)
}

/** The transfer id at the start of a body, if there is one and it names a transfer (not zero). */
function peekId(kind: FrameKind, body: Buffer): string | null {
  if (kind === 'hello' || body.length < ID_BYTES) return null
  const id = readId(body, 0)
  return id === ZERO_TRANSFER_ID ? null : id
}

function readUtf8(b: Buffer, start: number, end: number): string | null {
  try {
    return new TextDecoder('utf-8', { fatal: true, ignoreBOM: true }).decode(b.subarray(start, end))
  } catch {
    return null
  }
}

/** Reports a malformed body of the frame being decoded, naming its transfer when known. */
type Malformed = (message: string) => DecodeResult

function decodeBody(kind: FrameKind, b: Buffer): DecodeResult {
  const id = peekId(kind, b)
  const malformed: Malformed = (message) => fail('malformed_frame', `${kind} frame: ${message}`, id)
  // Only a NACK may carry the zero id (it then refuses the whole connection).
  if (kind !== 'hello' && kind !== 'nack' && b.length >= ID_BYTES && id === null)
    return malformed('the zero transfer id is reserved')
  return bodyDecoders[kind](b, malformed)
}

/** One decoder per frame kind: the body's bytes (exactly), checked, to a frame. */
const bodyDecoders: Record<FrameKind, (b: Buffer, malformed: Malformed) => DecodeResult> = {
  hello: decodeHelloBody,
  begin: decodeBeginBody,
  pages: decodePagesBody,
  end: decodeEndBody,
  ack: decodeAckBody,
  nack: decodeNackBody,
  abort: decodeAbortBody,
}

function decodeHelloBody(b: Buffer, malformed: Malformed): DecodeResult {
  if (b.length !== HELLO_BODY_BYTES)
    return malformed(`body is ${b.length} bytes, want ${HELLO_BODY_BYTES}`)
  return { ok: true, frame: { kind: 'hello', version: b.readUInt16BE(0) } }
}

function decodeBeginBody(b: Buffer, malformed: Malformed): DecodeResult {
  if (b.length < BEGIN_FIXED_BYTES + MAC_BYTES)
    return malformed(
      `body is ${b.length} bytes, want at least ${BEGIN_FIXED_BYTES + MAC_BYTES + 1}`,
    )
  const tenantBytes = b.readUInt16BE(44)
  if (tenantBytes < 1 || tenantBytes > MAX_TENANT_BYTES)
    return malformed(`tenant of ${tenantBytes} bytes (want 1..${MAX_TENANT_BYTES})`)
  const want = BEGIN_FIXED_BYTES + tenantBytes + MAC_BYTES
  if (b.length !== want)
    return malformed(`body is ${b.length} bytes, want ${want} for a ${tenantBytes}-byte tenant`)
  const tenant = readUtf8(b, BEGIN_FIXED_BYTES, BEGIN_FIXED_BYTES + tenantBytes)
  if (tenant === null) return malformed('tenant is not valid UTF-8')
  const numTokens = b.readUInt32BE(32)
  const numPages = b.readUInt32BE(36)
  const pageBytes = b.readUInt32BE(40)
  if (numTokens < 1 || numPages < 1 || pageBytes < 1)
    return malformed(
      `numTokens ${numTokens}, numPages ${numPages}, pageBytes ${pageBytes} must all be ≥ 1`,
    )
  const macStart = BEGIN_FIXED_BYTES + tenantBytes
  return {
    ok: true,
    frame: {
      kind: 'begin',
      transferId: readId(b, 0),
      requestId: readId(b, 16),
      tenant,
      numTokens,
      numPages,
      pageBytes,
      mac: b.subarray(macStart, macStart + MAC_BYTES),
    },
  }
}

/** The start of a PAGES body: its ids and how many page entries follow. */
export interface PagesHead {
  transferId: string
  requestId: string
  numPagesInFrame: number
}

/** One page entry's head (everything but the payload). */
export interface PageEntryHead {
  ordinal: number
  tokensOnPage: number
  /** Bytes of the payload that follows the head. */
  payloadBytes: number
  checksum: bigint
}

/** The PAGES body head in `b` (its first {@link PAGES_HEAD_BYTES} bytes, the caller guarantees
 *  them), or the reason the frame is malformed. Never throws. */
export function decodePagesHead(
  b: Buffer,
): { ok: true; head: PagesHead } | { ok: false; error: FrameError } {
  const id = peekId('pages', b)
  if (id === null) return fail('malformed_frame', 'pages frame: the zero transfer id is reserved')
  const numPagesInFrame = b.readUInt16BE(32)
  if (numPagesInFrame < 1 || numPagesInFrame > MAX_PAGES_PER_FRAME)
    return fail(
      'malformed_frame',
      `pages frame: ${numPagesInFrame} pages in one frame (want 1..${MAX_PAGES_PER_FRAME})`,
      id,
    )
  return { ok: true, head: { transferId: id, requestId: readId(b, 16), numPagesInFrame } }
}

/** Read page entry `index` (of `numPagesInFrame`) whose head starts at `offset` of `b`, in a body
 *  of which `numBodyLeft` bytes start at `offset` (the head's own bytes included). Returns the head
 *  or the message of the malformation: a truncated head, an empty payload, a payload longer than
 *  what remains, or bytes left after the last entry. Never throws. */
export function readPageEntryHead(
  b: Buffer,
  offset: number,
  index: number,
  numPagesInFrame: number,
  numBodyLeft: number,
  bodyOffset: number,
): PageEntryHead | string {
  if (numBodyLeft < PAGE_HEAD_BYTES) return `page entry ${index} is truncated at byte ${bodyOffset}`
  const payloadBytes = b.readUInt32BE(offset + 8)
  if (payloadBytes < 1) return `page entry ${index} has an empty payload`
  const numRemain = numBodyLeft - PAGE_HEAD_BYTES
  if (numRemain < payloadBytes)
    return `page entry ${index} declares ${payloadBytes} payload bytes, ${numRemain} remain`
  if (index === numPagesInFrame - 1 && numRemain > payloadBytes)
    return `${numRemain - payloadBytes} bytes after the last page entry`
  return {
    ordinal: b.readUInt32BE(offset),
    tokensOnPage: b.readUInt32BE(offset + 4),
    payloadBytes,
    checksum: b.readBigUInt64BE(offset + 12),
  }
}

function decodePagesBody(b: Buffer, malformed: Malformed): DecodeResult {
  if (b.length < PAGES_HEAD_BYTES)
    return malformed(`body is ${b.length} bytes, want at least ${PAGES_HEAD_BYTES}`)
  const decoded = decodePagesHead(b)
  if (!decoded.ok) return { ok: false, error: decoded.error }
  const { numPagesInFrame } = decoded.head
  const pages: PageEntry[] = []
  let offset = PAGES_HEAD_BYTES
  for (let i = 0; i < numPagesInFrame; i++) {
    const entry = readPageEntryHead(b, offset, i, numPagesInFrame, b.length - offset, offset)
    if (typeof entry === 'string') return malformed(entry)
    const payloadStart = offset + PAGE_HEAD_BYTES
    const { ordinal, tokensOnPage, checksum, payloadBytes } = entry
    pages.push({
      ordinal,
      tokensOnPage,
      checksum,
      payload: b.subarray(payloadStart, payloadStart + payloadBytes),
    })
    offset = payloadStart + payloadBytes
  }
  const { transferId, requestId } = decoded.head
  return { ok: true, frame: { kind: 'pages', transferId, requestId, pages } }
}

function decodeEndBody(b: Buffer, malformed: Malformed): DecodeResult {
  if (b.length !== END_BODY_BYTES)
    return malformed(`body is ${b.length} bytes, want ${END_BODY_BYTES}`)
  return {
    ok: true,
    frame: {
      kind: 'end',
      transferId: readId(b, 0),
      requestId: readId(b, 16),
      manifestChecksum: b.readBigUInt64BE(32),
      firstTokenId: b.readUInt32BE(40),
      mac: b.subarray(44, 44 + MAC_BYTES),
    },
  }
}

function decodeAckBody(b: Buffer, malformed: Malformed): DecodeResult {
  if (b.length !== ACK_BODY_BYTES)
    return malformed(`body is ${b.length} bytes, want ${ACK_BODY_BYTES}`)
  return { ok: true, frame: { kind: 'ack', transferId: readId(b, 0) } }
}

function decodeNackBody(b: Buffer, malformed: Malformed): DecodeResult {
  if (b.length < ID_BYTES + 1 + 1 + 2) return malformed(`body is ${b.length} bytes, too short`)
  const codeBytes = b.readUInt8(ID_BYTES)
  if (codeBytes < 1 || codeBytes > MAX_CODE_BYTES) return malformed(`code of ${codeBytes} bytes`)
  const codeEnd = ID_BYTES + 1 + codeBytes
  if (b.length < codeEnd + 2) return malformed(`body is ${b.length} bytes, code runs past it`)
  const messageBytes = b.readUInt16BE(codeEnd)
  if (messageBytes > MAX_MESSAGE_BYTES) return malformed(`message of ${messageBytes} bytes`)
  if (b.length !== codeEnd + 2 + messageBytes)
    return malformed(`body is ${b.length} bytes, want ${codeEnd + 2 + messageBytes}`)
  const message = readUtf8(b, codeEnd + 2, b.length)
  if (message === null) return malformed('message is not valid UTF-8')
  const code = b.toString('latin1', ID_BYTES + 1, codeEnd)
  // A code this build does not know (a newer peer) still refuses the transfer.
  return {
    ok: true,
    frame: {
      kind: 'nack',
      transferId: readId(b, 0),
      code: isErrorCode(code) ? code : 'transfer_failed',
      message: isErrorCode(code) ? message : `${code}: ${message}`,
    },
  }
}

function decodeAbortBody(b: Buffer, malformed: Malformed): DecodeResult {
  if (b.length < ID_BYTES + 2) return malformed(`body is ${b.length} bytes, too short`)
  const reasonBytes = b.readUInt16BE(ID_BYTES)
  if (reasonBytes > MAX_MESSAGE_BYTES) return malformed(`reason of ${reasonBytes} bytes`)
  if (b.length !== ID_BYTES + 2 + reasonBytes)
    return malformed(`body is ${b.length} bytes, want ${ID_BYTES + 2 + reasonBytes}`)
  const reason = readUtf8(b, ID_BYTES + 2, b.length)
  if (reason === null) return malformed('reason is not valid UTF-8')
  return { ok: true, frame: { kind: 'abort', transferId: readId(b, 0), reason } }
}
