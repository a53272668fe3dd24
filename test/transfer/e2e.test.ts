/** P → D over real TCP on 127.0.0.1: byte-identical pages, aborts, teardowns on either side, the
 *  incident's truncated transfer, malformed streams that never take the server down, and the
 *  sender's bounded batches and memory. */
import assert from 'node:assert/strict'
import { once } from 'node:events'
import net from 'node:net'
import { after, before, describe, it } from 'node:test'
import { KvfenceError } from '../../src/common/errors.js'
import {
  PROTOCOL_VERSION,
  encodeAck,
  encodeHello,
  encodeNack,
  type Frame,
  type PagesFrame,
} from '../../src/transfer/frames.js'
import { FrameParser } from '../../src/transfer/parser.js'
import type { TransferServer } from '../../src/transfer/receiver.js'
import { TransferError } from '../../src/transfer/refusals.js'
import { TransferClient } from '../../src/transfer/sender.js'
import {
  RecordingHooks,
  beginBytes,
  clientFor,
  closeEverything,
  endBytes,
  helloBytes,
  makeSpec,
  onCleanup,
  outgoing,
  pagesBytes,
  rawConnect,
  sendAndSettle,
  startRelay,
  startServer,
  stopServer,
  transferBytes,
  until,
  type TransferSpec,
} from './fixtures.js'

const KiB = 1024

after(closeEverything)

/** Every page of `spec` arrived byte-identical with its token count, and the transfer completed. */
function assertDelivered(hooks: RecordingHooks, spec: TransferSpec): void {
  const r = hooks.of(spec.transferId)
  assert.equal(r.completedWith, spec.firstTokenId)
  assert.equal(r.numAborts, 0)
  assert.equal(r.written.size, spec.numPages)
  for (let o = 0; o < spec.numPages; o++) {
    const w = r.written.get(o)!
    assert.ok(Buffer.from(w.payload).equals(Buffer.from(spec.pages[o])), `page ${o} differs`)
    assert.equal(w.tokensOnPage, Math.min(spec.pageSize, spec.numTokens - o * spec.pageSize))
  }
  assert.deepEqual(hooks.violations, [])
}

describe('transfer over TCP', () => {
  it('40 pages of 16 KiB arrive byte-identical and complete with the first token id', async () => {
    const hooks = new RecordingHooks()
    const server = await startServer(hooks)
    const client = clientFor(server)
    const spec = makeSpec(40 * 16 - 5, 16, 16 * KiB)
    hooks.expect(spec)
    const t = outgoing(spec)
    assert.equal(await sendAndSettle(client, t), null)
    assertDelivered(hooks, spec)
    assert.equal(t.numReads, 40)
    assert.equal(t.numReadsAfterSettle, 0)
    // G9: coalesced writes of ≥ 256 KiB (HELLO and the END flush aside), buffers reused.
    const stats = client.stats
    assert.ok(
      stats.numWrites <= Math.ceil((40 * 16 * KiB) / (256 * KiB)) + 2,
      `${stats.numWrites} writes`,
    )
    server.check()
    client.check()
    await client.close()
    await stopServer(server)
  })

  it('transfers to one decode worker share a connection, stay apart, and reuse the send buffers', async () => {
    const hooks = new RecordingHooks()
    const server = await startServer(hooks)
    const client = clientFor(server, { maxBytesInFlight: 1024 * KiB })
    const specs = Array.from({ length: 6 }, (_, i) =>
      makeSpec(50 + i * 7, 4, 8 * KiB, `tenant-${i}`),
    )
    for (const s of specs) hooks.expect(s)
    const results = await Promise.all(specs.map((s) => sendAndSettle(client, outgoing(s))))
    assert.deepEqual(
      results,
      specs.map(() => null),
    )
    for (const s of specs) {
      assertDelivered(hooks, s)
      assert.equal(hooks.of(s.transferId).info.tenant, s.tenant)
    }
    assert.equal(server.stats.numConnections, 1)
    const numAllocated = client.stats.numBuffersAllocated
    assert.ok(
      numAllocated <= 4 + 1,
      `${numAllocated} buffers for a 1 MiB budget of 256 KiB buffers`,
    )
    for (const s of specs.map((x) => ({ ...x, transferId: makeSpec().transferId }))) {
      hooks.expect(s)
      assert.equal(await sendAndSettle(client, outgoing(s)), null)
    }
    assert.equal(
      client.stats.numBuffersAllocated,
      numAllocated,
      'later transfers allocated new buffers',
    )
    await client.close()
    await stopServer(server)
  })

  it('a stalled transfer retires its connection: the transfer sharing it fails connection_closed, the next one arrives intact on a new connection', async () => {
    const hooks = new RecordingHooks()
    const server = await startServer(hooks)
    const relay = await startRelay(server.port)
    const client = new TransferClient({ host: '127.0.0.1', port: relay.port, stallTimeoutMs: 500 })
    onCleanup(() => client.close())
    const [a, b, c] = [makeSpec(), makeSpec(), makeSpec(40 * 4, 4, 16 * KiB)]
    for (const s of [a, b, c]) hooks.expect(s)
    // D gets HELLO and A's BEGIN on the first connection, then nothing more on it.
    relay.stallNext(helloBytes().length + beginBytes(a).length)
    const [tA, tB] = [outgoing(a), outgoing(b)]
    // A queues all its frames and arms its stall timer before B starts on the same connection, so
    // A's timer fires first.
    const [errA, errB] = await Promise.all([sendAndSettle(client, tA), sendAndSettle(client, tB)])
    assert.equal((errA as TransferError | null)?.reason, 'stalled')
    assert.equal(errA?.code, 'transfer_failed')
    assert.equal((errB as TransferError | null)?.reason, 'connection_closed')
    assert.equal(errB?.code, 'transfer_failed')
    assert.match(errB!.message, new RegExp(`transfer ${a.transferId} made no progress`))
    assert.equal(tA.numReadsAfterSettle + tB.numReadsAfterSettle, 0)
    const tC = outgoing(c)
    assert.equal(await sendAndSettle(client, tC), null)
    assert.equal(relay.numConnections(), 2)
    assertDelivered(hooks, c)
    assert.equal(tC.numReadsAfterSettle, 0)
    assert.equal(hooks.of(a.transferId).completedWith, null)
    assert.throws(() => hooks.of(b.transferId), /no reservation/, "B's BEGIN reached D")
    client.check()
    await client.close()
    // D sees the stalled link close only when the relay closes it (a stuck peer reads nothing).
    await relay.close()
    await until(() => hooks.of(a.transferId).numAborts === 1, 2_000, "A's abort on D")
    assert.equal(hooks.of(a.transferId).events.at(-1), 'abort connection_closed')
    server.check()
    assert.deepEqual(hooks.violations, [])
    await stopServer(server)
  })

  it('a receiver that stops reading mid-transfer: the sender, waiting for send buffers, fails stalled, reads nothing after, and the next transfer goes on a new connection', async () => {
    const hooks = new RecordingHooks()
    const server = await startServer(hooks)
    const relay = await startRelay(server.port)
    const client = new TransferClient({
      host: '127.0.0.1',
      port: relay.port,
      stallTimeoutMs: 500,
      maxBytesInFlight: 1024 * KiB,
    })
    onCleanup(() => client.close())
    const spec = makeSpec(1, 1, 1)
    const next = makeSpec(40 * 4, 4, 16 * KiB)
    for (const s of [spec, next]) hooks.expect(s)
    hooks.pageSize = 1
    relay.stallNext(64 * KiB)
    const numPages = 65_536 // 1 GiB of 16 KiB pages: far more than any socket buffers hold
    const t = outgoing(spec, {
      numTokens: numPages,
      numPages,
      pageBytes: 16 * KiB,
      readPage: (ordinal: number, dst: Uint8Array): number => {
        t.numReads++
        if (isSettled) t.numReadsAfterSettle++
        dst[0] = ordinal & 0xff
        return 1
      },
    })
    let isSettled = false
    const err = await sendAndSettle(client, t).finally(() => (isSettled = true))
    assert.equal((err as TransferError | null)?.reason, 'stalled')
    assert.equal(t.numReadsAfterSettle, 0)
    assert.ok(t.numReads < numPages, `${t.numReads} pages read`)
    hooks.pageSize = next.pageSize
    assert.equal(await sendAndSettle(client, outgoing(next)), null)
    assert.equal(relay.numConnections(), 2)
    assertDelivered(hooks, next)
    assert.equal(hooks.of(spec.transferId).completedWith, null)
    client.check()
    await client.close()
    await relay.close()
    await until(() => hooks.of(spec.transferId).numAborts === 1, 2_000, 'the abort on D')
    server.check()
    assert.deepEqual(hooks.violations, [])
    await stopServer(server)
  })

  it('an AbortSignal mid-transfer: P rejects request_aborted, D aborts once, nothing is written or read after', async () => {
    const hooks = new RecordingHooks()
    const server = await startServer(hooks)
    const client = clientFor(server, { maxBytesInFlight: 64 * KiB })
    const spec = makeSpec(2000 * 4, 4, 4 * KiB) // 8 MiB: more than loopback buffers hold
    hooks.expect(spec)
    const controller = new AbortController()
    // Abort once D has written page 10: P is still sending.
    hooks.onBegin = (r) =>
      (r.onWrite = (o) => o === 10 && controller.abort(new Error('client disconnected')))
    const t = outgoing(spec)
    const err = await sendAndSettle(client, t, controller.signal)
    assert.equal(err?.code, 'request_aborted')
    assert.equal((err as TransferError | null)?.reason, 'aborted_by_sender')
    assert.ok(t.numReads < 2000, `${t.numReads} pages read`)
    assert.equal(t.numReadsAfterSettle, 0)
    const r = hooks.of(spec.transferId)
    await until(() => r.numAborts === 1, 2_000, 'abort on D')
    await new Promise((resolve) => setTimeout(resolve, 20))
    assert.equal(r.numAborts, 1)
    assert.equal(r.events.at(-1), 'abort aborted_by_sender')
    assert.equal(r.completedWith, null)
    assert.ok(r.written.size <= t.numReads)
    assert.deepEqual(hooks.violations, [])
    server.check()
    await client.close()
    await stopServer(server)
  })

  it('an abort racing the ACK: D has completed (the late ABORT is ignored), P still rejects request_aborted', async () => {
    const hooks = new RecordingHooks()
    const server = await startServer(hooks)
    const client = clientFor(server)
    const spec = makeSpec(20, 4, 1 * KiB)
    hooks.expect(spec)
    const controller = new AbortController()
    hooks.onBegin = (r) => (r.onComplete = () => controller.abort())
    const err = await sendAndSettle(client, outgoing(spec), controller.signal)
    assert.equal(err?.code, 'request_aborted')
    await new Promise((resolve) => setTimeout(resolve, 20))
    const r = hooks.of(spec.transferId)
    assert.equal(r.completedWith, spec.firstTokenId)
    assert.equal(r.numAborts, 0)
    assert.deepEqual(hooks.violations, [])
    server.check()
    await client.close()
    await stopServer(server)
  })

  it('an AbortSignal fired inside readPage stops reading at once', async () => {
    const hooks = new RecordingHooks()
    const server = await startServer(hooks)
    const client = clientFor(server)
    const spec = makeSpec(40, 4, 512)
    hooks.expect(spec)
    const controller = new AbortController()
    const t = outgoing(spec, { onRead: (o) => o === 3 && controller.abort() })
    const err = await sendAndSettle(client, t, controller.signal)
    assert.equal(err?.code, 'request_aborted')
    assert.equal(t.numReads, 4)
    // The aborted frame was never sent; D saw BEGIN then ABORT.
    await until(() => hooks.reservations[0]?.numAborts === 1, 2_000, 'abort on D')
    assert.deepEqual(hooks.of(spec.transferId).events, ['abort aborted_by_sender'])
    await client.close()
    await stopServer(server)
  })

  it('D tears the connection down mid-transfer: P rejects, D aborts once, the next transfer reconnects', async () => {
    const hooks = new RecordingHooks()
    const server = await startServer(hooks)
    const client = clientFor(server, { maxPagesPerFrame: 1, writeBytes: 1 * KiB })
    const spec = makeSpec(200, 4, 1 * KiB)
    hooks.expect(spec)
    hooks.onBegin = (r) => (r.onWrite = (o) => o === 5 && server.destroyConnections())
    const t = outgoing(spec)
    const err = await sendAndSettle(client, t)
    assert.equal(err?.code, 'transfer_failed')
    const r = hooks.of(spec.transferId)
    assert.equal(r.numAborts, 1)
    assert.equal(r.events.at(-1), 'abort connection_closed')
    assert.equal(r.written.size, 6)
    assert.deepEqual(hooks.violations, [])
    assert.equal(t.numReadsAfterSettle, 0)
    hooks.onBegin = null
    const next = makeSpec(20, 4, 1 * KiB)
    hooks.expect(next)
    assert.equal(await sendAndSettle(client, outgoing(next)), null)
    assertDelivered(hooks, next)
    server.check()
    await client.close()
    await stopServer(server)
  })

  it('P tears the connection down mid-transfer: P rejects client_closed, D aborts once', async () => {
    const hooks = new RecordingHooks()
    const server = await startServer(hooks)
    const client = clientFor(server, { maxBytesInFlight: 64 * KiB })
    const spec = makeSpec(2000 * 4, 4, 4 * KiB)
    hooks.expect(spec)
    hooks.onBegin = (r) => (r.onWrite = (o) => void (o === 5 && client.close()))
    const t = outgoing(spec)
    const err = await sendAndSettle(client, t)
    assert.equal((err as TransferError | null)?.reason, 'client_closed')
    assert.ok(t.numReads < 2000, `${t.numReads} pages read`)
    assert.equal(t.numReadsAfterSettle, 0)
    await until(() => hooks.reservations[0]?.numAborts === 1, 2_000, 'abort on D')
    assert.equal(hooks.of(spec.transferId).events.at(-1), 'abort connection_closed')
    assert.deepEqual(hooks.violations, [])
    await until(() => server.stats.numConnections === 0, 2_000, 'connection gone on D')
    server.check()
    await stopServer(server)
  })

  it('the network cuts the connection mid-transfer: both sides settle', async () => {
    const hooks = new RecordingHooks()
    const server = await startServer(hooks)
    // A proxy that forwards 100 KiB towards D, then destroys both sockets.
    const proxy = net.createServer((inbound) => {
      const outbound = net.connect(server.port, '127.0.0.1')
      let numForwarded = 0
      inbound.on('data', (chunk: Buffer) =>
        outbound.write(chunk, () => {
          numForwarded += chunk.length
          if (numForwarded > 100 * KiB) {
            inbound.destroy()
            outbound.destroy()
          }
        }),
      )
      outbound.on('data', (chunk: Buffer) => inbound.write(chunk))
      inbound.on('error', () => {})
      outbound.on('error', () => {})
    })
    proxy.listen(0, '127.0.0.1')
    await once(proxy, 'listening')
    const { port } = proxy.address() as net.AddressInfo
    onCleanup(() => void proxy.close())
    const client = new TransferClient({ host: '127.0.0.1', port })
    onCleanup(() => client.close())
    const spec = makeSpec(64 * 16, 16, 16 * KiB)
    hooks.expect(spec)
    const t = outgoing(spec)
    const err = await sendAndSettle(client, t)
    assert.equal(err?.code, 'transfer_failed')
    assert.equal((err as TransferError | null)?.reason, 'connection_closed')
    await until(() => hooks.reservations[0]?.numAborts === 1, 2_000, 'abort on D')
    assert.equal(hooks.of(spec.transferId).completedWith, null)
    assert.deepEqual(hooks.violations, [])
    await client.close()
    proxy.close()
    await stopServer(server)
  })

  it('closing the server mid-transfer aborts its transfers (server_closed) and P rejects', async () => {
    const hooks = new RecordingHooks()
    const server = await startServer(hooks)
    const client = clientFor(server, { maxPagesPerFrame: 1, writeBytes: 1 * KiB })
    const spec = makeSpec(200, 4, 1 * KiB)
    hooks.expect(spec)
    let closed: Promise<void> | null = null
    hooks.onBegin = (r) => (r.onWrite = (o) => void (o === 3 && (closed = stopServer(server))))
    const err = await sendAndSettle(client, outgoing(spec))
    assert.equal(err?.code, 'transfer_failed')
    assert.equal(hooks.of(spec.transferId).events.at(-1), 'abort server_closed')
    await closed
    await client.close()
  })
})

describe('the incident over TCP', () => {
  /** P claims the whole prompt but sends only page 0 (ordinalsToSend=[0]), as in the incident. */
  async function truncated(
    verifyManifest: boolean,
  ): Promise<{ err: KvfenceError | null; hooks: RecordingHooks; spec: TransferSpec }> {
    const hooks = new RecordingHooks()
    const server = await startServer(hooks, { verifyManifest })
    const client = clientFor(server)
    const spec = makeSpec(64, 16, 4 * KiB)
    hooks.expect(spec)
    const err = await sendAndSettle(client, outgoing(spec, { ordinalsToSend: [0] }))
    await client.close()
    await stopServer(server)
    return { err, hooks, spec }
  }

  it('with verifyManifest off, a truncated transfer is ACKed and completed over 1 page of 4 (the incident)', async () => {
    const { err, hooks, spec } = await truncated(false)
    assert.equal(err, null)
    const r = hooks.of(spec.transferId)
    assert.equal(r.completedWith, spec.firstTokenId)
    assert.deepEqual([...r.written.keys()], [0])
  })

  it('with verifyManifest on, the same transfer is NACKed (incomplete) and D aborts it', async () => {
    const { err, hooks, spec } = await truncated(true)
    assert.equal(err?.code, 'transfer_failed')
    assert.equal((err as TransferError | null)?.reason, 'incomplete')
    assert.equal(hooks.of(spec.transferId).numAborts, 1)
    assert.equal(hooks.of(spec.transferId).completedWith, null)
  })

  it('a corrupted payload (corruptPayload) is NACKed checksum_mismatch', async () => {
    const hooks = new RecordingHooks()
    const server = await startServer(hooks)
    const client = clientFor(server)
    const spec = makeSpec(20, 4, 1 * KiB)
    hooks.expect(spec)
    const err = await sendAndSettle(client, outgoing(spec, { corruptPayload: true }))
    assert.equal((err as TransferError | null)?.reason, 'checksum_mismatch')
    await client.close()
    await stopServer(server)
  })

  it('a transfer under the wrong secret is NACKed bad_hmac', async () => {
    const hooks = new RecordingHooks()
    const server = await startServer(hooks)
    const client = clientFor(server)
    const spec = makeSpec()
    hooks.expect(spec)
    const err = await sendAndSettle(client, outgoing(spec, { secret: Buffer.alloc(32, 3) }))
    assert.equal((err as TransferError | null)?.reason, 'bad_hmac')
    assert.equal(hooks.reservations.length, 0)
    await client.close()
    await stopServer(server)
  })
})

describe('malformed streams over TCP never take the server down', () => {
  let hooks: RecordingHooks
  let server: TransferServer

  before(async () => {
    hooks = new RecordingHooks()
    server = await startServer(hooks)
  })
  after(async () => {
    await stopServer(server)
  })

  /** Send `bytes` (after HELLO) on a raw connection; wait for a NACK for `spec` (or a connection
   *  NACK); then check that a well-formed transfer still goes through on a new client. */
  async function refusedThenServed(
    spec: TransferSpec,
    bytes: Buffer[],
    reason: string,
    isFatal = false,
  ): Promise<void> {
    hooks.expect(spec)
    const raw = await rawConnect(server.port)
    raw.socket.write(Buffer.concat([helloBytes(), ...bytes]))
    const id = isFatal ? '0'.repeat(32) : spec.transferId
    await raw.waitFor((frames) => frames.some((f) => f.kind === 'nack' && f.transferId === id))
    const nack = raw.frames.find(
      (f): f is Extract<Frame, { kind: 'nack' }> => f.kind === 'nack' && f.transferId === id,
    )!
    assert.equal(nack.message.split(':')[0], reason)
    if (isFatal) await until(raw.isClosed, 2_000, 'connection closed by D')
    const r = hooks.reservations.find((x) => x.info.transferId === spec.transferId)
    if (r) {
      await until(() => r.numAborts === 1, 2_000, 'abort')
      assert.equal(r.completedWith, null)
    }
    raw.socket.destroy()
    const next = makeSpec()
    hooks.expect(next)
    const client = clientFor(server)
    assert.equal(await sendAndSettle(client, outgoing(next)), null)
    assertDelivered(hooks, next)
    await client.close()
    assert.deepEqual(hooks.violations, [])
  }

  it('bad magic → NACK of the transfer and of the connection, then close', async () => {
    const spec = makeSpec()
    const garbage = Buffer.from('4b57030000000010', 'hex')
    await refusedThenServed(spec, [beginBytes(spec), garbage], 'bad_magic', true)
    assert.equal(hooks.of(spec.transferId).events.at(-1), 'abort bad_magic')
  })

  it('an unknown frame kind → the connection is refused', async () => {
    const spec = makeSpec()
    await refusedThenServed(
      spec,
      [beginBytes(spec), Buffer.from('4b56090000000000', 'hex')],
      'unknown_kind',
      true,
    )
  })

  it('a wrong length inside a frame → NACK of that transfer only', async () => {
    const spec = makeSpec()
    const end = endBytes(spec)
    const short = Buffer.from(end.subarray(0, 8 + 40))
    short.writeUInt32BE(40, 4)
    await refusedThenServed(spec, [...transferBytes(spec).slice(0, 2), short], 'malformed_frame')
  })

  it('a truncated page payload → NACK of that transfer only', async () => {
    const spec = makeSpec()
    const pages = pagesBytes(spec, [0])
    pages.writeUInt32BE(spec.pageBytes + 1, 8 + 34 + 8)
    await refusedThenServed(spec, [beginBytes(spec), pages], 'malformed_frame')
  })

  it('duplicate pages → NACK page_out_of_order', async () => {
    const spec = makeSpec(16, 4)
    await refusedThenServed(spec, [beginBytes(spec), pagesBytes(spec, [0, 0])], 'page_out_of_order')
  })

  it('a page beyond the reservation → NACK ordinal_out_of_range', async () => {
    const spec = makeSpec(8, 4)
    await refusedThenServed(
      spec,
      [beginBytes(spec), pagesBytes(spec, [0, 1]), pagesBytes(spec, [2])],
      'ordinal_out_of_range',
    )
  })

  it('END early → NACK incomplete', async () => {
    const spec = makeSpec(12, 4)
    await refusedThenServed(
      spec,
      [beginBytes(spec), pagesBytes(spec, [0]), endBytes(spec, [0])],
      'incomplete',
    )
  })

  it('a wrong request id → NACK request_mismatch', async () => {
    const spec = makeSpec()
    await refusedThenServed(
      spec,
      [beginBytes(spec), pagesBytes(spec, [0], 'cd'.repeat(16))],
      'request_mismatch',
    )
  })

  it('a checksum mismatch → NACK checksum_mismatch', async () => {
    const spec = makeSpec()
    const pages = pagesBytes(spec, [0])
    pages[pages.length - 1] ^= 0xff
    await refusedThenServed(spec, [beginBytes(spec), pages], 'checksum_mismatch')
  })

  it('a bad HMAC → NACK bad_hmac', async () => {
    const spec = makeSpec()
    await refusedThenServed(spec, [beginBytes(spec, {}, Buffer.alloc(32, 5))], 'bad_hmac')
  })

  it('an unknown transfer → NACK unknown_transfer', async () => {
    const spec = makeSpec()
    await refusedThenServed(spec, [pagesBytes(spec, [0])], 'unknown_transfer')
  })

  it('a stream that ends mid-frame aborts its transfer', async () => {
    const spec = makeSpec()
    hooks.expect(spec)
    const raw = await rawConnect(server.port)
    const pages = pagesBytes(spec, [0])
    raw.socket.end(
      Buffer.concat([helloBytes(), beginBytes(spec), pages.subarray(0, pages.length - 5)]),
    )
    await until(
      () => hooks.reservations.find((r) => r.info.transferId === spec.transferId)?.numAborts === 1,
    )
    assert.equal(hooks.of(spec.transferId).events.at(-1), 'abort connection_closed')
  })

  it('a sender of another protocol version is refused with unsupported_version', async () => {
    const raw = await rawConnect(server.port)
    raw.socket.write(encodeHello({ version: PROTOCOL_VERSION + 1 }))
    await raw.waitFor((frames) => frames.some((f) => f.kind === 'nack'))
    const nack = raw.frames[0]
    assert.equal(nack.kind === 'nack' && nack.message.split(':')[0], 'unsupported_version')
    await until(raw.isClosed, 2_000, 'connection closed by D')
  })
})

// ─── Against a hand-written decode worker ───────────────────────────────────────────────────────

/** A fake D: answers HELLO, records every frame (copied), and lets the test decide the rest. */
async function fakeReceiver(
  onFrame: (f: Frame, socket: net.Socket) => void,
  { helloVersion = PROTOCOL_VERSION, isReading = true } = {},
) {
  const frames: Frame[] = []
  const sockets: net.Socket[] = []
  const server = net.createServer((socket) => {
    sockets.push(socket)
    socket.on('error', () => {})
    if (!isReading) return socket.pause()
    const parser = new FrameParser({
      frame: (f) => {
        const copy = structuredClone(f)
        frames.push(copy)
        if (f.kind === 'hello') socket.write(encodeHello({ version: helloVersion }))
        onFrame(copy, socket)
      },
      error: () => socket.destroy(),
    })
    socket.on('data', (chunk: Buffer) => parser.push(chunk))
  })
  server.listen(0, '127.0.0.1')
  await once(server, 'listening')
  const { port } = server.address() as net.AddressInfo
  const close = async (): Promise<void> => {
    for (const s of sockets) s.destroy()
    if (server.listening) await new Promise((r) => server.close(r))
  }
  onCleanup(close)
  return {
    frames,
    /** The connections accepted, in order. */
    sockets,
    port,
    client: (options = {}): TransferClient => {
      const client = new TransferClient({ host: '127.0.0.1', port, ...options })
      onCleanup(() => client.close())
      return client
    },
    close,
  }
}

describe('the sender against a hand-written receiver', () => {
  it('never puts more than maxPagesPerFrame pages in a frame, and sends pages in order', async () => {
    const fake = await fakeReceiver((f, socket) => {
      if (f.kind === 'end') socket.write(encodeAck({ transferId: f.transferId }))
    })
    const client = fake.client({ maxPagesPerFrame: 3 })
    const spec = makeSpec(40 * 4, 4, 2 * KiB)
    assert.equal(await sendAndSettle(client, outgoing(spec)), null)
    const pages = fake.frames.filter((f): f is PagesFrame => f.kind === 'pages')
    assert.ok(pages.every((f) => f.pages.length >= 1 && f.pages.length <= 3))
    assert.deepEqual(
      pages.flatMap((f) => f.pages.map((p) => p.ordinal)),
      Array.from({ length: 40 }, (_, i) => i),
    )
    assert.deepEqual(
      fake.frames.map((f) => f.kind).filter((k) => k !== 'pages'),
      ['hello', 'begin', 'end'],
    )
    await client.close()
    await fake.close()
  })

  it('a receiver that stops reading stalls the sender with bounded memory; abort then settles it', async () => {
    const fake = await fakeReceiver(() => {}, { isReading: false })
    const maxBytesInFlight = 1024 * KiB
    const client = fake.client({ maxBytesInFlight })
    const numPages = 65_536 // 1 GiB of 16 KiB pages: far more than any socket buffers hold
    const controller = new AbortController()
    const spec = makeSpec(1, 1, 1)
    let numReads = 0
    let numReadsAfterSettle = 0
    let isSettled = false
    const t = {
      ...outgoing(spec),
      numTokens: numPages,
      numPages,
      pageBytes: 16 * KiB,
      readPage: (ordinal: number, dst: Uint8Array): number => {
        numReads++
        if (isSettled) numReadsAfterSettle++
        dst[0] = ordinal & 0xff
        return 1
      },
    }
    const sent = client.send(t, controller.signal).finally(() => (isSettled = true))
    // Wait until the sender has stopped reading: the socket is full and the budget spent.
    let last = -1
    for (let i = 0; i < 60 && numReads !== last; i++) {
      last = numReads
      await new Promise((r) => setTimeout(r, 100))
    }
    assert.equal(numReads, last, 'the sender never stopped reading')
    const { numBytesInFlight, maxBytesInFlight: peak } = client.stats
    assert.ok(numBytesInFlight <= maxBytesInFlight, `${numBytesInFlight} bytes in flight`)
    assert.ok(peak <= maxBytesInFlight, `${peak} bytes at most`)
    // Beyond the budget, only what the kernel's socket buffers took (≤ 36 MiB here).
    assert.ok(numReads < 4096, `${numReads} pages read while the receiver reads nothing`)
    controller.abort()
    await assert.rejects(sent, (err: KvfenceError) => err.code === 'request_aborted')
    assert.equal(numReadsAfterSettle, 0)
    client.check()
    await client.close()
    await fake.close()
  })

  it('a receiver that never answers one END: P rejects it stalled, closes the connection, and sends the next transfer on a new one', async () => {
    const unanswered = makeSpec()
    const fake = await fakeReceiver((f, socket) => {
      if (f.kind === 'end' && f.transferId !== unanswered.transferId)
        socket.write(encodeAck({ transferId: f.transferId }))
    })
    const client = fake.client({ stallTimeoutMs: 100 })
    const err = await sendAndSettle(client, outgoing(unanswered))
    assert.equal((err as TransferError | null)?.reason, 'stalled')
    assert.equal(err?.code, 'transfer_failed')
    await until(() => fake.sockets[0]?.destroyed === true, 2_000, 'the stalled connection closed')
    assert.equal(await sendAndSettle(client, outgoing(makeSpec())), null)
    assert.equal(fake.sockets.length, 2)
    client.check()
    await client.close()
    await fake.close()
  })

  it('a NACK of the whole connection fails every transfer on it', async () => {
    const fake = await fakeReceiver((f, socket) => {
      if (f.kind === 'begin')
        socket.write(
          encodeNack({
            transferId: '0'.repeat(32),
            code: 'transfer_failed',
            message: 'bad_magic: x',
          }),
        )
    })
    const client = fake.client()
    const results = await Promise.all(
      [makeSpec(), makeSpec()].map((s) => sendAndSettle(client, outgoing(s))),
    )
    assert.deepEqual(
      results.map((e) => (e as TransferError | null)?.reason),
      ['bad_magic', 'bad_magic'],
    )
    await client.close()
    await fake.close()
  })

  it('a receiver of another protocol version is refused (unsupported_version)', async () => {
    const fake = await fakeReceiver(() => {}, { helloVersion: PROTOCOL_VERSION + 1 })
    const client = fake.client()
    const err = await sendAndSettle(client, outgoing(makeSpec()))
    assert.equal((err as TransferError | null)?.reason, 'unsupported_version')
    await client.close()
    await fake.close()
  })

  it('an ACK before END is refused (unexpected_ack)', async () => {
    const fake = await fakeReceiver((f, socket) => {
      if (f.kind === 'begin') socket.write(encodeAck({ transferId: f.transferId }))
    })
    const client = fake.client({ maxBytesInFlight: 16 * KiB })
    const err = await sendAndSettle(client, outgoing(makeSpec(4000 * 4, 4, 4 * KiB)))
    assert.equal((err as TransferError | null)?.reason, 'unexpected_ack')
    await client.close()
    await fake.close()
  })

  it('nothing listening: the send rejects connection_closed', async () => {
    const fake = await fakeReceiver(() => {})
    const client = fake.client()
    await fake.close()
    const err = await sendAndSettle(client, outgoing(makeSpec()))
    assert.equal((err as TransferError | null)?.reason, 'connection_closed')
    await client.close()
  })
})
