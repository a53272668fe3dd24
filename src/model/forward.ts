/** The Llama forward pass over a paged KV cache (Touvron et al. 2023; HF `modeling_llama.py`
 *  semantics: RMSNorm, rotate-half RoPE, grouped-query attention, SwiGLU, optional qkv bias).
 *
 *  K and V live only in the worker's {@link KvPool}; attention reads them only through the
 *  request's page table, after the pool checked owner, epoch and fill of every page (G5).
 *  Knows tensors, positions and page tables; knows nothing of tenants, transfers or HTTP. */
import type { KvPool, PageRef } from '../kv/pool.js'
import { matmulT, rmsNorm, silu } from './kernels.js'
import type { Model } from './weights.js'

/** The request whose KV a forward pass reads and writes. */
export interface SequenceKv {
  /** Page table: ordinal i holds positions [i × pageSize, (i+1) × pageSize). */
  pageTable: readonly PageRef[]
  /** Request slot owning the pages. */
  owner: number
}

/** Precomputed RoPE tables for positions [0, maxPositions): `cos`, `sin` of shape
 *  `[maxPositions, headDim / 2]` with angle = position × theta^(−2i/headDim). */
export interface Rope {
  cos: Float32Array
  sin: Float32Array
  half: number
}

/** Build the RoPE tables of a model (computed in float64, stored as float32). */
export function makeRope(model: Model): Rope {
  const { headDim, ropeTheta, maxPositionEmbeddings } = model.config
  const half = headDim / 2
  const cos = new Float32Array(maxPositionEmbeddings * half)
  const sin = new Float32Array(maxPositionEmbeddings * half)
  for (let i = 0; i < half; i++) {
    // HF computes inv_freq in float32; round the same way so angles agree at long positions.
    const invFreq = Math.fround(1 / Math.pow(ropeTheta, (2 * i) / headDim))
    for (let p = 0; p < maxPositionEmbeddings; p++) {
      const angle = Math.fround(p * invFreq)
      cos[p * half + i] = Math.cos(angle)
      sin[p * half + i] = Math.sin(angle)
    }
  }
  return { cos, sin, half }
}

/** Rotate `x[offset .. offset + headDim)` in place by position `pos` (rotate-half convention). */
function applyRope(x: Float32Array, offset: number, pos: number, rope: Rope): void {
  const { cos, sin, half } = rope
  const base = pos * half
  for (let i = 0; i < half; i++) {
    const a = x[offset + i]
    const b = x[offset + i + half]
    const c = cos[base + i]
    const s = sin[base + i]
    x[offset + i] = a * c - b * s
    x[offset + i + half] = b * c + a * s
  }
}

/**
 * Run the model on `tokenIds` at positions [startPos, startPos + n), writing their K/V into the
 * request's pages and attending over positions [0, startPos + i] for token i.
 * Returns the logits of the last token, `[vocabSize]`, or of every token `[n, vocabSize]` when
 * `allLogits` is set. Throws a G5 guard error (before any read) when a page of the table is not the
 * request's at the expected epoch or is not filled up to the positions read.
 */
export function forward(
  model: Model,
  rope: Rope,
  pool: KvPool,
  seq: SequenceKv,
  tokenIds: readonly number[],
  startPos: number,
  allLogits = false,
): Float32Array {
  const {
    hiddenSize: d,
    intermediateSize: ff,
    numHeads,
    numKvHeads,
    headDim,
    vocabSize,
  } = model.config
  const n = tokenIds.length
  const qDim = numHeads * headDim
  const kvDim = numKvHeads * headDim
  const groupSize = numHeads / numKvHeads
  const scale = 1 / Math.sqrt(headDim)
  const endPos = startPos + n
  if (endPos > model.config.maxPositionEmbeddings) {
    throw new RangeError(
      `positions up to ${endPos} exceed max_position_embeddings ${model.config.maxPositionEmbeddings}`,
    )
  }

  // The request claims these positions: ownership and epoch are checked before anything is written.
  pool.noteWrite(seq.pageTable, seq.owner, startPos, n)

  // x: [n, d] residual stream.
  const x = new Float32Array(n * d)
  for (let t = 0; t < n; t++)
    x.set(model.embed.subarray(tokenIds[t] * d, (tokenIds[t] + 1) * d), t * d)

  const h = new Float32Array(n * d)
  const q = new Float32Array(n * qDim)
  const k = new Float32Array(n * kvDim)
  const v = new Float32Array(n * kvDim)
  const attn = new Float32Array(n * qDim)
  const o = new Float32Array(n * d)
  const gate = new Float32Array(n * ff)
  const up = new Float32Array(n * ff)
  const scores = new Float32Array(endPos)
  const offsets = new Int32Array(endPos)

  for (let layer = 0; layer < model.layers.length; layer++) {
    const w = model.layers[layer]
    const poolK = pool.k[layer]
    const poolV = pool.v[layer]

    // Attention block: h = RMSNorm(x); q, k, v projections; RoPE on q and k.
    rmsNorm(h, x, w.inputNorm, n, d, model.config.rmsNormEps)
    matmulT(q, h, w.wq, w.bq, n, d, qDim)
    matmulT(k, h, w.wk, w.bk, n, d, kvDim)
    matmulT(v, h, w.wv, w.bv, n, d, kvDim)
    for (let t = 0; t < n; t++) {
      for (let head = 0; head < numHeads; head++)
        applyRope(q, t * qDim + head * headDim, startPos + t, rope)
      for (let head = 0; head < numKvHeads; head++)
        applyRope(k, t * kvDim + head * headDim, startPos + t, rope)
    }

    // Write the new tokens' K/V into their pages.
    for (let t = 0; t < n; t++) {
      const off = pool.offsetOf(seq.pageTable, startPos + t)
      poolK.set(k.subarray(t * kvDim, (t + 1) * kvDim), off)
      poolV.set(v.subarray(t * kvDim, (t + 1) * kvDim), off)
    }

    // Every page read below belongs to this request at its epoch and holds the positions read (G5).
    pool.checkRead(seq.pageTable, seq.owner, endPos)
    for (let p = 0; p < endPos; p++) offsets[p] = pool.offsetOf(seq.pageTable, p)

    // Causal attention: token t (position startPos + t) attends to positions [0, startPos + t].
    for (let t = 0; t < n; t++) {
      const numKeys = startPos + t + 1
      for (let head = 0; head < numHeads; head++) {
        const qOff = t * qDim + head * headDim
        const kvHeadOff = Math.floor(head / groupSize) * headDim
        let max = -Infinity
        for (let p = 0; p < numKeys; p++) {
          const kOff = offsets[p] + kvHeadOff
          let dot = 0
          for (let i = 0; i < headDim; i++) dot += q[qOff + i] * poolK[kOff + i]
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
        attn.fill(0, outOff, outOff + headDim)
        for (let p = 0; p < numKeys; p++) {
          const weight = scores[p] / sum
          const vOff = offsets[p] + kvHeadOff
          for (let i = 0; i < headDim; i++) attn[outOff + i] += weight * poolV[vOff + i]
        }
      }
    }
    matmulT(o, attn, w.wo, null, n, qDim, d)
    for (let i = 0; i < n * d; i++) x[i] += o[i]

    // MLP block: x += down(silu(gate(h)) * up(h)), h = RMSNorm(x).
    rmsNorm(h, x, w.postNorm, n, d, model.config.rmsNormEps)
    matmulT(gate, h, w.wGate, null, n, d, ff)
    matmulT(up, h, w.wUp, null, n, d, ff)
    for (let i = 0; i < n * ff; i++) gate[i] = silu(gate[i]) * up[i]
    matmulT(o, gate, w.wDown, null, n, ff, d)
    for (let i = 0; i < n * d; i++) x[i] += o[i]
  }

  // Final norm and LM head, for the last token or all of them.
  const first = allLogits ? 0 : n - 1
  const rows = n - first
  const last = x.subarray(first * d)
  const normed = new Float32Array(rows * d)
  rmsNorm(normed, last, model.norm, rows, d, model.config.rmsNormEps)
  const logits = new Float32Array(rows * vocabSize)
  matmulT(logits, normed, model.lmHead, null, rows, d, vocabSize)
  return logits
}
