/** The host offload ring's storage (src/kv/offload.ts): cells written over in place as the ring
 *  wraps, an index that keeps naming a dropped entry in its old cell, and the load that reads the
 *  cell and finds it given up or written over (a failed load, never a loaded one). Then the live
 *  failure this gives the prefix cache, with no byte damaged by hand: a tenant's prefix dropped
 *  from a full ring and its cell written over by another tenant's page is refused with G4 on (a
 *  miss, the right K/V recomputed) and, with fault `offload-load-as-hit` and G4 off, served as a
 *  hit on the other tenant's K/V. Then properties (fast-check): under random stores, loads and
 *  deletes the ring's invariant holds, its memory stays within its bytes, and a load is a failure
 *  or exactly the bytes last stored under that key. Expected values are written by hand. */
import assert from 'node:assert/strict'
import { mkdtempSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { describe, it } from 'node:test'
import fc from 'fast-check'
import { GuardTrips, makeGuards } from '../../src/kv/guards.js'
import { OffloadDisk } from '../../src/kv/offload-disk.js'
import { OffloadRing, TieredOffload } from '../../src/kv/offload.js'
import { KvPool, type PageLease } from '../../src/kv/pool.js'
import { PrefixCache, type PrefixCacheOptions } from '../../src/kv/prefix-cache.js'

/** Pages of 4 tokens, 1 layer, 1 KV head of dim 2: a payload is K (8 floats) then V, 64 bytes. */
const pageSize = 4
const pageBytes = 64
const meta = (key: string, tenant = 'tenant-a') => ({
  key,
  tenant,
  layout: 'l',
  numTokens: pageSize,
})
const bytesOf = (seed: number, n = pageBytes) =>
  Uint8Array.from({ length: n }, (_, i) => (seed + i) & 255)

describe('offload ring: cells written over in place', () => {
  it('a dropped entry stays named in its cell; once written over, its load fails with the later bytes', () => {
    const ring = new OffloadRing({ bytes: 2 * pageBytes })
    ring.store(meta('a'), bytesOf(1))
    ring.store(meta('b'), bytesOf(2))
    // Full: c drops a (the oldest) and is written into a's cell.
    ring.store(meta('c', 'tenant-b'), bytesOf(3))
    assert.equal(ring.numPages, 2)
    assert.equal(ring.numBytes, 2 * pageBytes)
    assert.equal(ring.numStaleNames, 1)
    assert.equal(ring.peek('a'), undefined)
    const got = ring.load('a')
    assert.equal(got.kind, 'failed')
    assert.ok(got.kind === 'failed' && got.page !== undefined)
    assert.equal(got.reason, 'its ring cell was written over by a later entry')
    // The index's record of a (key, tenant) with the cell's bytes as they are now: c's.
    assert.deepEqual(
      { key: got.page.key, tenant: got.page.tenant, payload: got.page.payload },
      { key: 'a', tenant: 'tenant-a', payload: bytesOf(3) },
    )
    assert.deepEqual(ring.load('c'), {
      kind: 'loaded',
      tier: 'host',
      page: { ...meta('c', 'tenant-b'), checksum: ring.peek('c')!.checksum, payload: bytesOf(3) },
    })
    ring.check()
  })

  it('a cell given up but not yet written over: still a failed load, its bytes intact', () => {
    const ring = new OffloadRing({ bytes: 2 * pageBytes })
    ring.store(meta('a'), bytesOf(1))
    ring.store(meta('b'), bytesOf(2))
    // A page of another size cannot reuse a's cell: a is dropped, its cell forgotten for room.
    ring.store(meta('big'), bytesOf(3, 2 * pageBytes))
    assert.deepEqual([ring.load('a').kind, ring.load('b').kind], ['absent', 'absent'])
    ring.check()
    const small = new OffloadRing({ bytes: 3 * pageBytes, bytesPerTenant: pageBytes })
    small.store(meta('a'), bytesOf(1))
    small.store(meta('x', 'tenant-b'), bytesOf(9))
    // tenant-a over its one page: a is dropped, and a2's cell is a's (in place).
    small.store(meta('a2'), bytesOf(2))
    const a = small.load('a')
    assert.ok(a.kind === 'failed' && a.page !== undefined)
    assert.deepEqual(a.page.payload, bytesOf(2))
    assert.equal(small.load('x').kind, 'loaded')
    small.check()
  })

  it('delete and a new store of the same key forget the stale name', () => {
    const ring = new OffloadRing({ bytes: pageBytes })
    ring.store(meta('a'), bytesOf(1))
    ring.store(meta('b'), bytesOf(2))
    assert.equal(ring.numStaleNames, 1)
    ring.delete('a')
    assert.equal(ring.numStaleNames, 0)
    assert.equal(ring.load('a').kind, 'absent')
    ring.store(meta('c'), bytesOf(3))
    // b's stale name goes; storing b again drops c, whose name is now the stale one.
    ring.store(meta('b'), bytesOf(4))
    assert.equal(ring.numStaleNames, 1)
    assert.deepEqual(ring.peek('b')!.payload, bytesOf(4))
    assert.equal(ring.load('c').kind, 'failed')
    ring.check()
  })

  it('a cell written over twice names only its last dropped entry (the index stays bounded)', () => {
    const ring = new OffloadRing({ bytes: pageBytes })
    for (const k of ['a', 'b', 'c', 'd']) ring.store(meta(k), bytesOf(k.charCodeAt(0)))
    assert.equal(ring.numStaleNames, 1)
    assert.deepEqual(
      ['a', 'b', 'c', 'd'].map((k) => ring.load(k).kind),
      ['absent', 'absent', 'failed', 'loaded'],
    )
    ring.check()
  })

  it('tiered: a page too large for the ring replaces the ring’s older copy of its key', () => {
    const disk = OffloadDisk.open({
      dir: mkdtempSync(join(tmpdir(), 'kvfence-offload-ring-')),
      bytes: 1 << 16,
    })
    const tier = new TieredOffload({ bytes: pageBytes }, disk)
    tier.store(meta('a'), bytesOf(1))
    tier.store(meta('a'), bytesOf(2, 2 * pageBytes))
    const got = tier.load('a')
    assert.equal(got.kind, 'loaded')
    assert.ok(got.kind === 'loaded')
    assert.deepEqual([got.tier, got.page.payload], ['disk', bytesOf(2, 2 * pageBytes)])
  })

  it('tiered: a page the ring dropped (its name stale there) loads from the disk', () => {
    const disk = OffloadDisk.open({
      dir: mkdtempSync(join(tmpdir(), 'kvfence-offload-ring-')),
      bytes: 1 << 16,
    })
    const tier = new TieredOffload({ bytes: pageBytes }, disk)
    tier.store(meta('a'), bytesOf(1))
    tier.store(meta('b'), bytesOf(2))
    assert.equal(tier.upper.load('a').kind, 'failed')
    const got = tier.load('a')
    assert.ok(got.kind === 'loaded')
    assert.deepEqual([got.tier, got.page.payload], ['disk', bytesOf(1)])
    tier.check()
  })
})

/** K of float `i` of token `id` for tenant number `t` (V is its negative). */
const kOf = (t: number, id: number, i: number) => t * 100_000 + id * 10 + i

/** A pool with a 2-page cache partitioned per tenant above a ring of `ringPages` pages shared by
 *  all tenants (or split, `perTenant`). */
function setup(extra: Partial<PrefixCacheOptions>, ringPages: number, perTenant = false) {
  const trips = new GuardTrips()
  const pool = new KvPool(
    { numPages: 32, pageSize, numLayers: 1, numKvHeads: 1, headDim: 2 },
    makeGuards(true),
    trips,
  )
  const ring = new OffloadRing({
    bytes: ringPages * pageBytes,
    ...(perTenant ? { bytesPerTenant: (ringPages / 2) * pageBytes } : {}),
  })
  let lastOwner = 0
  const ids = new Map<string, number>()
  const tenantId = (name: string) => {
    if (!ids.has(name)) ids.set(name, ids.size + 1)
    return ids.get(name)!
  }
  const loads: string[] = []
  const cache = new PrefixCache(pool, {
    maxPages: 4,
    maxPagesPerTenant: 2,
    nextOwner: () => ++lastOwner,
    tenantId,
    trips,
    offload: ring,
    layout: 'l',
    onOffloadLoad: (outcome) => loads.push(outcome),
    ...extra,
  })
  const check = () => {
    pool.check()
    cache.check()
  }
  const insert = (tenant: string, tokenIds: number[]) => {
    const t = tenantId(tenant)
    const lease = pool.allocate(pool.pagesFor(tokenIds.length), ++lastOwner, t)
    pool.noteWrite(lease, 0, tokenIds.length)
    tokenIds.forEach((id, pos) => {
      const off = pool.offsetOf(lease, pos)
      for (let i = 0; i < 2; i++) {
        pool.k[0][off + i] = kOf(t, id, i)
        pool.v[0][off + i] = -kOf(t, id, i)
      }
    })
    pool.seal(lease)
    cache.insert(tenant, tokenIds, lease)
    pool.release(lease)
    check()
  }
  const ask = (tenant: string, tokenIds: number[]) => {
    const hit = cache.lookup(tenant, tokenIds)
    check()
    if (hit === null) return { numTokens: 0, k: [] as number[] }
    const lease: PageLease = pool.allocate(hit.refs.length + 1, ++lastOwner, tenantId(tenant))
    cache.copyInto(hit, lease)
    cache.release(hit)
    const k: number[] = []
    for (let pos = 0; pos < hit.numTokens; pos++) k.push(pool.k[0][pool.offsetOf(lease, pos)])
    pool.release(lease)
    check()
    return { numTokens: hit.numTokens, k }
  }
  return { ring, loads, insert, ask }
}

const tokens = (n: number, base: number) => Array.from({ length: n }, (_, i) => base + i)

describe('offload ring under the prefix cache: the ring wraps', () => {
  // A's prefix (2 pages) goes to the ring when A's next prompt takes its partition; B's prompts
  // then push 4 pages through the 4-page ring, writing over A's cells.
  const run = (extra: Partial<PrefixCacheOptions>, perTenant = false) => {
    const s = setup(extra, 4, perTenant)
    const prefix = tokens(9, 100)
    s.insert('tenant-a', prefix)
    s.insert('tenant-a', tokens(9, 200))
    for (const base of [300, 400, 500]) s.insert('tenant-b', tokens(9, base))
    return { s, got: s.ask('tenant-a', prefix) }
  }

  it('guards on, the fault injected: A’s written-over pages are refused, a miss', () => {
    const { s, got } = run({ faults: { offloadLoadAsHit: true } })
    assert.equal(s.ring.numStaleNames, 2)
    assert.deepEqual(got, { numTokens: 0, k: [] })
    assert.deepEqual(s.loads, ['refused'])
  })

  it('fault offload-load-as-hit with G4 off: A is served B’s K/V from the written-over cells', () => {
    const { s, got } = run({ faults: { offloadLoadAsHit: true }, guards: { G4: false } })
    assert.equal(got.numTokens, 8)
    // The ring took A's pages (deepest first: 104–107, then 100–103), then B's 300s; B's 400s,
    // dropped from B's partition by its 500s, were written over A's cells in the same order.
    assert.deepEqual(
      got.k,
      tokens(8, 400).map((id) => kOf(2, id, 0)),
    )
    assert.deepEqual(s.loads, ['hit', 'hit'])
  })

  it('a ring split per tenant: B never writes over A’s cells, but A’s own reload can', () => {
    const { s, got } = run({ faults: { offloadLoadAsHit: true }, guards: { G4: false } }, true)
    // Page 100–103 comes back; loading it into A's partition drops A's 204–207 into A's full
    // half of the ring, written over page 104–107's cell: that page is served A's other K/V.
    assert.deepEqual(
      got.k,
      [...tokens(4, 100), ...tokens(4, 204)].map((id) => kOf(1, id, 0)),
    )
    assert.deepEqual(s.loads, ['hit', 'hit'])
  })
})

describe('offload ring: a store refused for its size', () => {
  it('drops the older copy under its key (found by the property below, seed -1171249728)', () => {
    // 127 bytes, 64 a tenant: 64 bytes fit the tenant's bound, 65 do not.
    const ring = new OffloadRing({ bytes: 127, bytesPerTenant: 64 })
    assert.equal(ring.store(meta('k5', 't0'), new Uint8Array(64)), true)
    assert.equal(ring.store(meta('k5', 't0'), new Uint8Array(65).fill(1)), false)
    assert.equal(ring.load('k5').kind, 'absent')
    assert.equal(ring.numBytes, 0)
    ring.check()
  })
})

describe('offload ring: properties', () => {
  it('the invariant holds, memory within bytes, a load a failure or the bytes last stored', () => {
    const op = fc.oneof(
      fc.record({
        kind: fc.constant('store' as const),
        key: fc.integer({ min: 0, max: 7 }),
        tenant: fc.integer({ min: 0, max: 2 }),
        // Mostly whole pages (a ring of equal cells), sometimes other sizes.
        length: fc.oneof(fc.constant(pageBytes), fc.integer({ min: 0, max: 3 * pageBytes })),
        seed: fc.integer({ min: 0, max: 255 }),
      }),
      fc.record({ kind: fc.constant('load' as const), key: fc.integer({ min: 0, max: 7 }) }),
      fc.record({ kind: fc.constant('delete' as const), key: fc.integer({ min: 0, max: 7 }) }),
    )
    fc.assert(
      fc.property(
        fc.array(op, { maxLength: 60 }),
        fc.integer({ min: 0, max: 6 * pageBytes }),
        fc.boolean(),
        (ops, bytes, isPerTenant) => {
          const ring = new OffloadRing({
            bytes,
            ...(isPerTenant ? { bytesPerTenant: Math.ceil(bytes / 2) } : {}),
          })
          const last = new Map<string, { tenant: string; payload: Uint8Array }>()
          for (const o of ops) {
            const key = `k${o.key}`
            if (o.kind === 'store') {
              const payload = Uint8Array.from({ length: o.length }, (_, i) => (o.seed + i) & 255)
              const tenant = `t${o.tenant}`
              if (ring.store(meta(key, tenant), payload)) last.set(key, { tenant, payload })
              else last.delete(key)
            } else if (o.kind === 'load') {
              const got = ring.load(key)
              if (got.kind === 'loaded') {
                const want = last.get(key)
                assert.ok(want, `${key} loaded after it was deleted`)
                assert.deepEqual(
                  [got.page.key, got.page.tenant, got.page.payload],
                  [key, want.tenant, want.payload],
                )
              }
            } else {
              ring.delete(key)
              last.delete(key)
              assert.equal(ring.load(key).kind, 'absent')
            }
            ring.check()
            assert.ok(ring.numBytes <= bytes)
          }
        },
      ),
      { numRuns: 200 },
    )
  })
})
