/** The WebAssembly SIMD kernels against the plain TypeScript oracle (src/model/kernels.ts) on
 *  random shapes, including ragged ones that exercise every SIMD tail path: ≤ 1e-5 relative to the
 *  largest output magnitude (the residual add: the same bits). */
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
      // Long contexts (the four-key score blocks, their leftovers and the vector exp's tail) and
      // head sizes that use the 32-column output blocks, 4-column blocks and scalar columns.
      [6, 301, 3, 1, 36],
      [2, 9, 2, 2, 70],
      [5, 250, 9, 3, 64],
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

  it('attention softmax stays finite and exact-weighted with scores far apart', () => {
    // One key far ahead of the others: e^(s − max) underflows to 0 for the rest, so the output is
    // that key's V row exactly (weights 1 and 0), as in the oracle.
    const [n, startPos, hd] = [1, 6, 8]
    const q = new Float32Array(hd).fill(10)
    const k = new Float32Array((startPos + n) * hd).fill(-10)
    k.fill(10, 3 * hd, 4 * hd)
    const v = fill(new Float32Array((startPos + n) * hd), random(250))
    const got = new Float32Array(hd)
    wasm.attention(got, q, k, v, n, startPos, 1, 1, hd)
    assert.deepEqual(got, v.slice(3 * hd, 4 * hd))
  })

  it('RMSNorm, SwiGLU, RoPE and the residual add match the TypeScript oracle', () => {
    // [n, d]: rows of 576 (SmolLM2) and ragged widths that exercise the scalar tails.
    for (const [i, [n, d]] of [
      [1, 576],
      [5, 37],
      [3, 3],
    ].entries()) {
      const rnd = random(600 + i)
      const x = fill(new Float32Array(n * d), rnd).map((e) => e * 3)
      const weight = fill(new Float32Array(d), rnd)
      const want = new Float32Array(n * d)
      const got = new Float32Array(n * d)
      ts.rmsNorm(want, x, weight, n, d, 1e-5)
      wasm.rmsNorm(got, x, weight, n, d, 1e-5)
      assertClose(got, want, `rmsNorm [${n}, ${d}]`)

      // SwiGLU over gates from −40 to 40 (e^−g far from 1 both ways); in place on the gate.
      const gate = fill(new Float32Array(n * d), rnd).map((e) => e * 40)
      const up = fill(new Float32Array(n * d), rnd)
      const wantGate = gate.slice()
      ts.swiglu(wantGate, up, n * d)
      const gotGate = wasm.scratch('test.gate', n * d)
      gotGate.set(gate)
      wasm.swiglu(gotGate, up, n * d)
      assertClose(gotGate, wantGate, `swiglu ${n * d}`)

      // The residual add is one f32 addition per element: the same bits.
      const y = fill(new Float32Array(n * d), rnd)
      const wantSum = x.slice()
      ts.addInPlace(wantSum, y, n * d)
      const gotSum = x.slice()
      wasm.addInPlace(gotSum, y, n * d)
      assert.deepEqual(gotSum, wantSum, `addInPlace ${n * d}`)
    }
    // RoPE: [n, heads, headDim] with half-head widths that are and are not multiples of 4.
    for (const [i, [n, heads, hd]] of [
      [4, 9, 64],
      [3, 2, 6],
      [2, 3, 18],
    ].entries()) {
      const rnd = random(700 + i)
      const x = fill(new Float32Array(n * heads * hd), rnd)
      const angles = fill(new Float32Array((n * hd) / 2), rnd).map((e) => e * 100)
      const cos = angles.map(Math.cos)
      const sin = angles.map(Math.sin)
      const want = x.slice()
      ts.rope(want, cos, sin, n, heads, hd)
      const got = x.slice()
      wasm.rope(got, cos, sin, n, heads, hd)
      assertClose(got, want, `rope [${n}, ${heads}, ${hd}]`)
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

  it('split between 1, 2 and 3 threads, linear, attention and SwiGLU give the same bits', () => {
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
      // SwiGLU, split on multiples of four elements (1,003: a scalar tail in the last chunk).
      const rnd = random(550)
      const gate = fill(new Float32Array(1003), rnd).map((e) => e * 20)
      const up = fill(new Float32Array(1003), rnd)
      const want = gate.slice()
      wasm.swiglu(want, up, gate.length)
      for (const team of teams) {
        const got = gate.slice()
        team.swiglu(got, up, gate.length)
        assert.deepEqual(new Uint32Array(got.buffer), new Uint32Array(want.buffer), 'swiglu')
      }
    } finally {
      for (const k of teams) k.close()
    }
  })

  it('linear with bf16 weights gives exact hand-checked sums on every path', () => {
    // Integer x and weights ±m · 2^-k (m ≤ 5): every product and partial sum is exact in f32
    // whatever the order, so the sum computed here in float64 is the exact answer. inDim 19: two
    // blocks of eight (weights widened four at a time from each half) and a scalar tail of three;
    // outDim 11: one eight-row group, then two single rows (decode), and 4-token groups of two rows
    // and of one row (prefill); n 5: one group of four tokens and one token alone.
    const [n, inDim, outDim] = [5, 19, 11]
    const x = Float32Array.from(
      { length: n * inDim },
      (_, k) => (k % inDim) + 1 + Math.floor(k / inDim),
    )
    const wf = Float32Array.from(
      { length: outDim * inDim },
      (_, k) => ((k % inDim) % 2 ? -1 : 1) * 2 ** -(Math.floor(k / inDim) % 3) * ((k % 5) + 1),
    )
    const want = new Float32Array(n * outDim)
    for (let t = 0; t < n; t++)
      for (let j = 0; j < outDim; j++) {
        let s = 0
        for (let i = 0; i < inDim; i++) s += x[t * inDim + i] * wf[j * inDim + i]
        want[t * outDim + j] = s + j
      }
    const bias = Float32Array.from({ length: outDim }, (_, j) => j)
    const data = wasm.allocU16(outDim * inDim)
    const u32 = new Uint32Array(wf.buffer)
    for (let k = 0; k < u32.length; k++) data[k] = u32[k] >>> 16
    const w: LinearWeights = { dtype: 'bf16', outDim, inDim, data }
    assert.deepEqual(
      new Uint16Array(new Uint32Array(wf.buffer).map((u) => u & 0xffff)),
      new Uint16Array(wf.length),
      'weights exact in bf16',
    )
    for (const rows of [n, 1]) {
      const got = new Float32Array(rows * outDim)
      wasm.linear(got, x.subarray(0, rows * inDim), w, bias, rows)
      assert.deepEqual(got, want.subarray(0, rows * outDim), `${rows} token(s)`)
    }
    const oracle = new Float32Array(n * outDim)
    ts.linear(oracle, x, w, bias, n)
    assert.deepEqual(oracle, want)
  })

  it('refuses weights that live outside its memory', () => {
    const foreign = weights(ts, 'f32', 2, 4, 1)
    assert.throws(
      () => wasm.linear(new Float32Array(2), new Float32Array(4), foreign, null, 1),
      /weights were not allocated by these WebAssembly kernels/,
    )
  })
})
