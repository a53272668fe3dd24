/** An independent oracle for the forward pass: the whole sequence at once over one contiguous
 *  cache (no pages, no pool, no incremental positions), written straight from the HF Llama
 *  equations. Slow and simple on purpose. */
import { toF32 } from '../../src/model/linear.js'
import type { Model } from '../../src/model/weights.js'

function linear(
  x: number[],
  w: Float32Array,
  bias: Float32Array | null,
  inDim: number,
  outDim: number,
): number[] {
  const out = new Array<number>(outDim).fill(0)
  for (let j = 0; j < outDim; j++) {
    let s = bias ? bias[j] : 0
    for (let i = 0; i < inDim; i++) s += x[i] * w[j * inDim + i]
    out[j] = s
  }
  return out
}

function norm(x: number[], w: Float32Array, eps: number): number[] {
  const ms = x.reduce((s, a) => s + a * a, 0) / x.length
  return x.map((a, i) => (a / Math.sqrt(ms + eps)) * w[i])
}

function rope(x: number[], pos: number, theta: number): number[] {
  const d = x.length
  const half = d / 2
  const out = x.slice()
  for (let i = 0; i < half; i++) {
    const angle = pos / Math.pow(theta, (2 * i) / d)
    out[i] = x[i] * Math.cos(angle) - x[i + half] * Math.sin(angle)
    out[i + half] = x[i + half] * Math.cos(angle) + x[i] * Math.sin(angle)
  }
  return out
}

/** Logits `[n][vocab]` for every position of `ids` (plain RoPE only: no `rope_scaling`). */
export function referenceLogits(model: Model, ids: number[]): number[][] {
  const c = model.config
  const { hiddenSize: d, headDim: hd, numHeads: H, numKvHeads: KV } = c
  let xs = ids.map((id) => Array.from(toF32(model.embed).subarray(id * d, (id + 1) * d)))
  for (const w of model.layers) {
    const hs = xs.map((x) => norm(x, w.inputNorm, c.rmsNormEps))
    const qs = hs.map((h) => linear(h, toF32(w.wq), w.bq, d, H * hd))
    const ks = hs.map((h) => linear(h, toF32(w.wk), w.bk, d, KV * hd))
    const vs = hs.map((h) => linear(h, toF32(w.wv), w.bv, d, KV * hd))
    const heads = (v: number[], n: number) =>
      Array.from({ length: n }, (_, i) => v.slice(i * hd, (i + 1) * hd))
    const qh = qs.map((q, p) => heads(q, H).map((x) => rope(x, p, c.ropeTheta)))
    const kh = ks.map((k, p) => heads(k, KV).map((x) => rope(x, p, c.ropeTheta)))
    const vh = vs.map((v) => heads(v, KV))
    xs = xs.map((x, t) => {
      const attn: number[] = []
      for (let head = 0; head < H; head++) {
        const g = Math.floor(head / (H / KV))
        const s = Array.from(
          { length: t + 1 },
          (_, p) => qh[t][head].reduce((a, q, i) => a + q * kh[p][g][i], 0) / Math.sqrt(hd),
        )
        const m = Math.max(...s)
        const e = s.map((a) => Math.exp(a - m))
        const z = e.reduce((a, b) => a + b, 0)
        for (let i = 0; i < hd; i++) attn.push(e.reduce((a, p, j) => a + (p / z) * vh[j][g][i], 0))
      }
      const o = linear(attn, toF32(w.wo), w.bo, H * hd, d)
      const x1 = x.map((a, i) => a + o[i])
      const h2 = norm(x1, w.postNorm, c.rmsNormEps)
      const gate = linear(h2, toF32(w.wGate), null, d, c.intermediateSize)
      const up = linear(h2, toF32(w.wUp), null, d, c.intermediateSize)
      const act = gate.map((g2, i) => (g2 / (1 + Math.exp(-g2))) * up[i])
      const down = linear(act, toF32(w.wDown), null, c.intermediateSize, d)
      return x1.map((a, i) => a + down[i])
    })
  }
  return xs.map((x) =>
    linear(norm(x, model.norm, c.rmsNormEps), toF32(model.lmHead), null, d, c.vocabSize),
  )
}
