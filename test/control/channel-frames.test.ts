/** The control channel's frame codec (src/control/channel-frames.ts): what is encoded is decoded
 *  unchanged however the bytes are cut, and a frame that breaks the format is a clear error that
 *  leaves the reader unusable. */
import assert from 'node:assert/strict'
import { test } from 'node:test'
import {
  ChannelFrameError,
  encodeFrame,
  encodeJsonFrame,
  FrameReader,
  frameKinds,
  maxPayloadBytes,
  parseJsonPayload,
  tokenIdOf,
  type Frame,
} from '../../src/control/channel-frames.js'

/** A conversation's worth of frames of every kind. */
function sampleFrames(): Buffer[] {
  return [
    encodeJsonFrame('generate', 1, { requestId: 'a'.repeat(32), promptTokenIds: [1, 2, 3] }),
    encodeJsonFrame('prefill', 2, { requestId: 'b'.repeat(32) }),
    encodeJsonFrame('event', 1, { type: 'reserved', numPages: 1, transferPort: 9000 }),
    encodeFrame('token', 1, 72),
    encodeFrame('token', 1, 0xffff_ffff),
    encodeJsonFrame('event', 1, {
      type: 'token',
      tokenId: 5,
      logprobs: { logprob: -0.5, top: [] },
    }),
    encodeJsonFrame('result', 2, { requestId: 'b'.repeat(32), numPages: 1 }),
    encodeFrame('cancel', 0xffff_fffe, null),
    encodeJsonFrame('failed', 3, { error: { code: 'capacity_exhausted', message: 'full' } }),
    encodeJsonFrame('event', 1, { type: 'done', finishReason: 'stop' }),
  ]
}

/** What a frame says, comparable with deepEqual (its payload copied out of the read buffer). */
function describeFrame(frame: Frame): { kind: string; stream: number; payload: string } {
  return { kind: frame.kind, stream: frame.stream, payload: frame.payload.toString('hex') }
}

test('a frame is u32 LE length | u8 kind | u32 LE stream | payload, as the table says', () => {
  const frame = encodeFrame('token', 7, 0x01020304)
  assert.equal(frame.toString('hex'), '09000000' + '11' + '07000000' + '04030201')
  const cancel = encodeFrame('cancel', 258, null)
  assert.equal(cancel.toString('hex'), '05000000' + '03' + '02010000')
  assert.deepEqual(frameKinds, {
    generate: 1,
    prefill: 2,
    cancel: 3,
    event: 16,
    token: 17,
    result: 18,
    failed: 19,
  })
})

test('every frame read whole comes back as encoded: kind, stream, payload', () => {
  const frames = sampleFrames()
  const read = new FrameReader().push(Buffer.concat(frames))
  assert.equal(read.length, frames.length)
  assert.deepEqual(parseJsonPayload(read[0]), {
    requestId: 'a'.repeat(32),
    promptTokenIds: [1, 2, 3],
  })
  assert.equal(read[0].kind, 'generate')
  assert.equal(read[0].stream, 1)
  assert.equal(tokenIdOf(read[3]), 72)
  assert.equal(tokenIdOf(read[4]), 0xffff_ffff)
  assert.equal(read[7].kind, 'cancel')
  assert.equal(read[7].stream, 0xffff_fffe)
  assert.equal(read[7].payload.length, 0)
  assert.deepEqual(parseJsonPayload(read[9]), { type: 'done', finishReason: 'stop' })
})

test('input split at every byte, and fed a byte at a time, reads the same frames', () => {
  const bytes = Buffer.concat(sampleFrames())
  const whole = new FrameReader().push(bytes).map(describeFrame)
  for (let cut = 0; cut <= bytes.length; cut++) {
    const reader = new FrameReader()
    const read = [...reader.push(bytes.subarray(0, cut)), ...reader.push(bytes.subarray(cut))]
    assert.deepEqual(read.map(describeFrame), whole, `cut at byte ${cut}`)
    assert.equal(reader.numBufferedBytes, 0)
  }
  const reader = new FrameReader()
  const read: ReturnType<typeof describeFrame>[] = []
  for (let i = 0; i < bytes.length; i++) {
    // Copied out at once: a frame's payload is a view into bytes the next push may drop.
    read.push(...reader.push(bytes.subarray(i, i + 1)).map(describeFrame))
  }
  assert.deepEqual(read, whole)
})

test('a frame length over the cap is refused before its payload arrives, and the reader stays broken', () => {
  const reader = new FrameReader()
  const header = Buffer.alloc(4)
  header.writeUInt32LE(5 + maxPayloadBytes + 1, 0)
  assert.throws(
    () => reader.push(header),
    (err: unknown) =>
      err instanceof ChannelFrameError &&
      err.code === 'internal_error' &&
      err.message ===
        `control channel: frame length ${5 + maxPayloadBytes + 1} outside [5, ${5 + maxPayloadBytes}]`,
  )
  assert.throws(() => reader.push(encodeFrame('cancel', 1, null)), /read after a malformed frame/)
})

test('a frame shorter than its head, or of an unknown kind, is a clear error', () => {
  const short = Buffer.from('04000000' + '03' + '000000', 'hex')
  assert.throws(() => new FrameReader().push(short), /frame length 4 outside \[5, /)
  const unknown = Buffer.from('05000000' + '63' + '01000000', 'hex')
  assert.throws(() => new FrameReader().push(unknown), /control channel: unknown frame kind 99$/)
})

test('a payload over the cap is refused when encoded', () => {
  assert.throws(
    () => encodeFrame('generate', 1, Buffer.alloc(maxPayloadBytes + 1)),
    new RegExp(`a generate payload of ${maxPayloadBytes + 1} bytes is over ${maxPayloadBytes}`),
  )
  assert.equal(
    encodeFrame('generate', 1, Buffer.alloc(maxPayloadBytes)).length,
    9 + maxPayloadBytes,
  )
})

test('a JSON payload that is not JSON, or a token frame not 4 bytes long, is a clear error', () => {
  const [notJson] = new FrameReader().push(encodeFrame('result', 4, Buffer.from('{nope')))
  assert.throws(() => parseJsonPayload(notJson), /a result frame on stream 4 is not JSON/)
  const [shortToken] = new FrameReader().push(encodeFrame('token', 4, Buffer.from([1, 2])))
  assert.throws(
    () => tokenIdOf(shortToken),
    /a token frame on stream 4 has 2 payload bytes, want 4/,
  )
})
