/** The copy-free path over real TCP on 127.0.0.1: P sends page views of its own memory (viewPage)
 *  without building send buffers, D receives them straight into views of its reservation
 *  (placePage), whatever the views' splits on either side; the checks hold on that path too. */
import assert from 'node:assert/strict'
import { after, describe, it } from 'node:test'
import fc from 'fast-check'
import { TransferError } from '../../src/transfer/refusals.js'
import { SendBuffers } from '../../src/transfer/send-buffers.js'
import {
  PlacedHooks,
  clientFor,
  closeEverything,
  makeSpec,
  outgoing,
  sendAndSettle,
  startServer,
  viewsOf,
  type PlacedReservation,
  type TransferSpec,
} from './fixtures.js'

after(closeEverything)

/** An outgoing transfer of `spec` that offers its pages as views cut at `cuts`. */
function viewed(spec: TransferSpec, cuts: number[]) {
  let numViews = 0
  const t = outgoing(spec, {
    viewPage: (ordinal) => {
      numViews++
      return {
        tokensOnPage: Math.min(spec.pageSize, spec.numTokens - ordinal * spec.pageSize),
        views: viewsOf(spec.pages[ordinal], cuts),
      }
    },
  })
  return { t, numViews: () => numViews }
}

describe('copy-free transfer over TCP', () => {
  it('pages go from P’s views into D’s views byte-identical, with no send buffer and no readPage', async () => {
    const hooks = new PlacedHooks()
    const server = await startServer(hooks)
    const client = clientFor(server)
    await fc.assert(
      fc.asyncProperty(
        fc.integer({ min: 1, max: 300 }),
        fc.integer({ min: 1, max: 6000 }),
        fc.array(fc.nat(), { maxLength: 12 }),
        fc.array(fc.nat(), { maxLength: 12 }),
        async (numTokens, pageBytes, sendCuts, receiveCuts) => {
          const spec = makeSpec(numTokens, 16, pageBytes)
          hooks.expect(spec)
          hooks.cuts = receiveCuts
          const { t, numViews } = viewed(spec, sendCuts)
          assert.equal(await sendAndSettle(client, t), null)
          const r = hooks.of(spec.transferId) as PlacedReservation
          assert.equal(r.completedWith, spec.firstTokenId)
          assert.ok(Buffer.from(r.memory).equals(Buffer.concat(spec.pages)))
          assert.equal(r.numPlaced, spec.numPages)
          assert.equal(numViews(), spec.numPages)
          assert.equal(t.numReads, 0)
          assert.deepEqual(hooks.violations, [])
        },
      ),
      { numRuns: 40 },
    )
    assert.equal(client.stats.numBuffersAllocated, 0)
    assert.equal(client.stats.numBytesInFlight, 0)
  })

  it('the corrupt-transfer fault still corrupts a private copy, and D refuses it (checksum_mismatch)', async () => {
    const hooks = new PlacedHooks()
    const server = await startServer(hooks)
    const client = clientFor(server)
    const spec = makeSpec(40, 16, 4096)
    hooks.expect(spec)
    const before = Buffer.concat(spec.pages)
    const { t } = viewed(spec, [100, 2000])
    t.corruptPayload = true
    const err = await sendAndSettle(client, t)
    assert.ok(err instanceof TransferError)
    assert.equal(err.reason, 'checksum_mismatch')
    assert.ok(Buffer.concat(spec.pages).equals(before), 'P’s own pages were changed')
    assert.equal(hooks.of(spec.transferId).numAborts, 1)
  })

  it('views that do not add up to pageBytes fail the transfer, naming the page', async () => {
    const hooks = new PlacedHooks()
    const server = await startServer(hooks)
    const client = clientFor(server)
    const spec = makeSpec(40, 16, 4096)
    hooks.expect(spec)
    const t = outgoing(spec, {
      viewPage: (ordinal) => ({ tokensOnPage: 16, views: [spec.pages[ordinal].subarray(1)] }),
    })
    const err = await sendAndSettle(client, t)
    assert.ok(err !== null)
    assert.match(err.message, /viewPage\(0\) gave 4095 bytes, want 4096/)
    assert.equal(t.numReads, 0)
  })
})

describe('SendBuffers reservations (page views written without a copy)', () => {
  it('count against the budget like buffers, wait in order, and end on cancel or close', async () => {
    const buffers = new SendBuffers(100, 1000)
    assert.equal(buffers.tryReserve(600), true)
    assert.equal(buffers.tryReserve(600), false) // 1200 > 1000
    const owner = {}
    const waited = buffers.reserve(600, owner)
    assert.equal(buffers.tryAcquire(100), null, 'a buffer jumped the queue')
    buffers.unreserve(600)
    assert.equal(await waited, true)
    assert.equal(buffers.numInUseBytes, 600)
    buffers.check()
    const cancelled = buffers.reserve(600, owner)
    buffers.cancel(owner)
    assert.equal(await cancelled, false)
    const closed = buffers.reserve(600, {})
    buffers.close()
    assert.equal(await closed, false)
    assert.equal(buffers.tryReserve(1), false)
    // One reservation is always allowed, even above the budget, so that large pages progress.
    const big = new SendBuffers(100, 1000)
    assert.equal(big.tryReserve(5000), true)
    big.check()
    assert.equal(big.maxInUseBytes, 5000)
  })
})
