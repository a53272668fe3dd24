/** What every worker (prefill or decode) holds: the model, its RoPE tables, one KV pool, the
 *  guard switches and trip counters, the injected faults, and the request-slot and tenant numbering.
 *  Knows engine state; knows nothing of HTTP or the transfer wire format. */
import { GuardTrips, makeGuards, type Guards } from '../kv/guards.js'
import { KvPool } from '../kv/pool.js'
import { makeRope, type Rope } from '../model/forward.js'
import type { Model } from '../model/weights.js'
import type { FaultConfig, FaultName } from './faults.js'

/** Options of {@link createWorkerCore}. */
export interface WorkerCoreOptions {
  model: Model
  /** Pages in this worker's KV pool. */
  numPages: number
  /** Tokens per page. */
  pageSize: number
  faults: FaultConfig
}

/** The engine state of one worker process. */
export interface WorkerCore {
  model: Model
  rope: Rope
  pool: KvPool
  guards: Guards
  trips: GuardTrips
  hasFault(name: FaultName): boolean
  faultNames(): string[]
  /** A fresh request slot (owner id ≥ 1), never reused while the process lives (u32 space). */
  nextOwner(): number
  /** A small stable number for a tenant name (page metadata stores numbers, not names). */
  tenantId(name: string): number
}

/** Build a worker's state. Throws RangeError for a non-positive pool size. */
export function createWorkerCore(opts: WorkerCoreOptions): WorkerCore {
  const guards = makeGuards(opts.faults.guardsEnabled)
  const trips = new GuardTrips()
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
  return {
    model: opts.model,
    rope: makeRope(opts.model),
    pool,
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

/** Copy page `ref` of every layer (K then V, layer by layer) into `dst` (`pool.pageBytes` bytes):
 *  the transfer payload layout of DESIGN.md §6. */
export function gatherPage(pool: KvPool, page: number, dst: Uint8Array): void {
  // A frame buffer may place the payload at an unaligned offset: gather into aligned scratch then.
  const isAligned = dst.byteOffset % 4 === 0
  const floats = isAligned
    ? new Float32Array(dst.buffer, dst.byteOffset, dst.byteLength / 4)
    : new Float32Array(dst.byteLength / 4)
  const start = page * pool.pageStride
  let at = 0
  for (let layer = 0; layer < pool.shape.numLayers; layer++) {
    floats.set(pool.k[layer].subarray(start, start + pool.pageStride), at)
    at += pool.pageStride
    floats.set(pool.v[layer].subarray(start, start + pool.pageStride), at)
    at += pool.pageStride
  }
  if (!isAligned) dst.set(new Uint8Array(floats.buffer))
}

/** Inverse of {@link gatherPage}: write a payload into page `page` of every layer. */
export function scatterPage(pool: KvPool, page: number, payload: Uint8Array): void {
  // The payload may sit at an unaligned offset in a network buffer: copy it aligned first.
  const aligned = payload.byteOffset % 4 === 0 ? payload : new Uint8Array(payload) // a copy (Buffer#slice would be a view)
  const floats = new Float32Array(aligned.buffer, aligned.byteOffset, aligned.byteLength / 4)
  const start = page * pool.pageStride
  let at = 0
  for (let layer = 0; layer < pool.shape.numLayers; layer++) {
    pool.k[layer].set(floats.subarray(at, at + pool.pageStride), start)
    at += pool.pageStride
    pool.v[layer].set(floats.subarray(at, at + pool.pageStride), start)
    at += pool.pageStride
  }
}
