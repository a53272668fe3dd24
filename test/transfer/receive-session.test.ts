/** The receiver's checks, one test each, driven without sockets through one ReceiveSession.
 *  Every refusal test asserts the exact reason, so that removing the check makes it fail (a later
 *  check would refuse for another reason, or nothing would). Always-on checks are tested with
 *  guards off, where they are the only line of defence. */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import fc from 'fast-check'
import { KvfenceError } from '../../src/common/errors.js'
import {
  encodeAbort,
  encodeAck,
  encodeEnd,
  encodePages,
  type EndFrame,
} from '../../src/transfer/frames.js'
import {
  RecordingHooks,
  SessionHarness,
  beginBytes,
  decodeAll,
  endBytes,
  helloBytes,
  makeSpec,
  pageEntry,
  pagesBytes,
  transferBytes,
  type TransferSpec,
} from './fixtures.js'

const unsafe = { verifyManifest: false, verifyAuth: false }

/** The fields of the one END frame in `bytes`. */
function decodeEndOf(bytes: Uint8Array): Omit<EndFrame, 'kind'> {
  const frame = decodeAll(bytes)[0]
  assert.ok(frame.kind === 'end')
  const { kind: _kind, ...fields } = frame
  return fields
}

function harness(spec: TransferSpec, options = {}): SessionHarness {
  const h = new SessionHarness(options)
  h.hooks.expect(spec)
  return h.hello()
}

/** The transfer was refused for `reason`: one NACK, no ACK, and its reservation (if any) was
 *  aborted exactly once and never completed. */
function assertRefused(
  h: SessionHarness,
  spec: TransferSpec,
  reason: string,
  hasReservation = true,
): void {
  assert.deepEqual(h.nackReasonsFor(spec.transferId), [reason])
  assert.equal(
    h.repliesFor(spec.transferId).some((f) => f.kind === 'ack'),
    false,
    'ACKed',
  )
  const r = h.hooks.reservations.find((x) => x.info.transferId === spec.transferId)
  if (!hasReservation) return assert.equal(r, undefined, 'begin() was called')
  assert.ok(r, 'no reservation')
  assert.equal(r.numAborts, 1)
  assert.equal(r.completedWith, null)
  assert.equal(r.abortedWith?.message.split(':')[0], reason)
  assert.deepEqual(h.hooks.violations, [])
}

function assertCompleted(h: SessionHarness, spec: TransferSpec): void {
  const r = h.hooks.of(spec.transferId)
  assert.deepEqual(h.nackReasonsFor(spec.transferId), [])
  assert.deepEqual(
    h.repliesFor(spec.transferId).map((f) => f.kind),
    ['ack'],
  )
  assert.equal(r.completedWith, spec.firstTokenId)
  assert.equal(r.numAborts, 0)
  assert.deepEqual(h.hooks.violations, [])
}

describe('receiver session: a well-formed transfer', () => {
  it('is written page by page, completed with its first token, and ACKed', () => {
    const spec = makeSpec(10, 4, 32)
    const h = harness(spec).push(...transferBytes(spec))
    assertCompleted(h, spec)
    const r = h.hooks.of(spec.transferId)
    assert.deepEqual(r.info, {
      transferId: spec.transferId,
      requestId: spec.requestId,
      tenant: spec.tenant,
      numTokens: 10,
      numPages: 3,
      pageBytes: 32,
    })
    assert.deepEqual(
      [...r.written.entries()].map(([o, w]) => [
        o,
        w.tokensOnPage,
        Buffer.from(w.payload).toString('hex'),
      ]),
      spec.pages.map((p, o) => [o, [4, 4, 2][o], Buffer.from(p).toString('hex')]),
    )
    assert.deepEqual(
      h.replies.map((f) => f.kind),
      ['hello', 'ack'],
    )
    assert.deepEqual(h.counters, { numStarted: 1, numCompleted: 1, numAborted: 0, numRefused: 0 })
  })
})

describe('receiver session: BEGIN checks', () => {
  it('refuses a request it was not told about (unknown_request, G10)', () => {
    const spec = makeSpec()
    const h = new SessionHarness().hello().push(...transferBytes(spec))
    assertRefused(h, spec, 'unknown_request', false)
  })

  it('refuses a BEGIN whose HMAC does not verify (bad_hmac, G10)', () => {
    const spec = makeSpec()
    const h = harness(spec).push(
      beginBytes(spec, {}, Buffer.alloc(32, 1)),
      ...transferBytes(spec).slice(1),
    )
    assertRefused(h, spec, 'bad_hmac', false)
  })

  it('refuses a BEGIN whose fields were changed after the HMAC (bad_hmac, G10)', () => {
    const spec = makeSpec(8, 4)
    const begin = beginBytes(spec)
    begin.writeUInt32BE(4, 8 + 32) // numTokens 8 → 4, MAC unchanged
    const h = harness(spec).push(begin)
    assertRefused(h, spec, 'bad_hmac', false)
  })

  it('with verifyAuth off, accepts a BEGIN under a wrong secret (the G10 switch is explicit)', () => {
    const spec = makeSpec()
    const h = new SessionHarness({ verifyAuth: false }).hello()
    h.push(beginBytes(spec, {}, Buffer.alloc(32, 1)), ...transferBytes(spec).slice(1))
    assertCompleted(h, spec)
  })

  it('refuses a second BEGIN of a transfer in flight and aborts the first (duplicate_transfer)', () => {
    const spec = makeSpec()
    const h = harness(spec).push(beginBytes(spec), beginBytes(spec))
    assertRefused(h, spec, 'duplicate_transfer')
    assert.equal(h.hooks.reservations.length, 1)
  })

  it('refuses a BEGIN that reuses the id of a transfer that ended (duplicate_transfer)', () => {
    const spec = makeSpec()
    const h = harness(spec).push(...transferBytes(spec), beginBytes(spec))
    assert.deepEqual(
      h
        .repliesFor(spec.transferId)
        .map((f) => (f.kind === 'nack' ? f.message.split(':')[0] : f.kind)),
      ['ack', 'duplicate_transfer'],
    )
    assert.equal(h.hooks.reservations.length, 1)
  })

  it('refuses a BEGIN the hooks reject, with the hook’s code, and never calls abort', () => {
    const spec = makeSpec()
    const h = harness(spec)
    h.hooks.refuseBegin = new KvfenceError('capacity_exhausted', 'pool full')
    h.push(...transferBytes(spec))
    const nacks = h.repliesFor(spec.transferId)
    assert.equal(nacks.length, 1)
    assert.equal(nacks[0].kind === 'nack' && nacks[0].code, 'capacity_exhausted')
    assert.equal(h.hooks.reservations.length, 0)
  })

  it('refuses counts that cannot fill the pages: too many tokens (counts_mismatch, G4)', () => {
    const spec = makeSpec(16, 4) // 4 full pages
    const h = harness(spec).push(
      beginBytes(spec, { numTokens: 17 }),
      ...transferBytes(spec).slice(1),
    )
    assertRefused(h, spec, 'counts_mismatch')
  })

  it('refuses counts that leave the last page empty (counts_mismatch, G4)', () => {
    const spec = makeSpec(16, 4)
    const h = harness(spec).push(beginBytes(spec, { numTokens: 12 }))
    assertRefused(h, spec, 'counts_mismatch')
  })
})

describe('receiver session: PAGES and END checks', () => {
  it('NACKs PAGES and END of a transfer it never saw and touches no reservation (unknown_transfer)', () => {
    const spec = makeSpec()
    const h = harness(spec).push(pagesBytes(spec, [0]), endBytes(spec))
    assert.deepEqual(h.nackReasonsFor(spec.transferId), ['unknown_transfer'])
    assert.equal(h.hooks.reservations.length, 0)
    const other = makeSpec()
    h.push(endBytes(other))
    assert.deepEqual(h.nackReasonsFor(other.transferId), ['unknown_transfer'])
  })

  it('refuses PAGES naming another request than BEGIN did (request_mismatch)', () => {
    const spec = makeSpec()
    const h = harness(spec, unsafe).push(
      beginBytes(spec),
      pagesBytes(spec, [0], 'ab'.repeat(16)),
      endBytes(spec),
    )
    assertRefused(h, spec, 'request_mismatch')
    assert.equal(h.hooks.of(spec.transferId).written.size, 0)
  })

  it('refuses END naming another request than BEGIN did (request_mismatch)', () => {
    const spec = makeSpec()
    const [begin, pages] = transferBytes(spec)
    const h = harness(spec, unsafe).push(
      begin,
      pages,
      endBytes(spec, undefined, { requestId: 'ab'.repeat(16) }),
    )
    assertRefused(h, spec, 'request_mismatch')
  })

  it('refuses an ordinal beyond the reservation, even with guards off (ordinal_out_of_range)', () => {
    const spec = makeSpec(8, 4) // pages 0, 1
    const h = harness(spec, unsafe).push(
      beginBytes(spec),
      pagesBytes(spec, [0, 1]),
      pagesBytes(spec, [2]),
      endBytes(spec),
    )
    assertRefused(h, spec, 'ordinal_out_of_range')
    assert.deepEqual([...h.hooks.of(spec.transferId).written.keys()], [0, 1])
  })

  it('refuses a payload that is not exactly pageBytes, even with guards off (page_bytes_mismatch)', () => {
    for (const delta of [1, -1]) {
      const spec = makeSpec(8, 4, 32)
      const payload = new Uint8Array(32 + delta)
      const wrong = encodePages({
        transferId: spec.transferId,
        requestId: spec.requestId,
        pages: [pageEntry(spec, 0, { payload })],
      })
      const h = harness(spec, unsafe).push(beginBytes(spec), wrong, endBytes(spec))
      assertRefused(h, spec, 'page_bytes_mismatch')
      assert.equal(h.hooks.of(spec.transferId).written.size, 0)
    }
  })

  it('refuses a page with more tokens than a page holds, even with guards off (page_overfull)', () => {
    const spec = makeSpec(8, 4)
    const over = encodePages({
      transferId: spec.transferId,
      requestId: spec.requestId,
      pages: [pageEntry(spec, 0, { tokensOnPage: 5 })],
    })
    const h = harness(spec, unsafe).push(beginBytes(spec), over, endBytes(spec))
    assertRefused(h, spec, 'page_overfull')
  })

  it('refuses a duplicated page that replaces a missing one (page_out_of_order, G4)', () => {
    const spec = makeSpec(16, 4) // 4 full pages
    const sent = [0, 1, 1, 3]
    const h = harness(spec).push(beginBytes(spec), pagesBytes(spec, sent), endBytes(spec, sent))
    assertRefused(h, spec, 'page_out_of_order')
    assert.deepEqual([...h.hooks.of(spec.transferId).written.keys()], [0, 1])
  })

  it('refuses pages out of order (page_out_of_order, G4)', () => {
    const spec = makeSpec(16, 4)
    const sent = [1, 0, 2, 3]
    const h = harness(spec).push(beginBytes(spec), pagesBytes(spec, sent), endBytes(spec, sent))
    assertRefused(h, spec, 'page_out_of_order')
    assert.equal(h.hooks.of(spec.transferId).written.size, 0)
  })

  it('refuses a page whose token count is not what its position requires (tokens_mismatch, G4)', () => {
    const spec = makeSpec(10, 4) // 4, 4, 2
    const short = encodePages({
      transferId: spec.transferId,
      requestId: spec.requestId,
      pages: [pageEntry(spec, 0), pageEntry(spec, 1, { tokensOnPage: 3 }), pageEntry(spec, 2)],
    })
    const h = harness(spec).push(beginBytes(spec), short, endBytes(spec))
    assertRefused(h, spec, 'tokens_mismatch')
  })

  it('refuses a page whose payload does not match its checksum (checksum_mismatch, G4)', () => {
    const spec = makeSpec(10, 4)
    const bad = encodePages({
      transferId: spec.transferId,
      requestId: spec.requestId,
      pages: [
        pageEntry(spec, 0),
        pageEntry(spec, 1, { checksum: pageEntry(spec, 1).checksum ^ 1n }),
        pageEntry(spec, 2),
      ],
    })
    const h = harness(spec).push(beginBytes(spec), bad, endBytes(spec))
    assertRefused(h, spec, 'checksum_mismatch')
    assert.deepEqual([...h.hooks.of(spec.transferId).written.keys()], [0])
  })

  it('refuses END before every page arrived (incomplete, G4)', () => {
    const spec = makeSpec(10, 4)
    const h = harness(spec).push(beginBytes(spec), pagesBytes(spec, [0]), endBytes(spec, [0]))
    assertRefused(h, spec, 'incomplete')
  })

  it('refuses END whose manifest does not match the pages received (manifest_mismatch, G4)', () => {
    const spec = makeSpec(10, 4)
    const [begin, pages] = transferBytes(spec)
    const h = harness(spec).push(begin, pages, endBytes(spec, undefined, { manifest: 12345n }))
    assertRefused(h, spec, 'manifest_mismatch')
  })

  it('refuses END whose MAC is not under the request’s secret (bad_end_mac, G10)', () => {
    const spec = makeSpec(10, 4)
    const [begin, pages] = transferBytes(spec)
    const forged = endBytes(spec, undefined, { secret: Buffer.alloc(32, 1) })
    const h = harness(spec).push(begin, pages, forged)
    assertRefused(h, spec, 'bad_end_mac')
  })

  it('refuses END whose MAC covers another first token (bad_end_mac, G10)', () => {
    const spec = makeSpec(10, 4)
    const [begin, pages] = transferBytes(spec)
    const end = endBytes(spec)
    end.writeUInt32BE(spec.firstTokenId + 1, 8 + 40) // firstTokenId, after the header
    const h = harness(spec).push(begin, pages, end)
    assertRefused(h, spec, 'bad_end_mac')
  })

  it('refuses another request’s pages and END spliced under a genuine BEGIN (bad_end_mac, G10)', () => {
    // The victim's BEGIN is genuine; pages, manifest and END MAC are an earlier request's (same
    // shape, its own secret), relabelled with the victim's ids as a middlebox would.
    const victim = makeSpec(10, 4)
    const earlier = {
      ...makeSpec(10, 4),
      transferId: victim.transferId,
      requestId: victim.requestId,
    }
    const h = harness(victim).push(beginBytes(victim), ...transferBytes(earlier).slice(1))
    assertRefused(h, victim, 'bad_end_mac')
    // Every page passed its checksum and the manifest matched: only END's MAC tells them apart.
    assert.equal(h.hooks.of(victim.transferId).written.size, 3)
  })

  it('refuses altered pages with a matching manifest under the genuine END’s MAC (bad_end_mac, G10)', () => {
    const spec = makeSpec(10, 4)
    const altered = { ...spec, pages: spec.pages.map((p) => p.map((b) => b ^ 0xff)) }
    const genuineMac = decodeAll(endBytes(spec))[0]
    assert.ok(genuineMac.kind === 'end')
    const end = encodeEnd({ ...decodeEndOf(endBytes(altered)), mac: genuineMac.mac })
    const h = harness(spec).push(beginBytes(spec), transferBytes(altered)[1], end)
    assertRefused(h, spec, 'bad_end_mac')
  })

  it('with verifyAuth off, ACKs an END whose MAC is wrong (G10 switches the check)', () => {
    const spec = makeSpec(10, 4)
    const [begin, pages] = transferBytes(spec)
    const h = harness(spec, { verifyAuth: false }).push(
      begin,
      pages,
      endBytes(spec, undefined, { secret: Buffer.alloc(32, 1) }),
    )
    assertCompleted(h, spec)
  })

  it('with verifyManifest off, ACKs a truncated, corrupted transfer (the incident’s unsafe mode)', () => {
    const spec = makeSpec(10, 4)
    const bad = encodePages({
      transferId: spec.transferId,
      requestId: spec.requestId,
      pages: [pageEntry(spec, 0, { checksum: 1n, tokensOnPage: 4 })],
    })
    const h = harness(spec, { verifyManifest: false }).push(
      beginBytes(spec),
      bad,
      endBytes(spec, [0], { manifest: 2n, checksums: [1n] }),
    )
    assertCompleted(h, spec)
    assert.equal(h.hooks.of(spec.transferId).written.size, 1)
  })

  it('refuses a transfer with no frame for stallTimeoutMs (stalled)', async () => {
    const spec = makeSpec()
    const h = harness(spec, { stallTimeoutMs: 30 }).push(beginBytes(spec), pagesBytes(spec, [0]))
    await new Promise((r) => setTimeout(r, 80))
    assertRefused(h, spec, 'stalled')
    h.teardown()
  })
})

describe('receiver session: failures stay contained', () => {
  it('a malformed frame refuses its transfer only; another transfer on the connection completes', () => {
    const a = makeSpec()
    const b = makeSpec()
    const h = harness(a)
    h.hooks.expect(b)
    const bad = pagesBytes(a, [0])
    bad.writeUInt32BE(33, 8 + 34 + 8) // payload claims 33 bytes, 32 follow
    const [beginB, pagesB, endB] = transferBytes(b)
    h.push(beginBytes(a), beginB, bad, pagesB, pagesBytes(a, [1]), endB)
    assertRefused(h, a, 'malformed_frame')
    assertCompleted(h, b)
    assert.equal(h.isIoClosed, false)
  })

  it('unparseable bytes close the connection: every transfer NACKed and aborted once, then a connection NACK', () => {
    const a = makeSpec()
    const b = makeSpec()
    const h = harness(a)
    h.hooks.expect(b)
    h.push(
      beginBytes(a),
      beginBytes(b),
      pagesBytes(a, [0]),
      Buffer.from('GET / HTTP/1.1\r\n\r\n'),
      ...transferBytes(b).slice(1),
    )
    assertRefused(h, a, 'bad_magic')
    assertRefused(h, b, 'bad_magic')
    assert.deepEqual(h.nackReasonsFor('0'.repeat(32)), ['bad_magic'])
    assert.equal(h.isIoClosed, true)
    assert.equal(h.session.isClosed, true)
  })

  it('a HELLO of another version gets a connection NACK and the connection closes', () => {
    const spec = makeSpec()
    const h = new SessionHarness()
    h.hooks.expect(spec)
    // Version 1 is the previous protocol, whose END carried no MAC.
    h.push(helloBytes(1), ...transferBytes(spec))
    assert.deepEqual(h.nackReasonsFor('0'.repeat(32)), ['unsupported_version'])
    assert.equal(h.isIoClosed, true)
    assert.equal(h.hooks.reservations.length, 0)
  })

  it('a frame before HELLO closes the connection', () => {
    const spec = makeSpec()
    const h = new SessionHarness()
    h.hooks.expect(spec)
    h.push(...transferBytes(spec))
    assert.deepEqual(h.nackReasonsFor('0'.repeat(32)), ['unexpected_frame'])
    assert.equal(h.hooks.reservations.length, 0)
  })

  it('a connection that sends no HELLO within stallTimeoutMs is closed', async () => {
    const h = new SessionHarness({ stallTimeoutMs: 30 })
    await new Promise((r) => setTimeout(r, 80))
    assert.deepEqual(h.nackReasonsFor('0'.repeat(32)), ['stalled'])
    assert.equal(h.isIoClosed, true)
  })

  it('a second HELLO or a frame only a receiver sends closes the connection (unexpected_frame)', () => {
    for (const frame of [helloBytes(), encodeAck({ transferId: '1'.repeat(32) })]) {
      const spec = makeSpec()
      const h = harness(spec).push(beginBytes(spec), frame)
      assertRefused(h, spec, 'unexpected_frame')
      assert.deepEqual(h.nackReasonsFor('0'.repeat(32)), ['unexpected_frame'])
      assert.equal(h.isIoClosed, true)
    }
  })

  it('a reservation without a usable pageSize is refused and aborted (hook_failed)', () => {
    const spec = makeSpec()
    const h = harness(spec)
    h.hooks.pageSize = 0
    h.push(...transferBytes(spec))
    assertRefused(h, spec, 'hook_failed')
  })

  it('a complete() that throws becomes a NACK with its code and one abort', () => {
    const spec = makeSpec()
    const h = harness(spec)
    h.hooks.onBegin = (r) =>
      (r.completeThrows = new KvfenceError('transfer_failed', 'first_token: out of vocabulary'))
    h.push(...transferBytes(spec))
    const r = h.hooks.of(spec.transferId)
    assert.deepEqual(h.nackReasonsFor(spec.transferId), ['first_token'])
    assert.equal(r.numAborts, 1)
    assert.deepEqual(h.counters, { numStarted: 1, numCompleted: 0, numAborted: 1, numRefused: 1 })
  })

  it('a writePage() that throws becomes a NACK and one abort; later pages are not written', () => {
    const spec = makeSpec(12, 4)
    const h = harness(spec)
    h.hooks.onBegin = (r) =>
      (r.onWrite = (o) => {
        if (o === 1) throw new Error('pool exploded')
      })
    h.push(...transferBytes(spec))
    assert.deepEqual(h.nackReasonsFor(spec.transferId), ['hook_failed'])
    const r = h.hooks.of(spec.transferId)
    assert.deepEqual(r.events, ['write 0', 'write 1', 'abort hook_failed'])
  })

  it('ABORT from the sender aborts once; later frames for it are dropped without a NACK', () => {
    const spec = makeSpec(12, 4)
    const h = harness(spec).push(beginBytes(spec), pagesBytes(spec, [0]))
    h.push(
      encodeAbort({ transferId: spec.transferId, reason: 'client went away' }),
      pagesBytes(spec, [1]),
      endBytes(spec),
    )
    const r = h.hooks.of(spec.transferId)
    assert.deepEqual(r.events, ['write 0', 'abort aborted_by_sender'])
    assert.equal(r.abortedWith?.code, 'request_aborted')
    assert.deepEqual(h.repliesFor(spec.transferId), [])
  })

  it('a teardown from inside writePage stops every later write to that reservation', () => {
    const spec = makeSpec(16, 4)
    const h = harness(spec)
    h.hooks.onBegin = (r) =>
      (r.onWrite = (o) => {
        if (o === 1)
          h.session.teardown(new KvfenceError('transfer_failed', 'connection_closed: mid-frame'))
      })
    h.push(...transferBytes(spec))
    assert.deepEqual(h.hooks.of(spec.transferId).events, [
      'write 0',
      'write 1',
      'abort connection_closed',
    ])
    assert.deepEqual(h.hooks.violations, [])
  })

  it('a teardown aborts every transfer in flight exactly once', () => {
    const specs = [makeSpec(), makeSpec(), makeSpec()]
    const h = new SessionHarness().hello()
    for (const s of specs) h.hooks.expect(s)
    h.push(
      beginBytes(specs[0]),
      beginBytes(specs[1]),
      pagesBytes(specs[1], [0]),
      ...transferBytes(specs[2]),
    )
    h.teardown()
    h.teardown()
    assert.deepEqual(
      specs.map((s) => h.hooks.of(s.transferId).events.at(-1)),
      ['abort connection_closed', 'abort connection_closed', 'complete'],
    )
    assert.deepEqual(h.hooks.violations, [])
    assert.deepEqual(h.counters, { numStarted: 3, numCompleted: 1, numAborted: 2, numRefused: 0 })
  })
})

// ─── Property: random interleavings ─────────────────────────────────────────────────────────────

type Op =
  | { op: 'whole'; i: number; cut: number }
  | { op: 'next'; i: number }
  | { op: 'begin'; i: number; isBadMac: boolean }
  | { op: 'pages'; i: number; ordinals: number[]; isCorrupt: boolean }
  | { op: 'end'; i: number; isWrongManifest: boolean }
  | { op: 'abort'; i: number }
  | { op: 'garbage' }
  | { op: 'teardown' }
  | { op: 'close-from-hook'; i: number }

const opArb: fc.Arbitrary<Op> = fc.oneof(
  {
    weight: 2,
    arbitrary: fc.record({ op: fc.constant('whole' as const), i: fc.nat(2), cut: fc.nat(400) }),
  },
  { weight: 6, arbitrary: fc.record({ op: fc.constant('next' as const), i: fc.nat(2) }) },
  {
    weight: 3,
    arbitrary: fc.record({
      op: fc.constant('begin' as const),
      i: fc.nat(2),
      isBadMac: fc.boolean(),
    }),
  },
  {
    weight: 2,
    arbitrary: fc.record({
      op: fc.constant('pages' as const),
      i: fc.nat(2),
      ordinals: fc.array(fc.nat(4), { minLength: 1, maxLength: 2 }),
      isCorrupt: fc.boolean(),
    }),
  },
  {
    weight: 3,
    arbitrary: fc.record({
      op: fc.constant('end' as const),
      i: fc.nat(2),
      isWrongManifest: fc.boolean(),
    }),
  },
  { weight: 1, arbitrary: fc.record({ op: fc.constant('abort' as const), i: fc.nat(2) }) },
  { weight: 1, arbitrary: fc.constant({ op: 'garbage' as const }) },
  { weight: 1, arbitrary: fc.constant({ op: 'teardown' as const }) },
  {
    weight: 1,
    arbitrary: fc.record({ op: fc.constant('close-from-hook' as const), i: fc.nat(2) }),
  },
)

describe('receiver session: property', () => {
  it('random interleavings of transfers, aborts, garbage and teardowns: no write after the end, one end per transfer, and a completed transfer (G4 on) holds exactly the sent pages', () => {
    fc.assert(
      fc.property(
        fc.array(opArb, { minLength: 1, maxLength: 40 }),
        fc.boolean(),
        fc.array(fc.integer({ min: 1, max: 7 }), { minLength: 3, maxLength: 3 }),
        fc.array(fc.boolean(), { minLength: 3, maxLength: 3 }),
        (ops, verifyManifest, numTokens, completeThrows) => {
          const specs = numTokens.map((n) => makeSpec(n, 2, 8))
          const hooks = new RecordingHooks()
          for (const s of specs) hooks.expect(s)
          hooks.pageSize = 2
          const harnesses: SessionHarness[] = []
          const open = (): SessionHarness => {
            const h = new SessionHarness({ verifyManifest }, hooks).hello()
            harnesses.push(h)
            return h
          }
          let h = open()
          const closeOnWrite = new Set<number>()
          hooks.onBegin = (r) => {
            const i = specs.findIndex((s) => s.transferId === r.info.transferId)
            if (completeThrows[i])
              r.completeThrows = new KvfenceError('transfer_failed', 'hook_failed: no')
            const session = h
            r.onWrite = () => {
              if (closeOnWrite.has(i)) session.teardown()
            }
          }
          const numSent = [0, 0, 0]
          for (const step of ops) {
            if (h.session.isClosed) h = open()
            switch (step.op) {
              case 'whole': {
                const bytes = Buffer.concat(transferBytes(specs[step.i]))
                const cut = step.cut % bytes.length
                h.push(bytes.subarray(0, cut), bytes.subarray(cut))
                break
              }
              case 'next': {
                const s = specs[step.i]
                if (numSent[step.i] < s.numPages) h.push(pagesBytes(s, [numSent[step.i]++]))
                else h.push(endBytes(s))
                break
              }
              case 'begin':
                numSent[step.i] = 0
                h.push(
                  beginBytes(
                    specs[step.i],
                    {},
                    step.isBadMac ? Buffer.alloc(32, 9) : specs[step.i].secret,
                  ),
                )
                break
              case 'pages': {
                const s = specs[step.i]
                const pages = step.ordinals.map((o) =>
                  pageEntry(s, o, step.isCorrupt ? { checksum: 7n } : {}),
                )
                h.push(encodePages({ transferId: s.transferId, requestId: s.requestId, pages }))
                break
              }
              case 'end': {
                const s = specs[step.i]
                h.push(
                  step.isWrongManifest ? endBytes(s, undefined, { manifest: 1n }) : endBytes(s),
                )
                break
              }
              case 'abort':
                h.push(encodeAbort({ transferId: specs[step.i].transferId, reason: 'x' }))
                break
              case 'garbage':
                h.push(Buffer.from('\x00\x01garbage'))
                break
              case 'teardown':
                h.teardown()
                break
              case 'close-from-hook':
                closeOnWrite.add(step.i)
                break
            }
            for (const x of harnesses) x.session.check()
          }
          for (const x of harnesses) x.teardown()
          assert.deepEqual(hooks.violations, [])
          for (const r of hooks.reservations) {
            const hasCompleted = r.completedWith !== null
            assert.equal(
              Number(hasCompleted) + r.numAborts,
              1,
              `transfer ended ${r.events.join(', ')}`,
            )
            if (hasCompleted && verifyManifest) {
              const s = specs.find((x) => x.transferId === r.info.transferId)!
              assert.equal(r.written.size, s.numPages)
              for (const [o, w] of r.written) assert.deepEqual(w.payload, s.pages[o])
            }
          }
          const sum = (k: 'numStarted' | 'numCompleted' | 'numAborted') =>
            harnesses.reduce((n, x) => n + x.counters[k], 0)
          assert.equal(sum('numStarted'), sum('numCompleted') + sum('numAborted'))
          assert.equal(sum('numStarted'), hooks.reservations.length)
        },
      ),
      { numRuns: 400 },
    )
  })
})
