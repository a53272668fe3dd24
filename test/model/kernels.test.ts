/** The WebAssembly SIMD kernels against the plain TypeScript oracle (src/model/kernels.ts) on
 *  random shapes, including ragged ones that exercise every SIMD tail path: ≤ 1e-5 relative to the
 *  largest output magnitude. */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import { createTsKernels } from '../../src/model/kernels.js'
import { createWasmKernels } from '../../src/model/kernels-wasm.js'
import type { Kernels, LinearWeights } from '../../src/model/linear.js'

/** Deterministic uniform values in [-1, 1). */
function random(seed: number): () => number {
  let s = seed >>> 0
  return () => {
    s = (Math.imul(s, 1664525) + 1013904223) >>> 0
    return s / 2 ** 31 - 1
  }
}

function fill(a: Float32Array, rnd: () => number): Float32Array {
  for (let i = 0; i < a.length; i++) a[i] = rnd()
  return a
}

function weights(
  k: Kernels,
  dtype: 'f32' | 'bf16',
  outDim: number,
  inDim: number,
  seed: number,
): LinearWeights {
  const rnd = random(seed)
  const f = fill(new Float32Array(outDim * inDim), rnd)
  if (dtype === 'f32') {
    const data = k.allocF32(outDim * inDim)
    data.set(f)
    return { dtype, outDim, inDim, data }
  }
  const data = k.allocU16(outDim * inDim)
  const u32 = new Uint32Array(f.buffer)
  for (let i = 0; i < u32.length; i++) data[i] = u32[i] >>> 16
  return { dtype, outDim, inDim, data }
}

function assertClose(got: Float32Array, want: Float32Array, what: string): void {
  assert.equal(got.length, want.length)
  let scale = 0
  for (const w of want) scale = Math.max(scale, Math.abs(w))
  for (let i = 0; i < got.length; i++) {
    const rel = Math.abs(got[i] - want[i]) / scale
    assert.ok(rel <= 1e-5, `${what}: element ${i}: ${got[i]} vs ${want[i]} (relative ${rel})`)
  }
}

describe('WebAssembly SIMD kernels', () => {
  const ts = createTsKernels()
  const wasm = createWasmKernels()

  // [n, inDim, outDim]: decode (n 1–3) and prefill (n ≥ 4) paths, dims not multiples of 4 or 8.
  const shapes = [
    [1, 64, 48],
    [1, 37, 5],
    [3, 576, 19],
    [4, 40, 12],
    [7, 61, 33],
    [13, 128, 96],
  ]
  for (const dtype of ['f32', 'bf16'] as const) {
    it(`linear with ${dtype} weights matches the TypeScript oracle on random shapes`, () => {
      for (const [i, [n, inDim, outDim]] of shapes.entries()) {
        const rnd = random(100 + i)
        const x = fill(new Float32Array(n * inDim), rnd)
        const bias = i % 2 ? fill(new Float32Array(outDim), rnd) : null
        const want = new Float32Array(n * outDim)
        ts.linear(want, x, weights(ts, dtype, outDim, inDim, i), bias, n)
        // Inputs and outputs on the JS heap (copied) and in the kernels' scratch (in place).
        const got = new Float32Array(n * outDim)
        wasm.linear(got, x, weights(wasm, dtype, outDim, inDim, i), bias, n)
        assertClose(got, want, `${dtype} [${n}, ${inDim}] → ${outDim}`)
        const xIn = wasm.scratch('test.x', x.length)
        xIn.set(x)
        const gotIn = wasm.scratch('test.out', n * outDim)
        wasm.linear(gotIn, xIn, weights(wasm, dtype, outDim, inDim, i), bias, n)
        assertClose(gotIn, want, `${dtype} in place [${n}, ${inDim}] → ${outDim}`)
      }
    })
  }

  it('attention matches the TypeScript oracle for GQA ratios, head sizes and start positions', () => {
    // [n, startPos, numHeads, numKvHeads, headDim]
    const cases = [
      [1, 0, 4, 1, 8],
      [1, 37, 9, 3, 64],
      [5, 0, 6, 2, 6],
      [8, 11, 8, 8, 4],
      [3, 20, 2, 1, 10],
    ]
    for (const [i, [n, startPos, H, KV, hd]] of cases.entries()) {
      const rnd = random(200 + i)
      const ctx = startPos + n
      const q = fill(new Float32Array(n * H * hd), rnd)
      const k = fill(new Float32Array(ctx * KV * hd), rnd)
      const v = fill(new Float32Array(ctx * KV * hd), rnd)
      const want = new Float32Array(n * H * hd)
      ts.attention(want, q, k, v, n, startPos, H, KV, hd)
      const got = new Float32Array(n * H * hd)
      wasm.attention(got, q, k, v, n, startPos, H, KV, hd)
      assertClose(got, want, `attention case ${i}`)
    }
  })

  it('refuses weights that live outside its memory', () => {
    const foreign = weights(ts, 'f32', 2, 4, 1)
    assert.throws(
      () => wasm.linear(new Float32Array(2), new Float32Array(4), foreign, null, 1),
      /weights were not allocated by these WebAssembly kernels/,
    )
  })
})
