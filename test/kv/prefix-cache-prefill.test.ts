/** The prefix cache inside the prefill worker, with a real decode worker over loopback TCP: a
 *  tenant's second prompt that shares a prefix with its first reuses the cached pages and still
 *  emits exactly the single-process engine's tokens (`generateLocal`, which has no cache);
 *  another tenant sending the same prompt never hits and reads only its own pages; a prompt that
 *  needs the cache's pages gets them by eviction instead of `capacity_exhausted`. The pool's and
 *  the cache's invariants are checked after every request. The cache is one budget shared by all
 *  tenants (`prefixCacheShared`): partitions are tested in prefix-cache-isolation and e2e. */
import assert from 'node:assert/strict'
import { after, before, describe, it } from 'node:test'
import type { PrefillResult } from '../../src/control/messages.js'
import { PrefillWorker } from '../../src/engine/prefill-worker.js'
import type { PageLease } from '../../src/kv/pool.js'
import {
  greedyOracle as oracle,
  makeRequest,
  runRequest,
  startPair,
  tokensOf,
  type Pair,
} from '../engine/pair.js'

const pageSize = 16
const prefix = 'stone garden: Lm4Nb8Vc1Xz0 / green field: Pq2Rs6Tu9Wy3 / river: Kd5'
/** BOS + 67 characters = 68 tokens, and both prompts continue with a space: they share 69 tokens,
 *  so 4 full pages (64 tokens). A1 is 86 tokens (5 full pages), A2 96 (6 full pages). */
const promptA1 = tokensOf(`${prefix} -- first question`)
const promptA2 = tokensOf(`${prefix} :: and a second, longer one`)

/** Prompt tokens a hit covers: whole pages of the common prefix, the last prompt token excluded. */
function expectedCached(cachedPrompt: number[], prompt: number[]): number {
  let common = 0
  while (
    common < Math.min(cachedPrompt.length, prompt.length) &&
    cachedPrompt[common] === prompt[common]
  )
    common += 1
  return Math.floor(Math.min(common, prompt.length - 1) / pageSize) * pageSize
}

describe('prefill with a prefix cache', () => {
  let pair: Pair
  let prefill: PrefillWorker
  const results: PrefillResult[] = []

  before(async () => {
    pair = await startPair({ pageSize, prefillPages: 24, decodePages: 32 })
    prefill = new PrefillWorker(pair.p, { prefixCachePages: 8, prefixCacheShared: true })
    // Record every PrefillResult (runRequest drops them).
    const run = prefill.prefill.bind(prefill)
    prefill.prefill = async (req, signal) => {
      const result = await run(req, signal)
      results.push(result)
      return result
    }
  })
  after(async () => {
    prefill?.close()
    await pair?.close()
  })

  /** Run one request through P (with the cache) and D; check both pools and the cache. */
  async function ask(tenant: string, prompt: number[], maxTokens: number) {
    const outcome = await runRequest({ ...pair, prefill }, makeRequest(tenant, prompt, maxTokens))
    assert.equal(outcome.prefillError, null)
    assert.equal(outcome.decodeError, null)
    pair.p.pool.check()
    prefill.checkCache()
    pair.d.pool.check()
    assert.equal(pair.p.pool.numUsed, prefill.numPagesCached, 'P holds only cached pages')
    assert.equal(pair.d.pool.numUsed, 0)
    return { tokenIds: outcome.tokenIds, cachedTokens: results.at(-1)!.cachedTokens }
  }

  async function counter(name: string, labels = ''): Promise<number> {
    const text = await pair.p.metrics.registry.getSingleMetricAsString(name)
    const line = text.split('\n').find((l) => l.startsWith(`${name}${labels} `))
    return line === undefined ? 0 : Number(line.split(' ')[1])
  }

  it('a tenant’s shared prefix hits and the tokens stay exactly the single-process ones', async () => {
    const first = await ask('tenant-a', promptA1, 24)
    assert.equal(first.cachedTokens, 0)
    assert.deepEqual(first.tokenIds, oracle(promptA1, 24))
    assert.equal(prefill.numPagesCached, 5)

    const second = await ask('tenant-a', promptA2, 24)
    assert.equal(expectedCached(promptA1, promptA2), 64)
    assert.equal(second.cachedTokens, 64)
    assert.deepEqual(second.tokenIds, oracle(promptA2, 24))
    assert.equal(prefill.numPagesCached, 7) // A2's pages 5 and 6 added

    // A1 again: all 5 of its full pages are cached, and its last token is on page 6.

    const again = await ask('tenant-a', promptA1, 24)
    assert.equal(again.cachedTokens, 80)
    assert.deepEqual(again.tokenIds, first.tokenIds)

    assert.equal(await counter('kvfence_prefix_cache_requests_total', '{outcome="hit"}'), 2)
    assert.equal(await counter('kvfence_prefix_cache_requests_total', '{outcome="miss"}'), 1)
    assert.equal(await counter('kvfence_prefix_cache_cached_tokens_total'), 144)
  })

  it('another tenant sending the same prompt never hits and reads only its own pages', async () => {
    const { pool } = pair.p
    const reads: { owner: number; tenants: number[]; owners: number[] }[] = []
    const checkRead = pool.checkRead.bind(pool)
    pool.checkRead = (lease: PageLease, numTokens: number) => {
      const { owner } = lease
      const pages = lease.pages.slice(0, pool.pagesFor(numTokens)).map((r) => r.page)
      reads.push({
        owner,
        tenants: pages.map((p) => pool.tenant[p]),
        owners: pages.map((p) => pool.owner[p]),
      })
      checkRead(lease, numTokens)
    }
    try {
      const b = await ask('tenant-b', promptA1, 24)
      assert.equal(b.cachedTokens, 0)
      assert.deepEqual(b.tokenIds, oracle(promptA1, 24))
      const tenantB = pair.p.tenantId('tenant-b')
      const readers = new Set(reads.map((r) => r.owner))
      assert.ok(reads.length > 0)
      for (const r of reads) {
        assert.deepEqual(new Set(r.tenants), new Set([tenantB]), 'B read a page of another tenant')
        assert.deepEqual(new Set(r.owners), new Set([r.owner]))
      }
      // Prefill reads as B's request; caching B's prompt reads the same pages under the same owner.
      assert.equal(readers.size, 1)

      // B's own second request hits B's own copy.
      reads.length = 0
      const again = await ask('tenant-b', promptA1, 24)
      assert.equal(again.cachedTokens, 80)
      assert.deepEqual(again.tokenIds, b.tokenIds)
      for (const r of reads) assert.deepEqual(new Set(r.tenants), new Set([tenantB]))
    } finally {
      pool.checkRead = checkRead
    }
  })

  it('evicts cached pages before refusing a prompt with capacity_exhausted', async () => {
    assert.equal(prefill.numPagesCached, 8) // at its budget: B's 5 pages evicted 4 of A's 7
    // 21 pages of 24: more than the 16 free, so 5 cached pages must go.
    const long = tokensOf(
      'the small market opens before the morning bread. '.repeat(7).slice(0, 320),
    )
    assert.equal(pair.p.pool.pagesFor(long.length), 21)
    const out = await ask('tenant-c', long, 8)
    assert.equal(out.cachedTokens, 0)
    assert.deepEqual(out.tokenIds, oracle(long, 8))
    assert.ok((await counter('kvfence_prefix_cache_evictions_total')) >= 5)
  })

  it('a prompt that needs the whole pool goes without its own cached prefix instead of failing', async () => {
    const text = 'the small market opens before the morning bread. '.repeat(8).slice(0, 383)
    const start = tokensOf(text.slice(0, 60)) // 4 pages, 3 of them full: cached
    await ask('tenant-d', start, 1)
    // A hit on those 3 pages would pin them, and with them pinned 24 free pages cannot be had.
    const whole = tokensOf(text)
    assert.equal(pair.p.pool.pagesFor(whole.length), 24)
    const out = await ask('tenant-d', whole, 1)
    assert.equal(out.cachedTokens, 0)
    assert.deepEqual(out.tokenIds, oracle(whole, 1))
  })
})
