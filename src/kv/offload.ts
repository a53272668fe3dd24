/** Offload tier of the prefix cache: a ring in host memory that keeps the K/V of prefix-cache
 *  pages evicted from the KV pool, so that a later hit can load them back instead of recomputing.
 *
 *  An entry is keyed by the tenant's salt-chained prefix key (the prefix cache's), and records the
 *  tenant, the model and page layout it was written under, its token count and the xxh64 (seed 0,
 *  as the transfer's page checksums) of its payload. A load is verified before any byte of it is
 *  used: same key, same tenant, same layout, a full page of tokens, the payload's length and
 *  checksum (the ring's own read checks the checksum; {@link verifyOffloaded} checks all of it). A
 *  load that fails any check is a refusal, which the caller counts as a miss, never a hit
 *  (dynamo#15079, LMCache#4385, #5151: a failed load counted as a hit).
 *
 *  The ring holds at most `bytes` payload bytes; storing past that drops the oldest entries. With
 *  `bytesPerTenant` set (one figure, or each tenant's own: its share of the prefix cache's
 *  partitions), a tenant's entries are also bounded by it and a store drops only that tenant's own
 *  oldest entries, as the prefix cache's partitions do for pool pages.
 *
 *  Storage: each entry's payload lies in a cell of host memory; a dropped entry's cell is given
 *  up and the next store of its size writes over it in place, as a ring of equal pages wraps.
 *  Dropping does not touch the index: it keeps naming the dropped entry in its old cell (one such
 *  stale name per cell at most), as an index kept apart from the memory a copy engine writes
 *  would. So a load always reads the cell and checks that it still holds the entry it names,
 *  with the checksum recorded at store; a cell given up or written over is a failed load (the
 *  live failure that a load counted as a hit turns into another entry's KV, possibly another
 *  tenant's: dynamo#15079, LMCache#4385).
 *
 *  Knows keys, tenant names, layouts and bytes; knows nothing of pools, models or transfers. */
import assert from 'node:assert/strict'
import { xxh64 } from '@node-rs/xxhash'

/** Options of {@link OffloadRing}. */
export interface OffloadRingOptions {
  /** Most payload bytes the ring holds (≥ 0; 0 keeps nothing). */
  bytes: number
  /** Most payload bytes of one tenant: the same for all, or each tenant's own (read at each
   *  store, so a tenant's share may change); unset: `bytes` shared by all tenants. */
  bytesPerTenant?: TenantBytes
  /** Called with each entry the ring drops to make room (not one deleted or replaced): the next
   *  tier down (the disk, {@link TieredOffload}) keeps it, checksum and all. */
  onDrop?: (page: OffloadedPage) => void
}

/** A per-tenant bound of an offload tier, bytes: one figure for every tenant, or a function of
 *  the tenant's name (an integer ≥ 0; 0: the tenant keeps nothing there). */
export type TenantBytes = number | ((tenant: string) => number)

/** `bound` for `tenant` (undefined: no per-tenant bound). Throws RangeError when a function gives
 *  anything but an integer ≥ 0. */
export function tenantBytesOf(bound: TenantBytes | undefined, tenant: string): number | undefined {
  if (typeof bound !== 'function') return bound
  const n = bound(tenant)
  if (!Number.isInteger(n) || n < 0)
    throw new RangeError(`offload bytes of a tenant must be an integer ≥ 0, got ${n}`)
  return n
}

/** Which tier a load came from (a label of `kvfence_prefix_cache_offload_loads_total`). */
export type OffloadTierName = 'host' | 'disk'

/** A tier below the KV pool where evicted prefix-cache pages are kept: the host-memory
 *  {@link OffloadRing}, the disk ({@link OffloadDisk}, src/kv/offload-disk.ts), or both
 *  ({@link TieredOffload}). Every implementation is bounded by bytes and returns what it holds
 *  only through {@link OffloadTier.load}, whose result the caller verifies
 *  ({@link verifyOffloaded}) before any byte is used. */
export interface OffloadTier {
  /** Keep `payload` under `page.key`, recording `checksum` (default: xxh64 of `payload`). Returns
   *  false when it was not kept (too large, or the tier could not write it). */
  store(
    page: Omit<OffloadedPage, 'checksum' | 'payload'>,
    payload: Uint8Array,
    checksum?: bigint,
  ): boolean
  /** The entry under `key`: absent, failed (unreadable, or bytes that do not match their
   *  checksum) or loaded (still to be verified). */
  load(key: string): OffloadLoad
  /** Drop the entry under `key`, if any. */
  delete(key: string): void
  /** The tier's invariant (byte counts within bounds); throws on violation. */
  check(): void
  /** Entries held now. */
  readonly numPages: number
  /** Bytes held now (payload bytes for the ring, file bytes for the disk). */
  readonly numBytes: number
}

/** One offloaded page. The payload is the page's K then V rows for each layer, as the transfer
 *  lays a page out. */
export interface OffloadedPage {
  readonly key: string
  readonly tenant: string
  /** Model and page layout identity of the writer (see {@link PrefixCacheOptions.layout}). */
  readonly layout: string
  /** Tokens the page holds (a prefix-cache page is always full). */
  readonly numTokens: number
  /** xxh64 (seed 0) of `payload`, computed when stored. */
  readonly checksum: bigint
  readonly payload: Uint8Array
}

/** What a load must match. */
export interface OffloadExpectation {
  tenant: string
  layout: string
  numTokens: number
  numBytes: number
}

/** The outcome of {@link OffloadTier.load}: absent, failed (the bytes read back do not match the
 *  checksum stored with them; `page` absent when nothing could be read or parsed at all), or
 *  loaded. A loaded page is still to be verified against what its user expects
 *  ({@link verifyOffloaded}) before any byte of it is used. */
export type OffloadLoad =
  | { readonly kind: 'absent' }
  | {
      readonly kind: 'failed'
      readonly tier: OffloadTierName
      readonly reason: string
      readonly page?: OffloadedPage
    }
  | { readonly kind: 'loaded'; readonly tier: OffloadTierName; readonly page: OffloadedPage }

/** Why `page` may not be used as the page under `key` for `expect`, or null when it may: same key,
 *  tenant, layout, token count, payload length, and a payload that matches its checksum (G4, as
 *  for a transfer's pages). */
export function verifyOffloaded(
  page: OffloadedPage,
  key: string,
  expect: OffloadExpectation,
): string | null {
  if (page.key !== key) return `key ${page.key}, expected ${key}`
  if (page.tenant !== expect.tenant) return 'another tenant’s page'
  if (page.layout !== expect.layout) return `layout ${page.layout}, expected ${expect.layout}`
  if (page.numTokens !== expect.numTokens)
    return `${page.numTokens} tokens, expected ${expect.numTokens}`
  if (page.payload.byteLength !== expect.numBytes)
    return `${page.payload.byteLength} bytes, expected ${expect.numBytes}`
  const checksum = xxh64(page.payload)
  return checksum === page.checksum ? null : `checksum ${checksum}, stored ${page.checksum}`
}

/** One stretch of the ring's host memory, holding one entry's payload at a time. */
interface Cell {
  readonly bytes: Uint8Array
  /** Key of the entry whose payload it holds now; null while free. */
  holder: string | null
  /** Key of the last entry dropped from it, if the index still names that entry here. */
  staleName: string | null
}

/** What the index records of an entry when it is stored: its identity and checksum, and where
 *  its payload was written. */
interface IndexEntry {
  readonly page: Omit<OffloadedPage, 'payload'>
  readonly cell: Cell
}

/** The host-memory ring of one prefix cache. */
export class OffloadRing implements OffloadTier {
  /** The index: entries by key, live or stale; Map order is age (oldest first). */
  private readonly index = new Map<string, IndexEntry>()
  /** Cells given up, the last given up last: a store takes the most recent one of its size. */
  private readonly free: Cell[] = []
  private readonly numBytesOf = new Map<string, number>()
  private numBytesHeld = 0
  private numPagesHeld = 0
  private numBytesFree = 0

  /** Throws RangeError for a negative or non-integer `bytes` or `bytesPerTenant` (a figure). */
  constructor(private readonly options: OffloadRingOptions) {
    for (const [name, value] of Object.entries(options)) {
      if (typeof value === 'function') continue
      if (value !== undefined && (!Number.isInteger(value) || value < 0))
        throw new RangeError(`offload ${name} must be an integer ≥ 0, got ${value}`)
    }
  }

  /** Pages held now (stale names not counted). */
  get numPages(): number {
    return this.numPagesHeld
  }

  /** Payload bytes held now (stale names not counted). */
  get numBytes(): number {
    return this.numBytesHeld
  }

  /** Names in the index whose cell now holds another entry or none (for tests and metrics). */
  get numStaleNames(): number {
    return this.index.size - this.numPagesHeld
  }

  /** Keep `payload` under `key` (replacing an entry of that key), dropping the oldest entries
   *  (the tenant's own, with `bytesPerTenant`) until it fits, and writing it over the cell of the
   *  last one dropped when that is its size; `checksum` defaults to the payload's xxh64. Returns
   *  false when it can never fit (then nothing changed). */
  store(
    page: Omit<OffloadedPage, 'checksum' | 'payload'>,
    payload: Uint8Array,
    checksum?: bigint,
  ): boolean {
    const { bytes } = this.options
    const bytesPerTenant = tenantBytesOf(this.options.bytesPerTenant, page.tenant)
    const size = payload.byteLength
    // First: an older copy under the key must not outlive a store that is refused for its size.
    this.delete(page.key)
    if (size > bytes || (bytesPerTenant !== undefined && size > bytesPerTenant)) return false
    if (bytesPerTenant !== undefined) {
      while ((this.numBytesOf.get(page.tenant) ?? 0) + size > bytesPerTenant)
        this.dropOldest(page.tenant)
    }
    // Only when `bytes` is less than the tenants' bounds added up can another tenant's entry go.
    while (this.numBytesHeld + size > bytes) this.dropOldest(undefined)
    const cell = this.cellFor(size)
    cell.bytes.set(payload)
    cell.holder = page.key
    this.index.set(page.key, { page: { ...page, checksum: checksum ?? xxh64(payload) }, cell })
    this.numBytesHeld += size
    this.numPagesHeld += 1
    this.numBytesOf.set(page.tenant, (this.numBytesOf.get(page.tenant) ?? 0) + size)
    return true
  }

  /** Read the entry under `key` back, checking what its cell holds now: failed when the cell was
   *  given up since (dropped, and perhaps written over by a later entry: the index still names
   *  it there), or when its bytes no longer match the checksum recorded at store. A failed load
   *  carries what was read: the entry's identity as the index recorded it, and the cell's bytes
   *  as they are now (a copy). The entry stays until {@link delete}. */
  load(key: string): OffloadLoad {
    const entry = this.index.get(key)
    if (entry === undefined) return { kind: 'absent' }
    // A copy: the cell may be written over before the caller is done (making room for the page
    // in the pool can drop a page into this very ring).
    const page = { ...entry.page, payload: entry.cell.bytes.slice() }
    if (entry.cell.holder !== key)
      return {
        kind: 'failed',
        tier: 'host',
        reason:
          entry.cell.holder === null
            ? 'dropped from the ring (its cell is free)'
            : 'its ring cell was written over by a later entry',
        page,
      }
    const checksum = xxh64(page.payload)
    if (checksum !== page.checksum)
      return {
        kind: 'failed',
        tier: 'host',
        reason: `checksum ${checksum}, stored ${page.checksum}`,
        page,
      }
    return { kind: 'loaded', tier: 'host', page }
  }

  /** The live entry under `key` (its payload a view of its cell), unverified: for {@link check}
   *  and tests only, never to load KV; undefined when absent or stale. */
  peek(key: string): OffloadedPage | undefined {
    const entry = this.index.get(key)
    if (entry === undefined || entry.cell.holder !== key) return undefined
    return { ...entry.page, payload: entry.cell.bytes }
  }

  /** Drop the entry under `key`, live or stale, from the index; a live one's cell is freed. */
  delete(key: string): void {
    const entry = this.index.get(key)
    if (entry === undefined) return
    this.index.delete(key)
    const { cell } = entry
    if (cell.staleName === key) cell.staleName = null
    if (cell.holder !== key) return
    this.release(entry)
    this.giveUp(cell)
  }

  /** The ring's invariant: live byte counts add up, per tenant and in all, within their bounds (a
   *  tenant whose share shrank may hold more until its own next store trims it); live and free
   *  cells together within `bytes`; every name in the index is its cell's holder or its cell's
   *  one stale name. */
  check(): void {
    const perTenant = new Map<string, number>()
    let total = 0
    let numLive = 0
    for (const [key, e] of this.index) {
      if (e.cell.holder === key) {
        numLive += 1
        total += e.cell.bytes.byteLength
        perTenant.set(e.page.tenant, (perTenant.get(e.page.tenant) ?? 0) + e.cell.bytes.byteLength)
      } else {
        assert.equal(e.cell.staleName, key, `offload ring: ${key} named in a cell that forgot it`)
      }
    }
    const freeBytes = this.free.reduce((n, s) => n + s.bytes.byteLength, 0)
    assert.equal(freeBytes, this.numBytesFree, `offload ring counts ${this.numBytesFree} free`)
    assert(
      this.free.every((s) => s.holder === null),
      'offload ring: a free cell is held',
    )
    assert.equal(numLive, this.numPagesHeld, `offload ring counts ${this.numPagesHeld} pages`)
    assert.equal(total, this.numBytesHeld, `offload ring counts ${this.numBytesHeld} bytes`)
    assert(total <= this.options.bytes, `offload ring holds ${total} bytes`)
    assert(total + freeBytes <= this.options.bytes, `offload ring keeps ${total + freeBytes} bytes`)
    for (const [tenant, n] of this.numBytesOf) {
      assert.equal(perTenant.get(tenant) ?? 0, n, `offload ring: tenant ${tenant} bytes`)
      const bound = this.options.bytesPerTenant
      if (typeof bound === 'number')
        assert(n <= bound, `offload ring: tenant ${tenant} over its bytes`)
    }
  }

  /** Drop the oldest live entry (of `tenant`, when given): the next tier down gets a copy, its
   *  cell is given up, and the index keeps naming it there (a stale name: a later load reads the
   *  cell and finds it given up or written over). */
  private dropOldest(tenant: string | undefined): void {
    for (const [key, e] of this.index) {
      if (e.cell.holder !== key || (tenant !== undefined && e.page.tenant !== tenant)) continue
      this.options.onDrop?.({ ...e.page, payload: e.cell.bytes.slice() })
      this.release(e)
      const older = e.cell.staleName
      if (older !== null && this.index.get(older)?.cell === e.cell) this.index.delete(older)
      e.cell.staleName = key
      this.giveUp(e.cell)
      return
    }
    assert.fail('offload ring: nothing to drop')
  }

  /** Count a live entry out (its cell still to be given up). */
  private release(e: IndexEntry): void {
    const size = e.cell.bytes.byteLength
    e.cell.holder = null
    this.numBytesHeld -= size
    this.numPagesHeld -= 1
    this.numBytesOf.set(e.page.tenant, this.numBytesOf.get(e.page.tenant)! - size)
  }

  /** Put `cell` on the free list, forgetting the oldest free cells (and the stale names in them)
   *  while live and free bytes together exceed `bytes`. */
  private giveUp(cell: Cell): void {
    this.free.push(cell)
    this.numBytesFree += cell.bytes.byteLength
    while (this.numBytesHeld + this.numBytesFree > this.options.bytes) this.forget(0)
  }

  /** Take free cell `i` off the free list for good, with the stale name it holds. */
  private forget(i: number): Cell {
    const [cell] = this.free.splice(i, 1)
    this.numBytesFree -= cell.bytes.byteLength
    if (cell.staleName !== null && this.index.get(cell.staleName)?.cell === cell)
      this.index.delete(cell.staleName)
    cell.staleName = null
    return cell
  }

  /** A cell of `size` bytes: the most recently given up one of that size, written over in place
   *  (its stale name stays in the index), or else fresh memory, after forgetting free cells
   *  until it fits. */
  private cellFor(size: number): Cell {
    for (let i = this.free.length - 1; i >= 0; i--) {
      const cell = this.free[i]
      if (cell.bytes.byteLength !== size) continue
      this.free.splice(i, 1)
      this.numBytesFree -= size
      return cell
    }
    while (this.numBytesHeld + this.numBytesFree + size > this.options.bytes) this.forget(0)
    return { bytes: new Uint8Array(size), holder: null, staleName: null }
  }
}

/** Two tiers, one below the other: host memory first, then (typically) the disk. A page goes to
 *  the upper ring; the ring's dropped entries go down, with the checksum recorded when the page
 *  left the pool (a page corrupted in host memory is not laundered by a fresh checksum on the way
 *  down); a page too large for the ring goes straight down. A load tries the ring, then the lower
 *  tier (a page the ring dropped went down, though the ring's index may still name it); a delete
 *  drops the key from both. */
export class TieredOffload implements OffloadTier {
  readonly upper: OffloadRing

  /** `upper` is made here so that its drops can reach `lower`; throws as {@link OffloadRing}. */
  constructor(
    upper: Omit<OffloadRingOptions, 'onDrop'>,
    readonly lower: OffloadTier,
  ) {
    this.upper = new OffloadRing({
      ...upper,
      onDrop: (p) => void lower.store(p, p.payload, p.checksum),
    })
  }

  get numPages(): number {
    return this.upper.numPages + this.lower.numPages
  }

  get numBytes(): number {
    return this.upper.numBytes + this.lower.numBytes
  }

  store(
    page: Omit<OffloadedPage, 'checksum' | 'payload'>,
    payload: Uint8Array,
    checksum?: bigint,
  ): boolean {
    // An older copy in either tier would otherwise outlive this one: below, its eviction from the
    // ring; in the ring, this one going straight down for being too large for the ring.
    this.delete(page.key)
    return this.upper.store(page, payload, checksum) || this.lower.store(page, payload, checksum)
  }

  /** The ring's entry when it loads; else the disk's, which holds what the ring dropped; else
   *  the ring's failure (the disk has nothing under `key`). */
  load(key: string): OffloadLoad {
    const up = this.upper.load(key)
    if (up.kind === 'loaded') return up
    const down = this.lower.load(key)
    return down.kind === 'absent' && up.kind === 'failed' ? up : down
  }

  delete(key: string): void {
    this.upper.delete(key)
    this.lower.delete(key)
  }

  check(): void {
    this.upper.check()
    this.lower.check()
  }
}
