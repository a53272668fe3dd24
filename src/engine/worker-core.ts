/** What every worker (prefill or decode) holds: the model, its RoPE tables, one KV pool, the
 *  guard switches and trip counters, the injected faults, the owner and tenant numbering,
 *  and the worker's Prometheus counters.
 *  Knows engine state; knows nothing of HTTP or the transfer wire format. */
import { Counter, Registry } from 'prom-client'
import { GuardTrips, guardIds, type Guards } from '../kv/guards.js'
import { KvPool } from '../kv/pool.js'
import { makeRope, type Rope } from '../model/forward.js'
import type { Model } from '../model/weights.js'
import { TransferError } from '../transfer/index.js'
import type { FaultConfig, FaultName } from './faults.js'

/** Options of {@link createWorkerCore}. */
export interface WorkerCoreOptions {
  model: Model
  /** Pages in this worker's KV pool. */
  numPages: number
  /** Tokens per page. */
  pageSize: number
  faults: FaultConfig
  /** Trip counter to use (e.g. one wired to a metric); default: a fresh one. */
  trips?: GuardTrips
}

/** The engine state of one worker process. */
export interface WorkerCore {
  model: Model
  rope: Rope
  pool: KvPool
  /** Most tokens one sequence (prompt + generated) may span on this worker: the pool's effective
   *  capacity or the model's positions, whichever is smaller. What every worker re-checks (G3). */
  maxSequenceTokens: number
  guards: Guards
  trips: GuardTrips
  hasFault(name: FaultName): boolean
  faultNames(): string[]
  /** A fresh owner id (≥ 1), never reused while the process lives (u32 space). */
  nextOwner(): number
  /** A small stable number for a tenant name (page metadata stores numbers, not names). */
  tenantId(name: string): number
  /** This worker's counters (registered in `metrics.registry`). */
  metrics: WorkerMetrics
}

/** A worker's Prometheus counters; gauges over the pool are added by the HTTP server. */
export interface WorkerMetrics {
  /** The registry `/metrics` serves (never prom-client's global one). */
  registry: Registry
  /** `kvfence_guard_trips_total{guard}`: times a guard refused an operation. */
  guardTrips: Counter<'guard'>
  /** `kvfence_transfers_total{outcome}`: transfers ended, by outcome (`completed` | `failed`). */
  transfers: Counter<'outcome'>
  /** `kvfence_transfer_bytes_total`: page payload bytes of completed transfers (sent on P,
   *  received on D). */
  transferBytes: Counter
  /** `kvfence_transfer_failures_total{reason}`: failed transfers by refusal reason
   *  (`checksum_mismatch`, `stalled`, `aborted_by_sender`, ...; `other` when the error has none). */
  transferFailures: Counter<'reason'>
  /** `kvfence_worker_requests_total{outcome}`: control-plane requests ended, by outcome (`ok`, or
   *  the error code, e.g. `request_aborted`). */
  requests: Counter<'outcome'>
}

/** Counters of one worker, the guard trip counter wired to `trips`. */
export function makeWorkerMetrics(trips: GuardTrips): WorkerMetrics {
  const registry = new Registry()
  const guardTrips = new Counter({
    name: 'kvfence_guard_trips_total',
    help: 'Times a safety guard refused an operation, by guard',
    labelNames: ['guard'] as const,
    registers: [registry],
  })
  // Every guard appears from the start (0), so a dashboard can tell "never tripped" from "absent".
  for (const id of guardIds) guardTrips.inc({ guard: id }, trips.counts[id])
  trips.onTrip((guard) => guardTrips.inc({ guard }))
  return {
    registry,
    guardTrips,
    transfers: new Counter({
      name: 'kvfence_transfers_total',
      help: 'KV transfers ended, by outcome',
      labelNames: ['outcome'] as const,
      registers: [registry],
    }),
    transferBytes: new Counter({
      name: 'kvfence_transfer_bytes_total',
      help: 'Page payload bytes of completed KV transfers',
      registers: [registry],
    }),
    requests: new Counter({
      name: 'kvfence_worker_requests_total',
      help: 'Prefill or generate requests ended, by outcome (ok or the error code)',
      labelNames: ['outcome'] as const,
      registers: [registry],
    }),
    transferFailures: new Counter({
      name: 'kvfence_transfer_failures_total',
      help: 'Failed KV transfers, by refusal reason',
      labelNames: ['reason'] as const,
      registers: [registry],
    }),
  }
}

/** The refusal reason of a failed transfer's error, for `kvfence_transfer_failures_total`:
 *  the guard id for a guard trip ("G7"), a {@link TransferError}'s reason ("checksum_mismatch"),
 *  or the error code. */
export function failureReason(err: unknown): string {
  if (err instanceof Error) {
    const guard = (err as { guard?: unknown }).guard
    if (typeof guard === 'string') return guard
    if (err instanceof TransferError) return err.reason
    const code = (err as { code?: unknown }).code
    if (typeof code === 'string') return code
  }
  return 'other'
}

/** Build a worker's state. Throws RangeError for a non-positive pool size. */
export function createWorkerCore(opts: WorkerCoreOptions): WorkerCore {
  const guards = opts.faults.guards
  const trips = opts.trips ?? new GuardTrips()
  const { config } = opts.model
  const pool = new KvPool(
    {
      numPages: opts.numPages,
      pageSize: opts.pageSize,
      numLayers: config.numLayers,
      numKvHeads: config.numKvHeads,
      headDim: config.headDim,
    },
    guards,
    trips,
    {
      staleEpoch: opts.faults.faults.has('stale-epoch'),
      skipScrub: opts.faults.faults.has('skip-scrub'),
    },
  )
  let lastOwner = 0
  const tenants = new Map<string, number>()
  const metrics = makeWorkerMetrics(trips)
  return {
    metrics,
    model: opts.model,
    rope: makeRope(opts.model, opts.numPages * opts.pageSize), // no position beyond the pool
    pool,
    maxSequenceTokens: Math.min(pool.capacityTokens, config.maxPositionEmbeddings),
    guards,
    trips,
    hasFault: (name) => opts.faults.faults.has(name),
    faultNames: () => [...opts.faults.faults],
    nextOwner: () => {
      lastOwner = lastOwner === 0xffffffff ? 1 : lastOwner + 1
      return lastOwner
    },
    tenantId: (name) => {
      let id = tenants.get(name)
      if (id === undefined) tenants.set(name, (id = tenants.size + 1))
      return id
    },
  }
}

/** Copy page `page` of every layer (K then V, layer by layer) into `dst` (`pool.pageBytes` bytes):
 *  the transfer payload layout of DESIGN.md §6 (floats in the machine's byte order, little-endian
 *  on every platform Node supports). Copies bytes through views, so `dst` may sit at any offset of
 *  a frame buffer (payloads are not 4-byte aligned on the wire) and nothing is allocated per page. */
export function gatherPage(pool: KvPool, page: number, dst: Uint8Array): void {
  const numBytes = pool.pageStride * Float32Array.BYTES_PER_ELEMENT
  let at = 0
  for (let layer = 0; layer < pool.shape.numLayers; layer++) {
    for (const store of [pool.k[layer], pool.v[layer]]) {
      dst.set(pageBytesOf(store, page, numBytes), at)
      at += numBytes
    }
  }
}

/** Inverse of {@link gatherPage}: write a payload (any alignment) into page `page` of every layer. */
export function scatterPage(pool: KvPool, page: number, payload: Uint8Array): void {
  const numBytes = pool.pageStride * Float32Array.BYTES_PER_ELEMENT
  let at = 0
  for (let layer = 0; layer < pool.shape.numLayers; layer++) {
    for (const store of [pool.k[layer], pool.v[layer]]) {
      pageBytesOf(store, page, numBytes).set(payload.subarray(at, at + numBytes))
      at += numBytes
    }
  }
}

/** Byte views of page `page` in transfer payload order (for each layer, K then V), over the pool's
 *  own memory: where a payload is sent from, or received into, without a copy. Checks nothing;
 *  the caller holds the page (pinned, claimed). */
export function pageSlices(pool: KvPool, page: number): Uint8Array[] {
  const numBytes = pool.pageStride * Float32Array.BYTES_PER_ELEMENT
  const slices: Uint8Array[] = []
  for (let layer = 0; layer < pool.shape.numLayers; layer++)
    slices.push(
      pageBytesOf(pool.k[layer], page, numBytes),
      pageBytesOf(pool.v[layer], page, numBytes),
    )
  return slices
}

/** A byte view of page `page` of one layer's K or V storage. */
function pageBytesOf(store: Float32Array, page: number, numBytes: number): Uint8Array {
  return new Uint8Array(store.buffer, store.byteOffset + page * numBytes, numBytes)
}
