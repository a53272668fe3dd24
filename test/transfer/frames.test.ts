/** The wire format: every frame kind round-trips, hand-written bytes match the table in frames.ts,
 *  and malformed bytes become coded errors (never throws). */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import {
  MAX_MESSAGE_BYTES,
  ZERO_TRANSFER_ID,
  decodeFrame,
  encodeAbort,
  encodeAck,
  encodeBegin,
  encodeEnd,
  encodeFrame,
  encodeHello,
  encodeNack,
  encodePages,
  isHexId,
  newTransferId,
  type Frame,
} from '../../src/transfer/frames.js'
import { oneOfEachKind, rid, tid } from './fixtures.js'

/** Views → plain Uint8Arrays so that deepEqual compares content, not backing buffers. */
function plain(frame: Frame): Frame {
  if (frame.kind === 'begin' || frame.kind === 'end')
    return { ...frame, mac: Uint8Array.from(frame.mac) }
  if (frame.kind === 'pages')
    return {
      ...frame,
      pages: frame.pages.map((p) => ({ ...p, payload: Uint8Array.from(p.payload) })),
    }
  return frame
}

function decodeOk(bytes: Uint8Array): Frame {
  const result = decodeFrame(bytes)
  if (!result.ok) assert.fail(`${result.error.reason}: ${result.error.message}`)
  return plain(result.frame)
}

function decodeErr(bytes: Uint8Array): { reason: string; transferId: string | null } {
  const result = decodeFrame(bytes)
  assert.equal(result.ok, false, 'decoded a malformed frame')
  if (result.ok) throw new Error('unreachable')
  return { reason: result.error.reason, transferId: result.error.transferId }
}

const hex = (s: string): Buffer => Buffer.from(s.replace(/\s+/g, ''), 'hex')

describe('frames', () => {
  it('every frame kind round-trips through encode and decode', () => {
    for (const frame of oneOfEachKind())
      assert.deepEqual(decodeOk(encodeFrame(frame)), frame, frame.kind)
  })

  it('HELLO, ACK, ABORT and END bytes match the table, written by hand', () => {
    assert.deepEqual(encodeHello({ version: 1 }), hex('4b56 01 00 00000002  0001'))
    assert.deepEqual(encodeAck({ transferId: tid }), hex(`4b56 05 00 00000010  ${tid}`))
    // ABORT: id, u16 reason length 2, "no"
    assert.deepEqual(
      encodeAbort({ transferId: tid, reason: 'no' }),
      hex(`4b56 07 00 00000014  ${tid} 0002 6e6f`),
    )
    assert.deepEqual(
      encodeEnd({
        transferId: tid,
        requestId: rid,
        manifestChecksum: 0x0102030405060708n,
        firstTokenId: 258,
        mac: Buffer.alloc(32, 0xab),
      }),
      hex(`4b56 04 00 0000004c  ${tid} ${rid} 0102030405060708 00000102 ${'ab'.repeat(32)}`),
    )
  })

  it('NACK bytes match the table, written by hand', () => {
    // body = 16 id + 1 + 15 ("transfer_failed") + 2 + 3 ("x:y") = 37 = 0x25
    assert.deepEqual(
      encodeNack({ transferId: tid, code: 'transfer_failed', message: 'x:y' }),
      hex(
        `4b56 06 00 00000025  ${tid} 0f ${Buffer.from('transfer_failed').toString('hex')} 0003 783a79`,
      ),
    )
  })

  it('PAGES bytes match the table, with the published xxh64 of "a" as checksum', () => {
    // xxh64("a", seed 0) = 0xd24ec4f1a98c6e5b (xxHash reference test vector).
    const bytes = encodePages({
      transferId: tid,
      requestId: rid,
      pages: [
        { ordinal: 3, tokensOnPage: 2, checksum: 0xd24ec4f1a98c6e5bn, payload: Buffer.from('a') },
      ],
    })
    // body = 34 + 20 + 1 = 55 = 0x37
    assert.deepEqual(
      bytes,
      hex(
        `4b56 03 00 00000037  ${tid} ${rid} 0001  00000003 00000002 00000001 d24ec4f1a98c6e5b 61`,
      ),
    )
  })

  it('BEGIN bytes match the table, with an HMAC computed by openssl', () => {
    // openssl dgst -sha256 -mac HMAC -macopt hexkey:42…42 over
    // "kvfence/transfer/begin/v1\0" ‖ the 50 field bytes below.
    const fields = '11'.repeat(16) + '22'.repeat(16) + '00000005 00000002 00000004 0004 61636d65'
    const mac = 'c9377e91cbd143121ddd8240c13efdb540e7948225e0219bcabaef5a1d70fbd3'
    const bytes = encodeBegin({
      transferId: '11'.repeat(16),
      requestId: '22'.repeat(16),
      tenant: 'acme',
      numTokens: 5,
      numPages: 2,
      pageBytes: 4,
      mac: hex(mac),
    })
    // body = 46 + 4 + 32 = 82 = 0x52
    assert.deepEqual(bytes, hex(`4b56 02 00 00000052 ${fields} ${mac}`))
  })

  it('a header with bad magic, flags or kind is a stream-level error', () => {
    const good = encodeAck({ transferId: tid })
    const badMagic = Buffer.from(good)
    badMagic[0] = 0x4c
    assert.equal(decodeErr(badMagic).reason, 'bad_magic')
    const badFlags = Buffer.from(good)
    badFlags[3] = 1
    assert.equal(decodeErr(badFlags).reason, 'bad_flags')
    for (const kind of [0, 8, 255]) {
      const unknown = Buffer.from(good)
      unknown[2] = kind
      assert.equal(decodeErr(unknown).reason, 'unknown_kind', `kind ${kind}`)
    }
  })

  it('a body longer than its kind allows is frame_too_large', () => {
    const bytes = Buffer.concat([encodeAck({ transferId: tid }), Buffer.alloc(1)])
    bytes.writeUInt32BE(17, 4)
    assert.equal(decodeErr(bytes).reason, 'frame_too_large')
    const pages = hex(`4b56 03 00 ffffffff`)
    assert.equal(decodeFrame(pages, 1024).ok, false)
  })

  it('wrong lengths inside a frame are malformed_frame and name the transfer', () => {
    const end = encodeEnd({
      transferId: tid,
      requestId: rid,
      manifestChecksum: 1n,
      firstTokenId: 1,
      mac: Buffer.alloc(32),
    })
    // END body cut to 40 bytes (header says 40 too): a wrong length for the kind.
    const short = Buffer.from(end.subarray(0, 48))
    short.writeUInt32BE(40, 4)
    assert.deepEqual(decodeErr(short), { reason: 'malformed_frame', transferId: tid })
    // Header and actual length disagree.
    assert.deepEqual(decodeErr(end.subarray(0, end.length - 1)), {
      reason: 'malformed_frame',
      transferId: tid,
    })
  })

  it('a truncated page payload or trailing bytes are malformed_frame', () => {
    const frame = encodePages({
      transferId: tid,
      requestId: rid,
      pages: [{ ordinal: 0, tokensOnPage: 1, checksum: 0n, payload: new Uint8Array(8) }],
    })
    const truncated = Buffer.from(frame)
    truncated.writeUInt32BE(9, 8 + 34 + 8) // payloadBytes 9, only 8 follow
    assert.deepEqual(decodeErr(truncated), { reason: 'malformed_frame', transferId: tid })
    const trailing = Buffer.from(frame)
    trailing.writeUInt32BE(7, 8 + 34 + 8) // payloadBytes 7, 8 follow
    assert.deepEqual(decodeErr(trailing), { reason: 'malformed_frame', transferId: tid })
    const tooMany = Buffer.from(frame)
    tooMany.writeUInt16BE(2, 8 + 32) // two pages declared, one present
    assert.deepEqual(decodeErr(tooMany), { reason: 'malformed_frame', transferId: tid })
  })

  it('BEGIN with a bad tenant, a zero transfer id or zero counts is malformed_frame', () => {
    const begin = oneOfEachKind()[1]
    const bytes = encodeFrame(begin)
    const badUtf8 = Buffer.from(bytes)
    badUtf8[8 + 46] = 0xff
    assert.equal(decodeErr(badUtf8).reason, 'malformed_frame')
    const zeroPages = Buffer.from(bytes)
    zeroPages.writeUInt32BE(0, 8 + 36)
    assert.equal(decodeErr(zeroPages).reason, 'malformed_frame')
    const zeroId = Buffer.from(bytes)
    zeroId.fill(0, 8, 8 + 16)
    assert.equal(decodeErr(zeroId).reason, 'malformed_frame')
  })

  it('only a NACK may carry the zero transfer id; elsewhere it is malformed and names no transfer', () => {
    for (const frame of oneOfEachKind()) {
      if (frame.kind === 'hello' || frame.kind === 'nack') continue
      const bytes = encodeFrame(frame)
      bytes.fill(0, 8, 8 + 16)
      assert.deepEqual(
        decodeErr(bytes),
        { reason: 'malformed_frame', transferId: null },
        frame.kind,
      )
    }
  })

  it('a NACK with a code this build does not know still decodes as transfer_failed', () => {
    const bytes = encodeNack({ transferId: tid, code: 'transfer_failed', message: 'm' })
    bytes.write('transfer_failxx', 8 + 17, 'ascii')
    assert.deepEqual(decodeOk(bytes), {
      kind: 'nack',
      transferId: tid,
      code: 'transfer_failed',
      message: 'transfer_failxx: m',
    })
  })

  it('long NACK messages are cut to 1024 bytes at a character boundary', () => {
    const frame = decodeOk(
      encodeNack({ transferId: tid, code: 'internal_error', message: 'é'.repeat(2000) }),
    )
    assert.equal(frame.kind, 'nack')
    if (frame.kind !== 'nack') return
    assert.equal(frame.message, 'é'.repeat(MAX_MESSAGE_BYTES / 2))
  })

  it('encoders refuse malformed ids, tenants and counts', () => {
    assert.throws(() => encodeAck({ transferId: 'XYZ' }), TypeError)
    assert.throws(() => encodeAck({ transferId: tid.toUpperCase() }), TypeError)
    const begin = oneOfEachKind()[1]
    if (begin.kind !== 'begin') return
    assert.throws(() => encodeBegin({ ...begin, tenant: '' }), TypeError)
    assert.throws(() => encodeBegin({ ...begin, tenant: 'x'.repeat(257) }), TypeError)
    assert.throws(() => encodeBegin({ ...begin, numPages: 0 }), RangeError)
    assert.throws(() => encodeBegin({ ...begin, numTokens: 2 ** 32 }), RangeError)
    assert.throws(() => encodeBegin({ ...begin, transferId: ZERO_TRANSFER_ID }), TypeError)
  })

  it('decoding never throws, whatever the bytes', () => {
    for (let n = 0; n < 200; n++) {
      const junk = Buffer.from(Array.from({ length: n % 60 }, (_, i) => (i * 37 + n) & 0xff))
      if (junk.length >= 2) junk.writeUInt16BE(0x4b56, 0)
      assert.doesNotThrow(() => decodeFrame(junk))
    }
  })

  it('transfer ids are random 128-bit hex, never zero', () => {
    const ids = new Set(Array.from({ length: 100 }, () => newTransferId()))
    assert.equal(ids.size, 100)
    for (const id of ids) assert.ok(isHexId(id) && id !== ZERO_TRANSFER_ID, id)
  })
})
