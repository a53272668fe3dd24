/** The KV pool's guards (DESIGN.md §3, §4): G5 ownership, epoch and fill on every read and write,
 *  G6 scrub on free, G7 deferred release; epochs, LIFO reuse, capacity and `check()`.
 *  Each guard test also runs the same steps with that guard off (or the matching fault on) and
 *  shows the bug class it rules out. Expected values are worked out by hand in the comments. */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import { KvfenceError } from '../../src/common/errors.js'
import {
  GuardError,
  GuardTrips,
  makeGuards,
  type GuardId,
  type Guards,
} from '../../src/kv/guards.js'
import {
  KvPool,
  PageState,
  type PageLease,
  type PageRef,
  type PoolFaults,
} from '../../src/kv/pool.js'

/** 6 pages of 4 tokens, 2 layers, 1 KV head of dim 2: 8 floats per page per layer. */
const shape = { numPages: 6, pageSize: 4, numLayers: 2, numKvHeads: 1, headDim: 2 }

function guardsWithout(...off: GuardId[]): Guards {
  const guards: Record<string, boolean> = { ...makeGuards(true) }
  for (const id of off) guards[id] = false
  return Object.freeze(guards) as Guards
}

function makePool(opts: { off?: GuardId[]; faults?: PoolFaults } = {}) {
  const trips = new GuardTrips()
  const pool = new KvPool(shape, guardsWithout(...(opts.off ?? [])), trips, opts.faults ?? {})
  return { pool, trips }
}

/** The value written for `layer`, float `i` of the token at `pos`, tagged by `tag` (K positive, V negative). */
function kValue(tag: number, layer: number, pos: number, i: number): number {
  return tag * 1000 + layer * 100 + pos * 2 + i
}

/** Claim positions [start, start + n) and write their K/V in every layer, as the forward pass does. */
function writeTokens(
  pool: KvPool,
  table: PageLease,
  owner: number,
  start: number,
  n: number,
  tag: number,
) {
  pool.noteWrite(by(owner, table), start, n)
  for (let pos = start; pos < start + n; pos++) {
    const off = pool.offsetOf(table, pos)
    for (let layer = 0; layer < shape.numLayers; layer++) {
      for (let i = 0; i < pool.tokenStride; i++) {
        pool.k[layer][off + i] = kValue(tag, layer, pos, i)
        pool.v[layer][off + i] = -kValue(tag, layer, pos, i)
      }
    }
  }
}

/** Every float of one page, K then V, layer by layer. */
function pageFloats(pool: KvPool, page: number): number[] {
  const out: number[] = []
  for (let layer = 0; layer < shape.numLayers; layer++) {
    const start = page * pool.pageStride
    out.push(...pool.k[layer].subarray(start, start + pool.pageStride))
    out.push(...pool.v[layer].subarray(start, start + pool.pageStride))
  }
  return out
}

/** What `writeTokens(…, tag)` over a whole page at ordinal `ordinal` leaves in it. */
function expectedPage(tag: number, ordinal: number): number[] {
  const out: number[] = []
  for (let layer = 0; layer < shape.numLayers; layer++) {
    const positions = [0, 1, 2, 3].map((slot) => ordinal * shape.pageSize + slot)
    out.push(
      ...positions.flatMap((pos) => [kValue(tag, layer, pos, 0), kValue(tag, layer, pos, 1)]),
    )
    out.push(
      ...positions.flatMap((pos) => [-kValue(tag, layer, pos, 0), -kValue(tag, layer, pos, 1)]),
    )
  }
  return out
}

/** `pages` (a lease's, or any) presented to the pool as owner `owner`'s: how a stale or another
 *  request's page table reaches the pool, which trusts no lease. */
function by(owner: number, pages: PageLease | readonly PageRef[]): PageLease {
  return { owner, tenant: 0, pages: 'pages' in pages ? pages.pages : pages }
}

function isGuardTrip(guard: GuardId, message: RegExp) {
  return (err: unknown) => {
    assert.ok(err instanceof GuardError, `expected a GuardError, got ${String(err)}`)
    assert.equal(err.guard, guard)
    assert.equal(err.code, 'guard_violation')
    assert.match(err.message, message)
    return true
  }
}

describe('KV pool G5: ownership, epoch and fill on every read and write', () => {
  it('refuses a read through another request’s pages', () => {
    const { pool, trips } = makePool()
    const victim = pool.allocate(1, 1, 10)
    writeTokens(pool, victim, 1, 0, 4, 1)
    assert.throws(
      () => pool.checkRead(by(2, victim), 4),
      isGuardTrip('G5', /^G5: read of page 0 by owner 2, but it belongs to 1$/),
    )
    assert.equal(trips.counts.G5, 1)
    pool.checkRead(victim, 4) // the owner itself may read

    // G5 off: the same read goes through, the cross-tenant leak.
    const off = makePool({ off: ['G5'] })
    const page = off.pool.allocate(1, 1, 10)
    writeTokens(off.pool, page, 1, 0, 4, 1)
    off.pool.checkRead(by(2, page), 4)
    assert.equal(off.trips.counts.G5, 0)
  })

  it('refuses a read at a stale epoch once the page was freed and reallocated', () => {
    // The same request slot (owner 1) gets page 0 back: only the epoch tells the two apart.
    const { pool } = makePool()
    const old = pool.allocate(1, 1, 10)
    assert.deepEqual(old.pages, [{ page: 0, epoch: 1 }])
    writeTokens(pool, old, 1, 0, 4, 1)
    pool.release(old)
    const now = pool.allocate(1, 1, 20)
    assert.deepEqual(now.pages, [{ page: 0, epoch: 2 }])
    writeTokens(pool, now, 1, 0, 4, 2)
    assert.throws(
      () => pool.checkRead(old, 4),
      isGuardTrip('G5', /^G5: read of page 0 at epoch 1, but it is at epoch 2$/),
    )
    pool.checkRead(now, 4)

    // G5 off: the stale table reads the page's new contents (tenant 20's KV).
    const off = makePool({ off: ['G5'] })
    const stale = off.pool.allocate(1, 1, 10)
    off.pool.release(stale)
    writeTokens(off.pool, off.pool.allocate(1, 1, 20), 1, 0, 4, 2)
    off.pool.checkRead(stale, 4)
  })

  it('refuses a read beyond the fill (unwritten KV) and beyond the page table', () => {
    const { pool } = makePool()
    const table = pool.allocate(2, 1, 10) // pages 0, 1
    writeTokens(pool, table, 1, 0, 5, 1) // page 0 holds 4 tokens, page 1 holds 1
    assert.deepEqual([pool.fill[0], pool.fill[1]], [4, 1])
    pool.checkRead(table, 5)
    assert.throws(
      () => pool.checkRead(table, 6),
      isGuardTrip('G5', /^G5: page 1 holds 1 tokens; owner 1 reads 2 \(unwritten KV\)$/),
    )
    assert.throws(
      () => pool.checkRead(table, 9),
      isGuardTrip('G5', /^G5: read of 9 tokens beyond the page table \(2 pages\)$/),
    )

    const off = makePool({ off: ['G5'] })
    const offTable = off.pool.allocate(2, 1, 10)
    writeTokens(off.pool, offTable, 1, 0, 5, 1)
    off.pool.checkRead(offTable, 8) // reads 3 positions nobody wrote
  })

  it('refuses a write into a sealed page and leaves its fill', () => {
    const { pool } = makePool()
    const table = pool.allocate(1, 1, 10)
    writeTokens(pool, table, 1, 0, 2, 1)
    pool.seal(table)
    assert.equal(pool.state[0], PageState.sealed)
    assert.throws(
      () => pool.noteWrite(table, 2, 1),
      isGuardTrip('G5', /^G5: page 0 is sealed; owner 1 may not write it$/),
    )
    assert.equal(pool.fill[0], 2)

    const off = makePool({ off: ['G5'] })
    const offTable = off.pool.allocate(1, 1, 10)
    writeTokens(off.pool, offTable, 1, 0, 2, 1)
    off.pool.seal(offTable)
    off.pool.noteWrite(offTable, 2, 1)
    assert.equal(off.pool.fill[0], 3)
  })

  it('refuses a write into another owner’s page and leaves its fill', () => {
    const { pool } = makePool()
    const victim = pool.allocate(1, 1, 10)
    writeTokens(pool, victim, 1, 0, 2, 1)
    assert.throws(
      () => pool.noteWrite(by(2, victim), 2, 1),
      isGuardTrip('G5', /^G5: write of page 0 by owner 2, but it belongs to 1$/),
    )
    assert.equal(pool.fill[0], 2)
    // Nor may another owner seal or pin it.
    assert.throws(
      () => pool.seal(by(2, victim)),
      isGuardTrip('G5', /^G5: seal of page 0 by owner 2/),
    )
    assert.throws(() => pool.pin(by(2, victim)), isGuardTrip('G5', /^G5: pin of page 0 by owner 2/))
    assert.deepEqual([pool.state[0], pool.pins[0]], [PageState.reserved, 0])

    const off = makePool({ off: ['G5'] })
    const offVictim = off.pool.allocate(1, 1, 10)
    writeTokens(off.pool, offVictim, 1, 0, 2, 1)
    off.pool.noteWrite(by(2, offVictim), 2, 1)
    assert.equal(off.pool.fill[0], 3)
  })

  it('refuses a write that would leave unwritten positions below the fill (the placeholder case)', () => {
    // Tenant 10 fills page 0 and leaves; with skip-scrub its KV stays in the page. Tenant 20 gets the
    // page, a one-token placeholder lands at position 0, and decode then writes position 3. Had the
    // pool accepted that write, fill would be 4 and positions 1 and 2 (tenant 10's KV) readable.
    const { pool } = makePool({ faults: { skipScrub: true } })
    const first = pool.allocate(1, 1, 10)
    writeTokens(pool, first, 1, 0, 4, 1)
    pool.release(first)
    const second = pool.allocate(1, 2, 20)
    writeTokens(pool, second, 2, 0, 1, 2)
    assert.throws(
      () => pool.noteWrite(second, 3, 1),
      isGuardTrip('G5', /^G5: write at position 3 leaves positions 1\.\.2 of page 0 unwritten$/),
    )
    assert.equal(pool.fill[0], 1)
    assert.throws(
      () => pool.checkRead(second, 4),
      isGuardTrip('G5', /holds 1 tokens; owner 2 reads 4/),
    )
    // Contiguous writes, rewrites below the fill and a later page first are all fine.
    writeTokens(pool, second, 2, 1, 2, 2)
    writeTokens(pool, second, 2, 0, 3, 2)
    assert.equal(pool.fill[0], 3)
    const more = by(2, [...second.pages, ...pool.allocate(1, 2, 20).pages])
    writeTokens(pool, more, 2, 4, 4, 2) // page ordinal 1 before the end of page ordinal 0
    writeTokens(pool, more, 2, 3, 1, 2)
    pool.checkRead(more, 8)
    assert.deepEqual(pageFloats(pool, more.pages[1].page), expectedPage(2, 1))
  })

  it('a refused write changes no fill, so the positions it named stay unreadable', () => {
    const { pool } = makePool()
    const table = pool.allocate(1, 1, 10)
    writeTokens(pool, table, 1, 0, 2, 1)
    // Positions 2..5: 2 and 3 are on page 0, 4 and 5 beyond the one-page table.
    assert.throws(
      () => pool.noteWrite(table, 2, 4),
      isGuardTrip('G5', /^G5: write at position 4 beyond the page table \(1 pages\)$/),
    )
    assert.equal(pool.fill[0], 2)
    assert.throws(
      () => pool.checkRead(table, 4),
      isGuardTrip('G5', /holds 2 tokens; owner 1 reads 4/),
    )
  })

  it('a refused release frees nothing', () => {
    const { pool } = makePool()
    const table = pool.allocate(2, 1, 10) // pages 0, 1
    pool.release(by(1, [table.pages[0]])) // page 0 goes back early …
    assert.deepEqual(pool.allocate(1, 2, 20).pages, [{ page: 0, epoch: 2 }]) // … and now is owner 2's
    assert.throws(
      () => pool.release(table),
      isGuardTrip('G5', /^G5: owner 1 released page 0 it does not own$/),
    )
    assert.deepEqual([pool.owner[0], pool.owner[1]], [2, 1])
    assert.deepEqual([pool.state[0], pool.state[1]], [PageState.reserved, PageState.reserved])
    assert.equal(pool.numFree, 4)
    // A table naming the same page twice is refused too, before anything is freed.
    assert.throws(
      () => pool.release(by(1, [table.pages[1], table.pages[1]])),
      isGuardTrip('G5', /released page 1/),
    )
    assert.equal(pool.owner[1], 1)
    pool.check()
    pool.release(by(1, [table.pages[1]]))
    assert.equal(pool.numFree, 5)
    pool.check()
  })
})

describe('KV pool size', () => {
  it('a pool too large to allocate is a RangeError naming its size and the fix', () => {
    const huge = { ...shape, numPages: 2 ** 31 }
    assert.throws(() => new KvPool(huge, guardsWithout()), {
      name: 'RangeError',
      message:
        /^a KV pool of 2147483648 pages × 4 tokens needs 256\.0 GiB \(.*\): give fewer or smaller pages$/,
    })
  })
})

describe('KV pool G6: scrub on free', () => {
  it('a fresh pool holds the poison value in every page, as if each had been scrubbed', () => {
    const { pool } = makePool()
    for (let page = 0; page < shape.numPages; page++) {
      const floats = pageFloats(pool, page)
      assert.equal(floats.length, 2 * 2 * 8) // layers × (K, V) × floats per page
      assert.ok(
        floats.every((x) => Number.isNaN(x)),
        `page ${page}: ${floats}`,
      )
    }
    // With G6 off nothing is scrubbed, not even at start-up: zeros, as fresh memory holds.
    const { pool: unscrubbed } = makePool({ off: ['G6'] })
    assert.deepEqual(pageFloats(unscrubbed, 5), new Array(2 * 2 * 8).fill(0))
  })

  it('after release every float of the page’s K and V in every layer is NaN; other pages keep theirs', () => {
    const { pool } = makePool()
    const table = pool.allocate(2, 1, 10) // pages 0, 1
    const other = pool.allocate(1, 2, 20) // page 2
    writeTokens(pool, table, 1, 0, 8, 1)
    writeTokens(pool, other, 2, 0, 4, 2)
    assert.deepEqual(pageFloats(pool, 0), expectedPage(1, 0))
    assert.deepEqual(pageFloats(pool, 1), expectedPage(1, 1))
    pool.release(table)
    for (const page of [0, 1]) {
      const floats = pageFloats(pool, page)
      assert.equal(floats.length, 2 * 2 * 8) // layers × (K, V) × floats per page
      assert.ok(
        floats.every((x) => Number.isNaN(x)),
        `page ${page}: ${floats}`,
      )
    }
    assert.deepEqual(pageFloats(pool, 2), expectedPage(2, 0))
  })

  it('with G6 off, or the skip-scrub fault, the old values remain', () => {
    for (const opts of [{ off: ['G6'] as GuardId[] }, { faults: { skipScrub: true } }]) {
      const { pool } = makePool(opts)
      const table = pool.allocate(2, 1, 10)
      writeTokens(pool, table, 1, 0, 8, 1)
      pool.release(table)
      assert.deepEqual(pageFloats(pool, 0), expectedPage(1, 0))
      assert.deepEqual(pageFloats(pool, 1), expectedPage(1, 1))
    }
  })
})

describe('KV pool G7: deferred release', () => {
  it('release while pinned throws and leaves the pages owned; after unpin it goes through', () => {
    const { pool, trips } = makePool()
    const table = pool.allocate(2, 1, 10)
    writeTokens(pool, table, 1, 0, 6, 1)
    pool.pin(table)
    pool.pin(by(1, table.pages.slice(1))) // a second transfer on page 1
    assert.equal(pool.isPinned(table), true)
    const expectRefused = () => {
      assert.throws(
        () => pool.release(table),
        isGuardTrip('G7', /^G7: owner 1 released pages while a transfer is in flight$/),
      )
      assert.deepEqual([...pool.owner.subarray(0, 2)], [1, 1])
      assert.deepEqual([...pool.state.subarray(0, 2)], [PageState.reserved, PageState.reserved])
      assert.deepEqual([...pool.fill.subarray(0, 2)], [4, 2])
      assert.deepEqual(pageFloats(pool, 0), expectedPage(1, 0))
      assert.equal(pool.numFree, 4)
      pool.check()
    }
    expectRefused()
    pool.unpin(table)
    assert.deepEqual([...pool.pins.subarray(0, 2)], [0, 1])
    expectRefused() // page 1 still has a transfer in flight
    assert.equal(trips.counts.G7, 2)
    pool.unpin(by(1, table.pages.slice(1)))
    assert.equal(pool.isPinned(table), false)
    pool.release(table)
    assert.deepEqual([...pool.state.subarray(0, 2)], [PageState.free, PageState.free])
    assert.equal(pool.numFree, 6)
    pool.check()
  })

  it('with G7 off the release of a pinned page goes through (the early-release bug class)', () => {
    const { pool } = makePool({ off: ['G7'] })
    const table = pool.allocate(1, 1, 10)
    pool.pin(table)
    pool.release(table)
    assert.equal(pool.state[0], PageState.free)
    assert.throws(() => pool.check(), /free page 0 is pinned/)
    // The next request gets the page while the transfer may still write into it.
    assert.deepEqual(pool.allocate(1, 2, 20).pages, [{ page: 0, epoch: 2 }])
    assert.equal(pool.pins[0], 1)
  })
})

describe('KV pool allocation', () => {
  it('bumps a page’s epoch on every allocation: 1 at first, 2 after free and reallocation', () => {
    const { pool } = makePool()
    assert.deepEqual(pool.allocate(1, 1, 10).pages, [{ page: 0, epoch: 1 }])
    assert.equal(pool.epoch[0], 1)
    pool.release(by(1, [{ page: 0, epoch: 1 }]))
    assert.equal(pool.epoch[0], 1) // freeing does not bump
    assert.deepEqual(pool.allocate(1, 3, 30).pages, [{ page: 0, epoch: 2 }])
    assert.equal(pool.epoch[0], 2)
    assert.equal(pool.epoch[1], 0) // never allocated

    // stale-epoch fault: the page comes back at epoch 0 both times, so an old table still matches.
    const stale = makePool({ faults: { staleEpoch: true } }).pool
    const old = stale.allocate(1, 1, 10)
    assert.deepEqual(old.pages, [{ page: 0, epoch: 0 }])
    stale.release(old)
    const now = stale.allocate(1, 1, 20)
    assert.deepEqual(now.pages, [{ page: 0, epoch: 0 }])
    writeTokens(stale, now, 1, 0, 4, 2)
    stale.checkRead(old, 4)
  })

  it('reuses freed pages LIFO: a table freed as [a, b, c] is allocated again as [a, b, c]', () => {
    // Free list (popped from the right): [5 4 3 2 1 0]. Owners 1, 2, 3 take [0 1], [2 3], [4 5].
    // Release 1 pushes 1, 0 → [1 0]; release 3 pushes 5, 4 → [1 0 5 4]. Owner 4 pops [4 5 0].
    const { pool } = makePool()
    assert.deepEqual(
      pool.allocate(2, 1, 10).pages.map((r) => r.page),
      [0, 1],
    )
    assert.deepEqual(
      pool.allocate(2, 2, 20).pages.map((r) => r.page),
      [2, 3],
    )
    assert.deepEqual(
      pool.allocate(2, 3, 30).pages.map((r) => r.page),
      [4, 5],
    )
    pool.release(pool.allocate(0, 9, 9)) // an empty table is a no-op
    pool.release(
      by(1, [
        { page: 0, epoch: 1 },
        { page: 1, epoch: 1 },
      ]),
    )
    pool.release(
      by(3, [
        { page: 4, epoch: 1 },
        { page: 5, epoch: 1 },
      ]),
    )
    const abc = pool.allocate(3, 4, 40)
    assert.deepEqual(abc.pages, [
      { page: 4, epoch: 2 },
      { page: 5, epoch: 2 },
      { page: 0, epoch: 2 },
    ])
    pool.release(abc)
    assert.deepEqual(pool.allocate(3, 5, 50).pages, [
      { page: 4, epoch: 3 },
      { page: 5, epoch: 3 },
      { page: 0, epoch: 3 },
    ])
    assert.deepEqual(pool.allocate(1, 6, 60).pages, [{ page: 1, epoch: 2 }])
    pool.check()
  })

  it('throws capacity_exhausted when too few pages are free, and allocates nothing', () => {
    const { pool } = makePool()
    pool.allocate(4, 1, 10)
    assert.equal(pool.canAllocate(3), false)
    assert.throws(
      () => pool.allocate(3, 2, 20),
      (err: unknown) =>
        err instanceof KvfenceError &&
        err.code === 'capacity_exhausted' &&
        err.status === 503 &&
        err.message === 'KV pool has 2 free pages, 3 needed',
    )
    assert.equal(pool.numFree, 2)
    assert.deepEqual([...pool.owner], [1, 1, 1, 1, 0, 0])
    assert.deepEqual([...pool.epoch], [1, 1, 1, 1, 0, 0])
    pool.check()
    assert.deepEqual(pool.allocate(2, 2, 20).pages, [
      { page: 4, epoch: 1 },
      { page: 5, epoch: 1 },
    ])
    assert.equal(pool.capacityTokens, 24)
    assert.equal(pool.pagesFor(9), 3)
  })
})

describe('KV pool check()', () => {
  /** Pages 0, 1 owned by 1 (0 pinned, written), 2 by 2; 3, 4, 5 free. */
  function populated(): KvPool {
    const { pool } = makePool()
    const table = pool.allocate(2, 1, 10)
    writeTokens(pool, table, 1, 0, 6, 1)
    pool.pin(by(1, table.pages.slice(0, 1)))
    pool.allocate(1, 2, 20)
    pool.check()
    return pool
  }
  const freeListOf = (pool: KvPool) => (pool as unknown as { freeList: number[] }).freeList

  const corruptions: [string, (pool: KvPool) => void, RegExp][] = [
    [
      'a free page marked reserved',
      (p) => (p.state[4] = PageState.reserved),
      /owned page 4 is on the free list/,
    ],
    [
      'an owned page marked free',
      (p) => (p.state[2] = PageState.free),
      /free page 2 is not on the free list/,
    ],
    ['an owner on a free page', (p) => (p.owner[5] = 7), /free page 5 has owner 7/],
    ['an owned page without owner', (p) => (p.owner[2] = 0), /owned page 2 has no owner/],
    ['a pin on a free page', (p) => (p.pins[3] = 1), /free page 3 is pinned/],
    ['a fill on a free page', (p) => (p.fill[3] = 2), /free page 3 has fill 2/],
    ['a fill beyond the page size', (p) => (p.fill[1] = 5), /page 1 fill 5 > page size 4/],
    [
      'a page on the free list twice',
      (p) => freeListOf(p).push(4),
      /page 4 is on the free list twice/,
    ],
    [
      'a page outside the pool on the free list',
      (p) => freeListOf(p).push(6),
      /free list holds page 6 outside the pool/,
    ],
    [
      'an owned page on the free list',
      (p) => freeListOf(p).push(1),
      /owned page 1 is on the free list/,
    ],
    [
      'a free page missing from the free list',
      (p) => freeListOf(p).shift(),
      /free page 5 is not on the free list/,
    ],
  ]
  for (const [what, corrupt, message] of corruptions) {
    it(`catches ${what}`, () => {
      const pool = populated()
      corrupt(pool)
      assert.throws(() => pool.check(), message)
    })
  }
})
