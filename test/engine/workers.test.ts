/** The workers' own guards, in process, with P and D talking over real loopback TCP: G3 (each worker
 *  re-checks what it receives), G4 on the decode side (begin() and complete()), G7 (deferred release
 *  against the `early-release` fault), G8 (an abort on D cancels the transfer in flight, and its pages
 *  are freed only after the transfer settled), and lost ACKs. Each guard test also runs with that
 *  guard off and shows what it stopped. Expected tokens come from the single-process engine
 *  (`generateLocal`), an independent path through the same model without any transfer. */
import assert from 'node:assert/strict'
import { randomBytes } from 'node:crypto'
import { after, describe, it } from 'node:test'
import { GuardError } from '../../src/kv/guards.js'
import { TransferClient } from '../../src/transfer/index.js'
import {
  greedyOracle as oracle,
  makeRequest,
  runRequest,
  startPair,
  tokensOf,
  type Pair,
} from './pair.js'

const pairs: Pair[] = []
after(async () => {
  for (const pair of pairs) await pair.close()
})
async function pair(opts: Parameters<typeof startPair>[0] = {}): Promise<Pair> {
  const p = await startPair(opts)
  pairs.push(p)
  return p
}

/** 70 tokens: 5 pages of 16 on both sides (the last one partly filled). */
const prompt = tokensOf('the river walks near the stone garden and Qx7vR2mK9pLt4Wz8 holds it!!')

/** Both pools are back to their idle baseline and consistent. */
function assertIdle(pair: Pair): void {
  assert.equal(pair.p.pool.numUsed, 0, 'prefill pages still used')
  assert.equal(pair.d.pool.numUsed, 0, 'decode pages still used')
  pair.p.pool.check()
  pair.d.pool.check()
}

function isGuard(guard: string, code: string, message: RegExp) {
  return (err: unknown) => {
    assert.ok(err instanceof GuardError, `expected a GuardError, got ${String(err)}`)
    assert.equal(err.guard, guard)
    assert.equal(err.code, code)
    assert.match(err.message, message)
    return true
  }
}

describe('disaggregated P → D', { timeout: 20_000 }, () => {
  it('emits exactly the single-process engine’s tokens and leaves both pools idle', async () => {
    const p = await pair()
    const out = await runRequest(p, makeRequest('tenant-a', prompt, 12))
    assert.equal(out.decodeError, null)
    assert.equal(out.prefillError, null)
    assert.deepEqual(out.tokenIds, oracle(prompt, 12))
    assert.deepEqual(out.events[0], { type: 'reserved', numPages: 6 }) // ceil((70 + 12) / 16)
    assert.deepEqual(out.events.at(-1), {
      type: 'done',
      finishReason: 'length',
      promptTokens: 70,
      completionTokens: 12,
    })
    assertIdle(p)
    const text = await p.p.metrics.registry.getSingleMetricAsString('kvfence_transfer_bytes_total')
    assert.match(text, new RegExp(`kvfence_transfer_bytes_total ${5 * p.p.pool.pageBytes}$`, 'm'))
  })
})

describe('G3: each worker re-checks every request it receives', { timeout: 20_000 }, () => {
  it('prefill refuses a prompt over its pool with context_length_exceeded, never a placeholder', async () => {
    // P's pool: 4 pages × 16 = 64 tokens < 70. D could hold it: only P's own check stops it.
    const p = await pair({ prefillPages: 4, prefillFaults: ['placeholder-forward'] })
    const out = await runRequest(p, makeRequest('tenant-b', prompt, 4))
    assert.ok(out.prefillError)
    assert.throws(
      () => {
        throw out.prefillError
      },
      isGuard(
        'G3',
        'context_length_exceeded',
        /^G3: prompt of 70 tokens exceeds this prefill worker's KV capacity of 64 tokens$/,
      ),
    )
    assert.equal(p.p.trips.counts.G3, 1)
    assert.equal(out.tokenIds.length, 0, 'no token for a rejected prompt')
    // D never got a transfer: the router's abort (as runRequest does) freed its reservation.
    assert.equal(out.decodeError?.code, 'request_aborted')
    assertIdle(p)
  })

  it('with G3 off, the placeholder is sent and only D’s manifest check (G4) stops it', async () => {
    const p = await pair({ prefillPages: 4, prefillFaults: ['placeholder-forward'], off: ['G3'] })
    const out = await runRequest(p, makeRequest('tenant-b', prompt, 4))
    assert.equal(p.p.trips.counts.G3, 0)
    assert.ok(out.decodeError, 'the placeholder transfer was refused on D')
    assert.equal(out.decodeError.code, 'transfer_failed')
    assert.equal(out.tokenIds.length, 0)
    assertIdle(p)
  })

  it('decode refuses prompt + max_tokens over its pool before reserving anything', async () => {
    const p = await pair({ decodePages: 5 }) // 80 tokens < 70 + 12
    const out = await runRequest(p, makeRequest('tenant-a', prompt, 12))
    assert.throws(
      () => {
        throw out.decodeError
      },
      isGuard(
        'G3',
        'context_length_exceeded',
        /^G3: prompt of 70 tokens \+ max_tokens 12 exceeds this decode worker's KV capacity of 80 tokens$/,
      ),
    )
    assert.deepEqual(out.events, [], 'nothing reserved, nothing emitted')
    assert.equal(out.prefillError, undefined, 'prefill never started')
    assert.equal(p.d.trips.counts.G3, 1)
    assertIdle(p)
  })

  it('with G3 off, decode reserves what fits and starts a request it cannot finish', async () => {
    const p = await pair({ decodePages: 5, off: ['G3'] })
    const out = await runRequest(p, makeRequest('tenant-a', prompt, 12))
    assert.deepEqual(out.events[0], { type: 'reserved', numPages: 5 })
    assert.equal(p.d.trips.counts.G3, 0)
    // The request is cut short at the pool's end: 80 − 70 + 1 tokens instead of 12.
    assert.equal(out.tokenIds.length, 11)
  })
})

describe(
  'G4 on the decode side: begin() and complete() verify the transfer against the request',
  { timeout: 20_000 },
  () => {
    /** Send a hand-made transfer for `req` straight to D's receiver (as a faulty or hostile P would). */
    async function sendRaw(
      p: Pair,
      req: ReturnType<typeof makeRequest>,
      fields: { tenant?: string; numTokens?: number; ordinalsToSend?: number[] },
    ): Promise<Error | null> {
      const client = new TransferClient({ host: '127.0.0.1', port: p.port })
      const numTokens = fields.numTokens ?? req.promptTokenIds.length
      try {
        await client.send({
          transferId: randomBytes(16).toString('hex'),
          requestId: req.requestId,
          tenant: fields.tenant ?? req.tenant,
          numTokens,
          numPages: Math.ceil(numTokens / 16),
          pageBytes: p.d.pool.pageBytes,
          secret: Buffer.from(req.transferSecret, 'hex'),
          firstTokenId: 7,
          readPage: (ordinal, dst) => {
            dst.fill(0)
            return Math.min(16, numTokens - ordinal * 16)
          },
          ordinalsToSend: fields.ordinalsToSend,
        })
        return null
      } catch (err) {
        return err as Error
      } finally {
        await client.close()
      }
    }

    async function reserveThen(
      p: Pair,
      fields: Parameters<typeof sendRaw>[2],
    ): Promise<{ sent: Error | null; decoded: Error | null }> {
      const req = makeRequest('tenant-a', prompt, 4)
      let sending: Promise<Error | null> | null = null
      const decoded = await p.decode
        .generate(req, new AbortController().signal, (e) => {
          if (e.type === 'reserved') sending = sendRaw(p, req, fields)
        })
        .then(
          () => null,
          (err: Error) => err,
        )
      return { sent: await sending!, decoded }
    }

    it('begin() refuses a transfer naming another tenant', async () => {
      const p = await pair()
      const { sent, decoded } = await reserveThen(p, { tenant: 'tenant-b' })
      assert.match(
        String(sent),
        /G4: transfer [0-9a-f]{32} does not match request [0-9a-f]{32}: tenant tenant-b ≠ tenant-a/,
      )
      assert.ok(decoded instanceof GuardError && decoded.guard === 'G4')
      assert.equal(p.d.trips.counts.G4, 1)
      assertIdle(p)
    })

    it('begin() refuses a transfer with another token count (the placeholder’s 1 token)', async () => {
      const p = await pair()
      const { sent, decoded } = await reserveThen(p, { numTokens: 1 })
      assert.match(String(sent), /G4: .*token count 1 ≠ 70, page count 1 ≠ 5/)
      assert.ok(decoded instanceof GuardError && decoded.guard === 'G4')
      assertIdle(p)
    })

    it('with G4 off, begin() accepts the mismatching transfer and the request decodes', async () => {
      const p = await pair({ off: ['G4'] })
      const { sent, decoded } = await reserveThen(p, { tenant: 'tenant-b' })
      assert.equal(sent, null)
      assert.equal(decoded, null)
      assert.equal(p.d.trips.counts.G4, 0)
    })

    it('complete() refuses a transfer that left a prompt page unwritten, even past a lax receiver', async () => {
      // The receiver's own manifest check is off: only D's complete() stands between the truncated
      // transfer (pages 0–3 of 5) and a decode over the unwritten page 4.
      const p = await pair({ receiver: { verifyManifest: false } })
      const { sent, decoded } = await reserveThen(p, { ordinalsToSend: [0, 1, 2, 3] })
      assert.match(String(sent), /G4: transfer [0-9a-f]{32}: page 4 holds 0 tokens, 6 expected/)
      assert.ok(decoded instanceof GuardError && decoded.guard === 'G4')
      assert.equal(p.d.trips.counts.G4, 1)
      assertIdle(p)
    })

    it('with G4 off as well, the truncated transfer is accepted (decode would read page 4 unwritten)', async () => {
      const p = await pair({ receiver: { verifyManifest: false }, off: ['G4', 'G5'] })
      const { sent } = await reserveThen(p, { ordinalsToSend: [0, 1, 2, 3] })
      assert.equal(sent, null, 'ACKed')
      assert.equal(p.d.trips.counts.G4, 0)
    })
  },
)

describe(
  'G7: pages with a transfer in flight are never freed (fault early-release)',
  { timeout: 20_000 },
  () => {
    it('guards on: the premature free is refused, the request fails, pages go once the transfer settled', async () => {
      const p = await pair({ decodeFaults: ['early-release'] })
      const out = await runRequest(p, makeRequest('tenant-b', prompt, 8))
      assert.ok(out.decodeError instanceof GuardError)
      assert.equal(out.decodeError.guard, 'G7')
      assert.match(
        out.decodeError.message,
        /^G7: owner \d+ released pages while a transfer is in flight$/,
      )
      assert.equal(out.prefillError?.code, 'transfer_failed', 'P saw the transfer refused (NACK)')
      assert.equal(out.tokenIds.length, 0)
      assert.equal(p.d.trips.counts.G7, 1)
      assertIdle(p)
    })

    it('G7 off: the pages are freed while the transfer writes; G5 refuses the write into them', async () => {
      const p = await pair({ decodeFaults: ['early-release'], off: ['G7'] })
      const out = await runRequest(p, makeRequest('tenant-b', prompt, 8))
      assert.equal(p.d.trips.counts.G7, 0)
      assert.ok(out.decodeError instanceof GuardError)
      assert.equal(out.decodeError.guard, 'G5')
      assert.match(
        out.decodeError.message,
        /^G5: write of page \d+ by owner \d+, but it belongs to nobody$/,
      )
      assert.equal(p.d.pool.numUsed, 0)
    })

    it('all guards off: the transfer writes into free pages and the pool invariant breaks', async () => {
      const p = await pair({
        decodeFaults: ['early-release'],
        off: ['G3', 'G4', 'G5', 'G6', 'G7', 'G8', 'G9', 'G10'],
      })
      const out = await runRequest(p, makeRequest('tenant-b', prompt, 8))
      assert.equal(out.decodeError, null, 'the request even "succeeds"')
      assert.equal(p.d.pool.numUsed, 0, 'its pages were on the free list the whole time')
      // Decode sealed "its" pages after the transfer: pages on the free list now claim to be sealed.
      assert.throws(() => p.d.pool.check(), /^AssertionError.*owned page 0 is on the free list/)
    })
  },
)

describe(
  'G8: an abort on D cancels the transfer in flight; pages are freed after it settled',
  { timeout: 20_000 },
  () => {
    it('guards on: P’s transfer is refused mid-flight, D frees its pages only after abort()', async () => {
      const p = await pair()
      const order: string[] = []
      const numPinned = () => p.d.pool.pins.filter((n) => n > 0).length
      const begin = p.decode.receiverHooks.begin
      p.decode.receiverHooks.begin = (info) => {
        const r = begin(info)
        return {
          ...r,
          pageSize: r.pageSize,
          writePage: (o, n, payload) => {
            if (o === 1) abort.abort() // the router's abort arrives while page 1 is on the wire
            order.push(`write ${o}`)
            r.writePage(o, n, payload)
          },
          complete: r.complete,
          abort: (reason) => {
            order.push(`abort: ${numPinned()} pinned, ${p.d.pool.numUsed} used`)
            r.abort(reason)
            order.push(`after: ${numPinned()} pinned, ${p.d.pool.numUsed} used`)
          },
        }
      }
      const abort = new AbortController()
      const out = await runRequest(p, makeRequest('tenant-a', prompt, 8), {
        decodeSignal: abort.signal,
      })
      assert.equal(out.decodeError?.code, 'request_aborted')
      assert.equal(out.prefillError?.code, 'transfer_failed')
      assert.match(
        out.prefillError!.message,
        /request aborted by the router \[decode worker: request_aborted\]/,
      )
      // Page 0 was written; page 1's write was refused (NACK); abort() came next: until then the 5
      // prompt pages stayed pinned and all 5 reserved pages (70 + 8 tokens) used; abort() freed them.
      assert.deepEqual(order, [
        'write 0',
        'write 1',
        'abort: 5 pinned, 5 used',
        'after: 0 pinned, 0 used',
      ])
      assert.equal(out.tokenIds.length, 0)
      assertIdle(p)
    })

    it('G8 off: the aborted request’s transfer runs to completion and is ACKed', async () => {
      const p = await pair({ off: ['G8'] })
      const abort = new AbortController()
      const begin = p.decode.receiverHooks.begin
      p.decode.receiverHooks.begin = (info) => {
        const r = begin(info)
        return {
          ...r,
          pageSize: r.pageSize,
          writePage: (o, n, payload) => {
            if (o === 1) abort.abort()
            r.writePage(o, n, payload)
          },
          complete: r.complete,
          abort: r.abort,
        }
      }
      const out = await runRequest(p, makeRequest('tenant-a', prompt, 8), {
        decodeSignal: abort.signal,
      })
      assert.equal(out.decodeError?.code, 'request_aborted')
      assert.equal(out.prefillError, null, 'P finished a transfer for a request that was gone')
      assertIdle(p)
    })
  },
)

describe(
  'lost-ack: P keeps its pages pinned until the transfer times out, never reports success',
  { timeout: 20_000 },
  () => {
    it('D decoded, but P holds every page pinned until its timeout, then fails the transfer', async () => {
      const p = await pair({ decodeFaults: ['lost-ack'], transferTimeoutMs: 300 })
      const req = makeRequest('tenant-a', prompt, 4)
      let pinnedWhileWaiting = -1
      const out = await runRequest(p, req, {
        onToken: (n) => {
          // D has the KV and decodes; P is still waiting for the ACK that never comes.
          if (n === 4) pinnedWhileWaiting = p.p.pool.pins.filter((x) => x > 0).length
        },
      })
      assert.equal(out.decodeError, null, 'D itself got every page and decoded')
      assert.equal(pinnedWhileWaiting, 5, 'P’s 5 pages stayed pinned after D finished')
      assert.equal(out.prefillError?.code, 'transfer_failed')
      assert.match(
        out.prefillError!.message,
        /^stalled: transfer [0-9a-f]{32}: no progress for 300 ms$/,
      )
      assertIdle(p)
      const failures = await p.p.metrics.registry.getSingleMetricAsString(
        'kvfence_transfer_failures_total',
      )
      assert.match(failures, /kvfence_transfer_failures_total\{reason="stalled"\} 1$/m)
    })
  },
)
