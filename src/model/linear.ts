/** Weight matrices of linear layers and the compute kernels that apply them: the seam between the
 *  forward pass and where (JS heap or WebAssembly memory) and how (plain TS or SIMD) it computes.
 *  Knows shapes, dtypes and memory; knows nothing of models, pools or requests. */

/** Storage dtype of a weight matrix. BF16 is kept as stored (the top 16 bits of an F32) and
 *  widened at use, so it is exact and moves half the bytes of F32. */
export type WeightDtype = 'f32' | 'bf16'

/** A weight matrix `[outDim, inDim]`, row-major (PyTorch `nn.Linear`, HF tensor layout). */
export type LinearWeights =
  | {
      readonly dtype: 'f32'
      readonly outDim: number
      readonly inDim: number
      readonly data: Float32Array
    }
  | {
      readonly dtype: 'bf16'
      readonly outDim: number
      readonly inDim: number
      readonly data: Uint16Array
    }

/** The compute kernels of one model. Buffers passed to them must come from {@link Kernels.allocF32},
 *  {@link Kernels.allocU16} or {@link Kernels.scratch} for the WebAssembly kernels to run without a
 *  copy; others are accepted and copied. */
export interface Kernels {
  /** `ts` (the plain TypeScript oracle) or `wasm-simd`. */
  readonly name: string
  /** Threads each call computes on, the caller's included (1: the calling thread only). */
  readonly threads: number
  /** Stop any helper threads (idempotent). The kernels stay usable on the calling thread alone,
   *  with bit-identical results. */
  close(): void
  /** A zeroed, long-lived F32 array in the kernels' memory (weights). */
  allocF32(count: number): Float32Array
  /** A zeroed, long-lived u16 array in the kernels' memory (BF16 weights). */
  allocU16(count: number): Uint16Array
  /** A reusable F32 array of `count` floats under `key`: the same memory on every call with
   *  the same key (contents undefined), so a caller must not hold it across calls. */
  scratch(key: string, count: number): Float32Array
  /** out[n, outDim] = x[n, inDim] · wᵀ + bias. */
  linear(
    out: Float32Array,
    x: Float32Array,
    w: LinearWeights,
    bias: Float32Array | null,
    n: number,
  ): void
  /** Causal grouped-query attention over a contiguous context: token t (position startPos + t)
   *  attends to context rows [0, startPos + t]. q, out: `[n, numHeads·headDim]`; k, v:
   *  `[startPos + n, numKvHeads·headDim]` (RoPE already applied). Softmax scale 1/√headDim. */
  attention(
    out: Float32Array,
    q: Float32Array,
    k: Float32Array,
    v: Float32Array,
    n: number,
    startPos: number,
    numHeads: number,
    numKvHeads: number,
    headDim: number,
  ): void
  /** RMSNorm row by row: out = x / sqrt(mean(x²) + eps) ⊙ weight; x, out: `[n, d]`. */
  rmsNorm(
    out: Float32Array,
    x: Float32Array,
    weight: Float32Array,
    n: number,
    d: number,
    eps: number,
  ): void
  /** SwiGLU in place: gate[i] = silu(gate[i]) · up[i] for i < count. */
  swiglu(gate: Float32Array, up: Float32Array, count: number): void
  /** Residual add in place: x[i] += y[i] for i < count. */
  addInPlace(x: Float32Array, y: Float32Array, count: number): void
  /** RoPE in place (rotate-half): row t of x `[n, numHeads·headDim]` by row t of cos, sin
   *  `[n, headDim / 2]`. */
  rope(
    x: Float32Array,
    cos: Float32Array,
    sin: Float32Array,
    n: number,
    numHeads: number,
    headDim: number,
  ): void
}

/** F32 value of BF16 bits `b` (exact). */
export function bf16ToF32(b: number): number {
  const u = new Uint32Array([b << 16])
  return new Float32Array(u.buffer)[0]
}

/** Copy row `row` of `w` into `out` at `offset` as F32 (exact for BF16). */
export function readRow(w: LinearWeights, row: number, out: Float32Array, offset: number): void {
  const start = row * w.inDim
  if (w.dtype === 'f32') {
    out.set(w.data.subarray(start, start + w.inDim), offset)
    return
  }
  // Widen into the F32 bit patterns directly: out's bytes at offset hold u32 = bits << 16.
  const u32 = new Uint32Array(out.buffer, out.byteOffset + offset * 4, w.inDim)
  for (let i = 0; i < w.inDim; i++) u32[i] = w.data[start + i] << 16
}

/** The whole matrix as a fresh F32 array (exact; for oracles and tests). */
export function toF32(w: LinearWeights): Float32Array {
  if (w.dtype === 'f32') return w.data.slice()
  const out = new Float32Array(w.outDim * w.inDim)
  for (let r = 0; r < w.outDim; r++) readRow(w, r, out, r * w.inDim)
  return out
}

/** Bytes one full pass over the matrix reads (what decode streams from memory per token). */
export function weightBytes(w: LinearWeights): number {
  return w.data.byteLength
}
