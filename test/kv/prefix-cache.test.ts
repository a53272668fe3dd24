/** The prefix cache on a bare KV pool (no model): per-tenant keys, exact copies in and out, pins,
 *  LRU eviction (deepest page of a chain first, never a pinned page), scrub on eviction, and the
 *  pool's and the cache's invariants after every operation. Page contents are tagged values
 *  written by hand, so every expected float is known without running anything else. */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import { GuardError, GuardTrips, makeGuards } from '../../src/kv/guards.js'
import { KvPool, PageState, type PageLease } from '../../src/kv/pool.js'
import { PrefixCache } from '../../src/kv/prefix-cache.js'

/** Pages of 4 tokens, 2 layers, 1 KV head of dim 2: 8 floats per page per layer. */
const pageSize = 4
const shapeOf = (numPages: number) => ({
  numPages,
  pageSize,
  numLayers: 2,
  numKvHeads: 1,
  headDim: 2,
})

interface Setup {
  pool: KvPool
  cache: PrefixCache
  trips: GuardTrips
  owner: () => number
  tenantId: (name: string) => number
  evicted: number[]
  /** pool.check() and cache.check(). */
  check: () => void
}

function setup(numPages: number, maxPages: number): Setup {
  const trips = new GuardTrips()
  const pool = new KvPool(shapeOf(numPages), makeGuards(true), trips)
  let lastOwner = 0
  const tenants = new Map<string, number>()
  const tenantId = (name: string) => {
    if (!tenants.has(name)) tenants.set(name, tenants.size + 1)
    return tenants.get(name)!
  }
  const evicted: number[] = []
  const owner = () => ++lastOwner
  const cache = new PrefixCache(pool, {
    maxPages,
    nextOwner: owner,
    tenantId,
    onEvict: (n) => evicted.push(n),
  })
  return {
    pool,
    cache,
    trips,
    owner,
    tenantId,
    evicted,
    check: () => {
      pool.check()
      cache.check()
    },
  }
}

/** The K value of float `i` of position `pos` in `layer` of a request tagged `tag` (V is its negative). */
const kValue = (tag: number, layer: number, pos: number, i: number) =>
  tag * 1000 + layer * 100 + pos * 2 + i

/** A prefilled request: pages for `numTokens` tokens, every position written with tagged values. */
function prefilled(s: Setup, tenant: string, numTokens: number, tag: number) {
  const owner = s.owner()
  const table = s.pool.allocate(s.pool.pagesFor(numTokens), owner, s.tenantId(tenant))
  s.pool.noteWrite(table, 0, numTokens)
  for (let pos = 0; pos < numTokens; pos++) {
    const off = s.pool.offsetOf(table, pos)
    for (let layer = 0; layer < 2; layer++) {
      for (let i = 0; i < 2; i++) {
        s.pool.k[layer][off + i] = kValue(tag, layer, pos, i)
        s.pool.v[layer][off + i] = -kValue(tag, layer, pos, i)
      }
    }
  }
  s.pool.seal(table)
  return { owner, table }
}

/** K of float `i` of position `pos` of a page table, in `layer`. */
function kAt(pool: KvPool, table: PageLease, layer: number, pos: number, i: number) {
  return pool.k[layer][pool.offsetOf(table, pos) + i]
}

const tokens = (n: number, base = 10) => Array.from({ length: n }, (_, i) => base + i)

describe('prefix cache', () => {
  it('a tenant hits its own full pages, minus the page holding the last prompt token', () => {
    const s = setup(16, 8)
    const prompt = tokens(10) // pages [0..3] [4..7] full, [8..9] partial
    const a = prefilled(s, 'a', 10, 1)
    assert.equal(s.cache.insert('a', prompt, a.table), 2)
    s.check()
    s.pool.release(a.table)
    s.check()
    assert.equal(s.cache.numPages, 2)

    // The same 8 tokens + anything: 2 pages (8 tokens) hit.
    const hit = s.cache.lookup('a', [...tokens(8), 99, 98, 97])
    assert.ok(hit)
    assert.equal(hit.numTokens, 8)
    assert.equal(hit.refs.length, 2)
    for (const ref of hit.refs) assert.equal(s.pool.pins[ref.page], 1)
    s.check()
    s.cache.release(hit)
    for (const ref of hit.refs) assert.equal(s.pool.pins[ref.page], 0)

    // Exactly 8 tokens: the last token must be computed, so only the first page hits.
    const exact = s.cache.lookup('a', tokens(8))
    assert.equal(exact?.numTokens, 4)
    s.cache.release(exact!)
    // Fewer than a page + 1 tokens: nothing to reuse.
    assert.equal(s.cache.lookup('a', tokens(4)), null)
    s.check()
  })

  it('copies cached K/V exactly into the request’s own pages, claimed first (G5)', () => {
    const s = setup(16, 8)
    const a = prefilled(s, 'a', 8, 7)
    s.cache.insert('a', tokens(8), a.table)
    s.pool.release(a.table) // scrubs the request's pages: the cache holds copies
    s.check()
    const owner = s.owner()
    const table = s.pool.allocate(3, owner, s.tenantId('a'))
    const hit = s.cache.lookup('a', tokens(9))!
    s.cache.copyInto(hit, table)
    s.cache.release(hit)
    s.check()
    for (let pos = 0; pos < 8; pos++) {
      for (let layer = 0; layer < 2; layer++) {
        for (let i = 0; i < 2; i++) {
          assert.equal(kAt(s.pool, table, layer, pos, i), kValue(7, layer, pos, i))
          assert.equal(s.pool.v[layer][s.pool.offsetOf(table, pos) + i], -kValue(7, layer, pos, i))
        }
      }
    }
    // The copy counts as the owner's write: it may read 8 tokens and append at position 8.
    assert.deepEqual([...table.pages.map((r) => s.pool.fill[r.page])], [4, 4, 0])
    s.pool.checkRead(table, 8)
    s.pool.noteWrite(table, 8, 1)
    s.pool.release(table)
    s.check()
  })

  it('refuses to copy into pages the request does not own, and copies nothing (G5)', () => {
    const s = setup(16, 8)
    const a = prefilled(s, 'a', 8, 3)
    s.cache.insert('a', tokens(8), a.table)
    const other = s.owner()
    const table = s.pool.allocate(3, other, s.tenantId('a'))
    const hit = s.cache.lookup('a', tokens(9))!
    assert.throws(() => s.cache.copyInto(hit, { ...table, owner: s.owner() }), GuardError)
    s.cache.release(hit)
    // Never-used pages hold the poison value: the refused copy left them untouched.
    assert.ok(Number.isNaN(kAt(s.pool, table, 0, 0, 0)))
    assert.deepEqual([...table.pages.map((r) => s.pool.fill[r.page])], [0, 0, 0])
    s.check()
  })

  it('another tenant never hits: same tokens, different salt, different keys', () => {
    const s = setup(16, 8)
    const a = prefilled(s, 'a', 12, 1)
    s.cache.insert('a', tokens(12), a.table)
    s.check()
    assert.equal(s.cache.lookup('b', tokens(12)), null)
    const keysA = s.cache.keysOf('a', tokens(12))
    const keysB = s.cache.keysOf('b', tokens(12))
    assert.equal(keysA.length, 3)
    for (const k of keysB) assert.ok(!keysA.includes(k))
    // B caching the same prompt gets its own pages under its own cache owner.
    const b = prefilled(s, 'b', 12, 2)
    assert.equal(s.cache.insert('b', tokens(12), b.table), 3)
    s.check()
    const hitA = s.cache.lookup('a', tokens(13))!
    const hitB = s.cache.lookup('b', tokens(13))!
    assert.notEqual(hitA.owner, hitB.owner)
    for (const ref of hitB.refs) {
      assert.equal(s.pool.tenant[ref.page], s.tenantId('b'))
      assert.ok(!hitA.refs.some((r) => r.page === ref.page))
    }
    assert.equal(kAt(s.pool, hitB.lease, 0, 0, 0), kValue(2, 0, 0, 0))
    s.cache.release(hitA)
    s.cache.release(hitB)
    s.check()
  })

  it('keys name a whole prefix: an equal page after a different one does not hit', () => {
    const s = setup(16, 8)
    const a = prefilled(s, 'a', 8, 1)
    s.cache.insert('a', tokens(8), a.table)
    const otherStart = [50, 51, 52, 53, ...tokens(8).slice(4), 1]
    assert.equal(s.cache.lookup('a', otherStart), null)
    s.check()
  })

  it('at maxPages evicts the least recently used page, a chain’s deepest page first', () => {
    const s = setup(16, 3)
    const a = prefilled(s, 'a', 8, 1) // chain a0 → a1
    s.cache.insert('a', tokens(8), a.table)
    const b = prefilled(s, 'a', 8, 2) // chain b0 → b1, other tokens, same tenant
    const bTokens = tokens(8, 40)
    // Full at 3 pages: b1 evicts a's deepest page (a1), never a0 (which would orphan a1).
    assert.equal(s.cache.insert('a', bTokens, b.table), 2)
    s.check()
    assert.deepEqual(s.evicted, [1])
    assert.equal(s.cache.numPages, 3)
    const hitA = s.cache.lookup('a', tokens(9))!
    const hitB = s.cache.lookup('a', [...bTokens, 1])!
    assert.equal(hitA.numTokens, 4)
    assert.equal(hitB.numTokens, 8)
    assert.equal(kAt(s.pool, hitB.lease, 0, 7, 1), kValue(2, 0, 7, 1))
    s.cache.release(hitA)
    s.cache.release(hitB)
    s.check()
  })

  it('never evicts a pinned page; evicted pages are scrubbed and free (G6)', () => {
    const s = setup(8, 8)
    const a = prefilled(s, 'a', 8, 1)
    s.cache.insert('a', tokens(8), a.table)
    s.pool.release(a.table)
    const hit = s.cache.lookup('a', tokens(9))! // pins both cached pages
    assert.equal(s.cache.evictFor(8), 0)
    assert.equal(s.cache.numPages, 2)
    s.check()
    s.cache.release(hit)
    assert.equal(s.cache.evictFor(8), 2)
    assert.deepEqual(s.evicted, [1, 1])
    assert.equal(s.cache.numPages, 0)
    s.check()
    for (const ref of hit.refs) {
      assert.equal(s.pool.state[ref.page], PageState.free)
      for (let layer = 0; layer < 2; layer++) {
        const start = ref.page * s.pool.pageStride
        for (let f = start; f < start + s.pool.pageStride; f++) {
          assert.ok(Number.isNaN(s.pool.k[layer][f]) && Number.isNaN(s.pool.v[layer][f]))
        }
      }
    }
    assert.equal(s.cache.lookup('a', tokens(9)), null)
  })

  it('takes only free pages beyond the reserve, and none from running requests', () => {
    const s = setup(4, 8)
    const a = prefilled(s, 'a', 12, 1) // 3 of 4 pages
    assert.equal(s.cache.insert('a', tokens(12), a.table, 1), 0)
    s.check()
    assert.equal(s.cache.insert('a', tokens(12), a.table), 1)
    assert.equal(s.pool.numFree, 0)
    s.check()
    // Pages already cached are reused, not copied again.
    assert.equal(s.cache.insert('a', tokens(12), a.table), 0)
    s.pool.release(a.table)
    s.check()
  })

  it('with maxPages 0 caches nothing and never hits', () => {
    const s = setup(8, 0)
    const a = prefilled(s, 'a', 8, 1)
    assert.equal(s.cache.isEnabled, false)
    assert.equal(s.cache.insert('a', tokens(8), a.table), 0)
    assert.equal(s.cache.lookup('a', tokens(9)), null)
    assert.equal(s.pool.numUsed, 2)
    s.check()
  })

  it('rejects a negative page budget', () => {
    const pool = new KvPool(shapeOf(4), makeGuards(true))
    assert.throws(
      () => new PrefixCache(pool, { maxPages: -1, nextOwner: () => 1, tenantId: () => 1 }),
      /prefix cache pages must be an integer ≥ 0, got -1/,
    )
  })
})
