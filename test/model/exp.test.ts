/** The vectorised e^x of the WebAssembly kernels (asm/kernels.ts, `expF32`: the softmax's and
 *  SiLU's exp) against Math.exp (float64, correctly rounded to well below an f32 ulp) over a dense
 *  sweep of every f32 input whose e^x is a normal f32, and at the edges of its range. */
import assert from 'node:assert/strict'
import { readFileSync } from 'node:fs'
import { describe, it } from 'node:test'
import { kernelsWasmPath } from '../../src/model/kernels-wasm.js'

/** The part of the WebAssembly JS API used here (the project's `lib` has no DOM types). */
interface WasmApi {
  Memory: new (d: { initial: number; maximum: number; shared: boolean }) => {
    buffer: ArrayBufferLike
  }
  Module: new (bytes: Uint8Array) => object
  Instance: new (module: object, imports: object) => { exports: object }
}
const WebAssembly = (globalThis as unknown as { WebAssembly: WasmApi }).WebAssembly

/** The module's exp alone, over its own memory: e^x[i] for every element of `xs`. */
function wasmExp(): (xs: Float32Array) => Float32Array {
  const memory = new WebAssembly.Memory({ initial: 64, maximum: 64, shared: true })
  const module = new WebAssembly.Module(readFileSync(kernelsWasmPath))
  const { expF32 } = new WebAssembly.Instance(module, { env: { memory } }).exports as {
    expF32(out: number, x: number, count: number): void
  }
  const base = 65_536 // above the module's static data
  const capacity = (memory.buffer.byteLength - base) / 8
  return (xs) => {
    assert.ok(xs.length <= capacity)
    const x = new Float32Array(memory.buffer, base, xs.length)
    const out = new Float32Array(memory.buffer, base + xs.length * 4, xs.length)
    x.set(xs)
    expF32(out.byteOffset, x.byteOffset, xs.length)
    return out.slice()
  }
}

describe('vectorised exp (WebAssembly kernels)', () => {
  const exp = wasmExp()

  it('is within one f32 ulp (1.2e-7 relative) of Math.exp over x ∈ [−87, 88]', () => {
    // 1,750,001 points, 2^-14 apart: every lane and the scalar tail (count not a multiple of 4).
    const count = 175 * 10_000 + 1
    const xs = new Float32Array(count)
    for (let i = 0; i < count; i++) xs[i] = -87 + (i * 175) / (count - 1)
    let worst = 0
    let worstX = 0
    for (let from = 0; from < count; from += 500_001) {
      const chunk = xs.subarray(from, Math.min(count, from + 500_001))
      const got = exp(chunk)
      for (let i = 0; i < chunk.length; i++) {
        const want = Math.exp(chunk[i])
        const rel = Math.abs(got[i] - want) / want
        if (rel > worst) [worst, worstX] = [rel, chunk[i]]
      }
    }
    assert.ok(worst <= 1.2e-7, `max relative error ${worst} at x = ${worstX}`)
  })

  it('is exact at 0, and gives +∞ above the f32 range, 0 far below it, NaN for NaN', () => {
    const got = exp(Float32Array.of(0, 89, 1000, Infinity, -104, -1000, -Infinity, NaN, 88.7))
    assert.equal(got[0], 1)
    assert.equal(got[1], Infinity)
    assert.equal(got[2], Infinity)
    assert.equal(got[3], Infinity)
    assert.ok(got[4] >= 0 && got[4] <= 2 ** -149, `e^-104 = ${got[4]}`)
    assert.equal(got[5], 0)
    assert.equal(got[6], 0)
    assert.ok(Number.isNaN(got[7]))
    // Just below the largest f32 (3.40e38): finite, and as close as in the range above.
    assert.ok(Math.abs(got[8] - Math.exp(Math.fround(88.7))) / got[8] <= 1.2e-7, `${got[8]}`)
  })

  it('follows Math.exp into the subnormals (x down to −103) within an absolute 2^-149 · 4', () => {
    const xs = new Float32Array(4001)
    for (let i = 0; i < xs.length; i++) xs[i] = -103 + (i * 16) / 4000
    const got = exp(xs)
    for (let i = 0; i < xs.length; i++) {
      const want = Math.exp(xs[i])
      const tol = Math.max(4 * 2 ** -149, 1.2e-7 * want)
      assert.ok(Math.abs(got[i] - want) <= tol, `x = ${xs[i]}: ${got[i]} vs ${want}`)
    }
  })
})
