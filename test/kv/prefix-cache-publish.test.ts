/** Only a completed prefill publishes its pages (sglang#38319), inside the prefill worker with a
 *  real decode worker over loopback TCP: a 300-token prompt (two prefill steps of 256 and 44
 *  tokens) is aborted right after its first step, then sent again. As shipped, nothing of the
 *  aborted prefill is cached; with fault `publish-partial` (its pages inserted on the abort path)
 *  and guards on, G5 refuses them (not filled, not sealed): the prompt is recomputed and the
 *  tokens are the single-process engine's. With every guard off the 18 pages are published, two
 *  of them never written, and the prompt sent again hits all 288 tokens and answers wrongly. The
 *  cache is shared (`prefixCacheShared`): requests made here carry no tenants-file partition. */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import type { PrefillResult } from '../../src/control/messages.js'
import { PrefillWorker } from '../../src/engine/prefill-worker.js'
import { guardIds, type GuardId } from '../../src/kv/guards.js'
import type { PageLease } from '../../src/kv/pool.js'
import { KvfenceError } from '../../src/common/errors.js'
import {
  greedyOracle as oracle,
  makeRequest,
  runRequest,
  startPair,
  tokensOf,
} from '../engine/pair.js'

/** BOS + 255 filler characters fill the first prefill step (256 tokens, pages 0..15) exactly; the
 *  code sits in pages 16 and 17 (32 characters); the last 12 characters start the code again, so
 *  the echo model's next tokens are the code's continuation, read from pages 16–17. */
const filler = 'the small market opens before the morning bread. '.repeat(6).slice(0, 255)
const code = ' the gate code: Lm4Nb8Vc1Xz0Pq2R'
const prompt = tokensOf(`${filler}${code} code: Lm4Nb`)

interface Run {
  /** The second request's tokens and the prompt tokens its prefill took from the cache. */
  tokenIds: number[]
  cachedTokens: number
  numPagesCachedAfterAbort: number
  numG5Trips: number
}

/** Abort `prompt` after its first prefill step, then send it again to completion. */
async function abortThenResend(faults: string[], off: GuardId[]): Promise<Run> {
  const pair = await startPair({
    pageSize: 16,
    prefillPages: 48,
    decodePages: 32,
    prefillFaults: faults,
    off,
  })
  const prefill = new PrefillWorker(pair.p, { prefixCachePages: 24, prefixCacheShared: true })
  const results: PrefillResult[] = []
  const run = prefill.prefill.bind(prefill)
  prefill.prefill = async (req, signal) => {
    const result = await run(req, signal)
    results.push(result)
    return result
  }
  const { pool } = pair.p
  const noteWrite = pool.noteWrite.bind(pool)
  const abort = new AbortController()
  pool.noteWrite = (lease: PageLease, start: number, numTokens: number) => {
    noteWrite(lease, start, numTokens)
    if (start === 0 && numTokens === 256) abort.abort()
  }
  try {
    const { requestId, tenant, sampling, transferSecret } = makeRequest('tenant-a', prompt, 6)
    const decode = { host: '127.0.0.1', port: pair.port }
    await assert.rejects(
      prefill.prefill(
        { requestId, tenant, sampling, transferSecret, decode, promptTokenIds: prompt },
        abort.signal,
      ),
      (e: unknown) => e instanceof KvfenceError && e.code === 'request_aborted',
    )
    pool.noteWrite = noteWrite
    const numPagesCachedAfterAbort = prefill.numPagesCached
    const outcome = await runRequest({ ...pair, prefill }, makeRequest('tenant-a', prompt, 6))
    assert.equal(outcome.prefillError, null)
    assert.equal(outcome.decodeError, null)
    return {
      tokenIds: outcome.tokenIds,
      cachedTokens: results.at(-1)!.cachedTokens ?? 0,
      numPagesCachedAfterAbort,
      numG5Trips: pair.p.trips.counts.G5,
    }
  } finally {
    prefill.close()
    await pair.close()
  }
}

describe('an aborted prefill never publishes its pages', () => {
  const expected = oracle(prompt, 6)

  it('the prompt is 300 tokens: 18 full pages, the last 12 tokens start the code again', () => {
    assert.equal(prompt.length, 300)
    assert.deepEqual(expected.slice(0, 4), tokensOf('8Vc1').slice(1))
  })

  it('as shipped: nothing of the aborted prefill is cached; sent again it is a miss', async () => {
    const r = await abortThenResend([], [])
    assert.deepEqual(r, {
      tokenIds: expected,
      cachedTokens: 0,
      numPagesCachedAfterAbort: 0,
      numG5Trips: 0,
    })
  })

  it('publish-partial, guards on: G5 refuses the unfinished pages, the prompt is recomputed', async () => {
    const r = await abortThenResend(['publish-partial'], [])
    assert.deepEqual(r, {
      tokenIds: expected,
      cachedTokens: 0,
      numPagesCachedAfterAbort: 0,
      numG5Trips: 1,
    })
  })

  it('publish-partial, guards off: 18 pages published, the prompt sent again hits them all and answers wrongly', async () => {
    const r = await abortThenResend(['publish-partial'], [...guardIds])
    assert.equal(r.numPagesCachedAfterAbort, 18)
    assert.equal(r.cachedTokens, 288)
    assert.notDeepEqual(r.tokenIds, expected)
    // The code's pages hold zeros (G6 off: never-used pages start at 0), so the echo model cannot
    // find the code and copies other text; the single-process engine continues it ("8Vc1Xz").
    assert.notEqual(r.tokenIds[0], expected[0])
    assert.notDeepEqual(r.tokenIds.slice(0, 4), tokensOf('8Vc1').slice(1))
  })
})
