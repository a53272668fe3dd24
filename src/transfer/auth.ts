/** Data-plane authentication of a transfer (G10), under the per-request secret the router issued
 *  to both P and D: BEGIN carries HMAC-SHA256 of its fields, and END carries HMAC-SHA256 of the
 *  whole manifest (ids, counts, every page checksum in ordinal order, first token), so that pages
 *  and first token are bound to the request as well as BEGIN is.
 *  Knows secrets and MACs; never logs or returns a secret. Knows nothing of sockets or pools. */
import { createHmac, timingSafeEqual, type Hmac } from 'node:crypto'
import { encodeBeginFields, ID_BYTES, isHexId, MAC_BYTES, type BeginFields } from './frames.js'

/** Domain separation: prefixed to the MAC input so a BEGIN MAC is valid for nothing else. */
export const BEGIN_MAC_CONTEXT = 'kvfence/transfer/begin/v1\0'

/** Domain separation of END's MAC: an END MAC is never a valid BEGIN MAC, nor the reverse. */
export const END_MAC_CONTEXT = 'kvfence/transfer/end/v1\0'

/** Shortest secret accepted, in bytes (the router issues 32). */
export const MIN_SECRET_BYTES = 16

/** HMAC-SHA256(secret, BEGIN_MAC_CONTEXT ‖ BEGIN body before the MAC): 32 bytes.
 *  @throws RangeError if `secret` is shorter than {@link MIN_SECRET_BYTES};
 *  TypeError/RangeError from {@link encodeBeginFields} on malformed fields. */
export function beginMac(secret: Uint8Array, fields: BeginFields): Buffer {
  checkSecret(secret)
  return createHmac('sha256', secret)
    .update(BEGIN_MAC_CONTEXT)
    .update(encodeBeginFields(fields))
    .digest()
}

/** Whether `mac` is the BEGIN MAC of `fields` under `secret`, compared in constant time.
 *  False (never a throw) for a short secret, a MAC of the wrong length, or unencodable fields. */
export function verifyBeginMac(secret: Uint8Array, fields: BeginFields, mac: Uint8Array): boolean {
  if (secret.length < MIN_SECRET_BYTES || mac.length !== MAC_BYTES) return false
  let want: Buffer
  try {
    want = beginMac(secret, fields)
  } catch {
    return false
  }
  return timingSafeEqual(want, mac)
}

/** What END's MAC covers besides the page checksums: BEGIN's ids and counts. */
export type EndMacFields = Pick<BeginFields, 'transferId' | 'requestId' | 'numTokens' | 'numPages'>

/** END's MAC, built page by page as checksums are sent or received:
 *  HMAC-SHA256(secret, END_MAC_CONTEXT ‖ transferId (16 bytes) ‖ requestId (16) ‖ numTokens (u32 BE)
 *  ‖ numPages (u32 BE) ‖ each page checksum (u64 BE) in the order added ‖ firstTokenId (u32 BE)).
 *  The caller adds the checksums in ordinal order. Holds the secret only inside the HMAC state. */
export class EndMacBuilder {
  private readonly hmac: Hmac
  private readonly scratch = Buffer.alloc(8)
  private isDone = false

  /** @throws RangeError if `secret` is shorter than {@link MIN_SECRET_BYTES} or a count is not a
   *  u32; TypeError on an id that is not 32 hex digits. */
  constructor(secret: Uint8Array, fields: EndMacFields) {
    checkSecret(secret)
    const head = Buffer.alloc(2 * ID_BYTES + 8)
    writeHexId(head, 0, fields.transferId)
    writeHexId(head, ID_BYTES, fields.requestId)
    head.writeUInt32BE(fields.numTokens, 2 * ID_BYTES)
    head.writeUInt32BE(fields.numPages, 2 * ID_BYTES + 4)
    this.hmac = createHmac('sha256', secret).update(END_MAC_CONTEXT).update(head)
  }

  /** Add the next page's checksum (a u64). @throws RangeError if it is not a u64. */
  add(checksum: bigint): void {
    this.scratch.writeBigUInt64BE(checksum, 0)
    this.hmac.update(this.scratch)
  }

  /** The MAC (32 bytes) once `firstTokenId` (a u32) is added. Call once.
   *  @throws RangeError if `firstTokenId` is not a u32; Error if called twice. */
  digest(firstTokenId: number): Buffer {
    if (this.isDone) throw new Error('EndMacBuilder.digest called twice')
    this.isDone = true
    this.scratch.writeUInt32BE(firstTokenId, 0)
    return this.hmac.update(this.scratch.subarray(0, 4)).digest()
  }

  /** Whether `mac` is the END MAC with `firstTokenId`, compared in constant time. Call once.
   *  False (never a throw) for a MAC of the wrong length or a `firstTokenId` that is not a u32. */
  verify(firstTokenId: number, mac: Uint8Array): boolean {
    if (mac.length !== MAC_BYTES) return false
    let want: Buffer
    try {
      want = this.digest(firstTokenId)
    } catch {
      return false
    }
    return timingSafeEqual(want, mac)
  }
}

/** END's MAC over `checksums` (in ordinal order) in one call; see {@link EndMacBuilder}.
 *  @throws like {@link EndMacBuilder}. */
export function endMac(
  secret: Uint8Array,
  fields: EndMacFields,
  checksums: readonly bigint[],
  firstTokenId: number,
): Buffer {
  const builder = new EndMacBuilder(secret, fields)
  for (const c of checksums) builder.add(c)
  return builder.digest(firstTokenId)
}

function checkSecret(secret: Uint8Array): void {
  if (secret.length < MIN_SECRET_BYTES)
    throw new RangeError(
      `transfer secret must be at least ${MIN_SECRET_BYTES} bytes, got ${secret.length}`,
    )
}

function writeHexId(out: Buffer, offset: number, id: string): void {
  if (!isHexId(id))
    throw new TypeError(`id must be 32 lowercase hex digits, got ${JSON.stringify(id)}`)
  out.write(id, offset, ID_BYTES, 'hex')
}
