/** PAGES frames streamed straight into page views: however the byte stream is cut into chunks and
 *  however a page's destination is cut into views, the parser puts the same bytes in the same pages
 *  as decoding whole frames does, the checksums computed over the views give the same verdicts, and
 *  a corrupted payload byte is caught on exactly its page. The receive session, with a reservation
 *  that takes payloads in place (placePage), accepts an intact transfer under any chunking and
 *  refuses one with a flipped payload byte (checksum_mismatch) under any chunking. */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import fc from 'fast-check'
import { waitUntil } from '../helpers/poll.js'
import { pageChecksum, pageChecksumOf } from '../../src/transfer/checksum.js'
import {
  encodeAck,
  encodePages,
  type FrameError,
  type PageEntryHead,
} from '../../src/transfer/frames.js'
import { FrameParser } from '../../src/transfer/parser.js'
import {
  PlacedHooks,
  SessionHarness,
  beginBytes,
  endBytes,
  helloBytes,
  makeSpec,
  pagesBytes,
  rid,
  tid,
  viewsOf,
  type PlacedReservation,
} from './fixtures.js'

/** What arrived of one page, and whether its checksum held. */
interface Received {
  ordinal: number
  tokensOnPage: number
  checksum: bigint
  bytes: number[]
  isIntact: boolean
}

/** `stream` cut at `cuts` into chunks (empty ones included: a socket never sends them, the
 *  parser must not mind). */
const chunked = viewsOf

/** Parse `chunks` streaming PAGES into views cut at `viewCuts`. */
function streamPages(chunks: Uint8Array[], viewCuts: number[]) {
  const received: Received[] = []
  const errors: FrameError[] = []
  const kinds: string[] = []
  let page: { entry: PageEntryHead; views: Uint8Array[] } | null = null
  const parser = new FrameParser({
    frame: (f) => kinds.push(f.kind),
    error: (e) => errors.push(e),
    pages: {
      begin: (head) => {
        kinds.push('pages')
        assert.equal(head.transferId, tid)
        return true
      },
      page: (entry) => {
        page = { entry, views: viewsOf(new Uint8Array(entry.payloadBytes), viewCuts) }
        return page.views
      },
      pageDone: () => {
        const { entry, views } = page!
        received.push({
          ordinal: entry.ordinal,
          tokensOnPage: entry.tokensOnPage,
          checksum: entry.checksum,
          bytes: views.flatMap((v) => [...v]),
          isIntact: pageChecksumOf(views) === entry.checksum,
        })
        return true
      },
    },
  })
  for (const chunk of chunks) {
    parser.push(chunk)
    parser.check()
  }
  assert.equal(parser.numBufferedBytes, 0)
  return { received, errors, kinds }
}

/** The same stream decoded frame by frame (no streaming), verdicts by one-shot xxh64. */
function decodeWhole(stream: Uint8Array) {
  const received: Received[] = []
  const kinds: string[] = []
  const parser = new FrameParser({
    frame: (f) => {
      kinds.push(f.kind)
      if (f.kind !== 'pages') return
      for (const p of f.pages)
        received.push({
          ordinal: p.ordinal,
          tokensOnPage: p.tokensOnPage,
          checksum: p.checksum,
          bytes: [...p.payload],
          isIntact: pageChecksum(p.payload) === p.checksum,
        })
    },
    error: () => assert.fail('the reference stream is well-formed'),
  })
  parser.push(stream)
  return { received, kinds }
}

const pageArb = fc.record({
  tokensOnPage: fc.nat({ max: 64 }),
  payload: fc.uint8Array({ minLength: 1, maxLength: 400 }),
})

/** Frames of 1..4 pages each, with an ACK between them (non-PAGES frames still pass whole), and
 *  the offsets of every payload byte in the stream. */
const streamArb = fc
  .array(fc.array(pageArb, { minLength: 1, maxLength: 4 }), { minLength: 1, maxLength: 5 })
  .map((frames) => {
    let ordinal = 0
    const parts: Buffer[] = []
    const payloadOffsets: number[] = []
    let at = 0
    for (const pages of frames) {
      const entries = pages.map((p) => ({
        ordinal: ordinal++,
        tokensOnPage: p.tokensOnPage,
        checksum: pageChecksum(p.payload),
        payload: p.payload,
      }))
      const bytes = encodePages({ transferId: tid, requestId: rid, pages: entries })
      let offset = at + 8 + 34
      for (const e of entries) {
        offset += 20
        for (let i = 0; i < e.payload.length; i++) payloadOffsets.push(offset + i)
        offset += e.payload.length
      }
      parts.push(bytes, encodeAck({ transferId: tid }))
      at += bytes.length + 8 + 16
    }
    return { stream: Buffer.concat(parts), payloadOffsets, numPages: ordinal }
  })

const cutsArb = fc.array(fc.nat(), { maxLength: 40 })

describe('PAGES streamed into page views', () => {
  it('any split of the stream and of the views gives the same pages and verdicts as whole frames', () => {
    fc.assert(
      fc.property(streamArb, cutsArb, cutsArb, ({ stream, numPages }, cuts, viewCuts) => {
        const want = decodeWhole(stream)
        const got = streamPages(chunked(stream, cuts), viewCuts)
        assert.deepEqual(got.errors, [])
        assert.deepEqual(got.kinds, want.kinds)
        assert.deepEqual(got.received, want.received)
        assert.equal(got.received.length, numPages)
        assert.ok(got.received.every((p) => p.isIntact))
      }),
      { numRuns: 300 },
    )
  })

  it('a corrupted payload byte is caught on its page only, under any split', () => {
    fc.assert(
      fc.property(
        streamArb,
        cutsArb,
        cutsArb,
        fc.nat(),
        fc.integer({ min: 1, max: 255 }),
        ({ stream, payloadOffsets }, cuts, viewCuts, which, flip) => {
          const bad = Buffer.from(stream)
          bad[payloadOffsets[which % payloadOffsets.length]] ^= flip
          const want = decodeWhole(bad)
          const got = streamPages(chunked(bad, cuts), viewCuts)
          assert.deepEqual(got.received, want.received)
          assert.equal(got.received.filter((p) => !p.isIntact).length, 1)
        },
      ),
      { numRuns: 300 },
    )
  })

  it('a body cut short mid-entry is reported as malformed after the entries before it', () => {
    const payload = Uint8Array.from({ length: 50 }, (_, i) => i)
    const page = { ordinal: 0, tokensOnPage: 1, checksum: pageChecksum(payload), payload }
    const frame = encodePages({ transferId: tid, requestId: rid, pages: [page, page] })
    // Declare one page fewer bytes than the second entry needs: its payload overruns the body.
    frame.writeUInt32BE(frame.readUInt32BE(4) - 10, 4)
    const got = streamPages([frame.subarray(0, frame.length - 10)], [])
    assert.equal(got.received.length, 1)
    assert.deepEqual(got.errors, [
      {
        reason: 'malformed_frame',
        message: 'pages frame: page entry 1 declares 50 payload bytes, 40 remain',
        transferId: tid,
      },
    ])
  })
})

describe('receive session with placePage', () => {
  const specArb = fc.record({
    numTokens: fc.integer({ min: 1, max: 40 }),
    pageSize: fc.integer({ min: 1, max: 8 }),
    pageBytes: fc.integer({ min: 1, max: 200 }),
    perFrame: fc.integer({ min: 1, max: 5 }),
  })

  function streamOf(spec: ReturnType<typeof makeSpec>, perFrame: number): Buffer {
    const frames = [helloBytes(), beginBytes(spec)]
    for (let o = 0; o < spec.numPages; o += perFrame)
      frames.push(
        pagesBytes(
          spec,
          Array.from({ length: Math.min(perFrame, spec.numPages - o) }, (_, i) => o + i),
        ),
      )
    frames.push(endBytes(spec))
    return Buffer.concat(frames)
  }

  it('an intact transfer lands in the reserved pages, ACKed, under any chunking', () => {
    fc.assert(
      fc.property(specArb, cutsArb, cutsArb, (p, cuts, viewCuts) => {
        const spec = makeSpec(p.numTokens, p.pageSize, p.pageBytes)
        const h = new SessionHarness({}, new PlacedHooks(viewCuts))
        h.hooks.expect(spec)
        h.push(...chunked(streamOf(spec, p.perFrame), cuts))
        assert.deepEqual(h.nackReasonsFor(spec.transferId), [])
        const r = h.hooks.of(spec.transferId) as PlacedReservation
        assert.equal(r.completedWith, spec.firstTokenId)
        assert.deepEqual(Buffer.from(r.memory), Buffer.concat(spec.pages))
        assert.deepEqual(h.hooks.violations, [])
      }),
      { numRuns: 150 },
    )
  })

  it('a flipped payload byte is refused (checksum_mismatch) and aborted, under any chunking', () => {
    fc.assert(
      fc.property(specArb, cutsArb, cutsArb, fc.nat(), (p, cuts, viewCuts, which) => {
        const spec = makeSpec(p.numTokens, p.pageSize, p.pageBytes)
        const bad = streamOf(spec, p.perFrame)
        // Frames: HELLO (10 bytes), BEGIN, then per PAGES frame a 42-byte head and per page a
        // 20-byte entry head before its payload.
        const ordinal = which % spec.numPages
        const frameOf = Math.floor(ordinal / p.perFrame)
        const at =
          10 +
          beginBytes(spec).length +
          (frameOf + 1) * 42 +
          (ordinal + 1) * 20 +
          ordinal * spec.pageBytes
        assert.deepEqual(bad.subarray(at, at + spec.pageBytes), Buffer.from(spec.pages[ordinal]))
        bad[at + (which % spec.pageBytes)] ^= 0x40
        const h = new SessionHarness({}, new PlacedHooks(viewCuts))
        h.hooks.expect(spec)
        h.push(...chunked(bad, cuts))
        const r = h.hooks.of(spec.transferId)
        assert.deepEqual(h.nackReasonsFor(spec.transferId), ['checksum_mismatch'])
        assert.equal(r.completedWith, null)
        assert.equal(r.numAborts, 1)
        assert.deepEqual(h.hooks.violations, [])
      }),
      { numRuns: 150 },
    )
  })
})

describe('a transfer ended mid-frame', () => {
  it('gets no more bytes in its pages: the rest of the frame is skipped (stalled)', async () => {
    const spec = makeSpec(8, 4, 1000)
    const hooks = new PlacedHooks([300])
    const h = new SessionHarness({ stallTimeoutMs: 50 }, hooks)
    hooks.expect(spec)
    const frame = pagesBytes(spec, [0, 1])
    const cut = 8 + 34 + 20 + 500 // halfway through page 0's payload
    h.push(helloBytes(), beginBytes(spec), frame.subarray(0, cut))
    const r = hooks.of(spec.transferId) as PlacedReservation
    assert.deepEqual(
      Buffer.from(r.memory.subarray(0, 500)),
      Buffer.from(spec.pages[0].subarray(0, 500)),
    )
    await waitUntil(() => h.nackReasonsFor(spec.transferId).length > 0, {
      timeoutMs: 30_000,
      intervalMs: 20,
      what: 'the stall NACK',
    })
    assert.deepEqual(h.nackReasonsFor(spec.transferId), ['stalled'])
    h.push(frame.subarray(cut), endBytes(spec))
    assert.ok(
      r.memory.subarray(500).every((b) => b === 0),
      'bytes landed after the transfer ended',
    )
    assert.equal(r.numAborts, 1)
    assert.equal(r.completedWith, null)
    assert.deepEqual(hooks.violations, [])
  })
})
