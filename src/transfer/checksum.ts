/** Integrity of transferred KV: the per-page checksum and the manifest checksum over all pages.
 *  Both are xxHash64 (seed 0) from `@node-rs/xxhash` (20+ GB/s here, see STACK.md).
 *  Knows bytes only; knows nothing of frames, pages' meaning, or which side computes them. */
import { Xxh64, xxh64 } from '@node-rs/xxhash'

/** xxh64 (seed 0) of a page payload, as a u64.
 *  Takes bytes: hash a `Float32Array` through a `Uint8Array` view of its buffer, never directly.
 *  @throws TypeError if `payload` is not a Uint8Array (e.g. a Float32Array passed by mistake). */
export function pageChecksum(payload: Uint8Array): bigint {
  if (!(payload instanceof Uint8Array))
    throw new TypeError('pageChecksum takes a Uint8Array view of the payload bytes')
  return xxh64(payload)
}

/** xxh64 (seed 0) of the concatenation of `views`, hashed in place, view by view: equal to
 *  {@link pageChecksum} of the joined bytes (a page that sits in the pool as one slice per layer's
 *  K and V is hashed where it lies). @throws TypeError if a view is not a Uint8Array. */
export function pageChecksumOf(views: readonly Uint8Array[]): bigint {
  if (views.length === 1) return pageChecksum(views[0])
  const hasher = new Xxh64()
  for (const view of views) {
    if (!(view instanceof Uint8Array))
      throw new TypeError('pageChecksumOf takes Uint8Array views of the payload bytes')
    hasher.update(view)
  }
  return hasher.digest()
}

/** Builds the manifest checksum incrementally: xxh64 (seed 0) over the pages' checksums, each as
 *  8 bytes big-endian, in the order added (the caller adds them in ordinal order).
 *  Equal to {@link manifestChecksum} of the same list. */
export class ManifestHasher {
  private readonly hasher = new Xxh64()
  private readonly scratch = Buffer.alloc(8)
  private numAdded = 0

  /** Add the next page's checksum (a u64). @throws RangeError if it is not a u64. */
  add(checksum: bigint): void {
    this.scratch.writeBigUInt64BE(checksum, 0)
    this.hasher.update(this.scratch)
    this.numAdded++
  }

  /** Pages added so far. */
  get numPages(): number {
    return this.numAdded
  }

  /** The manifest checksum of the pages added so far (does not reset). */
  digest(): bigint {
    return this.hasher.digest()
  }
}

/** The manifest checksum of a transfer: xxh64 (seed 0) over `checksums`, each as 8 bytes
 *  big-endian, in ordinal order. @throws RangeError if a checksum is not a u64. */
export function manifestChecksum(checksums: readonly bigint[]): bigint {
  const bytes = Buffer.alloc(checksums.length * 8)
  checksums.forEach((c, i) => bytes.writeBigUInt64BE(c, i * 8))
  return xxh64(bytes)
}
