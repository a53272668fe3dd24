/** Random hex strings for ids and secrets drawn on every request, from a pool of entropy filled
 *  by `crypto.randomFillSync` 4 KiB at a time: each draw from `crypto.randomBytes` is a call into
 *  OpenSSL that cost the router ~3 µs per request per id (measured by `npm run bench -- router`),
 *  while a slice of the pool costs ~0.1 µs. The bytes are the same CSPRNG's; each is handed out
 *  once, then overwritten by the next fill. Node pools the entropy of `crypto.randomUUID` the
 *  same way (lib/internal/crypto/random.js, its `uuidData` cache). */
import { randomFillSync } from 'node:crypto'

const poolBytes = 4096
const pool = Buffer.alloc(poolBytes)
let nextByte = poolBytes // empty: filled on the first draw

/** `numBytes` fresh random bytes (1 to 4096) as `2 × numBytes` lowercase hex characters.
 *  Throws a RangeError outside that range. */
export function randomHex(numBytes: number): string {
  if (!Number.isInteger(numBytes) || numBytes < 1 || numBytes > poolBytes) {
    throw new RangeError(`randomHex takes 1 to ${poolBytes} bytes, got ${numBytes}`)
  }
  if (nextByte + numBytes > poolBytes) {
    randomFillSync(pool)
    nextByte = 0
  }
  const hex = pool.toString('hex', nextByte, nextByte + numBytes)
  pool.fill(0, nextByte, nextByte + numBytes) // no copy of a handed-out secret stays behind
  nextByte += numBytes
  return hex
}
