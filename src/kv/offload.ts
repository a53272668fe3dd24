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

/** The host-memory ring of one prefix cache. */
export class OffloadRing implements OffloadTier {
  /** Entries by key; Map order is age (oldest first). */
  private readonly entries = new Map<string, OffloadedPage>()
  private readonly numBytesOf = new Map<string, number>()
  private numBytesHeld = 0

  /** Throws RangeError for a negative or non-integer `bytes` or `bytesPerTenant` (a figure). */
  constructor(private readonly options: OffloadRingOptions) {
    for (const [name, value] of Object.entries(options)) {
      if (typeof value === 'function') continue
      if (value !== undefined && (!Number.isInteger(value) || value < 0))
        throw new RangeError(`offload ${name} must be an integer ≥ 0, got ${value}`)
    }
  }

  /** Pages held now. */
  get numPages(): number {
    return this.entries.size
  }

  /** Payload bytes held now. */
  get numBytes(): number {
    return this.numBytesHeld
  }

  /** Keep a copy of `payload` under `key` (replacing an entry of that key), dropping the oldest
   *  entries (the tenant's own, with `bytesPerTenant`) until it fits; `checksum` defaults to the
   *  copy's xxh64. Returns false when it can never fit (then nothing changed). */
  store(
    page: Omit<OffloadedPage, 'checksum' | 'payload'>,
    payload: Uint8Array,
    checksum?: bigint,
  ): boolean {
    const { bytes } = this.options
    const bytesPerTenant = tenantBytesOf(this.options.bytesPerTenant, page.tenant)
    const size = payload.byteLength
    if (size > bytes || (bytesPerTenant !== undefined && size > bytesPerTenant)) return false
    this.delete(page.key)
    if (bytesPerTenant !== undefined) {
      while ((this.numBytesOf.get(page.tenant) ?? 0) + size > bytesPerTenant)
        this.dropOldest(page.tenant)
    }
    // Only when `bytes` is less than the tenants' bounds added up can another tenant's entry go.
    while (this.numBytesHeld + size > bytes) this.dropOldest(undefined)
    const copy = Uint8Array.from(payload)
    this.entries.set(page.key, { ...page, checksum: checksum ?? xxh64(copy), payload: copy })
    this.numBytesHeld += size
    this.numBytesOf.set(page.tenant, (this.numBytesOf.get(page.tenant) ?? 0) + size)
    return true
  }

  /** Read the entry under `key` back: failed when its bytes no longer match their checksum (a
   *  failed read). The entry stays until {@link delete}. */
  load(key: string): OffloadLoad {
    const page = this.entries.get(key)
    if (page === undefined) return { kind: 'absent' }
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

  /** The entry under `key`, unverified: for {@link check} and tests only, never to load KV. */
  peek(key: string): OffloadedPage | undefined {
    return this.entries.get(key)
  }

  /** Drop the entry under `key`, if any. */
  delete(key: string): void {
    const page = this.entries.get(key)
    if (page === undefined) return
    this.entries.delete(key)
    this.numBytesHeld -= page.payload.byteLength
    this.numBytesOf.set(page.tenant, this.numBytesOf.get(page.tenant)! - page.payload.byteLength)
  }

  /** The ring's invariant: byte counts add up, per tenant and in all, within their bounds (a
   *  tenant whose share shrank may hold more until its own next store trims it). */
  check(): void {
    const perTenant = new Map<string, number>()
    let total = 0
    for (const p of this.entries.values()) {
      total += p.payload.byteLength
      perTenant.set(p.tenant, (perTenant.get(p.tenant) ?? 0) + p.payload.byteLength)
    }
    assert.equal(total, this.numBytesHeld, `offload ring counts ${this.numBytesHeld} bytes`)
    assert(total <= this.options.bytes, `offload ring holds ${total} bytes`)
    for (const [tenant, n] of this.numBytesOf) {
      assert.equal(perTenant.get(tenant) ?? 0, n, `offload ring: tenant ${tenant} bytes`)
      const bound = this.options.bytesPerTenant
      if (typeof bound === 'number')
        assert(n <= bound, `offload ring: tenant ${tenant} over its bytes`)
    }
  }

  /** Drop the oldest entry (of `tenant`, when given). */
  private dropOldest(tenant: string | undefined): void {
    for (const p of this.entries.values()) {
      if (tenant !== undefined && p.tenant !== tenant) continue
      this.delete(p.key)
      this.options.onDrop?.(p)
      return
    }
    assert.fail('offload ring: nothing to drop')
  }
}

/** Two tiers, one below the other: host memory first, then (typically) the disk. A page goes to
 *  the upper ring; the ring's dropped entries go down, with the checksum recorded when the page
 *  left the pool (a page corrupted in host memory is not laundered by a fresh checksum on the way
 *  down); a page too large for the ring goes straight down. A load tries the ring, then the lower
 *  tier; a delete drops the key from both. */
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
    // An older copy below would otherwise outlive this one's eviction from the ring.
    this.lower.delete(page.key)
    return this.upper.store(page, payload, checksum) || this.lower.store(page, payload, checksum)
  }

  load(key: string): OffloadLoad {
    const up = this.upper.load(key)
    return up.kind === 'absent' ? this.lower.load(key) : up
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
