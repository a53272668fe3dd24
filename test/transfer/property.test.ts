/** Random interleavings over real TCP: concurrent transfers, aborts, faults and teardowns on either
 *  side. Whatever happens, P never reads a page after its send settled, D never writes after a
 *  transfer ended and ends each exactly once, and an ACK means D completed the transfer (with the
 *  exact pages when G4 is on). */
import assert from 'node:assert/strict'
import { after, describe, it } from 'node:test'
import fc from 'fast-check'
import type { KvfenceError } from '../../src/common/errors.js'
import {
  RecordingHooks,
  clientFor,
  closeEverything,
  makeSpec,
  outgoing,
  sendAndSettle,
  startServer,
  stopServer,
  until,
  type TransferSpec,
} from './fixtures.js'

interface TransferPlan {
  numTokens: number
  pageBytes: number
  abortAtRead: number | null
  abortAfterMs: number | null
  fault: 'none' | 'corrupt' | 'truncate' | 'wrong-secret'
}

const planArb: fc.Arbitrary<TransferPlan> = fc.record({
  numTokens: fc.integer({ min: 1, max: 80 }),
  pageBytes: fc.integer({ min: 1, max: 4096 }),
  abortAtRead: fc.option(fc.nat(25), { freq: 4 }),
  abortAfterMs: fc.option(fc.nat(4), { freq: 4 }),
  fault: fc.constantFrom('none', 'none', 'none', 'corrupt', 'truncate', 'wrong-secret'),
})

const teardownArb = fc.oneof(
  fc.constant({ side: 'none' as const, at: 0 }),
  fc.record({ side: fc.constantFrom('receiver' as const, 'sender' as const), at: fc.nat(40) }),
)

after(closeEverything)

describe('transfer property over TCP', () => {
  it('random transfers, aborts, faults and teardowns: reads stop at settle, writes stop at the end, one end each, ACK ⇒ complete', async () => {
    await fc.assert(
      fc.asyncProperty(
        fc.array(planArb, { minLength: 1, maxLength: 4 }),
        teardownArb,
        fc.boolean(),
        fc.constantFrom(2 * 1024, 64 * 1024, 4 * 1024 * 1024),
        fc.integer({ min: 1, max: 8 }),
        async (plans, teardown, verifyManifest, maxBytesInFlight, maxPagesPerFrame) => {
          const hooks = new RecordingHooks()
          const server = await startServer(hooks, { verifyManifest })
          const client = clientFor(server, {
            maxBytesInFlight,
            maxPagesPerFrame,
            writeBytes: 4 * 1024,
          })
          try {
            let numWrites = 0
            let numReads = 0
            const tearDown = (): void => {
              if (teardown.side === 'receiver') server.destroyConnections()
              else void client.close()
            }
            hooks.onBegin = (r) =>
              (r.onWrite = () => {
                if (teardown.side === 'receiver' && ++numWrites === teardown.at) tearDown()
              })
            const specs: TransferSpec[] = plans.map((p) => makeSpec(p.numTokens, 4, p.pageBytes))
            specs.forEach((s) => hooks.expect(s))
            const runs = plans.map((plan, i) => {
              const spec = specs[i]
              const controller = new AbortController()
              if (plan.abortAfterMs !== null)
                setTimeout(() => controller.abort(), plan.abortAfterMs)
              const t = outgoing(spec, {
                onRead: (o) => {
                  if (plan.abortAtRead === o) controller.abort()
                  if (teardown.side === 'sender' && ++numReads === teardown.at) tearDown()
                },
                ...(plan.fault === 'corrupt' ? { corruptPayload: true } : {}),
                ...(plan.fault === 'truncate' ? { ordinalsToSend: [0] } : {}),
                ...(plan.fault === 'wrong-secret' ? { secret: Buffer.alloc(32, 1) } : {}),
              })
              return sendAndSettle(client, t, controller.signal).then((err) => ({ t, err }))
            })
            const results: { t: ReturnType<typeof outgoing>; err: KvfenceError | null }[] =
              await Promise.all(runs)

            // D ends every transfer it started, exactly once, and no later than shortly after P settled.
            await until(
              () => hooks.reservations.every((r) => r.isEnded),
              3_000,
              'every reservation ended',
            )
            assert.deepEqual(hooks.violations, [])
            for (const r of hooks.reservations)
              assert.equal(Number(r.completedWith !== null) + r.numAborts, 1)
            results.forEach(({ t, err }, i) => {
              assert.equal(t.numReadsAfterSettle, 0, `transfer ${i} read a page after it settled`)
              if (err !== null) return
              // ACK ⇒ D completed; with G4 on, with exactly P's pages.
              const r = hooks.of(specs[i].transferId)
              assert.equal(r.completedWith, specs[i].firstTokenId)
              if (verifyManifest) {
                const isWhole =
                  plans[i].fault === 'none' ||
                  (plans[i].fault === 'truncate' && specs[i].numPages === 1)
                assert.ok(isWhole, `a ${plans[i].fault} transfer was ACKed with G4 on`)
                assert.equal(r.written.size, specs[i].numPages)
                for (const [o, w] of r.written) assert.deepEqual(w.payload, specs[i].pages[o])
              }
            })
            server.check()
            client.check()
          } finally {
            await client.close()
            await stopServer(server)
          }
        },
      ),
      // A run that hangs fails (instead of freezing the suite); sockets are closed either way.
      { numRuns: 100, timeout: 5_000 },
    )
  })
})
