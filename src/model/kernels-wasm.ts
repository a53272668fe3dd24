/** WebAssembly SIMD kernels (asm/kernels.ts, compiled by `npm run build:wasm` into
 *  `kernels.wasm` beside this file) behind the {@link Kernels} interface.
 *
 *  Weights and scratch live in one shared `WebAssembly.Memory` owned by the returned value; it only
 *  grows, and a shared memory's old views stay valid when it grows (they are never detached), so
 *  arrays handed out remain usable for the life of the kernels. Memory is shared so that helper
 *  threads (threads/) run the same module over the same weights and activations: with
 *  `threads` > 1 each linear is cut into chunks of output rows, and attention into heads × token
 *  blocks, which the calling thread and the helpers claim (threads/protocol.ts); every output
 *  element is computed by the same code over the same inputs as with one thread, so results are
 *  bit-identical whatever the thread count.
 *  Knows addresses and shapes; knows nothing of models or pools. */
import { readFileSync } from 'node:fs'
import { fileURLToPath } from 'node:url'
import type { Kernels, LinearWeights } from './linear.js'
import { Op, type KernelExports } from './threads/protocol.js'
import { startTeam, type ComputeThreadsError, type ThreadTeam } from './threads/team.js'

const pageBytes = 65_536
/** Below this the module keeps its static data (a 1 KiB exp table at 1024); we allocate above. */
const heapStart = pageBytes
/** 4 GiB, the wasm32 limit: only reserves address space. */
const maxPages = 65_536

/** The part of the WebAssembly JS API used here (the project's `lib` has no DOM types). */
interface WasmMemory {
  readonly buffer: ArrayBufferLike
  grow(pages: number): number
}
interface WasmApi {
  Memory: new (d: { initial: number; maximum: number; shared: boolean }) => WasmMemory
  Module: new (bytes: Uint8Array) => object
  Instance: new (module: object, imports: object) => { exports: object }
}
const WebAssembly = (globalThis as unknown as { WebAssembly: WasmApi }).WebAssembly

/** Path of the compiled module. */
export const kernelsWasmPath = fileURLToPath(new URL('./kernels.wasm', import.meta.url))

/** Options of {@link createWasmKernels}. */
export interface WasmKernelOptions {
  /** Threads computing each kernel call, the caller's included (default 1: no helper threads).
   *  A positive integer. */
  threads?: number
  /** Calls with fewer multiply-adds than this run on the calling thread alone (default 65,536,
   *  a few µs: handing out less would cost more than it saves; a helper spins between the calls
   *  of a forward step, so a job starts without a wake-up). Decode's 576 × 192 K and V
   *  projections of SmolLM2-135M (110,592) are split. Tests pass 0 to split every call. */
  parallelMinWork?: number
  /** Called once when the helper threads fail (a trap, a helper error, or a helper that stopped
   *  responding for 120 s), before the kernel call throws. The kernels are unusable from then on
   *  (every split call throws): a serving process should exit and be restarted. */
  onFailure?: (err: ComputeThreadsError) => void
}

/** Work of one SwiGLU element counted in multiply-adds (the exp, a division, a product): what
 *  {@link WasmKernelOptions.parallelMinWork} compares against. */
const swigluWork = 32

/** Default of {@link WasmKernelOptions.parallelMinWork}. */
const defaultParallelMinWork = 65_536

/** Compile and instantiate the SIMD kernels with a fresh memory, and start `threads − 1` helper
 *  threads over it. Throws a one-line error when the compiled module is missing (run
 *  `npm run build:wasm`), the runtime lacks WebAssembly SIMD or threads, `threads` is not a
 *  positive integer, or a helper thread fails to start (never falls back to fewer threads).
 *  Call `close()` to stop the helpers (they never keep the process alive). */
export function createWasmKernels(options: WasmKernelOptions = {}): Kernels {
  const threads = options.threads ?? 1
  if (!Number.isInteger(threads) || threads < 1 || threads > 64)
    throw new Error(`threads must be an integer from 1 to 64, got ${threads}`)
  const { module, memory, wasm } = loadKernels()
  const parallelMinWork = options.parallelMinWork ?? defaultParallelMinWork
  let team: ThreadTeam | null =
    threads > 1 ? startTeam(threads, module, memory, wasm, options.onFailure) : null
  // The element-wise exports, typed here (threads/protocol.ts types the threaded ones).
  const elementwise = wasm as unknown as ElementwiseExports
  const { buffers, reserve, buffer, scratch, addressOf, weightAddress } = createHeap(memory)

  return {
    name: 'wasm-simd',
    threads,
    close() {
      team?.close()
      team = null
    },
    allocF32(count) {
      const ptr = reserve(count * 4) // first: it may grow the memory, and buffer() must see that
      return new Float32Array(buffer(), ptr, count)
    },
    allocU16(count) {
      const ptr = reserve(count * 2)
      return new Uint16Array(buffer(), ptr, count)
    },
    scratch,
    linear(out, x, w, bias, n) {
      const outPtr = addressOf(out, 'linear.out', false)
      const xPtr = addressOf(x, 'linear.x', true)
      const biasPtr = bias ? addressOf(bias, 'linear.bias', true) : 0
      const wPtr = weightAddress(w)
      const { inDim, outDim } = w
      if (team && n * inDim * outDim >= parallelMinWork) {
        const op = w.dtype === 'f32' ? Op.linearF32 : Op.linearBf16
        team.run(op, [outPtr, xPtr, wPtr, biasPtr, n, inDim, outDim])
      } else if (w.dtype === 'f32')
        wasm.linearF32(outPtr, xPtr, wPtr, biasPtr, n, inDim, outDim, 0, outDim)
      else wasm.linearBf16(outPtr, xPtr, wPtr, biasPtr, n, inDim, outDim, 0, outDim)
      if (!buffers.has(out.buffer)) out.set(new Float32Array(buffer(), outPtr, n * outDim))
    },
    attention(out, q, k, v, n, startPos, numHeads, numKvHeads, headDim) {
      const outPtr = addressOf(out, 'attention.out', false)
      const qPtr = addressOf(q, 'attention.q', true)
      const kPtr = addressOf(k, 'attention.k', true)
      const vPtr = addressOf(v, 'attention.v', true)
      const numKeys = startPos + n
      const work = n * numKeys * numHeads * headDim
      if (team && numHeads > 1 && work >= parallelMinWork) {
        // Two scores rows per thread (the kernel takes query rows in pairs), 16-byte aligned.
        const stride = 2 * Math.ceil(numKeys / 4) * 4
        const scores = scratch('attention.scores', stride * team.threads)
        team.run(Op.attention, [
          outPtr,
          qPtr,
          kPtr,
          vPtr,
          scores.byteOffset,
          n,
          startPos,
          numHeads,
          numKvHeads,
          headDim,
          stride * 4,
        ])
      } else {
        const scores = scratch('attention.scores', 2 * Math.ceil(numKeys / 4) * 4)
        wasm.attention(
          outPtr,
          qPtr,
          kPtr,
          vPtr,
          scores.byteOffset,
          n,
          startPos,
          numHeads,
          numKvHeads,
          headDim,
          1 / Math.sqrt(headDim),
          0,
          numHeads,
        )
      }
      if (!buffers.has(out.buffer))
        out.set(new Float32Array(buffer(), outPtr, n * numHeads * headDim))
    },
    // Element-wise steps (asm/kernels.ts), on the calling thread but for a big SwiGLU.
    rmsNorm(out, x, weight, n, d, eps) {
      const outPtr = addressOf(out, 'rmsNorm.out', false)
      const xPtr = addressOf(x, 'rmsNorm.x', true)
      const wPtr = addressOf(weight, 'rmsNorm.weight', true)
      elementwise.rmsNorm(outPtr, xPtr, wPtr, n, d, eps)
      if (!buffers.has(out.buffer)) out.set(new Float32Array(buffer(), outPtr, n * d))
    },
    swiglu(gate, up, count) {
      const gPtr = addressOf(gate.subarray(0, count), 'swiglu.gate', true)
      const uPtr = addressOf(up.subarray(0, count), 'swiglu.up', true)
      // Split between the threads when big (prefill: the exp of 1.5 M gates per layer at 1,000
      // tokens would otherwise leave the helpers idle); element-wise, so bit-identical.
      if (team && count * swigluWork >= parallelMinWork) team.run(Op.swiglu, [gPtr, uPtr, count])
      else wasm.swiglu(gPtr, uPtr, count)
      if (!buffers.has(gate.buffer)) gate.set(new Float32Array(buffer(), gPtr, count))
    },
    addInPlace(x, y, count) {
      const xPtr = addressOf(x.subarray(0, count), 'add.x', true)
      elementwise.addInPlace(xPtr, addressOf(y.subarray(0, count), 'add.y', true), count)
      if (!buffers.has(x.buffer)) x.set(new Float32Array(buffer(), xPtr, count))
    },
    rope(x, cos, sin, n, numHeads, headDim) {
      const count = n * numHeads * headDim
      const angles = (n * headDim) / 2 // floats of cos (and of sin) used
      const xPtr = addressOf(x.subarray(0, count), 'rope.x', true)
      const cPtr = addressOf(cos.subarray(0, angles), 'rope.cos', true)
      const sPtr = addressOf(sin.subarray(0, angles), 'rope.sin', true)
      elementwise.rope(xPtr, cPtr, sPtr, n, numHeads, headDim)
      if (!buffers.has(x.buffer)) x.set(new Float32Array(buffer(), xPtr, count))
    },
  }
}

/** The compiled module, instantiated over a fresh shared memory. Throws a one-line error when
 *  the module is missing (run `npm run build:wasm`) or the runtime cannot load it (no SIMD or
 *  threads). */
function loadKernels(): { module: object; memory: WasmMemory; wasm: KernelExports } {
  let bytes: Buffer
  try {
    bytes = readFileSync(kernelsWasmPath)
  } catch {
    throw new Error(
      `WebAssembly kernels not built: ${kernelsWasmPath} is missing (run npm run build:wasm)`,
    )
  }
  const memory = new WebAssembly.Memory({ initial: 16, maximum: maxPages, shared: true })
  try {
    const module = new WebAssembly.Module(bytes)
    const instance = new WebAssembly.Instance(module, { env: { memory } })
    return { module, memory, wasm: instance.exports as unknown as KernelExports }
  } catch (err) {
    throw new Error(`cannot load the WebAssembly SIMD kernels: ${(err as Error).message}`)
  }
}

/** The allocator of `memory` above {@link heapStart}: it only grows. `scratch(key, count)` is a
 *  reusable array per key; `addressOf` the address of an array inside the memory, or of a
 *  scratch copy of one outside it. */
function createHeap(memory: WasmMemory) {
  // Every SharedArrayBuffer this memory has handed out (one per size it had): a typed array over
  // one of them is inside the memory, at address = its byteOffset.
  const buffers = new WeakSet<ArrayBufferLike>()
  let top = heapStart

  /** Reserve `bytes` (16-byte aligned) and return the address. */
  function reserve(numBytes: number): number {
    const ptr = top
    top += Math.ceil(numBytes / 16) * 16
    const needPages = Math.ceil(top / pageBytes) - memory.buffer.byteLength / pageBytes
    if (top > maxPages * pageBytes)
      throw new RangeError(`WebAssembly memory full (${top} bytes wanted)`)
    if (needPages > 0) memory.grow(needPages)
    return ptr
  }
  function buffer(): ArrayBufferLike {
    const b = memory.buffer
    buffers.add(b)
    return b
  }
  const scratches = new Map<string, { ptr: number; capacity: number }>()
  function scratch(key: string, count: number): Float32Array {
    let s = scratches.get(key)
    if (!s || s.capacity < count) {
      const capacity = Math.max(count, (s?.capacity ?? 0) * 2)
      scratches.set(key, (s = { ptr: reserve(capacity * 4), capacity }))
    }
    return new Float32Array(buffer(), s.ptr, count)
  }
  /** Address of `a` in the memory, or of a scratch copy of it (`key`) when it lives elsewhere. */
  function addressOf(a: Float32Array, key: string, copyIn: boolean): number {
    if (buffers.has(a.buffer)) return a.byteOffset
    const copy = scratch(key, a.length)
    if (copyIn) copy.set(a)
    return copy.byteOffset
  }
  function weightAddress(w: LinearWeights): number {
    if (!buffers.has(w.data.buffer))
      throw new Error('weights were not allocated by these WebAssembly kernels')
    return w.data.byteOffset
  }

  return { buffers, reserve, buffer, scratch, addressOf, weightAddress }
}

/** Element-wise exports of asm/kernels.ts; addresses are bytes in the shared memory. */
interface ElementwiseExports {
  rmsNorm(out: number, x: number, weight: number, n: number, d: number, eps: number): void
  addInPlace(x: number, y: number, count: number): void
  rope(x: number, cos: number, sin: number, n: number, numHeads: number, headDim: number): void
}
