/** Prefix cache of a prefill worker: full pages of earlier prompts' KV, kept in the worker's own KV
 *  pool, so that a later prompt of the SAME tenant that starts with the same tokens copies their KV
 *  instead of computing it.
 *
 *  Keys: a hash chain over full pages, key(i) = SHA-256(salt, key(i-1), token ids of page i), so a
 *  key names a whole prefix, never one page's tokens alone. The salt is HMAC-SHA-256 of the tenant
 *  name under a secret drawn when the cache is made: it comes from the tenant the router
 *  authenticated (never from a client field), differs between tenants (another tenant's lookup
 *  computes other keys and cannot hit), and cannot be computed outside this process.
 *
 *  Pages: each tenant's cached pages are owned by one owner id reserved for that tenant's cache
 *  (its "cache owner"), written once, sealed, and at the epoch recorded at allocation: they obey
 *  G5–G7 like any request's pages. A hit is pinned while its KV is copied into the requester's own
 *  pages; a cached page is never handed to a request and never mutated. Eviction is least recently
 *  used, skips pinned pages, and releases through the pool (which scrubs, G6).
 *
 *  Publishing: only pages sealed by a prefill that completed are inserted (the caller seals first;
 *  {@link PrefixCache.insert} refuses an unsealed or short page with a G5 trip), so an aborted or
 *  failed prefill never leaves KV it did not finish in the cache (sglang#38319).
 *
 *  Budgets, one of three:
 *  - assigned (`assigned: true`, what a prefill worker runs by default): each tenant's partition is
 *    the one the router's tenants file gives it ({@link PrefixCache.assign}, with every request):
 *    its own `prefixCachePages`, or an equal share of the pages the file does not give by name,
 *    capped at `maxPagesPerTenant`. The size depends only on the file, never on traffic; a tenant
 *    never assigned one caches nothing. A new size takes effect at the tenant's own next request.
 *  - first come (`maxPagesPerTenant` alone): partitions of that many pages, at most
 *    `floor(maxPages / maxPagesPerTenant)`, each given to a tenant at its first insert and kept for
 *    the process's life; a tenant that arrives when every partition is taken caches nothing.
 *  - shared (neither): every tenant's pages share `maxPages`, least recently used across tenants,
 *    so one tenant's load lowers another's hits (the load side channel of docs/threat-model.md).
 *  With partitions a tenant evicts only its own pages, so another tenant's traffic never changes
 *  its hits, except when the pool itself runs short ({@link PrefixCache.evictFor}: a prompt's
 *  pages come before any tenant's cache).
 *
 *  Offload: with an {@link OffloadTier} (host ring, disk, or both), an evicted page's K/V goes
 *  there and a lookup that finds a key missing from the pool loads it back, only once it is
 *  verified (tenant, layout, token count, checksum; G4, as a transfer's pages are); a refused
 *  load is a miss. With partitions the worker bounds each tenant's bytes in every tier by its
 *  partition's share ({@link partitionBytes}), so a tenant's evictions drop only its own
 *  offloaded pages.
 *
 *  Knows pages, tenants (names and pool numbers) and token ids; knows nothing of models, transfers
 *  or HTTP. Sources followed: the idea of SGLang's radix cache / vLLM's hashed block prefix cache
 *  (with vLLM's per-request `cache_salt` replaced by a server-derived per-tenant salt, see
 *  DESIGN.md §10 on vllm#53347). */
import assert from 'node:assert/strict'
import { createHash, createHmac, randomBytes } from 'node:crypto'
import { GuardTrips, type Guards } from './guards.js'
import { verifyOffloaded, type OffloadTier, type OffloadTierName } from './offload.js'
import { PageState, type KvPool, type PageLease, type PageRef } from './pool.js'

/** Options of {@link PrefixCache}. */
export interface PrefixCacheOptions {
  /** Most pages the cache may hold (≥ 0; 0 turns the cache off). */
  maxPages: number
  /** A fresh owner id for a tenant's cache owner; the worker's `core.nextOwner`. */
  nextOwner: () => number
  /** A tenant's number in page metadata; the worker's `core.tenantId`. */
  tenantId: (tenant: string) => number
  /** Pages of one tenant's partition (1..maxPages): with `assigned`, the most a tenant's default
   *  share may be; without, the size of every first-come partition. Unset and not `assigned`: one
   *  budget shared by all tenants. */
  maxPagesPerTenant?: number
  /** Each tenant caches only in the partition {@link PrefixCache.assign} gave it (default false). */
  assigned?: boolean
  /** Which guards are on (each default: on). G5: {@link PrefixCache.insert} refuses pages a
   *  prefill did not seal or fill. G4: a page loaded from the offload tier is verified first. */
  guards?: Partial<Pick<Guards, 'G4' | 'G5'>>
  /** Where a refused insert is counted; the worker's `core.trips`. Default: a fresh counter. */
  trips?: GuardTrips
  /** Called with the number of pages each eviction released (metrics). */
  onEvict?: (numPages: number) => void
  /** Where evicted pages go and come back from (host ring, disk, or both); unset: evicted pages
   *  are gone. */
  offload?: OffloadTier
  /** Identity of the model and page layout, recorded with each offloaded page and required of
   *  every load. Default: the pool's shape. */
  layout?: string
  /** Faults (docs/faults.md): `offloadLoadAsHit` takes a failed read of the offload tier for a
   *  loaded page (G4's verification then refuses it); `offloadKeyWithoutTenant` keys offloaded
   *  pages by their tokens alone, without the salt (G4's tenant check then refuses them). */
  faults?: { offloadLoadAsHit?: boolean; offloadKeyWithoutTenant?: boolean }
  /** Called for each load from the offload tier: `hit` (verified and used) or `refused` (a miss),
   *  and the tier it came from. */
  onOffloadLoad?: (outcome: 'hit' | 'refused', tier: OffloadTierName) => void
}

/** A tenant's partition as the tenants file describes it: what the router sends with each of the
 *  tenant's requests (src/router/tenants/tenants.ts) and {@link PrefixCache.assign} turns into pages. */
export interface PartitionSpec {
  /** The tenant's own size in the file (`prefixCachePages`, pages, ≥ 0); absent: a default share. */
  readonly pages?: number
  /** Pages the file gives tenants by name: the sum of every tenant's `prefixCachePages`. */
  readonly reservedPages: number
  /** Tenants in the file without a size of their own (≥ 0). */
  readonly numDefaultTenants: number
}

/** Pages of a tenant's partition in a cache of `maxPages` under `spec`: its own size, or
 *  `floor((maxPages − reservedPages) / numDefaultTenants)` capped at `cap`; 0 when the sizes the
 *  file gives by name add up to more than the cache (no tenant's share could be honoured). */
export function partitionPages(maxPages: number, spec: PartitionSpec, cap = Infinity): number {
  if (spec.reservedPages > maxPages) return 0
  if (spec.pages !== undefined) return spec.pages
  if (spec.numDefaultTenants === 0) return 0
  return Math.min(cap, Math.floor((maxPages - spec.reservedPages) / spec.numDefaultTenants))
}

/** A tenant's share of an offload tier of `bytes` when its partition is `pages` of a cache of
 *  `maxPages`: `floor(bytes × pages / maxPages)`, exact (integer arithmetic), so that the shares of
 *  partitions that fit the cache add up to at most `bytes` and no tenant's store ever has to drop
 *  another's entry. 0 for a cache of 0 pages. Throws RangeError for arguments that are not
 *  integers ≥ 0. */
export function partitionBytes(bytes: number, pages: number, maxPages: number): number {
  for (const n of [bytes, pages, maxPages]) {
    if (!Number.isSafeInteger(n) || n < 0)
      throw new RangeError(`an offload share needs integers ≥ 0, got ${n}`)
  }
  if (maxPages === 0) return 0
  return Number((BigInt(bytes) * BigInt(pages)) / BigInt(maxPages))
}

/** One cached page. */
interface Entry {
  readonly key: string
  readonly tenant: string
  readonly owner: number
  /** Its key in the offload tier (its `key`, unless fault `offload-key-without-tenant`). */
  readonly offloadKey: string
  /** The one page's lease, held by the tenant's cache owner. */
  readonly lease: PageLease
}

/** A hit: the cached pages of a prompt's longest cached prefix, pinned until {@link PrefixCache.release}. */
export interface PrefixHit {
  /** The tenant's cache owner (the pin is held under it). */
  readonly owner: number
  /** Cached pages of prompt pages 0..n-1, in order. */
  readonly refs: readonly PageRef[]
  /** The cached pages as one lease of the cache owner (what is pinned and read). */
  readonly lease: PageLease
  /** Prompt tokens covered: refs.length × pageSize. */
  readonly numTokens: number
}

/** The prefix cache of one prefill worker's pool. */
export class PrefixCache {
  /** Cached pages by key; Map order is LRU order (least recently used first). Parents are always
   *  touched after their children, so a chain is evicted from its end, never cut in the middle. */
  private readonly entries = new Map<string, Entry>()
  /** The cache owner of each tenant that has cached pages (or had). */
  private readonly owners = new Map<string, number>()
  private readonly secret = randomBytes(32)
  private readonly salts = new Map<string, Buffer>()
  /** Pages each tenant holds now (every tenant with a partition is listed, from its first insert). */
  private readonly numPagesOf = new Map<string, number>()
  /** With `assigned`: each tenant's partition, pages, as last assigned. */
  private readonly sizeOf = new Map<string, number>()

  /** Throws RangeError for a negative or non-integer `maxPages`, or a `maxPagesPerTenant` that is
   *  not an integer in 1..maxPages (when maxPages > 0). */
  constructor(
    private readonly pool: KvPool,
    private readonly options: PrefixCacheOptions,
  ) {
    const { maxPages, maxPagesPerTenant: perTenant } = options
    if (!Number.isInteger(maxPages) || maxPages < 0)
      throw new RangeError(`prefix cache pages must be an integer ≥ 0, got ${maxPages}`)
    if (
      perTenant !== undefined &&
      maxPages > 0 &&
      (!Number.isInteger(perTenant) || perTenant < 1 || perTenant > maxPages)
    )
      throw new RangeError(
        `prefix cache pages per tenant must be an integer in 1..${maxPages}, got ${perTenant}`,
      )
  }

  /** Whether each tenant has its own partition (`assigned`, or `maxPagesPerTenant` set). */
  get isPartitioned(): boolean {
    return this.options.assigned === true || this.options.maxPagesPerTenant !== undefined
  }

  /** With `assigned`: give `tenant` the partition `spec` describes ({@link partitionPages}),
   *  evicting its own least recently used unpinned pages beyond it. Called before each of the
   *  tenant's lookups, so a changed tenants file takes effect at the tenant's next request; no
   *  other tenant's partition changes. Returns the partition's pages. Throws RangeError for a spec
   *  whose numbers are not integers ≥ 0, or when the cache is not `assigned`. */
  assign(tenant: string, spec: PartitionSpec): number {
    if (this.options.assigned !== true)
      throw new RangeError('prefix cache partitions are assigned only to an assigned cache')
    for (const n of [spec.pages ?? 0, spec.reservedPages, spec.numDefaultTenants]) {
      if (!Number.isInteger(n) || n < 0)
        throw new RangeError(`a prefix cache partition needs integers ≥ 0, got ${n}`)
    }
    const size = partitionPages(this.options.maxPages, spec, this.options.maxPagesPerTenant)
    if (this.sizeOf.get(tenant) === size) return size
    this.sizeOf.set(tenant, size)
    this.trim(tenant)
    return size
  }

  /** Evict `tenant`'s least recently used unpinned pages beyond its assigned partition. */
  private trim(tenant: string): void {
    const size = this.sizeOf.get(tenant)
    if (size === undefined) return
    while ((this.numPagesOf.get(tenant) ?? 0) > size) {
      if (this.evictOne(new Set(), tenant) === 0) break
    }
  }

  /** The partition of `tenant` (pages), or undefined when the budget is shared. */
  partitionOf(tenant: string): number | undefined {
    if (this.options.assigned === true) return this.sizeOf.get(tenant) ?? 0
    return this.options.maxPagesPerTenant
  }

  /** Whether the cache may hold pages at all. */
  get isEnabled(): boolean {
    return this.options.maxPages > 0
  }

  /** Pages the cache holds now. */
  get numPages(): number {
    return this.entries.size
  }

  /** Keys of the full pages of `tokenIds` for `tenant`, in page order: `floor(n / pageSize)` keys,
   *  at most `maxPages` of them. */
  keysOf(tenant: string, tokenIds: readonly number[], maxPages = Infinity): string[] {
    return this.chainOf(this.saltOf(tenant), tokenIds, maxPages)
  }

  /** The offload tier's keys of `tokenIds` for `tenant`: {@link keysOf}, or with fault
   *  `offload-key-without-tenant` the same chain with no salt (every tenant's alike). */
  private offloadKeysOf(tenant: string, tokenIds: readonly number[], maxPages = Infinity) {
    if (this.options.faults?.offloadKeyWithoutTenant)
      return this.chainOf(Buffer.alloc(0), tokenIds, maxPages)
    return this.keysOf(tenant, tokenIds, maxPages)
  }

  private chainOf(salt: Buffer, tokenIds: readonly number[], maxPages: number): string[] {
    const { pageSize } = this.pool.shape
    const keys: string[] = []
    let parent = Buffer.alloc(0)
    const numFull = Math.min(Math.floor(tokenIds.length / pageSize), maxPages)
    for (let i = 0; i < numFull; i++) {
      const ids = Uint32Array.from(tokenIds.slice(i * pageSize, (i + 1) * pageSize))
      parent = createHash('sha256')
        .update(salt)
        .update(parent)
        .update(new Uint8Array(ids.buffer))
        .digest()
      keys.push(parent.toString('base64'))
    }
    return keys
  }

  /** The longest cached prefix of `tokenIds` for `tenant`, leaving at least the last prompt token
   *  uncovered (its logits must be computed). Its pages are pinned (so neither eviction nor
   *  anything else frees them) until {@link release}; null when nothing is cached. */
  lookup(tenant: string, tokenIds: readonly number[]): PrefixHit | null {
    if (!this.isEnabled) return null
    const maxPages = Math.floor((tokenIds.length - 1) / this.pool.shape.pageSize)
    const found: Entry[] = []
    const keys = this.keysOf(tenant, tokenIds, maxPages)
    const offloadKeys = this.options.offload ? this.offloadKeysOf(tenant, tokenIds, maxPages) : []
    for (let i = 0; i < keys.length; i++) {
      const entry = this.entries.get(keys[i]) ?? this.reload(tenant, keys[i], offloadKeys[i], found)
      if (entry === undefined) break
      // Defence in depth: equal keys from another tenant would need a SHA-256 collision.
      assert.equal(entry.tenant, tenant, 'prefix cache key shared by two tenants')
      found.push(entry)
    }
    if (found.length === 0) return null
    this.touch(found)
    const owner = found[0].owner
    const refs = found.map((e) => e.lease.pages[0])
    const lease: PageLease = { owner, tenant: found[0].lease.tenant, pages: refs }
    this.pool.pin(lease)
    return { owner, refs, lease, numTokens: refs.length * this.pool.shape.pageSize }
  }

  /** Unpin a hit's pages (its KV has been copied or the request failed), and bring the tenant's
   *  partition back within its size if a shrink had to leave pinned pages. */
  release(hit: PrefixHit): void {
    this.pool.unpin(hit.lease)
    for (const [tenant, owner] of this.owners) {
      if (owner === hit.owner) this.trim(tenant)
    }
  }

  /** Copy a hit's KV into the first `hit.refs.length` pages of a request's lease, claiming them
   *  first (`noteWrite`, G5) and checking the cached pages' owner, epoch and fill (`checkRead`).
   *  Throws a guard error when either check fails; then nothing was copied. */
  copyInto(hit: PrefixHit, lease: PageLease): void {
    this.pool.checkRead(hit.lease, hit.numTokens)
    this.pool.noteWrite(lease, 0, hit.numTokens)
    hit.refs.forEach((ref, i) => this.copyPage(ref.page, lease.pages[i].page))
  }

  /** Cache the full pages of a prefilled prompt: the pages of `lease` (sealed, holding KV for
   *  every token of `tokenIds`) are copied page by page into new pages of the tenant's cache owner.
   *  Pages already cached are only marked used. A new page is taken only from the free list, and
   *  only while at least `numPagesReserve` pages stay free; at the budget (the tenant's partition,
   *  or `maxPages` when shared) the least recently used unpinned page the inserter may evict goes
   *  first. Returns the number of pages added (0 for a tenant without a partition).
   *  Throws a G5 guard error, caching nothing, when a page to copy is not sealed (its prefill did
   *  not complete) or not filled, or is not the lease owner's. */
  insert(
    tenant: string,
    tokenIds: readonly number[],
    lease: PageLease,
    numPagesReserve = 0,
  ): number {
    if (!this.isEnabled) return 0
    const keys = this.keysOf(tenant, tokenIds)
    if (keys.length === 0) return 0
    this.pool.checkRead(lease, keys.length * this.pool.shape.pageSize)
    this.checkSealed(lease, keys.length)
    if (!this.hasPartition(tenant)) return 0
    const cacheOwner = this.ownerOf(tenant)
    const offloadKeys = this.options.offload ? this.offloadKeysOf(tenant, tokenIds) : keys
    const chain: Entry[] = []
    let numAdded = 0
    for (let i = 0; i < keys.length; i++) {
      const cached = this.entries.get(keys[i])
      if (cached !== undefined) {
        chain.push(cached)
        continue
      }
      if (!this.makeRoom(tenant, chain)) break
      if (this.pool.numFree <= numPagesReserve) break
      const copy = this.pool.allocate(1, cacheOwner, this.options.tenantId(tenant))
      this.pool.noteWrite(copy, 0, this.pool.shape.pageSize)
      this.copyPage(lease.pages[i].page, copy.pages[0].page)
      this.pool.seal(copy)
      const entry = {
        key: keys[i],
        offloadKey: offloadKeys[i],
        tenant,
        owner: cacheOwner,
        lease: copy,
      }
      this.entries.set(entry.key, entry)
      this.numPagesOf.set(tenant, (this.numPagesOf.get(tenant) ?? 0) + 1)
      chain.push(entry)
      numAdded += 1
    }
    this.touch(chain)
    return numAdded
  }

  /** Evict least recently used unpinned pages until the pool has `numPages` free pages or nothing
   *  more can go: `tenant`'s own pages first (when given), then any tenant's, since a prompt that
   *  fits the pool must not fail for the cache's sake. Returns the number of pages evicted. */
  evictFor(numPages: number, tenant?: string): number {
    let numEvicted = 0
    for (const only of tenant === undefined ? [undefined] : [tenant, undefined]) {
      while (this.pool.numFree < numPages) {
        const n = this.evictOne(new Set(), only)
        if (n === 0) break
        numEvicted += n
      }
    }
    return numEvicted
  }

  /** Evict every unpinned page (tests, shutdown). Returns the number evicted. */
  clear(): number {
    return this.evictFor(Infinity)
  }

  /** The cache's invariant: every cached page is owned by its tenant's cache owner and that
   *  tenant's pool number, sealed, at the recorded epoch, full (fill = pageSize), and listed once;
   *  the cache holds at most `maxPages` pages, each tenant's count is right and within its
   *  partition; the offload ring's own invariant holds. Throws on violation. */
  check(): void {
    const { pool } = this
    // Assigned partitions may add up to more for a while: a tenant keeps its old size until its
    // own next request after the tenants file changed (never shrunk by another's traffic).
    assert(
      this.options.assigned === true || this.entries.size <= this.options.maxPages,
      `prefix cache holds ${this.entries.size} pages, more than its ${this.options.maxPages}`,
    )
    const seen = new Set<number>()
    for (const e of this.entries.values()) {
      const { page, epoch } = e.lease.pages[0]
      assert(!seen.has(page), `page ${page} is cached twice`)
      seen.add(page)
      assert.equal(this.owners.get(e.tenant), e.owner, `page ${page}: not its tenant's cache owner`)
      assert.equal(pool.owner[page], e.owner, `cached page ${page} owned by ${pool.owner[page]}`)
      assert.equal(pool.tenant[page], this.options.tenantId(e.tenant), `page ${page}: tenant`)
      assert.equal(pool.state[page], PageState.sealed, `cached page ${page} is not sealed`)
      assert.equal(pool.epoch[page], epoch, `cached page ${page} at epoch ${pool.epoch[page]}`)
      assert.equal(pool.fill[page], pool.shape.pageSize, `cached page ${page} is not full`)
    }
    const counted = new Map<string, number>()
    for (const e of this.entries.values()) counted.set(e.tenant, (counted.get(e.tenant) ?? 0) + 1)
    for (const [tenant, n] of this.numPagesOf) {
      assert.equal(counted.get(tenant) ?? 0, n, `tenant ${tenant}: ${n} pages counted`)
      const partition = this.partitionOf(tenant)
      if (partition !== undefined) assert(n <= partition, `tenant ${tenant} over its partition`)
    }
    this.options.offload?.check()
  }

  /** Evict the least recently used page that is neither pinned nor in `keep` (and is `tenant`'s,
   *  when given). Returns 1, or 0 when no page can go. */
  private evictOne(keep: ReadonlySet<Entry>, tenant?: string): number {
    for (const e of this.entries.values()) {
      if (keep.has(e) || this.pool.isPinned(e.lease)) continue
      if (tenant !== undefined && e.tenant !== tenant) continue
      this.entries.delete(e.key)
      this.numPagesOf.set(e.tenant, this.numPagesOf.get(e.tenant)! - 1)
      this.offload(e)
      this.pool.release(e.lease)
      this.options.onEvict?.(1)
      return 1
    }
    return 0
  }

  /** Mark a chain most recently used, its first page last: a parent is always newer than its
   *  children, so LRU eviction takes a chain's deepest page first. */
  private touch(chain: readonly Entry[]): void {
    for (let i = chain.length - 1; i >= 0; i--) {
      this.entries.delete(chain[i].key)
      this.entries.set(chain[i].key, chain[i])
    }
  }

  /** The layout identity offloaded pages are recorded under and loads must match. */
  private get layout(): string {
    const { numLayers, numKvHeads, headDim, pageSize } = this.pool.shape
    return (
      this.options.layout ??
      `layers ${numLayers}, kv heads ${numKvHeads}×${headDim}, page ${pageSize}`
    )
  }

  /** Keep an evicted page's K/V in the offload tier, if there is one. */
  private offload(e: Entry): void {
    const ring = this.options.offload
    if (ring === undefined) return
    const payload = this.pageBytes(e.lease.pages[0].page)
    ring.store(
      {
        key: e.offloadKey,
        tenant: e.tenant,
        layout: this.layout,
        numTokens: this.pool.shape.pageSize,
      },
      payload,
    )
  }

  /** Load the page under `key` back from the offload tier into a new page of the tenant's cache
   *  owner, evicting (its own pages, with partitions) as an insert would but never a page of
   *  `found`. A failed read, or with G4 on a page that fails {@link verifyOffloaded}, is a miss
   *  (counted as `refused`). Returns the new entry, or undefined for a miss. */
  private reload(
    tenant: string,
    key: string,
    offloadKey: string | undefined,
    found: readonly Entry[],
  ): Entry | undefined {
    const ring = this.options.offload
    if (ring === undefined || offloadKey === undefined) return undefined
    const { pageSize } = this.pool.shape
    const loaded = ring.load(offloadKey)
    if (loaded.kind === 'absent') return undefined
    const expect = {
      tenant,
      layout: this.layout,
      numTokens: pageSize,
      numBytes: this.pool.pageBytes,
    }
    const { page, tier } = loaded
    const isRefused =
      page === undefined ||
      (loaded.kind === 'failed' && !this.options.faults?.offloadLoadAsHit) ||
      (this.options.guards?.G4 !== false && verifyOffloaded(page, offloadKey, expect) !== null)
    if (isRefused) {
      // The entry stays: were another tenant's lookup to drop it, that tenant would change this
      // one's hits.
      this.options.onOffloadLoad?.('refused', tier)
      return undefined
    }
    if (!this.hasPartition(tenant)) return undefined
    if (!this.makeRoom(tenant, found)) return undefined
    if (this.pool.numFree === 0) return undefined
    const lease = this.pool.allocate(1, this.ownerOf(tenant), this.options.tenantId(tenant))
    this.pool.noteWrite(lease, 0, pageSize)
    this.writePage(lease.pages[0].page, page.payload)
    this.pool.seal(lease)
    ring.delete(offloadKey)
    const entry = { key, offloadKey, tenant, owner: lease.owner, lease }
    this.entries.set(key, entry)
    this.numPagesOf.set(tenant, this.numPagesOf.get(tenant)! + 1)
    this.options.onOffloadLoad?.('hit', tier)
    return entry
  }

  /** A copy of page `page`'s K then V rows for each layer (the transfer's page layout). */
  private pageBytes(page: number): Uint8Array {
    const { pageStride } = this.pool
    const out = new Float32Array(2 * this.pool.shape.numLayers * pageStride)
    let at = 0
    for (let layer = 0; layer < this.pool.shape.numLayers; layer++) {
      for (const store of [this.pool.k[layer], this.pool.v[layer]]) {
        out.set(store.subarray(page * pageStride, (page + 1) * pageStride), at)
        at += pageStride
      }
    }
    return new Uint8Array(out.buffer)
  }

  /** Inverse of {@link pageBytes}: write `payload` (a verified load) into page `page`. */
  private writePage(page: number, payload: Uint8Array): void {
    const { pageStride } = this.pool
    const floats = new Float32Array(Uint8Array.from(payload).buffer)
    let at = 0
    for (let layer = 0; layer < this.pool.shape.numLayers; layer++) {
      for (const store of [this.pool.k[layer], this.pool.v[layer]]) {
        store.set(floats.subarray(at, at + pageStride), page * pageStride)
        at += pageStride
      }
    }
  }

  /** Copy every layer's K and V of page `from` to page `to`. */
  private copyPage(from: number, to: number): void {
    const { pageStride } = this.pool
    for (let layer = 0; layer < this.pool.shape.numLayers; layer++) {
      for (const store of [this.pool.k[layer], this.pool.v[layer]]) {
        store.copyWithin(to * pageStride, from * pageStride, (from + 1) * pageStride)
      }
    }
  }

  /** G5 at publication: the first `numPages` pages of `lease` are sealed, so the prefill that
   *  wrote them completed (checkRead has vouched for their owner and fill). */
  private checkSealed(lease: PageLease, numPages: number): void {
    if (this.options.guards?.G5 === false) return
    for (const { page } of lease.pages.slice(0, numPages)) {
      if (this.pool.state[page] !== PageState.sealed) {
        throw (this.options.trips ?? new GuardTrips()).trip(
          'G5',
          `page ${page} of owner ${lease.owner} is not sealed: its prefill did not complete, so it is not cached`,
        )
      }
    }
  }

  /** Whether `tenant` may cache: always when the budget is shared; with assigned partitions, when
   *  its partition has pages; first come, when it has one or one is left (then it is given one,
   *  for the process's life). */
  private hasPartition(tenant: string): boolean {
    if (this.options.assigned === true) {
      if ((this.sizeOf.get(tenant) ?? 0) === 0) return false
      if (!this.numPagesOf.has(tenant)) this.numPagesOf.set(tenant, 0)
      return true
    }
    const perTenant = this.options.maxPagesPerTenant
    if (perTenant === undefined || this.numPagesOf.has(tenant)) {
      if (!this.numPagesOf.has(tenant)) this.numPagesOf.set(tenant, 0)
      return true
    }
    if ((this.numPagesOf.size + 1) * perTenant > this.options.maxPages) return false
    this.numPagesOf.set(tenant, 0)
    return true
  }

  /** Evict until `tenant` may add a page (its own pages only, with partitions), never a page of
   *  `keep`; a partition still over its size after a shrink (pages then pinned) is brought back
   *  within it here. Returns whether a page may be added. */
  private makeRoom(tenant: string, keep: readonly Entry[]): boolean {
    const evictable = this.isPartitioned ? tenant : undefined
    const kept = new Set(keep)
    while (this.isAtBudget(tenant)) {
      if (this.evictOne(kept, evictable) === 0) return false
    }
    return true
  }

  /** Whether `tenant` must evict before it adds a page: its partition is full, or (shared budget)
   *  the whole cache is. */
  private isAtBudget(tenant: string): boolean {
    const partition = this.partitionOf(tenant)
    if (partition === undefined) return this.entries.size >= this.options.maxPages
    return this.numPagesOf.get(tenant)! >= partition
  }

  private ownerOf(tenant: string): number {
    let owner = this.owners.get(tenant)
    if (owner === undefined) this.owners.set(tenant, (owner = this.options.nextOwner()))
    return owner
  }

  private saltOf(tenant: string): Buffer {
    let salt = this.salts.get(tenant)
    if (salt === undefined) {
      salt = createHmac('sha256', this.secret).update(tenant, 'utf8').digest()
      this.salts.set(tenant, salt)
    }
    return salt
  }
}
