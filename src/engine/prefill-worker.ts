/** Prefill worker: runs a prompt through the model into its own KV pool, samples the first token,
 *  and sends the prompt's KV pages to the decode worker, keeping them pinned until it acknowledges.
 *  Knows token ids, tenants and the transfer client; knows nothing of HTTP, API keys or text. */
import { randomBytes } from 'node:crypto'
import { setTimeout as sleep } from 'node:timers/promises'
import { Counter, Gauge } from 'prom-client'
import { KvfenceError } from '../common/errors.js'
import { delayBeginMs } from './faults.js'
import type { PageLease } from '../kv/pool.js'
import { OffloadRing, TieredOffload, type OffloadTier } from '../kv/offload.js'
import { OffloadDisk } from '../kv/offload-disk.js'
import { partitionBytes, PrefixCache, type PrefixHit } from '../kv/prefix-cache.js'
import { isLoopbackHost } from '../link/plaintext.js'
import type { TlsMaterial } from '../link/tls.js'
import { TransferClient } from '../transfer/index.js'
import type { PrefillRequest, PrefillResult } from '../control/messages.js'
import { PrefillScheduler } from './prefill-scheduler.js'
import { RequestSampler, type SampledToken } from './request-sampler.js'
import { Sequence } from './sequence.js'
import { failureReason, gatherPage, type WorkerCore } from './worker-core.js'

/** Prompt tokens per prefill step, over all prompts being prefilled: long prompts are prefilled in
 *  chunks so that other prompts and aborts are served between them. */
export const prefillChunkTokens = 256

/** Options of {@link PrefillWorker}. */
export interface PrefillWorkerOptions {
  /** Pages per PAGES frame (G9). */
  maxPagesPerFrame?: number
  /** A transfer making no progress (no frame sent, or no ACK after END) for this long fails with
   *  `transfer_failed` (reason `stalled`) and closes the connection to that decode worker (the
   *  transfers sharing it fail, reason `connection_closed`; the next transfer opens a new one), ms.
   *  Default: the transfer sender's. Until then the pages stay pinned: P never frees them on a
   *  timer while the transfer may still read them (G7). */
  transferTimeoutMs?: number
  /** Most pages of the KV pool the prefix cache may hold; 0 (the default) turns it off. */
  prefixCachePages?: number
  /** The most pages of a tenant's default share of the prefix cache (1..prefixCachePages); unset:
   *  an equal share of what the tenants file does not give by name. */
  prefixCachePagesPerTenant?: number
  /** One prefix-cache budget shared by all tenants (least recently used across them), so that
   *  one tenant's traffic changes another's hits: for single-tenant operators only. Default
   *  false: each tenant caches only in its own partition, which the router sends with each
   *  request (`prefixCachePartition`, from the tenants file; see {@link PrefixCache.assign}). */
  prefixCacheShared?: boolean
  /** Bytes of host memory for the prefix cache's offload tier, where pages evicted from the pool
   *  go and are loaded back from (verified) on a hit; 0 or unset: no offload tier. With
   *  partitions (the default) each tenant has its partition's share of it,
   *  `floor(bytes × partition pages / prefixCachePages)`, and evicts only its own entries there;
   *  with `prefixCacheShared` the ring is shared by all tenants. */
  prefixCacheOffloadBytes?: number
  /** Directory of the offload tier's disk part, where pages dropped from host memory (or, with
   *  no host bytes, evicted from the pool) go; must exist, mode 0700. Needs
   *  `prefixCacheOffloadDiskBytes`. Unset: no disk tier. */
  prefixCacheOffloadDir?: string
  /** Most bytes of files in `prefixCacheOffloadDir` (> 0; split per tenant as the host bytes,
   *  unless `prefixCacheShared`). */
  prefixCacheOffloadDiskBytes?: number
  /** Mutual TLS for transfers to decode workers (src/link/tls.ts). Default null: plaintext. */
  transferTls?: TlsMaterial | null
  /** Without `transferTls`, send KV pages in plaintext to decode workers beyond loopback too
   *  (`--allow-plaintext`); default false: such a transfer fails with `transfer_failed` before
   *  any byte is sent (src/link/plaintext.ts). */
  allowPlaintext?: boolean
}

/** The prefill side of a disaggregated pair. One instance per process. */
export class PrefillWorker {
  private readonly clients = new Map<string, TransferClient>()
  /** The process's one prefill loop, made on first use. */
  private prefillLoop: PrefillScheduler | undefined
  /** Null when `prefixCachePages` is 0. */
  private readonly cache: PrefixCache | null
  private readonly cacheMetrics: PrefixCacheMetrics | null

  /** Throws RangeError for a negative `prefixCachePages` or one above the pool's pages, or a
   *  `prefixCachePagesPerTenant` outside 1..prefixCachePages; Error for a bad offload directory
   *  (see {@link OffloadDisk.open}). */
  constructor(
    readonly core: WorkerCore,
    private readonly options: PrefillWorkerOptions = {},
  ) {
    const maxPages = options.prefixCachePages ?? 0
    if (maxPages > core.pool.shape.numPages)
      throw new RangeError(
        `prefix cache pages ${maxPages} exceed the KV pool's ${core.pool.shape.numPages} pages`,
      )
    if (options.prefixCacheShared === true && options.prefixCachePagesPerTenant !== undefined)
      throw new RangeError('prefix cache pages per tenant need partitions, not a shared cache')
    if (maxPages === 0) {
      this.cache = null
      this.cacheMetrics = null
      return
    }
    const metrics = makePrefixCacheMetrics(core, () => this.numPagesCached)
    this.cacheMetrics = metrics
    // Each tenant's share of the tiers follows its partition, as assigned at its latest request.
    const partitionOf = (tenant: string) => this.cache?.partitionOf(tenant) ?? 0
    const offload = offloadTierOf(options, maxPages, partitionOf)
    this.cache = new PrefixCache(core.pool, {
      maxPages,
      maxPagesPerTenant: options.prefixCachePagesPerTenant,
      assigned: options.prefixCacheShared !== true,
      nextOwner: core.nextOwner,
      tenantId: core.tenantId,
      guards: core.guards,
      trips: core.trips,
      onEvict: (n) => metrics.evictions.inc(n),
      offload,
      // The model's whole config and the pool's shape: a page written under any other is refused.
      layout: JSON.stringify({ model: core.model.config, pool: core.pool.shape }),
      faults: {
        offloadLoadAsHit: core.hasFault('offload-load-as-hit'),
        offloadKeyWithoutTenant: core.hasFault('offload-key-without-tenant'),
      },
      onOffloadLoad: (outcome, tier) => metrics.offloadLoads.inc({ outcome, tier }),
    })
  }

  /** Pages the prefix cache holds now (they are evicted on demand, so they do not count against
   *  a new prompt's capacity). */
  get numPagesCached(): number {
    return this.cache?.numPages ?? 0
  }

  /** The prefix cache's invariant (see {@link PrefixCache.check}); no-op when it is off. */
  checkCache(): void {
    this.cache?.check()
  }

  /** Prefill `req` and transfer its KV to the decode worker named in it. Resolves once the decode
   *  worker acknowledged every page. Throws `context_length_exceeded` when the prompt cannot fit this
   *  pool (G3: a terminal rejection, never a substitution), `capacity_exhausted` when the pool is
   *  momentarily full, `request_aborted` when `signal` fires, `transfer_failed` on a NACK or teardown,
   *  or before any work when the transfer would go in plaintext beyond loopback (not allowed). */
  async prefill(req: PrefillRequest, signal: AbortSignal): Promise<PrefillResult> {
    const { pool } = this.core
    this.checkPlaintextTransfer(req.decode.host)
    const { tokens, isPlaceholder } = this.promptToRun(req)
    const { seq, hit } = this.leaseFor(req, tokens, isPlaceholder)
    let isPinned = false
    try {
      const { first, numCached } = await this.firstToken(seq, hit, isPlaceholder, signal)
      pool.seal(seq.lease)
      // Published only now, sealed by a completed prefill: the transfer only reads these pages, so
      // their KV is final here whatever becomes of the transfer; a concurrent prompt of the same
      // tenant can hit them already.
      if (this.cache && !isPlaceholder) this.cache.insert(seq.tenant, seq.promptTokenIds, seq.lease)
      pool.pin(seq.lease)
      isPinned = true
      const numPages = await this.sendKv(req, seq, first.tokenId, isPlaceholder, signal)
      return {
        requestId: req.requestId,
        numPages,
        numTokens: req.promptTokenIds.length,
        firstTokenId: first.tokenId,
        ...(first.logprobs === undefined ? {} : { firstTokenLogprobs: first.logprobs }),
        cachedTokens: numCached,
      }
    } finally {
      // The send promise settles only when no more page reads can happen: now the pages may go.
      if (isPinned) pool.unpin(seq.lease)
      pool.release(seq.lease)
    }
  }

  /** Without TLS, KV pages go to a decode worker beyond loopback only when the operator allowed
   *  plaintext (src/link/plaintext.ts). @throws KvfenceError `transfer_failed`. */
  private checkPlaintextTransfer(host: string): void {
    if (this.options.transferTls != null || this.options.allowPlaintext || isLoopbackHost(host))
      return
    throw new KvfenceError(
      'transfer_failed',
      `refused to send KV pages in plaintext to ${host} (beyond loopback): start the prefill worker with --tls-ca/--tls-cert/--tls-key, or --allow-plaintext`,
    )
  }

  /** The prompt this worker runs: the request's own, or (fault `placeholder-forward` with G3 off)
   *  a one-token placeholder for one over capacity. Throws G3 `context_length_exceeded` otherwise. */
  private promptToRun(req: PrefillRequest): {
    tokens: readonly number[]
    isPlaceholder: boolean
  } {
    const { guards, trips, maxSequenceTokens: limit } = this.core
    const numPromptTokens = req.promptTokenIds.length
    if (numPromptTokens <= limit) return { tokens: req.promptTokenIds, isPlaceholder: false }
    if (guards.G3 || !this.core.hasFault('placeholder-forward')) {
      throw trips.trip(
        'G3',
        `prompt of ${numPromptTokens} tokens exceeds this prefill worker's KV capacity of ${limit} tokens`,
        'context_length_exceeded',
      )
    }
    // The incident (fault injection only): the rejected prompt becomes a one-token placeholder.
    return { tokens: [this.core.model.config.bosTokenId ?? 0], isPlaceholder: true }
  }

  /** Lease pages for `tokens` (evicting prefix-cache pages when short) and make the sequence; look
   *  the prompt up in the prefix cache first, and give the hit up when the pool has no room while
   *  it is pinned. Throws `capacity_exhausted` when the pool is full even then. */
  private leaseFor(
    req: PrefillRequest,
    tokens: readonly number[],
    isPlaceholder: boolean,
  ): { seq: Sequence; hit: PrefixHit | null } {
    const owner = this.core.nextOwner()
    // The partition comes from the tenants file, with the request; without one a tenant of a
    // partitioned cache caches nothing.
    if (this.cache && this.options.prefixCacheShared !== true && req.prefixCachePartition)
      this.cache.assign(req.tenant, req.prefixCachePartition)
    // The tenant is the one the router authenticated, so the cache's salt is the server's choice.
    let hit = isPlaceholder ? null : (this.cache?.lookup(req.tenant, tokens) ?? null)
    let lease: PageLease
    try {
      lease = this.allocatePages(tokens.length, owner, req.tenant)
    } catch (err) {
      if (!hit) throw err
      // The hit's pages are pinned while we copy from them, so they cannot be evicted to make
      // room; a prompt that needs the whole pool goes without the cache instead of failing.
      this.cache!.release(hit)
      hit = null
      lease = this.allocatePages(tokens.length, owner, req.tenant)
    }
    // The sequence runs `tokens`; the transfer still announces the request's own prompt length.
    const seq = new Sequence({
      id: req.requestId,
      tenant: req.tenant,
      promptTokenIds: tokens,
      sampling: req.sampling,
      maxTokens: 1,
      stopTokenIds: new Set(),
      lease,
    })
    return { seq, hit }
  }

  /** Copy the prefix-cache hit, prefill the rest and sample the first token. Returns it with the
   *  prompt tokens the cache covered. */
  private async firstToken(
    seq: Sequence,
    hit: PrefixHit | null,
    isPlaceholder: boolean,
    signal: AbortSignal,
  ): Promise<{ first: SampledToken; numCached: number }> {
    const numCached = hit ? this.copyHit(hit, seq.lease) : 0
    if (this.cache && !isPlaceholder) {
      this.cacheMetrics!.requests.inc({ outcome: numCached > 0 ? 'hit' : 'miss' })
      this.cacheMetrics!.cachedTokens.inc(numCached)
    }
    let logits: Float32Array
    try {
      logits = await this.runPrefill(seq, numCached, signal)
    } catch (err) {
      if (this.cache && this.core.hasFault('publish-partial')) this.publishPartial(seq)
      throw err
    }
    // The same pipeline as every later token (penalties have no history yet); its
    // log-probabilities go back to the router in the result, the decode worker never sees them.
    const first = new RequestSampler(seq.sampling, 'prefill').next(logits)
    return { first, numCached }
  }

  /** Fault `publish-partial` (sglang#38319): cache an aborted or failed prefill's pages as if it had
   *  completed. With G5 on the cache refuses them (not sealed, not filled) and the trip is counted;
   *  with G5 off their unwritten KV is published. Never throws: the prefill's own error stands. */
  private publishPartial(seq: Sequence): void {
    try {
      this.cache!.insert(seq.tenant, seq.promptTokenIds, seq.lease)
    } catch {
      // Refused by G5 and counted in the guard trips.
    }
  }

  /** Send the sealed, pinned prompt pages to the decode worker; resolves once it acknowledged
   *  them, with the number of pages the manifest announced. */
  private async sendKv(
    req: PrefillRequest,
    seq: Sequence,
    firstTokenId: number,
    isPlaceholder: boolean,
    signal: AbortSignal,
  ): Promise<number> {
    const { pool } = this.core
    const { pageSize } = pool.shape
    const numPromptTokens = req.promptTokenIds.length
    const numPages = pool.pagesFor(numPromptTokens)
    // Faults only: which pages actually go on the wire (default: all of them, in order).
    const ordinalsToSend = isPlaceholder
      ? [0]
      : this.core.hasFault('truncate-transfer')
        ? Array.from({ length: Math.max(1, numPages - 1) }, (_, i) => i)
        : undefined
    // A placeholder page claims to be full: "the full KV has arrived".
    const tokensOn = (ordinal: number): number =>
      isPlaceholder ? pageSize : Math.min(pageSize, numPromptTokens - ordinal * pageSize)
    const client = this.clientFor(req.decode.host, req.decode.port)
    if (this.core.hasFault('delay-begin')) await delayBegin(signal)
    await this.countTransfer(
      ordinalsToSend?.length ?? numPages,
      client.send(
        {
          transferId: randomBytes(16).toString('hex'),
          requestId: req.requestId,
          tenant: req.tenant,
          numTokens: numPromptTokens,
          numPages,
          pageBytes: pool.pageBytes,
          secret: Buffer.from(req.transferSecret, 'hex'),
          firstTokenId,
          readPage: (ordinal, dst) => {
            gatherPage(pool, seq.lease.pages[ordinal].page, dst)
            return tokensOn(ordinal)
          },
          // Each page is gathered into the frame (one copy), not sent as its per-layer slices
          // (`viewPage`): measured side by side (`bench -- transfer`, view_vs_copy_path_ratio)
          // the slices were no faster and cost P more CPU (0.77 vs 0.72 s/GB; an earlier run
          // 1.48–1.56 vs 1.43): 2 × layers slices a page, each hashed and written on its own.
          ordinalsToSend,
          corruptPayload: this.core.hasFault('corrupt-transfer'),
        },
        signal,
      ),
    )
    return numPages
  }

  /** Reserve the pages of a prompt of `numTokens` tokens for `owner`; when the pool is short,
   *  evict unpinned prefix-cache pages first. Throws `capacity_exhausted` when even then too few
   *  pages are free (nothing is allocated then). */
  private allocatePages(numTokens: number, owner: number, tenant: string): PageLease {
    const { pool } = this.core
    const numPages = pool.pagesFor(numTokens)
    if (!pool.canAllocate(numPages)) this.cache?.evictFor(numPages, tenant)
    return pool.allocate(numPages, owner, this.core.tenantId(tenant))
  }

  /** Copy a prefix-cache hit's KV into the request's first pages, then unpin the cached pages
   *  (whether or not the copy succeeded). Returns the prompt tokens it covers. */
  private copyHit(hit: PrefixHit, lease: PageLease): number {
    try {
      this.cache!.copyInto(hit, lease)
    } finally {
      this.cache!.release(hit)
    }
    return hit.numTokens
  }

  /** Chunked prefill of `seq` in the process's prefill loop, starting after the
   *  `numCached` tokens already in them: each step runs at most {@link prefillChunkTokens} prompt
   *  tokens, shared fairly with every other prompt being prefilled. Returns the last token's
   *  logits `[vocabSize]`. */
  private async runPrefill(
    seq: Sequence,
    numCached: number,
    signal: AbortSignal,
  ): Promise<Float32Array> {
    const { model, rope, pool } = this.core
    this.prefillLoop ??= new PrefillScheduler(model, rope, pool, {
      maxTokensPerStep: prefillChunkTokens,
    })
    const logits = await this.prefillLoop.run({ seq, numCached, signal })
    if (signal.aborted) throw new KvfenceError('request_aborted', 'request aborted during prefill')
    return logits
  }

  /** Count a transfer of `numPagesSent` pages in the worker's metrics; resolves or rejects as
   *  `sending` does. */
  private async countTransfer(numPagesSent: number, sending: Promise<void>): Promise<void> {
    const { metrics, pool } = this.core
    try {
      await sending
    } catch (err) {
      metrics.transfers.inc({ outcome: 'failed' })
      metrics.transferFailures.inc({ reason: failureReason(err) })
      throw err
    }
    metrics.transfers.inc({ outcome: 'completed' })
    metrics.transferBytes.inc(numPagesSent * pool.pageBytes)
  }

  private clientFor(host: string, port: number): TransferClient {
    const key = `${host}:${port}`
    let client = this.clients.get(key)
    if (!client) {
      client = new TransferClient({
        host,
        port,
        maxPagesPerFrame: this.options.maxPagesPerFrame,
        stallTimeoutMs: this.options.transferTimeoutMs,
        ...(this.options.transferTls == null ? {} : { tls: this.options.transferTls }),
      })
      this.clients.set(key, client)
    }
    return client
  }

  /** Close every transfer connection. */
  close(): void {
    for (const client of this.clients.values()) client.close()
    this.clients.clear()
  }
}

/** Prometheus metrics of the prefix cache, registered in the worker's registry. */
interface PrefixCacheMetrics {
  /** `kvfence_prefix_cache_requests_total{outcome}`: prompts looked up, `hit` (≥ 1 page reused) or
   *  `miss`. */
  requests: Counter<'outcome'>
  /** `kvfence_prefix_cache_cached_tokens_total`: prompt tokens whose KV came from the cache. */
  cachedTokens: Counter
  /** `kvfence_prefix_cache_evictions_total`: cached pages evicted (released and scrubbed). */
  evictions: Counter
  /** `kvfence_prefix_cache_offload_loads_total{outcome,tier}`: pages loaded back from the offload
   *  tier (`host` or `disk`), `hit` (verified, used) or `refused` (failed verification: a miss). */
  offloadLoads: Counter<'outcome' | 'tier'>
}

/** The prefix cache's offload tier from `options`: host ring, disk, both (disk below host), or
 *  none. Unless `prefixCacheShared`, each tenant's share of either is its partition's
 *  ({@link partitionBytes} of the tenant's `partitionOf`, pages of a cache of `maxPages`). Throws
 *  as {@link OffloadDisk.open} for a bad directory, and Error when only one of
 *  `prefixCacheOffloadDir` and `prefixCacheOffloadDiskBytes` is given. */
function offloadTierOf(
  options: PrefillWorkerOptions,
  maxPages: number,
  partitionOf: (tenant: string) => number,
): OffloadTier | undefined {
  const shareOf = (bytes: number) =>
    options.prefixCacheShared === true
      ? {}
      : { bytesPerTenant: (t: string) => partitionBytes(bytes, partitionOf(t), maxPages) }
  const hostBytes = options.prefixCacheOffloadBytes ?? 0
  const { prefixCacheOffloadDir: dir, prefixCacheOffloadDiskBytes: diskBytes } = options
  if ((dir === undefined) !== (diskBytes === undefined))
    throw new Error(
      dir === undefined
        ? 'prefix cache offload disk bytes given without a directory'
        : `prefix cache offload dir ${dir} given without its disk bytes`,
    )
  const disk =
    dir === undefined
      ? undefined
      : OffloadDisk.open({ dir, bytes: diskBytes!, ...shareOf(diskBytes!) })
  if (hostBytes === 0) return disk
  const host = { bytes: hostBytes, ...shareOf(hostBytes) }
  return disk === undefined ? new OffloadRing(host) : new TieredOffload(host, disk)
}

function makePrefixCacheMetrics(core: WorkerCore, numPages: () => number): PrefixCacheMetrics {
  const registers = [core.metrics.registry]
  new Gauge({
    name: 'kvfence_prefix_cache_pages',
    help: 'KV pool pages held by the prefix cache (evictable)',
    registers,
    collect() {
      this.set(numPages())
    },
  })
  return {
    requests: new Counter({
      name: 'kvfence_prefix_cache_requests_total',
      help: 'Prompts looked up in the prefix cache, by outcome (hit or miss)',
      labelNames: ['outcome'] as const,
      registers,
    }),
    cachedTokens: new Counter({
      name: 'kvfence_prefix_cache_cached_tokens_total',
      help: 'Prompt tokens whose KV came from the prefix cache',
      registers,
    }),
    evictions: new Counter({
      name: 'kvfence_prefix_cache_evictions_total',
      help: 'Prefix cache pages evicted (released and scrubbed)',
      registers,
    }),
    offloadLoads: new Counter({
      name: 'kvfence_prefix_cache_offload_loads_total',
      help: 'Prefix cache pages loaded back from the offload tier (host or disk), by outcome (hit, or refused: a miss)',
      labelNames: ['outcome', 'tier'] as const,
      registers,
    }),
  }
}

/** Fault `delay-begin`: waits {@link delayBeginMs} before a transfer starts.
 *  @throws KvfenceError `request_aborted` as soon as `signal` fires (no BEGIN is sent then). */
async function delayBegin(signal: AbortSignal): Promise<void> {
  try {
    await sleep(delayBeginMs, undefined, { signal })
  } catch {
    throw new KvfenceError('request_aborted', 'request aborted before its transfer began')
  }
}
