/** The sending side's checks and its byte budget, driven without sockets through one SendSession.
 *  Its output is checked against an independent reader (a ReceiveSession, which must accept it
 *  page for page), and D's replies are fed back split at every byte. Every failure test asserts
 *  the exact reason, that the transfer settled once, and that no page was read after it settled. */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import { endMac } from '../../src/transfer/auth.js'
import { manifestChecksum, pageChecksum } from '../../src/transfer/checksum.js'
import {
  encodeAck,
  encodeBegin,
  encodeHello,
  encodeNack,
  PROTOCOL_VERSION,
  ZERO_TRANSFER_ID,
  type Frame,
} from '../../src/transfer/frames.js'
import { TransferError } from '../../src/transfer/refusals.js'
import { prepareBegin, SendSession, type SenderCounters } from '../../src/transfer/send-session.js'
import { senderConfig, type TransferClientOptions } from '../../src/transfer/sender.js'
import {
  SessionHarness,
  decodeAll,
  makeSpec,
  outgoing,
  tokensOn,
  type TransferSpec,
} from './fixtures.js'

/** One SendSession with its io recorded. Writes complete (their callbacks run) on the next
 *  microtask unless `isHoldingWrites`, in which case `completeWrites()` runs them. */
class SendHarness {
  readonly counters: SenderCounters = {
    numWrites: 0,
    numBytesWritten: 0,
    numBuffersAllocated: 0,
    maxBytesInFlight: 0,
  }
  readonly session: SendSession
  readonly chunks: Buffer[] = []
  private readonly held: (() => void)[] = []
  isDestroyed = false
  busy: boolean[] = []

  constructor(
    options: Partial<TransferClientOptions> = {},
    private readonly isHoldingWrites = false,
  ) {
    this.session = new SendSession(
      senderConfig({ host: '127.0.0.1', port: 1, ...options }),
      {
        write: (bytes, onWritten) => {
          if (this.isDestroyed) throw new Error('write after destroy')
          this.chunks.push(Buffer.from(bytes))
          if (onWritten === undefined) return
          if (this.isHoldingWrites) this.held.push(onWritten)
          else queueMicrotask(onWritten)
        },
        destroy: () => {
          this.isDestroyed = true
        },
        setBusy: (isBusy) => this.busy.push(isBusy),
      },
      this.counters,
      'd.test:1',
    )
  }

  /** Every byte written so far. */
  get bytes(): Buffer {
    return Buffer.concat(this.chunks)
  }

  /** Every frame written so far. */
  get frames(): Frame[] {
    return decodeAll(this.bytes)
  }

  /** Run the held write callbacks (the socket drained). */
  completeWrites(): void {
    for (const done of this.held.splice(0)) done()
  }

  /** Feed D's bytes and check the session's invariants. */
  reply(...frames: Uint8Array[]): this {
    for (const f of frames) this.session.push(f)
    this.session.check()
    return this
  }
}

/** Start sending `spec`; the promise resolves to the error (null on success). */
function start(h: SendHarness, spec: TransferSpec, signal?: AbortSignal, extra = {}) {
  const t = outgoing(spec, extra)
  const begin = prepareBegin(t, senderConfig({ host: 'h', port: 1 }).maxFrameBytes)
  const settled = h.session.send(t, begin, signal).then(
    () => null,
    (err: unknown) => {
      if (!(err instanceof TransferError)) throw err
      return err
    },
  )
  return {
    t,
    settled: settled.finally(() => t.markSettled()),
  }
}

/** Let the pump and queued write callbacks run. */
const tick = (): Promise<void> => new Promise((resolve) => setImmediate(resolve))

function kinds(frames: Frame[]): string[] {
  return frames.map((f) => f.kind)
}

describe('send session: a well-formed transfer', () => {
  it('writes HELLO, BEGIN, PAGES of at most maxPagesPerFrame pages and END, which a receiver accepts page for page', async () => {
    const spec = makeSpec(37, 4, 24) // 10 pages, the last with 1 token
    const h = new SendHarness({ maxPagesPerFrame: 3 })
    const { t, settled } = start(h, spec)
    await tick()
    const frames = h.frames
    assert.deepEqual(kinds(frames), ['hello', 'begin', 'pages', 'pages', 'pages', 'pages', 'end'])
    assert.deepEqual(
      frames.flatMap((f) => (f.kind === 'pages' ? [f.pages.map((p) => p.ordinal)] : [])),
      [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]],
    )
    // END's manifest and MAC, computed here from the pages P holds.
    const checksums = spec.pages.map((p) => pageChecksum(p))
    const end = frames.at(-1)
    assert.ok(end?.kind === 'end')
    assert.equal(end.manifestChecksum, manifestChecksum(checksums))
    assert.equal(end.firstTokenId, spec.firstTokenId)
    assert.deepEqual(Buffer.from(end.mac), endMac(spec.secret, spec, checksums, spec.firstTokenId))
    // An independent reader takes it whole, and its replies settle the send.
    const d = new SessionHarness()
    d.hooks.expect(spec)
    d.push(h.bytes)
    const r = d.hooks.of(spec.transferId)
    assert.equal(r.completedWith, spec.firstTokenId)
    assert.deepEqual(
      [...r.written.entries()].map(([o, w]) => [o, w.tokensOnPage, Buffer.from(w.payload)]),
      spec.pages.map((p, o) => [o, tokensOn(spec, o), Buffer.from(p)]),
    )
    h.reply(...d.replies.map(encodeReply))
    assert.equal(await settled, null)
    assert.equal(t.numReads, 10)
    assert.deepEqual(h.busy, [true, false])
    h.session.check()
  })

  it('settles on D’s replies split at every byte', async () => {
    const spec = makeSpec(10, 4, 16)
    const replies = Buffer.concat([
      encodeHello({ version: PROTOCOL_VERSION }),
      encodeAck({ transferId: spec.transferId }),
    ])
    for (let at = 0; at <= replies.length; at++) {
      const h = new SendHarness()
      const { settled } = start(h, spec)
      await tick()
      h.reply(replies.subarray(0, at))
      await tick()
      h.reply(replies.subarray(at))
      assert.equal(await settled, null, `split at ${at}`)
    }
  })

  it('keeps bytes in flight within maxBytesInFlight, and the pump waits until writes complete (G9)', async () => {
    const spec = makeSpec(64 * 4, 4, 1024) // 64 pages of 1 KiB
    const h = new SendHarness({ maxBytesInFlight: 4096, writeBytes: 2048 }, true)
    const { t, settled } = start(h, spec)
    for (let i = 0; i < 5; i++) {
      await tick()
      assert.ok(h.session.numBytesInFlight <= 4096, `${h.session.numBytesInFlight} bytes in flight`)
    }
    // No write completed: the pump stopped at the budget, ~4 KiB of 1 KiB pages.
    assert.ok(t.numReads >= 1 && t.numReads <= 4, `${t.numReads} pages read`)
    for (let i = 0; i < 200 && !kinds(h.frames).includes('end'); i++) {
      h.completeWrites()
      await tick()
      assert.ok(h.session.numBytesInFlight <= 4096)
    }
    assert.equal(t.numReads, 64)
    assert.ok(h.counters.maxBytesInFlight <= 4096, `${h.counters.maxBytesInFlight}`)
    h.reply(encodeHello({ version: PROTOCOL_VERSION }), encodeAck({ transferId: spec.transferId }))
    h.completeWrites()
    assert.equal(await settled, null)
  })
})

describe('send session: refusals and failures', () => {
  it('a NACK rejects with D’s reason and message, and reads stop (checksum_mismatch)', async () => {
    const spec = makeSpec(10, 4, 16)
    const h = new SendHarness()
    const { t, settled } = start(h, spec)
    await tick()
    h.reply(
      encodeHello({ version: PROTOCOL_VERSION }),
      encodeNack({
        transferId: spec.transferId,
        code: 'transfer_failed',
        message: 'checksum_mismatch: page 1',
      }),
    )
    const err = await settled
    assert.equal(err?.reason, 'checksum_mismatch')
    assert.equal(err?.code, 'transfer_failed')
    assert.equal(err?.message, 'checksum_mismatch: page 1 [decode worker: transfer_failed]')
    assert.equal(t.numReadsAfterSettle, 0)
    // D refused it: P sends no ABORT.
    assert.equal(kinds(h.frames).includes('abort'), false)
  })

  it('a NACK whose message names no known reason is refused_by_receiver, message kept', async () => {
    const spec = makeSpec(10, 4, 16)
    const h = new SendHarness()
    const { settled } = start(h, spec)
    await tick()
    const message = `transfer ${spec.transferId}: no reservation waiting for request x`
    h.reply(
      encodeHello({ version: PROTOCOL_VERSION }),
      encodeNack({ transferId: spec.transferId, code: 'transfer_failed', message }),
    )
    const err = await settled
    assert.equal(err?.reason, 'refused_by_receiver')
    assert.equal(err?.message, `${message} [decode worker: transfer_failed]`)
  })

  it('an ACK before END fails the transfer and ABORT follows its last frame (unexpected_ack)', async () => {
    const spec = makeSpec(64 * 4, 4, 1024)
    const h = new SendHarness({ maxBytesInFlight: 4096, writeBytes: 2048 }, true)
    const { t, settled } = start(h, spec)
    await tick()
    h.reply(encodeHello({ version: PROTOCOL_VERSION }), encodeAck({ transferId: spec.transferId }))
    const err = await settled
    assert.equal(err?.reason, 'unexpected_ack')
    h.completeWrites()
    await tick()
    const ks = kinds(h.frames)
    assert.equal(ks.at(-1), 'abort')
    assert.equal(ks.includes('end'), false)
    assert.equal(t.numReadsAfterSettle, 0)
  })

  it('a connection NACK before HELLO fails every transfer with D’s reason and ends the connection', async () => {
    const specs = [makeSpec(), makeSpec()]
    const h = new SendHarness()
    const runs = specs.map((s) => start(h, s))
    await tick()
    h.reply(
      encodeNack({
        transferId: ZERO_TRANSFER_ID,
        code: 'transfer_failed',
        message: 'unsupported_version: peer speaks 1',
      }),
    )
    const errs = await Promise.all(runs.map((r) => r.settled))
    assert.deepEqual(
      errs.map((e) => e?.reason),
      ['unsupported_version', 'unsupported_version'],
    )
    assert.equal(h.isDestroyed, true)
    assert.equal(h.session.isClosed, true)
  })

  it('a HELLO of another version ends the connection (unsupported_version)', async () => {
    const spec = makeSpec()
    const h = new SendHarness()
    const { settled } = start(h, spec)
    await tick()
    h.reply(encodeHello({ version: PROTOCOL_VERSION + 1 }))
    assert.equal((await settled)?.reason, 'unsupported_version')
    assert.equal(h.isDestroyed, true)
  })

  it('a frame only a sender sends, or a second HELLO, ends the connection (unexpected_frame)', async () => {
    for (const bad of [
      (spec: TransferSpec) => encodeBegin({ ...spec, mac: Buffer.alloc(32) }),
      () => encodeHello({ version: PROTOCOL_VERSION }),
    ]) {
      const spec = makeSpec()
      const h = new SendHarness()
      const { settled } = start(h, spec)
      await tick()
      h.reply(encodeHello({ version: PROTOCOL_VERSION }), bad(spec))
      assert.equal((await settled)?.reason, 'unexpected_frame')
      assert.equal(h.isDestroyed, true)
    }
  })

  it('malformed bytes from D end the connection with their decoding reason (bad_magic)', async () => {
    const spec = makeSpec()
    const h = new SendHarness()
    const { settled } = start(h, spec)
    await tick()
    h.reply(Buffer.from('GET / HTTP/1.1\r\n\r\n'))
    assert.equal((await settled)?.reason, 'bad_magic')
  })

  it('an aborted signal stops the pump, sends ABORT after the transfer’s last frame and rejects (aborted_by_sender)', async () => {
    const spec = makeSpec(64 * 4, 4, 1024)
    const h = new SendHarness({ maxBytesInFlight: 4096, writeBytes: 2048 }, true)
    const controller = new AbortController()
    const { t, settled } = start(h, spec, controller.signal)
    await tick()
    controller.abort(new Error('client went away'))
    const err = await settled
    assert.equal(err?.reason, 'aborted_by_sender')
    assert.equal(err?.code, 'request_aborted')
    h.completeWrites()
    await tick()
    const frames = h.frames
    assert.equal(frames.at(-1)?.kind, 'abort')
    assert.equal(kinds(frames).includes('end'), false)
    assert.equal(t.numReadsAfterSettle, 0)
    assert.equal(h.session.numActiveTransfers, 0)
  })

  it('a second transfer with an id in flight is refused, and the first goes on (duplicate_transfer)', async () => {
    const spec = makeSpec()
    const h = new SendHarness()
    const first = start(h, spec)
    const second = start(h, spec)
    assert.equal((await second.settled)?.reason, 'duplicate_transfer')
    await tick()
    h.reply(encodeHello({ version: PROTOCOL_VERSION }), encodeAck({ transferId: spec.transferId }))
    assert.equal(await first.settled, null)
  })

  it('a teardown rejects every transfer with its reason and writes nothing more (connection_closed)', async () => {
    const spec = makeSpec(64 * 4, 4, 1024)
    const h = new SendHarness({ maxBytesInFlight: 4096, writeBytes: 2048 }, true)
    const { t, settled } = start(h, spec)
    await tick()
    const numChunks = h.chunks.length
    h.session.teardown(
      new TransferError('connection_closed', 'transfer_failed', 'connection_closed: gone'),
    )
    const err = await settled
    assert.equal(err?.reason, 'connection_closed')
    h.completeWrites()
    await tick()
    assert.equal(h.chunks.length, numChunks)
    assert.equal(t.numReadsAfterSettle, 0)
    assert.equal(h.isDestroyed, false, 'teardown does not destroy: the socket is already gone')
    // A transfer started on a closed connection fails at once.
    assert.equal((await start(h, makeSpec()).settled)?.reason, 'connection_closed')
  })

  it('a transfer with no progress for stallTimeoutMs fails stalled and closes its connection; the transfer sharing it fails connection_closed', async () => {
    const h = new SendHarness({ stallTimeoutMs: 30 })
    const stalled = start(h, makeSpec(10, 4, 16))
    const sharing = start(h, makeSpec(10, 4, 16))
    await tick()
    h.reply(encodeHello({ version: PROTOCOL_VERSION }))
    const numChunks = h.chunks.length
    const [err, sharingErr] = await Promise.all([stalled.settled, sharing.settled])
    assert.equal(err?.reason, 'stalled')
    assert.equal(sharingErr?.reason, 'connection_closed')
    assert.equal(sharingErr?.code, 'transfer_failed')
    assert.equal(h.isDestroyed, true)
    assert.equal(h.session.isClosed, true)
    assert.equal(h.chunks.length, numChunks, 'wrote after the stall (an ABORT to a stuck peer)')
    assert.equal(stalled.t.numReadsAfterSettle + sharing.t.numReadsAfterSettle, 0)
    assert.equal(h.session.numActiveTransfers, 0)
    h.session.check()
  })
})

/** Bytes of a reply frame decoded from a ReceiveSession's output (HELLO, ACK or NACK). */
function encodeReply(f: Frame): Buffer {
  switch (f.kind) {
    case 'hello':
      return encodeHello(f)
    case 'ack':
      return encodeAck(f)
    case 'nack':
      return encodeNack(f)
    default:
      throw new Error(`a receiver does not send ${f.kind}`)
  }
}
