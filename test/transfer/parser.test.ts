/** The streaming parser rebuilds exactly the frames that were sent, however the stream is cut,
 *  and reports malformed input as coded errors without throwing. */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import fc from 'fast-check'
import {
  encodeAck,
  encodeFrame,
  encodePages,
  type Frame,
  type FrameError,
} from '../../src/transfer/frames.js'
import { FrameParser } from '../../src/transfer/parser.js'
import { oneOfEachKind, rid, tid } from './fixtures.js'

/** Parse `chunks`; every frame is re-encoded inside the callback (its views die after it). */
function parse(chunks: Uint8Array[], maxFrameBytes?: number) {
  const frames: Buffer[] = []
  const errors: { error: FrameError; isFatal: boolean }[] = []
  const parser = new FrameParser(
    {
      frame: (f: Frame) => frames.push(encodeFrame(f)),
      error: (error, isFatal) => errors.push({ error, isFatal }),
    },
    { maxFrameBytes },
  )
  for (const chunk of chunks) {
    parser.push(chunk)
    parser.check()
  }
  return { frames, errors, parser }
}

const framesOfEachKind = oneOfEachKind().map((f) => encodeFrame(f))
const stream = Buffer.concat(framesOfEachKind)

describe('parser', () => {
  it('rebuilds identical frames when the stream is split into two chunks at every offset', () => {
    for (let cut = 0; cut <= stream.length; cut++) {
      const { frames, errors, parser } = parse([stream.subarray(0, cut), stream.subarray(cut)])
      assert.deepEqual(errors, [], `cut at ${cut}`)
      assert.deepEqual(frames, framesOfEachKind, `cut at ${cut}`)
      assert.equal(parser.numBufferedBytes, 0)
    }
  })

  it('rebuilds identical frames when fed one byte at a time', () => {
    const chunks = Array.from(stream, (b) => Uint8Array.of(b))
    assert.deepEqual(parse(chunks).frames, framesOfEachKind)
  })

  it('rebuilds identical frames under random chunkings of random frame sequences', () => {
    const frameArb = fc.constantFrom(...framesOfEachKind)
    const bigPages = fc.uint8Array({ minLength: 1, maxLength: 3000 }).map((payload) =>
      encodePages({
        transferId: tid,
        requestId: rid,
        pages: [{ ordinal: 1, tokensOnPage: 2, checksum: 3n, payload }],
      }),
    )
    fc.assert(
      fc.property(
        fc.array(fc.oneof(frameArb, bigPages), { minLength: 1, maxLength: 12 }),
        fc.array(fc.integer({ min: 1, max: 4096 }), { minLength: 1, maxLength: 40 }),
        (frames, sizes) => {
          const bytes = Buffer.concat(frames)
          const chunks: Uint8Array[] = []
          for (let pos = 0, i = 0; pos < bytes.length; i++) {
            const size = sizes[i % sizes.length]
            chunks.push(bytes.subarray(pos, pos + size))
            pos += size
          }
          const out = parse(chunks)
          assert.deepEqual(out.errors, [])
          assert.deepEqual(out.frames, frames)
        },
      ),
      { numRuns: 300 },
    )
  })

  it('bad magic after a good frame: the good frame is delivered, then one fatal error, then silence', () => {
    const good = encodeAck({ transferId: tid })
    const bad = Buffer.from(good)
    bad[1] = 0
    const { frames, errors, parser } = parse([Buffer.concat([good, bad, good]), good])
    assert.deepEqual(frames, [good])
    assert.equal(errors.length, 1)
    assert.equal(errors[0].error.reason, 'bad_magic')
    assert.equal(errors[0].isFatal, true)
    assert.equal(parser.isFailed, true)
  })

  it('a frame declared over the cap is fatal before its body is buffered', () => {
    const header = Buffer.from('4b56030004000000', 'hex') // PAGES of 64 MiB
    const { errors, parser } = parse([header, Buffer.alloc(100_000)], 1024 * 1024)
    assert.equal(errors.length, 1)
    assert.equal(errors[0].error.reason, 'frame_too_large')
    assert.equal(errors[0].isFatal, true)
    assert.equal(parser.numBufferedBytes, 0)
  })

  it('a malformed body is reported with its transfer id and parsing goes on', () => {
    const good = encodeAck({ transferId: tid })
    const wrong = encodePages({
      transferId: tid,
      requestId: rid,
      pages: [{ ordinal: 0, tokensOnPage: 1, checksum: 0n, payload: Uint8Array.of(1, 2) }],
    })
    wrong.writeUInt32BE(3, 8 + 34 + 8) // payload claims 3 bytes, 2 follow
    for (let cut = 0; cut <= wrong.length; cut++) {
      const all = Buffer.concat([wrong, good])
      const { frames, errors } = parse([all.subarray(0, cut), all.subarray(cut)])
      assert.deepEqual(frames, [good])
      assert.deepEqual(
        errors.map((e) => [e.error.reason, e.error.transferId, e.isFatal]),
        [['malformed_frame', tid, false]],
      )
    }
  })

  it('an incomplete frame stays buffered until the rest arrives', () => {
    const frame = framesOfEachKind[2]
    const { frames, parser } = parse([frame.subarray(0, frame.length - 1)])
    assert.deepEqual(frames, [])
    assert.equal(parser.numBufferedBytes, frame.length - 1)
    parser.push(frame.subarray(frame.length - 1))
    assert.equal(parser.numBufferedBytes, 0)
  })
})
