/** The KV pool of one worker: fixed storage for every layer's K and V, cut into pages of
 *  `pageSize` tokens, and the metadata that says who owns each page and what it holds.
 *
 *  Knows pages, owners (one id per request, ≥ 1), tenants (small ints), epochs, fills and the leases it hands
 *  out; knows nothing of models, transfers or HTTP. Only this file assigns page states.
 *
 *  Page life: free → reserved (owner writes) → sealed (read-only) → free, with a pin count that
 *  forbids freeing while a transfer reads or writes the page (G7). Every allocation bumps the
 *  page's epoch; every page starts poisoned and every free scrubs it again (G6). Reads check
 *  owner, epoch and fill (G5). */
import assert from 'node:assert/strict'
import { KvfenceError } from '../common/errors.js'
import { GuardTrips, type Guards } from './guards.js'

/** Page states. Only pool.ts assigns them. */
export const PageState = { free: 0, reserved: 1, sealed: 2 } as const
export type PageState = (typeof PageState)[keyof typeof PageState]

/** Geometry of a pool. */
export interface PoolShape {
  numPages: number
  /** Tokens per page. */
  pageSize: number
  numLayers: number
  numKvHeads: number
  headDim: number
}

/** One entry of a request's page table: a page and the epoch it had when allocated. */
export interface PageRef {
  readonly page: number
  readonly epoch: number
}

/** What {@link KvPool.allocate} hands out: a request's pages, in position order (ordinal i holds
 *  positions [i × pageSize, (i+1) × pageSize)), each with the epoch it had when allocated, and the
 *  owner and tenant they were allocated for. Every pool call on the pages takes the lease.
 *
 *  The pool trusts no lease: each call checks every page's owner and epoch against the pool's own
 *  metadata (G5, G7), so a lease whose pages were released (or one put together by hand) is refused
 *  once its pages are free or another request's. */
export interface PageLease {
  /** Owner id (≥ 1) of the request the pages were allocated for. */
  readonly owner: number
  /** The tenant's pool number. */
  readonly tenant: number
  /** The page table. */
  readonly pages: readonly PageRef[]
}

/** The first `numPages` pages of `lease`, under the same owner and tenant: the prompt's pages of a
 *  lease that also holds room for generated tokens (a transfer pins and fills only those). */
export function leasePrefix(lease: PageLease, numPages: number): PageLease {
  return { owner: lease.owner, tenant: lease.tenant, pages: lease.pages.slice(0, numPages) }
}

/** Fault switches the pool honours (DESIGN.md §5); all off in normal operation. */
export interface PoolFaults {
  /** `stale-epoch`: reuse a page without bumping its epoch. */
  staleEpoch?: boolean
  /** `skip-scrub`: return pages to the free list without overwriting them. */
  skipScrub?: boolean
}

/** Value written over every freed page (G6): a read of a freed page yields NaN logits. */
export const poisonValue = Number.NaN

/** The owner id meaning "no owner". Owners are ≥ 1. */
export const noOwner = 0

/** A worker's KV pool. Storage per layer: `k[layer]`, `v[layer]` of shape
 *  `[numPages, pageSize, numKvHeads, headDim]` (one allocation each, never resized). */
export class KvPool {
  readonly shape: Readonly<PoolShape>
  /** Per layer: `[numPages, pageSize, numKvHeads, headDim]`. */
  readonly k: Float32Array[]
  /** Per layer: `[numPages, pageSize, numKvHeads, headDim]`. */
  readonly v: Float32Array[]
  /** Floats per token per layer in `k`/`v`: numKvHeads × headDim. */
  readonly tokenStride: number
  /** Floats per page per layer: pageSize × tokenStride. */
  readonly pageStride: number
  /** Bytes of one page across all layers, K and V (the transfer payload size). */
  readonly pageBytes: number

  readonly state: Uint8Array
  readonly owner: Uint32Array
  readonly tenant: Uint32Array
  readonly epoch: Uint32Array
  /** Tokens written into the page (0..pageSize). */
  readonly fill: Uint32Array
  /** Transfers currently reading or writing the page; a pinned page cannot be freed (G7). */
  readonly pins: Uint32Array

  /** Free pages, most recently freed last (so reuse is LIFO, like a real allocator's). */
  private readonly freeList: number[]

  constructor(
    shape: PoolShape,
    private readonly guards: Guards,
    private readonly trips: GuardTrips = new GuardTrips(),
    private readonly faults: PoolFaults = {},
  ) {
    for (const [name, value] of Object.entries(shape)) {
      if (!Number.isInteger(value) || value < 1)
        throw new RangeError(`pool ${name} must be a positive integer, got ${value}`)
    }
    this.shape = Object.freeze({ ...shape })
    this.tokenStride = shape.numKvHeads * shape.headDim
    this.pageStride = shape.pageSize * this.tokenStride
    this.pageBytes = shape.numLayers * 2 * this.pageStride * Float32Array.BYTES_PER_ELEMENT
    const floats = shape.numPages * this.pageStride
    // With G6 on, poisoned from the start like a scrubbed page: a never-used page reads back the
    // same value as a freed one. Either way every page is written now, so the pool's memory is
    // resident from start-up instead of creeping up as load first reaches each page.
    const initial = guards.G6 ? poisonValue : 0
    const store = (): Float32Array => {
      try {
        return new Float32Array(floats).fill(initial)
      } catch (err) {
        const gib = (2 * shape.numLayers * floats * 4) / 2 ** 30
        throw new RangeError(
          `a KV pool of ${shape.numPages} pages × ${shape.pageSize} tokens needs ${gib.toFixed(1)} GiB ` +
            `(${(err as Error).message}): give fewer or smaller pages`,
        )
      }
    }
    this.k = Array.from({ length: shape.numLayers }, store)
    this.v = Array.from({ length: shape.numLayers }, store)
    this.state = new Uint8Array(shape.numPages)
    this.owner = new Uint32Array(shape.numPages)
    this.tenant = new Uint32Array(shape.numPages)
    this.epoch = new Uint32Array(shape.numPages)
    this.fill = new Uint32Array(shape.numPages)
    this.pins = new Uint32Array(shape.numPages)
    // Reversed so that the first allocation gets pages 0, 1, 2, ...
    this.freeList = Array.from({ length: shape.numPages }, (_, i) => shape.numPages - 1 - i)
  }

  /** Effective capacity in tokens: numPages × pageSize. Nothing may advertise more (G1). */
  get capacityTokens(): number {
    return this.shape.numPages * this.shape.pageSize
  }

  get numFree(): number {
    return this.freeList.length
  }

  get numUsed(): number {
    return this.shape.numPages - this.freeList.length
  }

  /** Pages needed for `numTokens` tokens. */
  pagesFor(numTokens: number): number {
    return Math.ceil(numTokens / this.shape.pageSize)
  }

  canAllocate(numPages: number): boolean {
    return numPages <= this.freeList.length
  }

  /** Reserve `numPages` pages for owner `owner` of tenant `tenant`, bumping each epoch, and
   *  return their lease. Throws `capacity_exhausted` when the pool has too few free pages (nothing
   *  is allocated then). */
  allocate(numPages: number, owner: number, tenant: number): PageLease {
    assert(owner !== noOwner, 'owner 0 is reserved for "no owner"')
    if (!this.canAllocate(numPages)) {
      throw new KvfenceError(
        'capacity_exhausted',
        `KV pool has ${this.freeList.length} free pages, ${numPages} needed`,
      )
    }
    const refs: PageRef[] = []
    for (let i = 0; i < numPages; i++) {
      const page = this.freeList.pop()!
      assert.equal(this.state[page], PageState.free, `page ${page} on the free list is not free`)
      if (!this.faults.staleEpoch) this.epoch[page] = (this.epoch[page] + 1) >>> 0
      this.state[page] = PageState.reserved
      this.owner[page] = owner
      this.tenant[page] = tenant
      this.fill[page] = 0
      refs.push({ page, epoch: this.epoch[page] })
    }
    return { owner, tenant, pages: refs }
  }

  /** Mark `numTokens` tokens from position `start` of a lease's sequence as written by its owner.
   *  Throws a G5 guard error when a page is not the owner's, at another epoch, or already sealed, or
   *  when the write would leave a hole: a page's fill counts the tokens written from its start, so
   *  a write may begin at most at the page's fill. A refused write changes no fill. */
  noteWrite(lease: PageLease, start: number, numTokens: number): void {
    const { pageSize } = this.shape
    const { pages: pageTable, owner } = lease
    // Check every page first: a write refused halfway must not leave fills vouching for KV that the
    // caller, seeing the error, never wrote.
    for (
      let pos = start;
      pos < start + numTokens;
      pos = (Math.floor(pos / pageSize) + 1) * pageSize
    ) {
      const ordinal = Math.floor(pos / pageSize)
      const ref = pageTable[ordinal]
      if (ref === undefined)
        throw this.trips.trip(
          'G5',
          `write at position ${pos} beyond the page table (${pageTable.length} pages)`,
        )
      if (!this.guards.G5) continue
      this.checkOwned(ref, owner, 'write')
      if (this.state[ref.page] !== PageState.reserved) {
        throw this.trips.trip('G5', `page ${ref.page} is sealed; owner ${owner} may not write it`)
      }
      const offset = pos - ordinal * pageSize
      if (offset > this.fill[ref.page]) {
        throw this.trips.trip(
          'G5',
          `write at position ${pos} leaves positions ${ordinal * pageSize + this.fill[ref.page]}..${pos - 1} of page ${ref.page} unwritten`,
        )
      }
    }
    for (let pos = start; pos < start + numTokens;) {
      const ordinal = Math.floor(pos / pageSize)
      const ref = pageTable[ordinal]
      const end = Math.min((ordinal + 1) * pageSize, start + numTokens)
      this.fill[ref.page] = Math.max(this.fill[ref.page], end - ordinal * pageSize)
      pos = end
    }
  }

  /** Check that a lease's owner may read positions [0, numTokens) through its pages (G5): every page
   *  is the owner's, at the epoch it was allocated with, and filled up to the positions read.
   *  Throws a G5 guard error otherwise; nothing may then be read. No-op when G5 is off. */
  checkRead(lease: PageLease, numTokens: number): void {
    if (!this.guards.G5) return
    const { pageSize } = this.shape
    const { pages: pageTable, owner } = lease
    const numPages = Math.ceil(numTokens / pageSize)
    if (numPages > pageTable.length) {
      throw this.trips.trip(
        'G5',
        `read of ${numTokens} tokens beyond the page table (${pageTable.length} pages)`,
      )
    }
    for (let ordinal = 0; ordinal < numPages; ordinal++) {
      const ref = pageTable[ordinal]
      this.checkOwned(ref, owner, 'read')
      const needed = Math.min(pageSize, numTokens - ordinal * pageSize)
      if (this.fill[ref.page] < needed) {
        throw this.trips.trip(
          'G5',
          `page ${ref.page} holds ${this.fill[ref.page]} tokens; owner ${owner} reads ${needed} (unwritten KV)`,
        )
      }
    }
  }

  /** Float offset of token `position` of a lease's sequence in `k[layer]`/`v[layer]`. */
  offsetOf(lease: PageLease, position: number): number {
    const { pageSize } = this.shape
    const ref = lease.pages[Math.floor(position / pageSize)]
    return ref.page * this.pageStride + (position % pageSize) * this.tokenStride
  }

  /** Make pages read-only: their KV is complete (after prefill, or after a verified transfer). */
  seal(lease: PageLease): void {
    const { owner } = lease
    for (const ref of lease.pages) {
      if (this.guards.G5) this.checkOwned(ref, owner, 'seal')
      this.state[ref.page] = PageState.sealed
    }
  }

  /** A transfer starts reading or writing these pages: they cannot be freed until `unpin` (G7). */
  pin(lease: PageLease): void {
    const { owner } = lease
    for (const ref of lease.pages) {
      if (this.guards.G7) this.checkOwned(ref, owner, 'pin')
      this.pins[ref.page] += 1
    }
  }

  /** The transfer on these pages has settled (ack, abort handshake or teardown). */
  unpin(lease: PageLease): void {
    const { owner } = lease
    for (const ref of lease.pages) {
      assert(this.pins[ref.page] > 0, `page ${ref.page} unpinned more often than pinned`)
      if (this.guards.G7) this.checkOwned(ref, owner, 'unpin')
      this.pins[ref.page] -= 1
    }
  }

  /** Whether any page of the lease still has a transfer in flight. */
  isPinned(lease: PageLease): boolean {
    return lease.pages.some((ref) => this.pins[ref.page] > 0)
  }

  /** Return a lease's pages to the free list, scrubbing each with the poison value (G6).
   *  With G7 on, throws a guard error if a page is still pinned: the caller must wait for the
   *  transfer to settle (deferred release). With G5 on, throws if a page is not the request's at its
   *  epoch (or appears twice); either way a refused release frees nothing. After a release the
   *  lease is spent: its pages are free or another lease's, so G5 refuses every later use of it. */
  release(lease: PageLease): void {
    const { pages: pageTable, owner } = lease
    if (this.guards.G7 && this.isPinned(lease)) {
      throw this.trips.trip('G7', `owner ${owner} released pages while a transfer is in flight`)
    }
    if (this.guards.G5) {
      // Check every page first: a release refused halfway would leave the request's table half freed.
      const seen = new Set<number>()
      for (const ref of pageTable) {
        const isOurs =
          this.owner[ref.page] === owner &&
          this.epoch[ref.page] === ref.epoch &&
          this.state[ref.page] !== PageState.free
        if (!isOurs || seen.has(ref.page)) {
          // Not ours any more (or a double free): freeing it would hand another request's page out twice.
          throw this.trips.trip('G5', `owner ${owner} released page ${ref.page} it does not own`)
        }
        seen.add(ref.page)
      }
    }
    // Release in reverse so that the next allocation gets the same pages in the same order (LIFO).
    for (let i = pageTable.length - 1; i >= 0; i--) {
      const ref = pageTable[i]
      if (this.state[ref.page] === PageState.free) continue // only with G5 off: a double free is skipped
      if (this.guards.G6 && !this.faults.skipScrub) this.scrub(ref.page)
      this.state[ref.page] = PageState.free
      this.owner[ref.page] = noOwner
      this.tenant[ref.page] = 0
      this.fill[ref.page] = 0
      this.freeList.push(ref.page)
    }
  }

  /** Overwrite every layer's K and V of one page with the poison value. */
  private scrub(page: number): void {
    const start = page * this.pageStride
    const end = start + this.pageStride
    for (let layer = 0; layer < this.shape.numLayers; layer++) {
      this.k[layer].fill(poisonValue, start, end)
      this.v[layer].fill(poisonValue, start, end)
    }
  }

  private checkOwned(ref: PageRef, owner: number, what: string): void {
    if (this.owner[ref.page] !== owner) {
      throw this.trips.trip(
        'G5',
        `${what} of page ${ref.page} by owner ${owner}, but it belongs to ${this.owner[ref.page] || 'nobody'}`,
      )
    }
    if (this.epoch[ref.page] !== ref.epoch) {
      throw this.trips.trip(
        'G5',
        `${what} of page ${ref.page} at epoch ${ref.epoch}, but it is at epoch ${this.epoch[ref.page]}`,
      )
    }
  }

  /** The pool's invariant: every page is free xor owned; free pages are exactly the free list,
   *  unowned, unfilled and unpinned; fills never exceed the page size. Throws on violation. */
  check(): void {
    const { numPages, pageSize } = this.shape
    const onFreeList = new Uint8Array(numPages)
    for (const page of this.freeList) {
      assert(page >= 0 && page < numPages, `free list holds page ${page} outside the pool`)
      assert.equal(onFreeList[page], 0, `page ${page} is on the free list twice`)
      onFreeList[page] = 1
    }
    let numOwned = 0
    for (let page = 0; page < numPages; page++) {
      assert(
        this.fill[page] <= pageSize,
        `page ${page} fill ${this.fill[page]} > page size ${pageSize}`,
      )
      if (this.state[page] === PageState.free) {
        assert.equal(onFreeList[page], 1, `free page ${page} is not on the free list`)
        assert.equal(this.owner[page], noOwner, `free page ${page} has owner ${this.owner[page]}`)
        assert.equal(this.pins[page], 0, `free page ${page} is pinned`)
        assert.equal(this.fill[page], 0, `free page ${page} has fill ${this.fill[page]}`)
      } else {
        numOwned += 1
        assert.equal(onFreeList[page], 0, `owned page ${page} is on the free list`)
        assert.notEqual(this.owner[page], noOwner, `owned page ${page} has no owner`)
      }
    }
    assert.equal(
      numOwned + this.freeList.length,
      numPages,
      `pages leaked or double-freed: ${numOwned} owned + ${this.freeList.length} free != ${numPages}`,
    )
  }
}
