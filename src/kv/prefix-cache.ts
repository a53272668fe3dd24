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
 *  Pages: each tenant's cached pages are owned by one request slot reserved for that tenant's cache
 *  (its "cache owner"), written once, sealed, and at the epoch recorded at allocation: they obey
 *  G5–G7 like any request's pages. A hit is pinned while its KV is copied into the requester's own
 *  pages; a cached page is never handed to a request and never mutated. Eviction is least recently
 *  used, skips pinned pages, and releases through the pool (which scrubs, G6).
 *
 *  Knows pages, tenants (names and pool numbers) and token ids; knows nothing of models, transfers
 *  or HTTP. Sources followed: the idea of SGLang's radix cache / vLLM's hashed block prefix cache
 *  (with vLLM's per-request `cache_salt` replaced by a server-derived per-tenant salt, see
 *  DESIGN.md §10 on vllm#53347). */
import assert from 'node:assert/strict'
import { createHash, createHmac, randomBytes } from 'node:crypto'
import { PageState, type KvPool, type PageLease, type PageRef } from './pool.js'

/** Options of {@link PrefixCache}. */
export interface PrefixCacheOptions {
  /** Most pages the cache may hold (≥ 0; 0 turns the cache off). */
  maxPages: number
  /** A fresh request slot (owner id) for a tenant's cache owner; the worker's `core.nextOwner`. */
  nextOwner: () => number
  /** A tenant's number in page metadata; the worker's `core.tenantId`. */
  tenantId: (tenant: string) => number
  /** Called with the number of pages each eviction released (metrics). */
  onEvict?: (numPages: number) => void
}

/** One cached page. */
interface Entry {
  readonly key: string
  readonly tenant: string
  readonly owner: number
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

  /** Throws RangeError for a negative or non-integer `maxPages`. */
  constructor(
    private readonly pool: KvPool,
    private readonly options: PrefixCacheOptions,
  ) {
    if (!Number.isInteger(options.maxPages) || options.maxPages < 0)
      throw new RangeError(`prefix cache pages must be an integer ≥ 0, got ${options.maxPages}`)
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
    const { pageSize } = this.pool.shape
    const salt = this.saltOf(tenant)
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
    for (const key of this.keysOf(tenant, tokenIds, maxPages)) {
      const entry = this.entries.get(key)
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

  /** Unpin a hit's pages (its KV has been copied or the request failed). */
  release(hit: PrefixHit): void {
    this.pool.unpin(hit.lease)
  }

  /** Copy a hit's KV into the first `hit.refs.length` pages of a request's lease, claiming them
   *  first (`noteWrite`, G5) and checking the cached pages' owner, epoch and fill (`checkRead`).
   *  Throws a guard error when either check fails; then nothing was copied. */
  copyInto(hit: PrefixHit, lease: PageLease): void {
    this.pool.checkRead(hit.lease, hit.numTokens)
    this.pool.noteWrite(lease, 0, hit.numTokens)
    hit.refs.forEach((ref, i) => this.copyPage(ref.page, lease.pages[i].page))
  }

  /** Cache the full pages of a prefilled prompt: the pages of `lease` (holding KV for every token of
   *  `tokenIds`) are copied page by page into new pages of the tenant's cache owner. Pages
   *  already cached are only marked used. A new page is taken only from the free list, and only
   *  while at least `numPagesReserve` pages stay free; at `maxPages` the least recently used
   *  unpinned page is evicted first. Returns the number of pages added. */
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
    const cacheOwner = this.ownerOf(tenant)
    const chain: Entry[] = []
    let numAdded = 0
    for (let i = 0; i < keys.length; i++) {
      const cached = this.entries.get(keys[i])
      if (cached !== undefined) {
        chain.push(cached)
        continue
      }
      if (this.entries.size >= this.options.maxPages && this.evictOne(new Set(chain)) === 0) break
      if (this.pool.numFree <= numPagesReserve) break
      const copy = this.pool.allocate(1, cacheOwner, this.options.tenantId(tenant))
      this.pool.noteWrite(copy, 0, this.pool.shape.pageSize)
      this.copyPage(lease.pages[i].page, copy.pages[0].page)
      this.pool.seal(copy)
      const entry = { key: keys[i], tenant, owner: cacheOwner, lease: copy }
      this.entries.set(entry.key, entry)
      chain.push(entry)
      numAdded += 1
    }
    this.touch(chain)
    return numAdded
  }

  /** Evict least recently used unpinned pages until the pool has `numPages` free pages or nothing
   *  more can go. Returns the number of pages evicted. */
  evictFor(numPages: number): number {
    let numEvicted = 0
    while (this.pool.numFree < numPages) {
      const n = this.evictOne(new Set())
      if (n === 0) break
      numEvicted += n
    }
    return numEvicted
  }

  /** Evict every unpinned page (tests, shutdown). Returns the number evicted. */
  clear(): number {
    return this.evictFor(Infinity)
  }

  /** The cache's invariant: every cached page is owned by its tenant's cache owner and that
   *  tenant's pool number, sealed, at the recorded epoch, full (fill = pageSize), and listed once;
   *  the cache holds at most `maxPages` pages. Throws on violation. */
  check(): void {
    const { pool } = this
    assert(
      this.entries.size <= this.options.maxPages,
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
  }

  /** Evict the least recently used page that is neither pinned nor in `keep`. Returns 1, or 0
   *  when no page can go. */
  private evictOne(keep: ReadonlySet<Entry>): number {
    for (const e of this.entries.values()) {
      if (keep.has(e) || this.pool.isPinned(e.lease)) continue
      this.entries.delete(e.key)
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

  /** Copy every layer's K and V of page `from` to page `to`. */
  private copyPage(from: number, to: number): void {
    const { pageStride } = this.pool
    for (let layer = 0; layer < this.pool.shape.numLayers; layer++) {
      for (const store of [this.pool.k[layer], this.pool.v[layer]]) {
        store.copyWithin(to * pageStride, from * pageStride, (from + 1) * pageStride)
      }
    }
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
