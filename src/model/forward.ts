/** The Llama forward pass over a paged KV cache (Touvron et al. 2023; HF `modeling_llama.py`
 *  semantics: RMSNorm, rotate-half RoPE, grouped-query attention, SwiGLU, optional qkv bias).
 *
 *  K and V live only in the worker's {@link KvPool}; attention reads them only through the
 *  request's page table, after the pool checked owner, epoch and fill of every page (G5).
 *  Knows tensors, positions and page tables; knows nothing of tenants, transfers or HTTP. */
import type { KvPool, PageRef } from '../kv/pool.js'
import { rmsNorm, silu } from './kernels.js'
import { readRow } from './linear.js'
import type { Model } from './weights.js'

/** The request whose KV a forward pass reads and writes. */
export interface SequenceKv {
  /** Page table: ordinal i holds positions [i × pageSize, (i+1) × pageSize). */
  pageTable: readonly PageRef[]
  /** Request slot owning the pages. */
  owner: number
}

/** Precomputed RoPE tables for positions [0, maxPositions): `cos`, `sin` of shape
 *  `[maxPositions, headDim / 2]` with angle = position × invFreq[i]. */
export interface Rope {
  cos: Float32Array
  sin: Float32Array
  half: number
}

/** RoPE inverse frequencies `[headDim / 2]`: theta^(−2i/headDim), then Llama-3's rescaling when the
 *  config has one (HF `modeling_rope_utils._compute_llama3_parameters`: wavelengths shorter than
 *  original_max / high_freq_factor kept, longer than original_max / low_freq_factor divided by
 *  factor, smoothly interpolated between). Rounded to float32 as HF holds them. */
export function ropeInverseFrequencies(config: Model['config']): Float32Array {
  const { headDim, ropeTheta, ropeScaling } = config
  const half = headDim / 2
  const out = new Float32Array(half)
  for (let i = 0; i < half; i++) {
    const inv = Math.fround(1 / Math.pow(ropeTheta, (2 * i) / headDim))
    if (ropeScaling === null) {
      out[i] = inv
      continue
    }
    const {
      factor,
      lowFreqFactor,
      highFreqFactor,
      originalMaxPositionEmbeddings: old,
    } = ropeScaling
    const wavelen = (2 * Math.PI) / inv
    if (wavelen < old / highFreqFactor) out[i] = inv
    else if (wavelen > old / lowFreqFactor) out[i] = inv / factor
    else {
      const smooth = (old / wavelen - lowFreqFactor) / (highFreqFactor - lowFreqFactor)
      out[i] = ((1 - smooth) * inv) / factor + smooth * inv
    }
  }
  return out
}

/** Build the RoPE tables of a model (angles rounded to float32 as HF computes them). */
export function makeRope(model: Model): Rope {
  const { headDim, maxPositionEmbeddings } = model.config
  const half = headDim / 2
  const invFreq = ropeInverseFrequencies(model.config)
  const cos = new Float32Array(maxPositionEmbeddings * half)
  const sin = new Float32Array(maxPositionEmbeddings * half)
  for (let i = 0; i < half; i++) {
    for (let p = 0; p < maxPositionEmbeddings; p++) {
      const angle = Math.fround(p * invFreq[i])
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
  const endPos = startPos + n
  if (endPos > model.config.maxPositionEmbeddings) {
    throw new RangeError(
      `positions up to ${endPos} exceed max_position_embeddings ${model.config.maxPositionEmbeddings}`,
    )
  }

  // The request claims these positions: ownership and epoch are checked before anything is written.
  pool.noteWrite(seq.pageTable, seq.owner, startPos, n)

  // Activations live in the kernels' scratch memory (reused across calls, so the SIMD kernels
  // read and write them in place). x: [n, d] residual stream.
  const K = model.kernels
  const x = K.scratch('x', n * d)
  for (let t = 0; t < n; t++) readRow(model.embed, tokenIds[t], x, t * d)

  const h = K.scratch('h', n * d)
  const q = K.scratch('q', n * qDim)
  const k = K.scratch('k', n * kvDim)
  const v = K.scratch('v', n * kvDim)
  const attn = K.scratch('attn', n * qDim)
  const o = K.scratch('o', n * d)
  const gate = K.scratch('gate', n * ff)
  const up = K.scratch('up', n * ff)
  // The request's context gathered from its pages: [endPos, kvDim] each.
  const kCtx = K.scratch('kCtx', endPos * kvDim)
  const vCtx = K.scratch('vCtx', endPos * kvDim)
  const { pageSize } = pool.shape

  for (let layer = 0; layer < model.layers.length; layer++) {
    const w = model.layers[layer]
    const poolK = pool.k[layer]
    const poolV = pool.v[layer]

    // Attention block: h = RMSNorm(x); q, k, v projections; RoPE on q and k.
    rmsNorm(h, x, w.inputNorm, n, d, model.config.rmsNormEps)
    K.linear(q, h, w.wq, w.bq, n)
    K.linear(k, h, w.wk, w.bk, n)
    K.linear(v, h, w.wv, w.bv, n)
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
    // Then gather positions [0, endPos) page by page (a page's tokens are contiguous) into kCtx/vCtx.
    pool.checkRead(seq.pageTable, seq.owner, endPos)
    for (let first = 0; first < endPos; first += pageSize) {
      const off = pool.offsetOf(seq.pageTable, first)
      const count = Math.min(pageSize, endPos - first) * kvDim
      kCtx.set(poolK.subarray(off, off + count), first * kvDim)
      vCtx.set(poolV.subarray(off, off + count), first * kvDim)
    }

    // Causal attention: token t (position startPos + t) attends to positions [0, startPos + t].
    K.attention(attn, q, kCtx, vCtx, n, startPos, numHeads, numKvHeads, headDim)
    K.linear(o, attn, w.wo, w.bo, n)
    for (let i = 0; i < n * d; i++) x[i] += o[i]

    // MLP block: x += down(silu(gate(h)) * up(h)), h = RMSNorm(x).
    rmsNorm(h, x, w.postNorm, n, d, model.config.rmsNormEps)
    K.linear(gate, h, w.wGate, null, n)
    K.linear(up, h, w.wUp, null, n)
    for (let i = 0; i < n * ff; i++) gate[i] = silu(gate[i]) * up[i]
    K.linear(o, gate, w.wDown, null, n)
    for (let i = 0; i < n * d; i++) x[i] += o[i]
  }

  // Final norm and LM head, for the last token or all of them.
  const first = allLogits ? 0 : n - 1
  const rows = n - first
  const last = x.subarray(first * d)
  const normed = K.scratch('normed', rows * d)
  rmsNorm(normed, last, model.norm, rows, d, model.config.rmsNormEps)
  const logits = new Float32Array(rows * vocabSize) // the caller's to keep: not scratch
  K.linear(logits, normed, model.lmHead, null, rows)
  return logits
}
