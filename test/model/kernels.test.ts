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

  for (const dtype of ['f32', 'bf16'] as const) {
    it(`linear with ${dtype} weights gives each token the same bits alone or in a batch`, () => {
      // n = 9: two groups of four tokens (the batched path) and one token alone; outDim 19 leaves
      // three rows after the 4-row groups of the one-token path.
      const [n, inDim, outDim] = [9, 77, 19]
      const rnd = random(300)
      const x = fill(new Float32Array(n * inDim), rnd)
      const bias = fill(new Float32Array(outDim), rnd)
      const w = weights(wasm, dtype, outDim, inDim, 7)
      for (const b of [null, bias]) {
        const batched = new Float32Array(n * outDim)
        wasm.linear(batched, x, w, b, n)
        for (let t = 0; t < n; t++) {
          const alone = new Float32Array(outDim)
          wasm.linear(alone, x.subarray(t * inDim, (t + 1) * inDim), w, b, 1)
          assert.deepEqual(
            new Uint32Array(alone.buffer),
            new Uint32Array(batched.slice(t * outDim, (t + 1) * outDim).buffer),
            `${dtype} token ${t}${b ? ' with bias' : ''}`,
          )
        }
      }
    })
  }

  it('split between 1, 2 and 3 threads, linear and attention give the same bits', () => {
    const teams = [2, 3].map((threads) => createWasmKernels({ threads, parallelMinWork: 0 }))
    try {
      for (const dtype of ['f32', 'bf16'] as const) {
        for (const [i, [n, inDim, outDim]] of [...shapes, [5, 33, 7], [2, 16, 3]].entries()) {
          const rnd = random(400 + i)
          const x = fill(new Float32Array(n * inDim), rnd)
          const bias = i % 2 ? fill(new Float32Array(outDim), rnd) : null
          const want = new Float32Array(n * outDim)
          wasm.linear(want, x, weights(wasm, dtype, outDim, inDim, i), bias, n)
          for (const k of teams) {
            const got = new Float32Array(n * outDim)
            k.linear(got, x, weights(k, dtype, outDim, inDim, i), bias, n)
            assert.deepEqual(
              new Uint32Array(got.buffer),
              new Uint32Array(want.buffer),
              `${dtype} [${n}, ${inDim}] → ${outDim}, ${k.threads} threads`,
            )
          }
        }
      }
      for (const [i, [n, startPos, H, KV, hd]] of [
        [1, 37, 9, 3, 64],
        [5, 0, 6, 2, 6],
        [3, 20, 2, 1, 10],
        [1, 4, 1, 1, 8],
      ].entries()) {
        const rnd = random(500 + i)
        const q = fill(new Float32Array(n * H * hd), rnd)
        const k = fill(new Float32Array((startPos + n) * KV * hd), rnd)
        const v = fill(new Float32Array((startPos + n) * KV * hd), rnd)
        const want = new Float32Array(n * H * hd)
        wasm.attention(want, q, k, v, n, startPos, H, KV, hd)
        for (const team of teams) {
          const got = new Float32Array(n * H * hd)
          team.attention(got, q, k, v, n, startPos, H, KV, hd)
          assert.deepEqual(new Uint32Array(got.buffer), new Uint32Array(want.buffer), `case ${i}`)
        }
      }
    } finally {
      for (const k of teams) k.close()
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
