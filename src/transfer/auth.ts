/** Data-plane authentication of a transfer (G10): BEGIN carries HMAC-SHA256 of its fields under the
 *  per-request secret the router issued to both P and D.
 *  Knows secrets and MACs; never logs or returns a secret. Knows nothing of sockets or pools. */
import { createHmac, timingSafeEqual } from 'node:crypto'
import { encodeBeginFields, MAC_BYTES, type BeginFields } from './frames.js'

/** Domain separation: prefixed to the MAC input so a BEGIN MAC is valid for nothing else. */
export const BEGIN_MAC_CONTEXT = 'kvfence/transfer/begin/v1\0'

/** Shortest secret accepted, in bytes (the router issues 32). */
export const MIN_SECRET_BYTES = 16

/** HMAC-SHA256(secret, BEGIN_MAC_CONTEXT ‖ BEGIN body before the MAC): 32 bytes.
 *  @throws RangeError if `secret` is shorter than {@link MIN_SECRET_BYTES};
 *  TypeError/RangeError from {@link encodeBeginFields} on malformed fields. */
export function beginMac(secret: Uint8Array, fields: BeginFields): Buffer {
  if (secret.length < MIN_SECRET_BYTES)
    throw new RangeError(
      `transfer secret must be at least ${MIN_SECRET_BYTES} bytes, got ${secret.length}`,
    )
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
