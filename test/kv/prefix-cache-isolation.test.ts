/** Tenant isolation of the prefix cache on a bare KV pool (no model): with per-tenant partitions
 *  (assigned from the tenants file, the prefill worker's default, or first come with
 *  `maxPagesPerTenant`) a tenant's hits are exactly the same with and without another tenant's
 *  flood of distinct prefixes (with one shared budget, as a control, the flood wipes them out);
 *  partitions are handed out while they last and a pool short of pages takes the requester's own
 *  cached pages first. And publication: only sealed pages (a prefill that completed) are cached,
 *  a refused insert is a counted G5 trip. Pool and cache invariants are checked after every step. */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import { GuardError, GuardTrips, makeGuards } from '../../src/kv/guards.js'
import { KvPool, type PageLease } from '../../src/kv/pool.js'
import { PrefixCache, partitionPages, type PrefixCacheOptions } from '../../src/kv/prefix-cache.js'

/** Pages of 4 tokens, 1 layer, 1 KV head of dim 2. */
const pageSize = 4

interface Setup {
  pool: KvPool
  cache: PrefixCache
  trips: GuardTrips
  /** A prefilled request of `tenant` for `tokenIds`: pages allocated, every position written,
   *  sealed unless `isSealed` is false. */
  prefilled: (tenant: string, tokenIds: number[], isSealed?: boolean) => PageLease
  /** Prefill `tokenIds` for `tenant`, cache its pages, free the request. Returns pages added. */
  insert: (tenant: string, tokenIds: number[]) => number
  /** Prompt tokens a lookup of `tokenIds` covers (the hit released at once). */
  hitTokens: (tenant: string, tokenIds: number[]) => number
  check: () => void
}

function setup(
  numPages: number,
  options: Pick<PrefixCacheOptions, 'maxPages' | 'maxPagesPerTenant' | 'guards' | 'assigned'>,
): Setup {
  const trips = new GuardTrips()
  const pool = new KvPool(
    { numPages, pageSize, numLayers: 1, numKvHeads: 1, headDim: 2 },
    makeGuards(true),
    trips,
  )
  let lastOwner = 0
  const tenants = new Map<string, number>()
  const tenantId = (name: string) => {
    if (!tenants.has(name)) tenants.set(name, tenants.size + 1)
    return tenants.get(name)!
  }
  const cache = new PrefixCache(pool, {
    ...options,
    nextOwner: () => ++lastOwner,
    tenantId,
    trips,
  })
  const check = () => {
    pool.check()
    cache.check()
  }
  const prefilled = (tenant: string, tokenIds: number[], isSealed = true) => {
    const lease = pool.allocate(pool.pagesFor(tokenIds.length), ++lastOwner, tenantId(tenant))
    pool.noteWrite(lease, 0, tokenIds.length)
    tokenIds.forEach((id, pos) => pool.k[0].fill(id, pool.offsetOf(lease, pos), 2))
    if (isSealed) pool.seal(lease)
    return lease
  }
  return {
    pool,
    cache,
    trips,
    prefilled,
    insert: (tenant, tokenIds) => {
      const lease = prefilled(tenant, tokenIds)
      const n = cache.insert(tenant, tokenIds, lease)
      pool.release(lease)
      check()
      return n
    },
    hitTokens: (tenant, tokenIds) => {
      const hit = cache.lookup(tenant, tokenIds)
      if (hit === null) return 0
      cache.release(hit)
      return hit.numTokens
    },
    check,
  }
}

/** `n` token ids from `base` on. */
const tokens = (n: number, base: number) => Array.from({ length: n }, (_, i) => base + i)

/** Tenant A's prompts: 13 tokens (3 full pages), 9 tokens (2), and one sharing a1's first 2 pages. */
const a1 = tokens(13, 100)
const a2 = tokens(9, 200)
const a3 = [...a1.slice(0, 8), ...tokens(6, 300)]

/** A's traffic: cache a1 and a2, then (optionally) B's flood of 10 distinct 3-page prompts, then
 *  A's hits on a1, a2, a3, a1 again. Returns the tokens each of A's lookups covered. */
function tenantAHits(s: Setup, isFlooded: boolean): number[] {
  s.insert('tenant-a', a1)
  s.insert('tenant-a', a2)
  if (isFlooded) for (let i = 0; i < 10; i++) s.insert('tenant-b', tokens(13, 1000 + 100 * i))
  return [a1, a2, a3, a1].map((p) => s.hitTokens('tenant-a', p))
}

/** The tenants file of two tenants without sizes: 16 pages split 8 + 8. */
const twoDefault = { reservedPages: 0, numDefaultTenants: 2 }

describe('prefix cache: partitions assigned from the tenants file (the default)', () => {
  it('a tenant’s hits are identical with and without another tenant’s flood of distinct prefixes', () => {
    const run = (isFlooded: boolean) => {
      const s = setup(64, { maxPages: 16, assigned: true })
      for (const t of ['tenant-a', 'tenant-b']) assert.equal(s.cache.assign(t, twoDefault), 8)
      return { s, hits: tenantAHits(s, isFlooded) }
    }
    const quiet = run(false)
    const flooded = run(true)
    assert.deepEqual(quiet.hits, [12, 8, 8, 12])
    assert.deepEqual(flooded.hits, quiet.hits)
    // B's 10 prompts of 3 pages kept its last 8 pages (2 whole prompts and 2 pages of a third).
    assert.equal(flooded.s.cache.numPages, 5 + 8)
    assert.equal(flooded.s.hitTokens('tenant-b', tokens(13, 1900)), 12)
    assert.equal(flooded.s.hitTokens('tenant-b', tokens(13, 1000)), 0)
  })

  it('sizes: the file’s own size, else an equal share of the rest (capped); 0 when overbooked', () => {
    // 16 pages; the file gives one tenant 6 by name and has 3 without a size: 10 / 3 = 3 each.
    assert.equal(partitionPages(16, { pages: 6, reservedPages: 6, numDefaultTenants: 3 }), 6)
    assert.equal(partitionPages(16, { reservedPages: 6, numDefaultTenants: 3 }), 3)
    assert.equal(partitionPages(16, { reservedPages: 6, numDefaultTenants: 3 }, 2), 2)
    assert.equal(partitionPages(16, { pages: 0, reservedPages: 0, numDefaultTenants: 1 }), 0)
    // Names asking for 17 of 16 pages: no size can be honoured, so no tenant caches.
    assert.equal(partitionPages(16, { pages: 9, reservedPages: 17, numDefaultTenants: 1 }), 0)
    assert.equal(partitionPages(16, { reservedPages: 17, numDefaultTenants: 1 }), 0)
  })

  it('a tenant never assigned a partition caches nothing; a bad spec is a RangeError', () => {
    const s = setup(64, { maxPages: 16, assigned: true })
    assert.equal(s.insert('tenant-a', a1), 0)
    assert.equal(s.hitTokens('tenant-a', a1), 0)
    assert.throws(
      () => s.cache.assign('tenant-a', { reservedPages: -1, numDefaultTenants: 1 }),
      RangeError,
    )
    assert.throws(
      () => s.cache.assign('tenant-a', { reservedPages: 0, numDefaultTenants: 0.5 }),
      RangeError,
    )
    const shared = setup(64, { maxPages: 16 })
    assert.throws(() => shared.cache.assign('tenant-a', twoDefault), RangeError)
  })

  it('a changed file takes effect at the tenant’s own next request, evicting only its pages', () => {
    const s = setup(64, { maxPages: 16, assigned: true })
    for (const t of ['tenant-a', 'tenant-b']) s.cache.assign(t, twoDefault)
    s.insert('tenant-a', a1)
    s.insert('tenant-a', a2)
    s.insert('tenant-b', tokens(13, 500))
    // A third tenant added (keys add): its first request brings the split of 16 / 3 = 5 pages.
    const three = { reservedPages: 0, numDefaultTenants: 3 }
    assert.equal(s.cache.assign('tenant-c', three), 5)
    assert.equal(s.insert('tenant-c', tokens(13, 700)), 3)
    // A and B keep every page until their own next request.
    assert.equal(s.cache.numPages, 5 + 3 + 3)
    assert.equal(s.cache.assign('tenant-a', three), 5)
    s.check()
    // A held 5 pages, within its new 5: nothing went. Shrunk to 2 by name, its oldest chain's
    // deepest pages go first (a1 was used before a2).
    assert.equal(s.cache.numPages, 11)
    assert.equal(
      s.cache.assign('tenant-a', { pages: 2, reservedPages: 2, numDefaultTenants: 2 }),
      2,
    )
    s.check()
    assert.deepEqual(
      [a1, a2].map((p) => s.hitTokens('tenant-a', p)),
      [0, 8],
    )
    assert.equal(s.hitTokens('tenant-b', tokens(13, 500)), 12)
    assert.equal(s.hitTokens('tenant-c', tokens(13, 700)), 12)
  })
})

describe('prefix cache: a shrink that meets pinned pages', () => {
  it('finishes when the hit is released: the partition is back within its size', () => {
    const s = setup(64, { maxPages: 16, assigned: true })
    s.cache.assign('tenant-a', twoDefault)
    s.insert('tenant-a', a1)
    const hit = s.cache.lookup('tenant-a', a1)!
    assert.equal(hit.numTokens, 12)
    // The file now gives A one page; its 3 pages are pinned by the hit being copied.
    assert.equal(
      s.cache.assign('tenant-a', { pages: 1, reservedPages: 1, numDefaultTenants: 1 }),
      1,
    )
    assert.equal(s.cache.numPages, 3)
    s.cache.release(hit)
    assert.equal(s.cache.numPages, 1)
    s.check()
    assert.equal(s.hitTokens('tenant-a', a1), 4)
  })
})

describe('prefix cache: first-come partitions (maxPagesPerTenant alone)', () => {
  it('a tenant’s hits are identical with and without another tenant’s flood of distinct prefixes', () => {
    const options = { maxPages: 16, maxPagesPerTenant: 8 }
    const quiet = tenantAHits(setup(64, options), false)
    const flooded = setup(64, options)
    // Whole pages of each prompt minus its last token: a1 3 pages, a2 2, a3 its 2 shared with a1.
    assert.deepEqual(quiet, [12, 8, 8, 12])
    assert.deepEqual(tenantAHits(flooded, true), quiet)
    // B filled its own partition and no more; it evicted only its own pages to do so.
    assert.equal(flooded.cache.numPages, 5 + 8)
    assert.equal(flooded.hitTokens('tenant-b', tokens(13, 1900)), 12)
    assert.equal(flooded.hitTokens('tenant-b', tokens(13, 1000)), 0)
  })

  it('control: with one budget shared by all tenants the same flood evicts every page of A', () => {
    assert.deepEqual(tenantAHits(setup(64, { maxPages: 16 }), false), [12, 8, 8, 12])
    assert.deepEqual(tenantAHits(setup(64, { maxPages: 16 }), true), [0, 0, 0, 0])
  })

  it('hands out floor(maxPages / perTenant) partitions; a later tenant caches nothing', () => {
    const s = setup(64, { maxPages: 17, maxPagesPerTenant: 8 })
    assert.equal(s.insert('tenant-a', a1), 3)
    assert.equal(s.insert('tenant-b', a1), 3)
    assert.equal(s.insert('tenant-c', a1), 0)
    assert.equal(s.hitTokens('tenant-c', a1), 0)
    assert.deepEqual(
      ['tenant-a', 'tenant-b'].map((t) => s.hitTokens(t, a1)),
      [12, 12],
    )
    assert.equal(s.cache.numPages, 6)
  })

  it('a pool short of pages takes the requesting tenant’s own cached pages first', () => {
    const s = setup(12, { maxPages: 12, maxPagesPerTenant: 6 })
    s.insert('tenant-a', a1)
    s.insert('tenant-b', tokens(13, 500))
    assert.equal(s.pool.numFree, 6)
    // B's prompt needs 9 free pages: its own 3 cached pages go, although A's are older.
    assert.equal(s.cache.evictFor(9, 'tenant-b'), 3)
    s.check()
    assert.equal(s.hitTokens('tenant-a', a1), 12)
    assert.equal(s.hitTokens('tenant-b', tokens(13, 500)), 0)
    // When its own pages are not enough, other tenants' go too: a prompt that fits never fails.
    assert.equal(s.cache.evictFor(12, 'tenant-b'), 3)
    assert.equal(s.cache.numPages, 0)
    s.check()
  })

  it('rejects a per-tenant budget outside 1..maxPages', () => {
    const pool = new KvPool(
      { numPages: 8, pageSize, numLayers: 1, numKvHeads: 1, headDim: 2 },
      makeGuards(true),
    )
    const base = { nextOwner: () => 1, tenantId: () => 1 }
    for (const bad of [0, 9, 1.5]) {
      assert.throws(
        () => new PrefixCache(pool, { ...base, maxPages: 8, maxPagesPerTenant: bad }),
        RangeError,
      )
    }
  })
})

describe('prefix cache: only a completed prefill is published', () => {
  it('refuses pages that were never sealed (G5), caching nothing, and counts the trip', () => {
    const s = setup(16, { maxPages: 8 })
    const lease = s.prefilled('tenant-a', a1, false)
    assert.throws(
      () => s.cache.insert('tenant-a', a1, lease),
      (e: unknown) => e instanceof GuardError && e.guard === 'G5' && /not sealed/.test(e.message),
    )
    assert.equal(s.trips.counts.G5, 1)
    assert.equal(s.cache.numPages, 0)
    assert.equal(s.hitTokens('tenant-a', a1), 0)
    s.pool.release(lease)
    s.check()
  })

  it('refuses a sealed lease whose pages are not all filled (G5), caching nothing', () => {
    const s = setup(16, { maxPages: 8 })
    // Written for 9 of a1's 13 tokens only (an aborted prefill), then sealed by a bug.
    const lease = s.pool.allocate(4, 99, 1)
    s.pool.noteWrite(lease, 0, 9)
    s.pool.seal(lease)
    assert.throws(() => s.cache.insert('tenant-a', a1, lease), GuardError)
    assert.equal(s.cache.numPages, 0)
    s.pool.release(lease)
    s.check()
  })

  it('with G5 off the same unsealed pages are cached (what the publish-partial fault relies on)', () => {
    const s = setup(16, { maxPages: 8, guards: { G5: false } })
    const lease = s.prefilled('tenant-a', a1, false)
    assert.equal(s.cache.insert('tenant-a', a1, lease), 3)
    assert.equal(s.hitTokens('tenant-a', a1), 12)
    s.pool.release(lease)
  })
})
