/** Streaming read bandwidth with N threads reading at once: the memory bound of decode, which
 *  reads every weight once per token and writes next to nothing. Each thread sums F32 values of a
 *  buffer far larger than the last-level cache with the SIMD kernels' own reduction (`sumF32` in
 *  asm/kernels.ts: 128-bit loads, as the linear kernels make), the threads being the compute
 *  threads of the kernels (src/model/threads/): the calling thread and N − 1 helpers claim chunks
 *  of one job over one shared WebAssembly memory, as they do for a linear. A copy (copy-bandwidth.ts)
 *  reads and writes each byte, so it measures less than a read alone and is no bound for decode. */
import { readFileSync } from 'node:fs'
import { kernelsWasmPath } from '../src/model/kernels-wasm.js'
import { chunkCount, Op, type KernelExports } from '../src/model/threads/protocol.js'
import { startTeam, type ThreadTeam } from '../src/model/threads/team.js'

/** WebAssembly pages are 64 KiB. */
const pageBytes = 65_536
/** The buffer starts above the module's static data (the kernels keep theirs below 64 KiB). */
const heapStart = pageBytes
/** Bytes kept for the per-chunk sums, below the buffer. */
const sumsBytes = 4096

/** The part of the WebAssembly JS API used here (the project's `lib` has no DOM types). */
interface WasmApi {
  Memory: new (d: { initial: number; maximum: number; shared: boolean }) => {
    readonly buffer: ArrayBufferLike
    grow(pages: number): number
  }
  Module: new (bytes: Uint8Array) => object
  Instance: new (module: object, imports: object) => { exports: object }
}
const WebAssembly = (globalThis as unknown as { WebAssembly: WasmApi }).WebAssembly

/** Read bandwidth of a fixed number of threads, measurable again and again (the buffer stays
 *  allocated and the helper threads running between measurements), so that it can be measured
 *  next to each timed repeat of a benchmark, under the same load. */
export interface ReadMeter {
  /** Threads reading at once, the caller included. */
  readonly threads: number
  /** Bytes read per round, over all threads. */
  readonly bytes: number
  /** Median over `rounds` rounds of bytes read ÷ time until the last chunk was summed, in GB/s
   *  (10⁹ B/s). Throws when a helper thread fails or stops responding. */
  measure(rounds: number): number
  /** What the last round summed (the buffer holds ones: the number of values read, exactly while
   *  each partial sum stays within F32's 2²⁴ integers). */
  sum(): number
  /** Stop the helper threads (the memory goes with the meter). */
  close(): void
}

/** Start a {@link ReadMeter} of `threads` threads reading `totalBytes` (rounded down to 64-byte
 *  lines) of F32 ones, after one round that brings the pages in. Throws a one-line error when the
 *  kernels are not built (`npm run build:wasm`) or a helper fails to start. */
export function openReadMeter(threads: number, totalBytes: number): ReadMeter {
  const bytes = Math.floor(totalBytes / 64) * 64
  const xPtr = heapStart + sumsBytes
  const memory = new WebAssembly.Memory({
    initial: Math.ceil((xPtr + bytes) / pageBytes),
    maximum: 65_536,
    shared: true,
  })
  const module = new WebAssembly.Module(readFileSync(kernelsWasmPath))
  const wasm = new WebAssembly.Instance(module, { env: { memory } })
    .exports as unknown as KernelExports
  new Float32Array(memory.buffer, xPtr, bytes / 4).fill(1)
  const team: ThreadTeam | null = threads > 1 ? startTeam(threads, module, memory, wasm) : null
  const count = bytes / 4
  const chunks = team ? chunkCount(Op.sumF32, [heapStart, xPtr, count], threads) : 1
  /** One round: seconds until every chunk of the buffer is summed. */
  const once = (): number => {
    const t0 = process.hrtime.bigint()
    if (team) team.run(Op.sumF32, [heapStart, xPtr, count])
    else wasm.sumF32(heapStart, xPtr, count)
    return Number(process.hrtime.bigint() - t0) / 1e9
  }
  once()
  return {
    threads,
    bytes,
    measure(rounds) {
      const rates: number[] = []
      for (let r = 0; r < rounds; r++) rates.push(bytes / once() / 1e9)
      rates.sort((a, b) => a - b)
      const m = rates.length >> 1
      return rates.length % 2 ? rates[m] : (rates[m - 1] + rates[m]) / 2
    },
    sum() {
      return new Float32Array(memory.buffer, heapStart, chunks).reduce((s, x) => s + x, 0)
    },
    close() {
      team?.close()
    },
  }
}
