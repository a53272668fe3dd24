/** The prefix cache's offload tier on a bare KV pool (no model): a page evicted from the pool goes
 *  to the host-memory ring and comes back, bit for bit, on a hit; a load is verified before use
 *  (checksum, tenant, layout, token count) and one that fails is a counted miss. The two faults are
 *  shown both ways: `offload-load-as-hit` (a corrupt load used anyway, only with G4 off) and
 *  `offload-key-without-tenant` (another tenant's lookup finds the page: refused with G4 on, a
 *  cross-tenant hit with it off). K/V are tagged values written by hand, so every expected float is
 *  known without running anything else. Pool, cache and ring invariants after every step. */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import { GuardTrips, makeGuards } from '../../src/kv/guards.js'
import { OffloadRing } from '../../src/kv/offload.js'
import { KvPool, type PageLease } from '../../src/kv/pool.js'
import { partitionBytes, PrefixCache, type PrefixCacheOptions } from '../../src/kv/prefix-cache.js'

/** Pages of 4 tokens, 1 layer, 1 KV head of dim 2: a payload is K (8 floats) then V, 64 bytes. */
const pageSize = 4
const pageBytes = 64

/** K of float `i` of a token `id` (V is its negative): the tokens tag their own KV. */
const kOf = (id: number, i: number) => id * 10 + i

function setup(extra: Partial<PrefixCacheOptions> = {}, ringBytes = 1024) {
  const trips = new GuardTrips()
  const pool = new KvPool(
    { numPages: 32, pageSize, numLayers: 1, numKvHeads: 1, headDim: 2 },
    makeGuards(true),
    trips,
  )
  const ring = new OffloadRing({ bytes: ringBytes })
  let lastOwner = 0
  const tenants = new Map<string, number>()
  const tenantId = (name: string) => {
    if (!tenants.has(name)) tenants.set(name, tenants.size + 1)
    return tenants.get(name)!
  }
  const loads: string[] = []
  const cache = new PrefixCache(pool, {
    maxPages: 3,
    nextOwner: () => ++lastOwner,
    tenantId,
    trips,
    offload: ring,
    layout: 'layout-1',
    onOffloadLoad: (outcome) => loads.push(outcome),
    ...extra,
  })
  const check = () => {
    pool.check()
    cache.check()
    ring.check()
  }
  /** Prefill `tokenIds` for `tenant` (tagged KV), cache its pages, free the request. */
  const insert = (tenant: string, tokenIds: number[]) => {
    const lease = pool.allocate(pool.pagesFor(tokenIds.length), ++lastOwner, tenantId(tenant))
    pool.noteWrite(lease, 0, tokenIds.length)
    tokenIds.forEach((id, pos) => {
      const off = pool.offsetOf(lease, pos)
      for (let i = 0; i < 2; i++) {
        pool.k[0][off + i] = kOf(id, i)
        pool.v[0][off + i] = -kOf(id, i)
      }
    })
    pool.seal(lease)
    cache.insert(tenant, tokenIds, lease)
    pool.release(lease)
    check()
  }
  /** Look up `tokenIds`; returns the tokens covered and the K/V copied into a fresh request. */
  const ask = (tenant: string, tokenIds: number[]) => {
    const hit = cache.lookup(tenant, tokenIds)
    check()
    if (hit === null) return { numTokens: 0, k: [], v: [] }
    const lease: PageLease = pool.allocate(hit.refs.length + 1, ++lastOwner, tenantId(tenant))
    cache.copyInto(hit, lease)
    cache.release(hit)
    const k: number[] = []
    const v: number[] = []
    for (let pos = 0; pos < hit.numTokens; pos++) {
      const off = pool.offsetOf(lease, pos)
      k.push(pool.k[0][off], pool.k[0][off + 1])
      v.push(pool.v[0][off], pool.v[0][off + 1])
    }
    pool.release(lease)
    check()
    return { numTokens: hit.numTokens, k, v }
  }
  return { pool, cache, ring, trips, loads, insert, ask, check }
}

const tokens = (n: number, base: number) => Array.from({ length: n }, (_, i) => base + i)
/** 13 tokens: 3 full pages; then 9 tokens of another prefix: 2 pages, which evict 2 of the first. */
const a1 = tokens(13, 100)
const a2 = tokens(9, 200)
/** What a hit on a1's 3 pages must copy: each token's own tag. */
const a1K = a1.slice(0, 12).flatMap((id) => [kOf(id, 0), kOf(id, 1)])

describe('prefix cache offload tier', () => {
  it('an evicted page goes to the ring and comes back bit for bit on a hit', () => {
    const s = setup()
    s.insert('tenant-a', a1)
    s.insert('tenant-a', a2) // at maxPages 3: a1's pages 3 and 2 go, deepest first
    assert.equal(s.ring.numPages, 2)
    assert.equal(s.ring.numBytes, 2 * pageBytes)
    const got = s.ask('tenant-a', a1)
    assert.equal(got.numTokens, 12)
    assert.deepEqual(got.k, a1K)
    assert.deepEqual(
      got.v,
      a1K.map((x) => -x),
    )
    assert.deepEqual(s.loads, ['hit', 'hit'])
  })

  it('a corrupt page is refused: a counted miss, the hit stops before it', () => {
    const s = setup()
    s.insert('tenant-a', a1)
    s.insert('tenant-a', a2)
    const [, key2] = s.cache.keysOf('tenant-a', a1)
    s.ring.peek(key2)!.payload[0] ^= 0x01
    const got = s.ask('tenant-a', a1)
    assert.equal(got.numTokens, 4)
    assert.deepEqual(got.k, a1K.slice(0, 8))
    assert.deepEqual(s.loads, ['refused'])
  })

  it('refuses a page of another layout, tenant or token count (each a miss)', () => {
    const s = setup()
    const [key1] = s.cache.keysOf('tenant-a', a1)
    const payload = new Uint8Array(pageBytes)
    const cases = [
      { layout: 'layout-2', tenant: 'tenant-a', numTokens: pageSize },
      { layout: 'layout-1', tenant: 'tenant-b', numTokens: pageSize },
      { layout: 'layout-1', tenant: 'tenant-a', numTokens: pageSize - 1 },
    ]
    for (const c of cases) {
      s.ring.store({ key: key1, ...c }, payload)
      assert.equal(s.ask('tenant-a', a1).numTokens, 0)
    }
    assert.deepEqual(s.loads, ['refused', 'refused', 'refused'])
    // The same page with the right identity is used.
    s.ring.store(
      { key: key1, layout: 'layout-1', tenant: 'tenant-a', numTokens: pageSize },
      payload,
    )
    assert.equal(s.ask('tenant-a', a1).numTokens, 4)
  })

  it('fault offload-load-as-hit: refused with G4 on; with G4 off the corrupt page is used', () => {
    for (const isG4On of [true, false]) {
      const s = setup({ faults: { offloadLoadAsHit: true }, guards: { G4: isG4On } })
      s.insert('tenant-a', a1)
      s.insert('tenant-a', a2)
      const [, key2] = s.cache.keysOf('tenant-a', a1)
      // The top exponent bit of page 2's first K: 1040 becomes 1040 × 2^-128 (as corrupt-transfer).
      s.ring.peek(key2)!.payload[3] ^= 0x40
      const got = s.ask('tenant-a', a1)
      if (isG4On) {
        assert.equal(got.numTokens, 4)
        assert.deepEqual(s.loads, ['refused'])
      } else {
        assert.equal(got.numTokens, 12)
        assert.notEqual(got.k[8], a1K[8])
        assert.deepEqual(got.k.slice(9), a1K.slice(9))
        assert.deepEqual(s.loads, ['hit', 'hit'])
      }
    }
  })

  it('fault offload-key-without-tenant: another tenant is refused with G4 on, hits A’s page with it off', () => {
    for (const isG4On of [true, false]) {
      const s = setup({ faults: { offloadKeyWithoutTenant: true }, guards: { G4: isG4On } })
      s.insert('tenant-a', a1)
      s.insert('tenant-a', a2)
      // B's own first page (the pool cache is salted: B never finds A's pool pages).
      const b1 = [...a1.slice(0, 4), 900]
      s.insert('tenant-b', b1)
      const got = s.ask('tenant-b', a1)
      if (isG4On) {
        assert.equal(got.numTokens, 4)
        assert.deepEqual(s.loads, ['refused'])
      } else {
        // A's page 2, offloaded under a key without the tenant, serves B: a cross-tenant hit.
        assert.ok(got.numTokens > 4)
        assert.deepEqual(got.k.slice(8, 16), a1K.slice(8, 16))
        assert.equal(s.loads[0], 'hit')
      }
    }
  })

  it('drops the oldest entries past its bytes, and only the storing tenant’s with bytesPerTenant', () => {
    const ring = new OffloadRing({ bytes: 3 * pageBytes, bytesPerTenant: 2 * pageBytes })
    const payload = new Uint8Array(pageBytes)
    const put = (tenant: string, key: string) =>
      ring.store({ key, tenant, layout: 'l', numTokens: pageSize }, payload)
    put('tenant-a', 'a1')
    put('tenant-b', 'b1')
    put('tenant-b', 'b2')
    put('tenant-b', 'b3') // B over its 2 pages: b1 goes, A's a1 stays
    assert.deepEqual(
      ['a1', 'b1', 'b2', 'b3'].map((k) => ring.peek(k) !== undefined),
      [true, false, true, true],
    )
    ring.check()
    assert.equal(
      ring.store(
        { key: 'x', tenant: 'tenant-a', layout: 'l', numTokens: 4 },
        new Uint8Array(4 * pageBytes),
      ),
      false,
    )
  })

  it('each tenant its own bound (a share that may change): a store drops only its own entries', () => {
    const share = new Map([
      ['tenant-a', 2 * pageBytes],
      ['tenant-b', 1 * pageBytes],
    ])
    const ring = new OffloadRing({ bytes: 3 * pageBytes, bytesPerTenant: (t) => share.get(t) ?? 0 })
    const payload = new Uint8Array(pageBytes)
    const put = (tenant: string, key: string) =>
      ring.store({ key, tenant, layout: 'l', numTokens: pageSize }, payload)
    const held = () => ['a1', 'a2', 'a3', 'b1', 'b2', 'c1'].filter((k) => ring.peek(k))
    assert.equal(put('tenant-a', 'a1'), true)
    assert.equal(put('tenant-a', 'a2'), true)
    assert.equal(put('tenant-b', 'b1'), true)
    assert.equal(put('tenant-b', 'b2'), true) // B's one page: b1 goes, A's stay
    assert.deepEqual(held(), ['a1', 'a2', 'b2'])
    assert.equal(put('tenant-c', 'c1'), false) // no partition, no share: nothing kept or dropped
    assert.deepEqual(held(), ['a1', 'a2', 'b2'])
    share.set('tenant-a', pageBytes) // A's partition shrank: its own next store trims it
    assert.equal(put('tenant-a', 'a3'), true)
    assert.deepEqual(held(), ['a3', 'b2'])
    ring.check()
    const bad = new OffloadRing({ bytes: 3 * pageBytes, bytesPerTenant: () => 0.5 })
    assert.throws(
      () => bad.store({ key: 'x', tenant: 't', layout: 'l', numTokens: 4 }, payload),
      /offload bytes of a tenant must be an integer ≥ 0, got 0.5$/,
    )
  })
})

describe('partitionBytes: a tenant’s share of an offload tier', () => {
  it('is floor(bytes × partition / cache pages), exact beyond 2^53, and adds up to at most bytes', () => {
    // Hand-checked: 1000 × 3 / 8 = 375; 1000 × 1 / 3 = 333.33…; a cache of 0 pages keeps nothing.
    assert.equal(partitionBytes(1000, 3, 8), 375)
    assert.equal(partitionBytes(1000, 1, 3), 333)
    assert.equal(partitionBytes(1000, 0, 8), 0)
    assert.equal(partitionBytes(1000, 8, 8), 1000)
    assert.equal(partitionBytes(1000, 0, 0), 0)
    // Products past 2^53: 2^52 × 3 / 4 = 3 × 2^50; (2^53 − 1) × 5 // 7 = 6433713753386422
    // (Python's integer division).
    assert.equal(partitionBytes(2 ** 52, 3, 4), 3 * 2 ** 50)
    assert.equal(partitionBytes(2 ** 53 - 1, 5, 7), 6433713753386422)
    // Three tenants' default shares of a 16-page cache (5 pages each) within 65536 bytes.
    assert.ok(3 * partitionBytes(65536, 5, 16) <= 65536)
    assert.throws(() => partitionBytes(-1, 1, 1), /integers ≥ 0, got -1$/)
    assert.throws(() => partitionBytes(1, 1.5, 2), /integers ≥ 0, got 1.5$/)
  })
})
