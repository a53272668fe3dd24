/** Plain TypeScript compute kernels for the forward pass (the reference implementation; faster
 *  kernels must match these). Shapes are row-major; all arrays are float32. */

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
