/** Model-based test of the KV pool: random sequences of allocate / write / seal / pin / unpin /
 *  release / read by several owners of several tenants, own and cross-owner, and through stale page
 *  tables, against an independent model of who owns what. The model predicts each operation's
 *  outcome (which pages and epochs an allocation returns, which guard refuses what); after every
 *  step the pool must agree with it and keep its invariants (DESIGN.md §3, G5, G6, G7). */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import fc from 'fast-check'
import { KvfenceError } from '../../src/common/errors.js'
import { GuardError, makeGuards, type GuardId } from '../../src/kv/guards.js'
import { KvPool, PageState, type PageLease, type PageRef } from '../../src/kv/pool.js'

const shape = { numPages: 12, pageSize: 4, numLayers: 2, numKvHeads: 1, headDim: 2 }
const { numPages, pageSize, numLayers } = shape
const tokenStride = shape.numKvHeads * shape.headDim
const owners = [1, 2, 3, 4, 5]
/** Owners 1, 2 are tenant 1; 3, 4 tenant 2; 5 tenant 3. */
const tenantOf = (owner: number) => (owner <= 2 ? 1 : owner <= 4 ? 2 : 3)

/** A page table presented to the pool as `owner`'s (the model keeps each owner's pages, from all its
 *  allocations, as one table; the pool trusts no lease and checks every page). */
const by = (owner: number, pages: readonly PageRef[]): PageLease => ({
  owner,
  tenant: tenantOf(owner),
  pages,
})

type Action =
  | { kind: 'allocate'; actor: number; numPages: number }
  /** `tableOf` null: the actor's own table; else another owner's (a cross-owner attempt). */
  | { kind: 'write'; actor: number; tableOf: number | null; delta: number; numTokens: number }
  | { kind: 'read'; actor: number; tableOf: number | null; delta: number }
  | { kind: 'seal'; actor: number; tableOf: number | null }
  | { kind: 'pin'; actor: number; tableOf: number | null }
  | { kind: 'unpin'; actor: number }
  | { kind: 'release'; actor: number; tableOf: number | null }
  | { kind: 'stale'; index: number; op: 'read' | 'write' | 'seal' | 'release' }

const ownerArb = fc.constantFrom(...owners)
const tableOfArb = fc.oneof(
  { weight: 4, arbitrary: fc.constant(null) },
  { weight: 1, arbitrary: ownerArb },
)
/** Offset from the table's write frontier: mostly at it, sometimes below (rewrite) or past it (hole). */
const deltaArb = (min: number, max: number) =>
  fc.oneof(
    { weight: 2, arbitrary: fc.constant(0) },
    { weight: 1, arbitrary: fc.integer({ min, max }) },
  )
const actionArb: fc.Arbitrary<Action> = fc.oneof(
  {
    weight: 4,
    arbitrary: fc.record({
      kind: fc.constant('allocate' as const),
      actor: ownerArb,
      numPages: fc.integer({ min: 1, max: 5 }),
    }),
  },
  {
    weight: 6,
    arbitrary: fc.record({
      kind: fc.constant('write' as const),
      actor: ownerArb,
      tableOf: tableOfArb,
      delta: deltaArb(-3, 2),
      numTokens: fc.integer({ min: 1, max: 5 }),
    }),
  },
  {
    weight: 4,
    arbitrary: fc.record({
      kind: fc.constant('read' as const),
      actor: ownerArb,
      tableOf: tableOfArb,
      delta: deltaArb(-4, 1),
    }),
  },
  {
    weight: 1,
    arbitrary: fc.record({
      kind: fc.constant('seal' as const),
      actor: ownerArb,
      tableOf: tableOfArb,
    }),
  },
  {
    weight: 1,
    arbitrary: fc.record({
      kind: fc.constant('pin' as const),
      actor: ownerArb,
      tableOf: tableOfArb,
    }),
  },
  { weight: 1, arbitrary: fc.record({ kind: fc.constant('unpin' as const), actor: ownerArb }) },
  {
    weight: 1,
    arbitrary: fc.record({
      kind: fc.constant('release' as const),
      actor: ownerArb,
      tableOf: tableOfArb,
    }),
  },
  {
    weight: 1,
    arbitrary: fc.record({
      kind: fc.constant('stale' as const),
      index: fc.nat(),
      op: fc.constantFrom('read' as const, 'write' as const, 'seal' as const, 'release' as const),
    }),
  },
)

/** What the pool should hold, kept without looking at the pool. */
class Model {
  /** Free pages, next allocation from the end (LIFO; the pool starts with 0 at the end). */
  readonly free = Array.from({ length: numPages }, (_, i) => numPages - 1 - i)
  readonly owner = new Array<number>(numPages).fill(0)
  /** Times each page was allocated: the epoch its current owner must present. */
  readonly numAllocations = new Array<number>(numPages).fill(0)
  readonly isSealed = new Array<boolean>(numPages).fill(false)
  readonly fill = new Array<number>(numPages).fill(0)
  readonly pins = new Array<number>(numPages).fill(0)
  /** Tag of the write that last wrote each token slot `[page × pageSize + slot]`. */
  readonly written = new Array<number>(numPages * pageSize).fill(0)
  /** Each owner's live page table. */
  readonly tables = new Map<number, PageRef[]>(owners.map((o) => [o, []]))
  /** Tables released earlier, with the owner that held them. */
  readonly stale: { owner: number; table: PageRef[] }[] = []
  numWrites = 0

  isOwnedBy(ref: PageRef, owner: number): boolean {
    return this.owner[ref.page] === owner && this.numAllocations[ref.page] === ref.epoch
  }

  /** The first position of the table not yet written (positions below it may still have holes). */
  frontier(table: readonly PageRef[]): number {
    for (let ordinal = 0; ordinal < table.length; ordinal++) {
      const fill = this.fill[table[ordinal].page]
      if (fill < pageSize) return ordinal * pageSize + fill
    }
    return table.length * pageSize
  }

  /** Whether `actor` may note a write of [start, start + n) through `table` (the G5 rules). */
  mayWrite(table: readonly PageRef[], actor: number, start: number, n: number): boolean {
    for (let pos = start; pos < start + n; pos++) {
      const ordinal = Math.floor(pos / pageSize)
      const ref = table[ordinal]
      if (ref === undefined || !this.isOwnedBy(ref, actor) || this.isSealed[ref.page]) return false
      // A write may start at most at the page's fill: no holes below it.
      if (pos === start && pos % pageSize > this.fill[ref.page]) return false
    }
    return true
  }

  /** Whether `actor` may read [0, n) through `table` (the G5 rules). */
  mayRead(table: readonly PageRef[], actor: number, n: number): boolean {
    for (let pos = 0; pos < n; pos++) {
      const ref = table[Math.floor(pos / pageSize)]
      if (ref === undefined || !this.isOwnedBy(ref, actor)) return false
      if (this.fill[ref.page] <= pos % pageSize) return false
    }
    return true
  }
}

/** `fn` must throw the given guard's error (or, for 'capacity', capacity_exhausted). */
function expectRefusal(fn: () => void, guard: GuardId | 'capacity', what: string, seen: Coverage) {
  seen[guard] = (seen[guard] ?? 0) + 1
  assert.throws(
    fn,
    (err: unknown) => {
      if (guard === 'capacity')
        return err instanceof KvfenceError && err.code === 'capacity_exhausted'
      assert.ok(err instanceof GuardError, `${what}: expected a ${guard} trip, got ${String(err)}`)
      assert.equal(err.guard, guard, `${what}: ${err.message}`)
      return true
    },
    `${what} should be refused by ${guard}`,
  )
}

/** How often each outcome happened over all runs, so that the test can show it was exercised. */
type Outcome =
  'allocated' | 'capacity' | 'wrote' | 'read' | 'released' | 'pinned' | GuardId | 'stale'
type Coverage = Record<string, number>

function step(pool: KvPool, model: Model, action: Action, seen: Coverage): void {
  const note = (outcome: Outcome) => (seen[outcome] = (seen[outcome] ?? 0) + 1)
  const tableOf = (actor: number, other: number | null) => model.tables.get(other ?? actor)!
  switch (action.kind) {
    case 'allocate': {
      const { actor, numPages: n } = action
      if (n > model.free.length) {
        expectRefusal(() => pool.allocate(n, actor, tenantOf(actor)), 'capacity', 'allocate', seen)
        return
      }
      const expected: PageRef[] = []
      for (let i = 0; i < n; i++) {
        const page = model.free.pop()!
        model.numAllocations[page] += 1
        model.owner[page] = actor
        model.isSealed[page] = false
        model.fill[page] = 0
        expected.push({ page, epoch: model.numAllocations[page] })
      }
      assert.deepEqual(pool.allocate(n, actor, tenantOf(actor)), {
        owner: actor,
        tenant: tenantOf(actor),
        pages: expected,
      })
      note('allocated')
      model.tables.get(actor)!.push(...expected)
      return
    }
    case 'write': {
      const { actor, delta, numTokens: n } = action
      const table = tableOf(actor, action.tableOf)
      const start = Math.max(0, model.frontier(table) + delta)
      if (!model.mayWrite(table, actor, start, n)) {
        expectRefusal(
          () => pool.noteWrite(by(actor, table), start, n),
          'G5',
          `write [${start}, ${start + n})`,
          seen,
        )
        return
      }
      pool.noteWrite(by(actor, table), start, n)
      note('wrote')
      // Write the KV as the forward pass would, tagged so that a later read can tell whose it is.
      const tag = ++model.numWrites
      for (let pos = start; pos < start + n; pos++) {
        const ref = table[Math.floor(pos / pageSize)]
        const off = pool.offsetOf(by(actor, table), pos)
        assert.equal(off, (ref.page * pageSize + (pos % pageSize)) * tokenStride)
        for (let layer = 0; layer < numLayers; layer++) {
          for (let i = 0; i < tokenStride; i++) {
            pool.k[layer][off + i] = tag * 8 + layer * 2 + i
            pool.v[layer][off + i] = -(tag * 8 + layer * 2 + i)
          }
        }
        model.written[ref.page * pageSize + (pos % pageSize)] = tag
        model.fill[ref.page] = Math.max(model.fill[ref.page], (pos % pageSize) + 1)
      }
      return
    }
    case 'read': {
      const { actor, delta } = action
      const table = tableOf(actor, action.tableOf)
      const n = Math.max(1, model.frontier(table) + delta)
      if (!model.mayRead(table, actor, n)) {
        expectRefusal(() => pool.checkRead(by(actor, table), n), 'G5', `read of ${n} tokens`, seen)
        return
      }
      pool.checkRead(by(actor, table), n)
      note('read')
      // Everything the read may touch is the reader's, at the epoch it holds, and what it wrote.
      for (let pos = 0; pos < n; pos++) {
        const ref = table[Math.floor(pos / pageSize)]
        assert.equal(
          pool.owner[ref.page],
          actor,
          `read touched page ${ref.page} of owner ${pool.owner[ref.page]}`,
        )
        assert.equal(pool.epoch[ref.page], ref.epoch)
        assert.equal(pool.tenant[ref.page], tenantOf(actor))
        const tag = model.written[ref.page * pageSize + (pos % pageSize)]
        const off = pool.offsetOf(by(actor, table), pos)
        for (let layer = 0; layer < numLayers; layer++) {
          for (let i = 0; i < tokenStride; i++) {
            assert.equal(pool.k[layer][off + i], tag * 8 + layer * 2 + i, `K at position ${pos}`)
            assert.equal(pool.v[layer][off + i], -(tag * 8 + layer * 2 + i), `V at position ${pos}`)
          }
        }
      }
      return
    }
    case 'seal': {
      const { actor } = action
      const table = tableOf(actor, action.tableOf)
      if (table.length > 0 && !table.every((ref) => model.isOwnedBy(ref, actor))) {
        expectRefusal(() => pool.seal(by(actor, table)), 'G5', 'cross-owner seal', seen)
        return
      }
      pool.seal(by(actor, table))
      for (const ref of table) model.isSealed[ref.page] = true
      return
    }
    case 'pin': {
      const { actor } = action
      const table = tableOf(actor, action.tableOf)
      if (table.length > 0 && !table.every((ref) => model.isOwnedBy(ref, actor))) {
        expectRefusal(() => pool.pin(by(actor, table)), 'G5', 'cross-owner pin', seen)
        return
      }
      pool.pin(by(actor, table))
      note('pinned')
      for (const ref of table) model.pins[ref.page] += 1
      return
    }
    case 'unpin': {
      const table = model.tables.get(action.actor)!
      // Unpinning more often than pinning is a programming error (an assert), not a guard: skip.
      if (!table.every((ref) => model.pins[ref.page] > 0)) return
      pool.unpin(by(action.actor, table))
      for (const ref of table) model.pins[ref.page] -= 1
      return
    }
    case 'release': {
      const { actor } = action
      const table = tableOf(actor, action.tableOf)
      if (table.some((ref) => model.pins[ref.page] > 0)) {
        expectRefusal(() => pool.release(by(actor, table)), 'G7', 'release of pinned pages', seen)
        return
      }
      if (!table.every((ref) => model.isOwnedBy(ref, actor))) {
        expectRefusal(() => pool.release(by(actor, table)), 'G5', 'cross-owner release', seen)
        return
      }
      pool.release(by(actor, table))
      note('released')
      for (let i = table.length - 1; i >= 0; i--) {
        const { page } = table[i]
        model.owner[page] = 0
        model.isSealed[page] = false
        model.fill[page] = 0
        model.free.push(page)
      }
      // Only the actor's own table (or an empty one) gets here.
      if (table.length > 0) model.stale.push({ owner: actor, table: [...table] })
      model.tables.set(action.tableOf ?? actor, [])
      return
    }
    case 'stale': {
      if (model.stale.length === 0) return
      const { owner, table } = model.stale[action.index % model.stale.length]
      note('stale')
      const what = `${action.op} through a released table of owner ${owner}`
      if (action.op === 'read')
        expectRefusal(() => pool.checkRead(by(owner, table), 1), 'G5', what, seen)
      if (action.op === 'write')
        expectRefusal(() => pool.noteWrite(by(owner, table), 0, 1), 'G5', what, seen)
      if (action.op === 'seal') expectRefusal(() => pool.seal(by(owner, table)), 'G5', what, seen)
      if (action.op === 'release') {
        const guard = table.some((ref) => model.pins[ref.page] > 0) ? 'G7' : 'G5'
        expectRefusal(() => pool.release(by(owner, table)), guard, what, seen)
      }
      return
    }
  }
}

/** The pool agrees with the model and keeps its invariants. */
function checkInvariants(pool: KvPool, model: Model): void {
  pool.check()
  // No page is owned twice, and each live table's pages are its owner's at the epoch it holds.
  const ownedBy = new Map<number, number>()
  for (const [owner, table] of model.tables) {
    for (const ref of table) {
      assert.equal(
        ownedBy.get(ref.page),
        undefined,
        `page ${ref.page} in the tables of ${ownedBy.get(ref.page)} and ${owner}`,
      )
      ownedBy.set(ref.page, owner)
      assert.equal(pool.owner[ref.page], owner)
      assert.equal(pool.tenant[ref.page], tenantOf(owner))
      assert.equal(pool.epoch[ref.page], ref.epoch)
    }
  }
  assert.equal(pool.numUsed, ownedBy.size)
  assert.equal(pool.numFree, model.free.length)
  for (let page = 0; page < numPages; page++) {
    assert.equal(pool.fill[page], model.fill[page], `fill of page ${page}`)
    assert.equal(pool.pins[page], model.pins[page], `pins of page ${page}`)
    // Pinned pages are never freed (G7).
    if (model.pins[page] > 0)
      assert.notEqual(pool.state[page], PageState.free, `pinned page ${page} is free`)
    const wantState =
      model.owner[page] === 0
        ? PageState.free
        : model.isSealed[page]
          ? PageState.sealed
          : PageState.reserved
    assert.equal(pool.state[page], wantState, `state of page ${page}`)
    if (pool.state[page] !== PageState.free) continue
    // A free page holds only the poison value: scrubbed on release (G6), poisoned from the start.
    for (let layer = 0; layer < numLayers; layer++) {
      for (const kv of [pool.k[layer], pool.v[layer]]) {
        const floats = kv.subarray(page * pool.pageStride, (page + 1) * pool.pageStride)
        const isClean = floats.every(Number.isNaN)
        assert.ok(isClean, `free page ${page} layer ${layer} holds ${floats}`)
      }
    }
  }
}

describe('KV pool against a model of page ownership', () => {
  it('agrees with the model and keeps G5, G6, G7 and check() after every step', () => {
    let numSucceeded = 0
    const seen: Coverage = {}
    fc.assert(
      fc.property(fc.array(actionArb, { minLength: 10, maxLength: 80, size: 'max' }), (actions) => {
        const pool = new KvPool(shape, makeGuards(true))
        const model = new Model()
        for (const action of actions) {
          step(pool, model, action, seen)
          checkInvariants(pool, model)
        }
        numSucceeded += 1
      }),
      { numRuns: 300 },
    )
    assert.equal(numSucceeded, 300)
    // Every path was taken many times: successes and each kind of refusal.
    for (const outcome of [
      'allocated',
      'capacity',
      'wrote',
      'read',
      'released',
      'pinned',
      'G5',
      'G7',
      'stale',
    ]) {
      assert.ok(
        (seen[outcome] ?? 0) >= 20,
        `only ${seen[outcome] ?? 0} × ${outcome}: ${JSON.stringify(seen)}`,
      )
    }
  })
})

/** One step of the lease property: allocate a lease, release a live one, or use a released one. */
type LeaseAction =
  | { kind: 'allocate'; owner: number; numPages: number }
  | { kind: 'release'; index: number }
  | { kind: 'reuse'; index: number; op: 'read' | 'write' | 'seal' | 'pin' | 'release' }

const leaseActionArb: fc.Arbitrary<LeaseAction> = fc.oneof(
  {
    weight: 3,
    arbitrary: fc.record({
      kind: fc.constant('allocate' as const),
      owner: ownerArb,
      numPages: fc.integer({ min: 0, max: 4 }),
    }),
  },
  { weight: 2, arbitrary: fc.record({ kind: fc.constant('release' as const), index: fc.nat() }) },
  {
    weight: 2,
    arbitrary: fc.record({
      kind: fc.constant('reuse' as const),
      index: fc.nat(),
      op: fc.constantFrom(
        'read' as const,
        'write' as const,
        'seal' as const,
        'pin' as const,
        'release' as const,
      ),
    }),
  },
)

describe('KV pool leases', () => {
  it('never hands out one page in two live leases, and refuses every use of a released lease (G5)', () => {
    let numRefused = 0
    fc.assert(
      fc.property(fc.array(leaseActionArb, { minLength: 5, maxLength: 60 }), (actions) => {
        const pool = new KvPool(shape, makeGuards(true))
        const live: PageLease[] = []
        const released: PageLease[] = []
        for (const action of actions) {
          if (action.kind === 'allocate' && pool.canAllocate(action.numPages)) {
            const lease = pool.allocate(action.numPages, action.owner, tenantOf(action.owner))
            assert.equal(lease.owner, action.owner)
            assert.equal(lease.tenant, tenantOf(action.owner))
            assert.equal(lease.pages.length, action.numPages)
            live.push(lease)
          } else if (action.kind === 'release' && live.length > 0) {
            const [lease] = live.splice(action.index % live.length, 1)
            pool.release(lease)
            released.push(lease)
          } else if (action.kind === 'reuse') {
            // An empty lease names no page: nothing to refuse.
            const spent = released.filter((l) => l.pages.length > 0)
            if (spent.length === 0) continue
            const lease = spent[action.index % spent.length]
            const use = {
              read: () => pool.checkRead(lease, 1),
              write: () => pool.noteWrite(lease, 0, 1),
              seal: () => pool.seal(lease),
              pin: () => pool.pin(lease),
              release: () => pool.release(lease),
            }[action.op]
            assert.throws(use, (err: unknown) => err instanceof GuardError && err.guard === 'G5')
            numRefused += 1
          }
          pool.check()
          // Live leases are disjoint, and each of their pages is theirs at their epoch.
          const holder = new Map<number, PageLease>()
          for (const lease of live) {
            for (const ref of lease.pages) {
              assert.equal(holder.get(ref.page), undefined, `page ${ref.page} in two leases`)
              holder.set(ref.page, lease)
              assert.equal(pool.owner[ref.page], lease.owner)
              assert.equal(pool.epoch[ref.page], ref.epoch)
              assert.equal(pool.pins[ref.page], 0, `a refused pin left page ${ref.page} pinned`)
            }
          }
          assert.equal(pool.numUsed, holder.size)
        }
      }),
      { numRuns: 200 },
    )
    assert.ok(numRefused >= 50, `only ${numRefused} uses of released leases were tried`)
  })
})
