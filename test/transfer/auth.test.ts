/** Transfer authentication (G10): BEGIN's and END's HMACs match an independent computation
 *  (openssl) and verification fails for any changed field, a wrong secret or a mangled MAC. */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import { beginMac, endMac, EndMacBuilder, verifyBeginMac } from '../../src/transfer/auth.js'
import type { BeginFields } from '../../src/transfer/frames.js'

const fields: BeginFields = {
  transferId: '11'.repeat(16),
  requestId: '22'.repeat(16),
  tenant: 'acme',
  numTokens: 5,
  numPages: 2,
  pageBytes: 4,
}
const secret = Buffer.alloc(32, 0x42)
// `openssl dgst -sha256 -mac HMAC -macopt hexkey:4242…42` over "kvfence/transfer/begin/v1\0" ‖
// 1111…11 2222…22 00000005 00000002 00000004 0004 61636d65 (see frames.test.ts for the layout).
const opensslMac = 'c9377e91cbd143121ddd8240c13efdb540e7948225e0219bcabaef5a1d70fbd3'

describe('auth', () => {
  it('beginMac equals the HMAC-SHA256 openssl computes over the context and BEGIN fields', () => {
    assert.equal(beginMac(secret, fields).toString('hex'), opensslMac)
  })

  it('verifyBeginMac accepts the right MAC', () => {
    assert.equal(verifyBeginMac(secret, fields, Buffer.from(opensslMac, 'hex')), true)
  })

  it('verifyBeginMac refuses any changed field', () => {
    const mac = beginMac(secret, fields)
    const changes: Partial<BeginFields>[] = [
      { transferId: '13'.repeat(16) },
      { requestId: '23'.repeat(16) },
      { tenant: 'acmf' },
      { numTokens: 6 },
      { numPages: 3 },
      { pageBytes: 5 },
    ]
    for (const change of changes)
      assert.equal(
        verifyBeginMac(secret, { ...fields, ...change }, mac),
        false,
        JSON.stringify(change),
      )
  })

  it('verifyBeginMac refuses a wrong secret, a flipped bit, a short MAC or a short secret', () => {
    const mac = beginMac(secret, fields)
    assert.equal(verifyBeginMac(Buffer.alloc(32, 0x43), fields, mac), false)
    const flipped = Buffer.from(mac)
    flipped[31] ^= 1
    assert.equal(verifyBeginMac(secret, fields, flipped), false)
    assert.equal(verifyBeginMac(secret, fields, mac.subarray(0, 31)), false)
    assert.equal(verifyBeginMac(Buffer.alloc(8, 0x42), fields, mac), false)
    assert.throws(() => beginMac(Buffer.alloc(8), fields), RangeError)
  })

  // `openssl dgst -sha256 -mac HMAC -macopt hexkey:4242…42` over "kvfence/transfer/end/v1\0" ‖
  // 1111…11 2222…22 00000005 00000002 0102030405060708 f0e0d0c0b0a09080 00000102.
  const opensslEndMac = 'be5e47041b9a6aa5e1a267c23eafd4f38b780595210c20e6ca988a725c2304ad'
  const checksums = [0x0102030405060708n, 0xf0e0d0c0b0a09080n]

  it('endMac equals the HMAC-SHA256 openssl computes over the context, ids, counts, checksums and first token', () => {
    assert.equal(endMac(secret, fields, checksums, 258).toString('hex'), opensslEndMac)
  })

  it('EndMacBuilder accepts the right END MAC and refuses any change to what it covers', () => {
    const mac = Buffer.from(opensslEndMac, 'hex')
    const verify = (
      s: Buffer,
      f: Partial<BeginFields>,
      sums: bigint[],
      firstTokenId: number,
      m: Uint8Array = mac,
    ): boolean => {
      const builder = new EndMacBuilder(s, { ...fields, ...f })
      for (const c of sums) builder.add(c)
      return builder.verify(firstTokenId, m)
    }
    assert.equal(verify(secret, {}, checksums, 258), true)
    assert.equal(verify(Buffer.alloc(32, 0x43), {}, checksums, 258), false, 'secret')
    for (const change of [
      { transferId: '13'.repeat(16) },
      { requestId: '23'.repeat(16) },
      { numTokens: 6 },
      { numPages: 3 },
    ])
      assert.equal(verify(secret, change, checksums, 258), false, JSON.stringify(change))
    assert.equal(verify(secret, {}, [...checksums].reverse(), 258), false, 'page order')
    assert.equal(verify(secret, {}, [checksums[0]], 258), false, 'a page missing')
    assert.equal(verify(secret, {}, [checksums[0], checksums[1] ^ 1n], 258), false, 'checksum')
    assert.equal(verify(secret, {}, checksums, 259), false, 'first token')
    assert.equal(verify(secret, {}, checksums, 258, mac.subarray(0, 31)), false, 'short MAC')
    assert.equal(verify(secret, {}, checksums, -1), false, 'first token not a u32')
    // A BEGIN MAC is never an END MAC (domain separation).
    assert.notEqual(beginMac(secret, fields).toString('hex'), opensslEndMac)
    assert.throws(() => new EndMacBuilder(Buffer.alloc(8), fields), RangeError)
  })
})
