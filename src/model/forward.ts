/** The Llama forward pass over a paged KV cache (Touvron et al. 2023; HF `modeling_llama.py`
 *  semantics: RMSNorm, rotate-half RoPE, grouped-query attention, SwiGLU, optional qkv bias).
 *
 *  K and V live only in the worker's {@link KvPool}; attention reads them only through the
 *  request's page table, after the pool checked owner, epoch and fill of every page (G5).
 *  Knows tensors, positions and page tables; knows nothing of tenants, transfers or HTTP. */
import type { KvPool, PageLease } from '../kv/pool.js'
import { readRow } from './linear.js'
import type { Model } from './weights.js'

/** The request whose KV a forward pass reads and writes. */
export interface SequenceKv {
  /** The request's pages (ordinal i holds positions [i × pageSize, (i+1) × pageSize)) and owner. */
  lease: PageLease
}

/** Precomputed RoPE tables for positions [0, positions): `cos`, `sin` of shape
 *  `[positions, headDim / 2]` with angle = position × invFreq[i]. */
export interface Rope {
  cos: Float32Array
  sin: Float32Array
  half: number
  /** Positions the tables hold; a forward pass beyond them is refused (RangeError). */
  positions: number
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

/** Build the RoPE tables of a model (angles rounded to float32 as HF computes them) for positions
 *  [0, min(maxPositions, max_position_embeddings)). Pass `maxPositions` when fewer positions can
 *  ever be held (e.g. a KV pool's capacity in tokens): the full tables of a long-context model are
 *  large (131,072 positions × 64 angles × 2 tables × 4 bytes = 64 MiB). Throws a RangeError when
 *  `maxPositions` is not a positive integer. */
export function makeRope(model: Model, maxPositions?: number): Rope {
  const { headDim, maxPositionEmbeddings } = model.config
  if (maxPositions !== undefined && (!Number.isInteger(maxPositions) || maxPositions < 1))
    throw new RangeError(`RoPE positions must be a positive integer, got ${maxPositions}`)
  const positions = Math.min(maxPositions ?? maxPositionEmbeddings, maxPositionEmbeddings)
  const half = headDim / 2
  const invFreq = ropeInverseFrequencies(model.config)
  const cos = new Float32Array(positions * half)
  const sin = new Float32Array(positions * half)
  for (let i = 0; i < half; i++) {
    for (let p = 0; p < positions; p++) {
      const angle = Math.fround(p * invFreq[i])
      cos[p * half + i] = Math.cos(angle)
      sin[p * half + i] = Math.sin(angle)
    }
  }
  return { cos, sin, half, positions }
}

/** One sequence's share of a batched forward step ({@link forwardBatch}). */
export interface BatchSequence extends SequenceKv {
  /** New tokens of this sequence for this step (at least one). */
  tokenIds: readonly number[]
  /** Position of `tokenIds[0]`: the sequence already holds KV for positions [0, startPos). */
  startPos: number
  /** Return the logits of every new token `[n, vocabSize]` instead of the last one's `[vocabSize]`. */
  allLogits?: boolean
}

/** What {@link forwardBatch} returns for one sequence: its logits, or why it failed (a guard error,
 *  or a RangeError for positions beyond the model's or the RoPE table's). A failed sequence never
 *  fails the others. */
export type BatchResult = { logits: Float32Array } | { error: Error }

/**
 * Run the model on `tokenIds` at positions [startPos, startPos + n), writing their K/V into the
 * request's pages and attending over positions [0, startPos + i] for token i.
 * Returns the logits of the last token, `[vocabSize]`, or of every token `[n, vocabSize]` when
 * `allLogits` is set. Throws a G5 guard error (before any read) when a page of the table is not the
 * request's at the expected epoch or is not filled up to the positions read, and a RangeError for
 * positions beyond max_position_embeddings or the RoPE table.
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
  const [result] = forwardBatch(model, rope, pool, [{ ...seq, tokenIds, startPos, allLogits }])
  if ('error' in result) throw result.error
  return result.logits
}

/**
 * One forward step for several sequences at once (continuous batching, chunked prefill): the new
 * tokens of every sequence are stacked into one `[N, hiddenSize]` activation so that each weight
 * matrix is streamed once per step for all of them; attention runs per sequence over that
 * sequence's own pages only. Each sequence's writes are claimed (`pool.noteWrite`) and its reads
 * checked (`pool.checkRead`, G5) for its own owner; a sequence that fails a check gets
 * `{ error }` and drops out of the step, the others go on. Every linear kernel computes each row
 * independently of the others, so with F32 weights a sequence's logits are bit-identical to
 * {@link forward} on it alone.
 * Returns one {@link BatchResult} per entry of `seqs`, in order.
 */
export function forwardBatch(
  model: Model,
  rope: Rope,
  pool: KvPool,
  seqs: readonly BatchSequence[],
): BatchResult[] {
  const {
    hiddenSize: d,
    intermediateSize: ff,
    numHeads,
    numKvHeads,
    headDim,
    vocabSize,
    maxPositionEmbeddings,
  } = model.config
  const qDim = numHeads * headDim
  const kvDim = numKvHeads * headDim
  const results: (BatchResult | undefined)[] = new Array(seqs.length)

  // Each sequence claims its positions: ownership and epoch are checked before anything is written.
  // Rows of the stacked activations: sequence i owns rows [rowStart[i], rowStart[i] + n_i).
  const live: number[] = []
  const rowStart: number[] = new Array(seqs.length).fill(-1)
  let numRows = 0
  let maxEndPos = 0
  for (let i = 0; i < seqs.length; i++) {
    const s = seqs[i]
    const endPos = s.startPos + s.tokenIds.length
    try {
      if (s.tokenIds.length === 0)
        throw new RangeError('a batched sequence needs at least one token')
      if (endPos > maxPositionEmbeddings) {
        throw new RangeError(
          `positions up to ${endPos} exceed max_position_embeddings ${maxPositionEmbeddings}`,
        )
      }
      if (endPos > rope.positions)
        throw new RangeError(`positions up to ${endPos} exceed the RoPE table (${rope.positions})`)
      pool.noteWrite(s.lease, s.startPos, s.tokenIds.length)
    } catch (err) {
      results[i] = { error: asError(err) }
      continue
    }
    live.push(i)
    rowStart[i] = numRows
    numRows += s.tokenIds.length
    maxEndPos = Math.max(maxEndPos, endPos)
  }
  if (live.length === 0) return results as BatchResult[]
  const n = numRows

  // Activations live in the kernels' scratch memory (reused across calls, so the SIMD kernels
  // read and write them in place). x: [n, d] residual stream, rows stacked sequence by sequence.
  const K = model.kernels
  const x = K.scratch('x', n * d)
  for (const i of live)
    for (let t = 0; t < seqs[i].tokenIds.length; t++)
      readRow(model.embed, seqs[i].tokenIds[t], x, (rowStart[i] + t) * d)

  const h = K.scratch('h', n * d)
  const q = K.scratch('q', n * qDim)
  const k = K.scratch('k', n * kvDim)
  const v = K.scratch('v', n * kvDim)
  const attn = K.scratch('attn', n * qDim)
  const o = K.scratch('o', n * d)
  const gate = K.scratch('gate', n * ff)
  const up = K.scratch('up', n * ff)
  // One sequence's context gathered from its pages, reused sequence by sequence: [endPos, kvDim].
  const kCtx = K.scratch('kCtx', maxEndPos * kvDim)
  const vCtx = K.scratch('vCtx', maxEndPos * kvDim)
  const { pageSize } = pool.shape
  // RoPE angles of every stacked row at its own position: [n, headDim / 2] cosines and sines.
  const { half } = rope
  const ropeCos = K.scratch('ropeCos', n * half)
  const ropeSin = K.scratch('ropeSin', n * half)
  for (const i of live) {
    const { startPos, tokenIds } = seqs[i]
    const from = startPos * half
    const to = (startPos + tokenIds.length) * half
    ropeCos.set(rope.cos.subarray(from, to), rowStart[i] * half)
    ropeSin.set(rope.sin.subarray(from, to), rowStart[i] * half)
  }

  for (let layer = 0; layer < model.layers.length; layer++) {
    if (live.every((i) => results[i] !== undefined)) break // every sequence failed a check
    const w = model.layers[layer]
    const poolK = pool.k[layer]
    const poolV = pool.v[layer]

    // Attention block: h = RMSNorm(x); q, k, v projections for every row; RoPE at each row's position.
    K.rmsNorm(h, x, w.inputNorm, n, d, model.config.rmsNormEps)
    K.linear(q, h, w.wq, w.bq, n)
    K.linear(k, h, w.wk, w.bk, n)
    K.linear(v, h, w.wv, w.bv, n)
    K.rope(q, ropeCos, ropeSin, n, numHeads, headDim)
    K.rope(k, ropeCos, ropeSin, n, numKvHeads, headDim)

    for (const i of live) {
      const s = seqs[i]
      if (results[i] !== undefined) continue // failed at an earlier layer: its rows are ignored
      const first = rowStart[i]
      const numNew = s.tokenIds.length
      const endPos = s.startPos + numNew
      // Write the new tokens' K/V into this sequence's pages.
      for (let t = 0; t < numNew; t++) {
        const off = pool.offsetOf(s.lease, s.startPos + t)
        poolK.set(k.subarray((first + t) * kvDim, (first + t + 1) * kvDim), off)
        poolV.set(v.subarray((first + t) * kvDim, (first + t + 1) * kvDim), off)
      }
      // Every page read below belongs to this sequence at its epoch and holds the positions read
      // (G5). Then gather positions [0, endPos) page by page (a page's tokens are contiguous).
      try {
        pool.checkRead(s.lease, endPos)
      } catch (err) {
        results[i] = { error: asError(err) }
        attn.fill(0, first * qDim, (first + numNew) * qDim)
        continue
      }
      for (let pos = 0; pos < endPos; pos += pageSize) {
        const off = pool.offsetOf(s.lease, pos)
        const count = Math.min(pageSize, endPos - pos) * kvDim
        kCtx.set(poolK.subarray(off, off + count), pos * kvDim)
        vCtx.set(poolV.subarray(off, off + count), pos * kvDim)
      }
      // Causal attention: token t (position startPos + t) attends to positions [0, startPos + t].
      K.attention(
        attn.subarray(first * qDim, (first + numNew) * qDim),
        q.subarray(first * qDim, (first + numNew) * qDim),
        kCtx,
        vCtx,
        numNew,
        s.startPos,
        numHeads,
        numKvHeads,
        headDim,
      )
    }
    K.linear(o, attn, w.wo, w.bo, n)
    K.addInPlace(x, o, n * d)

    // MLP block: x += down(silu(gate(h)) * up(h)), h = RMSNorm(x).
    K.rmsNorm(h, x, w.postNorm, n, d, model.config.rmsNormEps)
    K.linear(gate, h, w.wGate, null, n)
    K.linear(up, h, w.wUp, null, n)
    K.swiglu(gate, up, n * ff)
    K.linear(o, gate, w.wDown, null, n)
    K.addInPlace(x, o, n * d)
  }

  // Final norm and LM head, for each surviving sequence's last token or all of its tokens:
  // the selected rows are stacked into `picked` [rows, d] so the LM head streams once.
  const picks: { i: number; first: number; rows: number }[] = []
  let numPicked = 0
  for (const i of live) {
    if (results[i] !== undefined) continue
    const numNew = seqs[i].tokenIds.length
    const rows = seqs[i].allLogits ? numNew : 1
    picks.push({ i, first: rowStart[i] + numNew - rows, rows })
    numPicked += rows
  }
  if (numPicked === 0) return results as BatchResult[]
  const picked = K.scratch('picked', numPicked * d)
  let at = 0
  for (const p of picks) {
    picked.set(x.subarray(p.first * d, (p.first + p.rows) * d), at * d)
    at += p.rows
  }
  const normed = K.scratch('normed', numPicked * d)
  K.rmsNorm(normed, picked, model.norm, numPicked, d, model.config.rmsNormEps)
  const logits = new Float32Array(numPicked * vocabSize) // the callers' to keep: not scratch
  K.linear(logits, normed, model.lmHead, null, numPicked)
  at = 0
  for (const p of picks) {
    results[p.i] = { logits: logits.subarray(at * vocabSize, (at + p.rows) * vocabSize) }
    at += p.rows
  }
  return results as BatchResult[]
}

function asError(err: unknown): Error {
  return err instanceof Error ? err : new Error(String(err))
}
