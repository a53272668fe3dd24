/** Page and manifest checksums: xxh64 reference vectors, byte views of float pages, and the
 *  manifest's definition (xxh64 over the checksums as 8 bytes big-endian, in order). */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import { ManifestHasher, manifestChecksum, pageChecksum } from '../../src/transfer/checksum.js'

describe('checksum', () => {
  it('pageChecksum matches the xxHash reference vectors for xxh64 (seed 0)', () => {
    assert.equal(pageChecksum(new Uint8Array(0)), 0xef46db3751d8e999n)
    assert.equal(pageChecksum(Buffer.from('a')), 0xd24ec4f1a98c6e5bn)
    assert.equal(pageChecksum(Buffer.from('abc')), 0x44bc2cf5ad770999n)
  })

  it('hashes exactly the bytes of a view, wherever it sits in its buffer', () => {
    const k = new Float32Array([1.5, -2, 3.25, 0, 7])
    const view = new Uint8Array(k.buffer, 4, 12) // floats 1..3
    const copy = Uint8Array.from(view)
    assert.equal(pageChecksum(view), pageChecksum(copy))
    assert.notEqual(pageChecksum(view), pageChecksum(new Uint8Array(k.buffer)))
  })

  it('refuses a Float32Array passed where bytes are expected', () => {
    const k = new Float32Array(4)
    assert.throws(() => pageChecksum(k as unknown as Uint8Array), TypeError)
  })

  it('the manifest is xxh64 over the checksums as big-endian u64s, in order', () => {
    const checksums = [0x0102030405060708n, 0xffff_ffff_ffff_ffffn, 0n]
    const bytes = Buffer.from('0102030405060708' + 'ff'.repeat(8) + '00'.repeat(8), 'hex')
    assert.equal(manifestChecksum(checksums), pageChecksum(bytes))
    assert.notEqual(manifestChecksum(checksums), manifestChecksum([...checksums].reverse()))
    assert.equal(manifestChecksum([]), 0xef46db3751d8e999n)
  })

  it('ManifestHasher built page by page equals manifestChecksum of the list', () => {
    const checksums = Array.from(
      { length: 40 },
      (_, i) => (BigInt(i) * 0x9e3779b97f4a7c15n) % 2n ** 64n,
    )
    const hasher = new ManifestHasher()
    for (const c of checksums) hasher.add(c)
    assert.equal(hasher.numPages, 40)
    assert.equal(hasher.digest(), manifestChecksum(checksums))
  })
})
