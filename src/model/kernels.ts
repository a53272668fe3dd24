/** Plain TypeScript compute kernels for the forward pass: the reference implementation (oracle)
 *  that the WebAssembly kernels (kernels-wasm.ts) must match. Shapes are row-major; activations
 *  are float32. */
import type { Kernels, LinearWeights } from './linear.js'

/** out[n, outDim] = x[n, inDim] · wᵀ + bias, with w of shape `[outDim, inDim]` (PyTorch `nn.Linear`). */
export function matmulT(
  out: Float32Array,
  x: Float32Array,
  w: Float32Array,
  bias: Float32Array | null,
  n: number,
  inDim: number,
  outDim: number,
): void {
  for (let t = 0; t < n; t++) {
    const xOff = t * inDim
    for (let j = 0; j < outDim; j++) {
      const wOff = j * inDim
      let s0 = 0
      let s1 = 0
      let s2 = 0
      let s3 = 0
      let i = 0
      for (; i + 3 < inDim; i += 4) {
        s0 += x[xOff + i] * w[wOff + i]
        s1 += x[xOff + i + 1] * w[wOff + i + 1]
        s2 += x[xOff + i + 2] * w[wOff + i + 2]
        s3 += x[xOff + i + 3] * w[wOff + i + 3]
      }
      for (; i < inDim; i++) s0 += x[xOff + i] * w[wOff + i]
      out[t * outDim + j] = s0 + s1 + s2 + s3 + (bias ? bias[j] : 0)
    }
  }
}

/** As {@link matmulT} with BF16 weights (u16 = the top half of an F32), widened one at a time. */
export function matmulTBf16(
  out: Float32Array,
  x: Float32Array,
  w: Uint16Array,
  bias: Float32Array | null,
  n: number,
  inDim: number,
  outDim: number,
): void {
  const bits = new Uint32Array(1)
  const f = new Float32Array(bits.buffer)
  for (let t = 0; t < n; t++) {
    const xOff = t * inDim
    for (let j = 0; j < outDim; j++) {
      const wOff = j * inDim
      let s = 0
      for (let i = 0; i < inDim; i++) {
        bits[0] = w[wOff + i] << 16
        s += x[xOff + i] * f[0]
      }
      out[t * outDim + j] = s + (bias ? bias[j] : 0)
    }
  }
}

/** Causal grouped-query attention over a contiguous context; see {@link Kernels.attention}. */
export function attention(
  out: Float32Array,
  q: Float32Array,
  k: Float32Array,
  v: Float32Array,
  n: number,
  startPos: number,
  numHeads: number,
  numKvHeads: number,
  headDim: number,
): void {
  const qDim = numHeads * headDim
  const kvDim = numKvHeads * headDim
  const groupSize = numHeads / numKvHeads
  const scale = 1 / Math.sqrt(headDim)
  const scores = new Float32Array(startPos + n)
  for (let t = 0; t < n; t++) {
    const numKeys = startPos + t + 1
    for (let head = 0; head < numHeads; head++) {
      const qOff = t * qDim + head * headDim
      const kvHeadOff = Math.floor(head / groupSize) * headDim
      let max = -Infinity
      for (let p = 0; p < numKeys; p++) {
        const kOff = p * kvDim + kvHeadOff
        let dot = 0
        for (let i = 0; i < headDim; i++) dot += q[qOff + i] * k[kOff + i]
        const s = dot * scale
        scores[p] = s
        if (s > max) max = s
      }
      let sum = 0
      for (let p = 0; p < numKeys; p++) {
        const e = Math.exp(scores[p] - max)
        scores[p] = e
        sum += e
      }
      const outOff = t * qDim + head * headDim
      out.fill(0, outOff, outOff + headDim)
      for (let p = 0; p < numKeys; p++) {
        const weight = scores[p] / sum
        const vOff = p * kvDim + kvHeadOff
        for (let i = 0; i < headDim; i++) out[outOff + i] += weight * v[vOff + i]
      }
    }
  }
}

/** RMSNorm (Zhang & Sennrich 2019) row by row: out = x / sqrt(mean(x²) + eps) ⊙ weight; `[n, d]`. */
export function rmsNorm(
  out: Float32Array,
  x: Float32Array,
  weight: Float32Array,
  n: number,
  d: number,
  eps: number,
): void {
  for (let t = 0; t < n; t++) {
    const off = t * d
    let ss = 0
    for (let i = 0; i < d; i++) ss += x[off + i] * x[off + i]
    const inv = 1 / Math.sqrt(ss / d + eps)
    for (let i = 0; i < d; i++) out[off + i] = x[off + i] * inv * weight[i]
  }
}

/** SiLU: x · sigmoid(x). */
export function silu(x: number): number {
  return x / (1 + Math.exp(-x))
}

/** SwiGLU (Shazeer 2020) in place: gate[i] = silu(gate[i]) · up[i] for i < count. */
export function swiglu(gate: Float32Array, up: Float32Array, count: number): void {
  for (let i = 0; i < count; i++) gate[i] = silu(gate[i]) * up[i]
}

/** Residual add: x[i] += y[i] for i < count. */
export function addInPlace(x: Float32Array, y: Float32Array, count: number): void {
  for (let i = 0; i < count; i++) x[i] += y[i]
}

/** RoPE in place (rotate-half convention, HF `apply_rotary_pos_emb`): row t of x
 *  `[n, numHeads·headDim]` is rotated by the angles whose cosines and sines are row t of `cos`,
 *  `sin` `[n, headDim / 2]`, every head alike: (a, b) → (a·cos − b·sin, b·cos + a·sin) for a in
 *  the first half of a head and b the matching element of the second. */
export function rope(
  x: Float32Array,
  cos: Float32Array,
  sin: Float32Array,
  n: number,
  numHeads: number,
  headDim: number,
): void {
  const half = headDim / 2
  for (let t = 0; t < n; t++) {
    for (let head = 0; head < numHeads; head++) {
      const off = (t * numHeads + head) * headDim
      for (let i = 0; i < half; i++) {
        const a = x[off + i]
        const b = x[off + i + half]
        const c = cos[t * half + i]
        const s = sin[t * half + i]
        x[off + i] = a * c - b * s
        x[off + i + half] = b * c + a * s
      }
    }
  }
}

/** The plain TypeScript kernels as a {@link Kernels}: weights and scratch on the JS heap. */
export function createTsKernels(): Kernels {
  const scratch = new Map<string, Float32Array>()
  return {
    name: 'ts',
    threads: 1,
    close() {},
    allocF32: (count) => new Float32Array(count),
    allocU16: (count) => new Uint16Array(count),
    scratch(key, count) {
      let buf = scratch.get(key)
      if (!buf || buf.length < count) scratch.set(key, (buf = new Float32Array(count)))
      return buf.subarray(0, count)
    },
    linear(out, x, w: LinearWeights, bias, n) {
      if (w.dtype === 'f32') matmulT(out, x, w.data, bias, n, w.inDim, w.outDim)
      else matmulTBf16(out, x, w.data, bias, n, w.inDim, w.outDim)
    },
    attention,
    rmsNorm,
    swiglu,
    addInPlace,
    rope,
  }
}
