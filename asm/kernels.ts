// WebAssembly SIMD compute kernels for the forward pass (AssemblyScript; compiled by
// `npm run build:wasm` to dist/src/model/kernels.wasm). The plain TypeScript kernels in
// src/model/kernels.ts are the oracle these must match (test/model/kernels.test.ts).
//
// Every argument is a byte address in the one (imported, shared) memory or a count; nothing is
// allocated here. Matrices are row-major; weights are `[outDim, inDim]` (PyTorch `nn.Linear`).
// BF16 weights are the top 16 bits of an F32: widened in registers by a 16-bit shift.

// ---------------------------------------------------------------------------------------------
// Linear layers: out[n, outDim] = x[n, inDim] · Wᵀ + bias (bias = 0: none)

function hsum(v: v128): f32 {
  return (
    f32x4.extract_lane(v, 0) +
    f32x4.extract_lane(v, 1) +
    f32x4.extract_lane(v, 2) +
    f32x4.extract_lane(v, 3)
  )
}

function bf16Lo(v: v128): v128 {
  return i32x4.shl(i32x4.extend_low_i16x8_u(v), 16)
}

function bf16Hi(v: v128): v128 {
  return i32x4.shl(i32x4.extend_high_i16x8_u(v), 16)
}

function bf16At(w: usize, i: usize): f32 {
  return reinterpret<f32>((<u32>load<u16>(w + (i << 1))) << 16)
}

/** F32 weights. Four tokens share each weight load (prefill); one token streams four rows (decode). */
export function linearF32(
  out: usize,
  x: usize,
  w: usize,
  bias: usize,
  n: i32,
  inDim: i32,
  outDim: i32,
): void {
  const vecEnd = inDim & ~3
  const rowBytes = (<usize>inDim) << 2
  let t = 0
  for (; t + 3 < n; t += 4) {
    const x0 = x + <usize>t * rowBytes
    const x1 = x0 + rowBytes
    const x2 = x1 + rowBytes
    const x3 = x2 + rowBytes
    for (let j = 0; j < outDim; j++) {
      const wr = w + <usize>j * rowBytes
      let a0 = f32x4.splat(0)
      let a1 = f32x4.splat(0)
      let a2 = f32x4.splat(0)
      let a3 = f32x4.splat(0)
      let i = 0
      for (; i < vecEnd; i += 4) {
        const o = (<usize>i) << 2
        const wv = v128.load(wr + o)
        a0 = f32x4.add(a0, f32x4.mul(v128.load(x0 + o), wv))
        a1 = f32x4.add(a1, f32x4.mul(v128.load(x1 + o), wv))
        a2 = f32x4.add(a2, f32x4.mul(v128.load(x2 + o), wv))
        a3 = f32x4.add(a3, f32x4.mul(v128.load(x3 + o), wv))
      }
      let s0 = hsum(a0)
      let s1 = hsum(a1)
      let s2 = hsum(a2)
      let s3 = hsum(a3)
      for (; i < inDim; i++) {
        const o = (<usize>i) << 2
        const wi = load<f32>(wr + o)
        s0 += load<f32>(x0 + o) * wi
        s1 += load<f32>(x1 + o) * wi
        s2 += load<f32>(x2 + o) * wi
        s3 += load<f32>(x3 + o) * wi
      }
      const b: f32 = bias ? load<f32>(bias + ((<usize>j) << 2)) : 0
      const oj = out + ((<usize>j) << 2)
      const outRow = (<usize>outDim) << 2
      store<f32>(oj + <usize>t * outRow, s0 + b)
      store<f32>(oj + <usize>(t + 1) * outRow, s1 + b)
      store<f32>(oj + <usize>(t + 2) * outRow, s2 + b)
      store<f32>(oj + <usize>(t + 3) * outRow, s3 + b)
    }
  }
  for (; t < n; t++) {
    const xt = x + <usize>t * rowBytes
    let j = 0
    for (; j + 3 < outDim; j += 4) {
      const w0 = w + <usize>j * rowBytes
      const w1 = w0 + rowBytes
      const w2 = w1 + rowBytes
      const w3 = w2 + rowBytes
      let a0 = f32x4.splat(0)
      let a1 = f32x4.splat(0)
      let a2 = f32x4.splat(0)
      let a3 = f32x4.splat(0)
      let i = 0
      for (; i < vecEnd; i += 4) {
        const o = (<usize>i) << 2
        const xv = v128.load(xt + o)
        a0 = f32x4.add(a0, f32x4.mul(xv, v128.load(w0 + o)))
        a1 = f32x4.add(a1, f32x4.mul(xv, v128.load(w1 + o)))
        a2 = f32x4.add(a2, f32x4.mul(xv, v128.load(w2 + o)))
        a3 = f32x4.add(a3, f32x4.mul(xv, v128.load(w3 + o)))
      }
      let s0 = hsum(a0)
      let s1 = hsum(a1)
      let s2 = hsum(a2)
      let s3 = hsum(a3)
      for (; i < inDim; i++) {
        const o = (<usize>i) << 2
        const xi = load<f32>(xt + o)
        s0 += xi * load<f32>(w0 + o)
        s1 += xi * load<f32>(w1 + o)
        s2 += xi * load<f32>(w2 + o)
        s3 += xi * load<f32>(w3 + o)
      }
      const ot = out + ((<usize>t * <usize>outDim + <usize>j) << 2)
      if (bias) {
        const bj = bias + ((<usize>j) << 2)
        s0 += load<f32>(bj)
        s1 += load<f32>(bj, 4)
        s2 += load<f32>(bj, 8)
        s3 += load<f32>(bj, 12)
      }
      store<f32>(ot, s0)
      store<f32>(ot, s1, 4)
      store<f32>(ot, s2, 8)
      store<f32>(ot, s3, 12)
    }
    for (; j < outDim; j++) {
      const wr = w + <usize>j * rowBytes
      let a = f32x4.splat(0)
      let i = 0
      for (; i < vecEnd; i += 4) {
        const o = (<usize>i) << 2
        a = f32x4.add(a, f32x4.mul(v128.load(xt + o), v128.load(wr + o)))
      }
      let s = hsum(a)
      for (; i < inDim; i++)
        s += load<f32>(xt + ((<usize>i) << 2)) * load<f32>(wr + ((<usize>i) << 2))
      if (bias) s += load<f32>(bias + ((<usize>j) << 2))
      store<f32>(out + ((<usize>t * <usize>outDim + <usize>j) << 2), s)
    }
  }
}

/** BF16 weights (u16 each), widened to F32 in registers: half the bytes read per weight. */
export function linearBf16(
  out: usize,
  x: usize,
  w: usize,
  bias: usize,
  n: i32,
  inDim: i32,
  outDim: i32,
): void {
  const vecEnd = inDim & ~7
  const xRowBytes = (<usize>inDim) << 2
  const wRowBytes = (<usize>inDim) << 1
  let t = 0
  for (; t + 3 < n; t += 4) {
    const x0 = x + <usize>t * xRowBytes
    const x1 = x0 + xRowBytes
    const x2 = x1 + xRowBytes
    const x3 = x2 + xRowBytes
    for (let j = 0; j < outDim; j++) {
      const wr = w + <usize>j * wRowBytes
      let a0 = f32x4.splat(0)
      let a1 = f32x4.splat(0)
      let a2 = f32x4.splat(0)
      let a3 = f32x4.splat(0)
      let i = 0
      for (; i < vecEnd; i += 8) {
        const o = (<usize>i) << 2
        const raw = v128.load(wr + ((<usize>i) << 1))
        const lo = bf16Lo(raw)
        const hi = bf16Hi(raw)
        a0 = f32x4.add(a0, f32x4.mul(v128.load(x0 + o), lo))
        a1 = f32x4.add(a1, f32x4.mul(v128.load(x1 + o), lo))
        a2 = f32x4.add(a2, f32x4.mul(v128.load(x2 + o), lo))
        a3 = f32x4.add(a3, f32x4.mul(v128.load(x3 + o), lo))
        a0 = f32x4.add(a0, f32x4.mul(v128.load(x0 + o, 16), hi))
        a1 = f32x4.add(a1, f32x4.mul(v128.load(x1 + o, 16), hi))
        a2 = f32x4.add(a2, f32x4.mul(v128.load(x2 + o, 16), hi))
        a3 = f32x4.add(a3, f32x4.mul(v128.load(x3 + o, 16), hi))
      }
      let s0 = hsum(a0)
      let s1 = hsum(a1)
      let s2 = hsum(a2)
      let s3 = hsum(a3)
      for (; i < inDim; i++) {
        const o = (<usize>i) << 2
        const wi = bf16At(wr, i)
        s0 += load<f32>(x0 + o) * wi
        s1 += load<f32>(x1 + o) * wi
        s2 += load<f32>(x2 + o) * wi
        s3 += load<f32>(x3 + o) * wi
      }
      const b: f32 = bias ? load<f32>(bias + ((<usize>j) << 2)) : 0
      const oj = out + ((<usize>j) << 2)
      const outRow = (<usize>outDim) << 2
      store<f32>(oj + <usize>t * outRow, s0 + b)
      store<f32>(oj + <usize>(t + 1) * outRow, s1 + b)
      store<f32>(oj + <usize>(t + 2) * outRow, s2 + b)
      store<f32>(oj + <usize>(t + 3) * outRow, s3 + b)
    }
  }
  for (; t < n; t++) {
    const xt = x + <usize>t * xRowBytes
    let j = 0
    for (; j + 3 < outDim; j += 4) {
      const w0 = w + <usize>j * wRowBytes
      const w1 = w0 + wRowBytes
      const w2 = w1 + wRowBytes
      const w3 = w2 + wRowBytes
      let a0 = f32x4.splat(0)
      let a1 = f32x4.splat(0)
      let a2 = f32x4.splat(0)
      let a3 = f32x4.splat(0)
      let i = 0
      for (; i < vecEnd; i += 8) {
        const o = (<usize>i) << 2
        const ow = (<usize>i) << 1
        const xl = v128.load(xt + o)
        const xh = v128.load(xt + o, 16)
        const r0 = v128.load(w0 + ow)
        const r1 = v128.load(w1 + ow)
        const r2 = v128.load(w2 + ow)
        const r3 = v128.load(w3 + ow)
        a0 = f32x4.add(a0, f32x4.add(f32x4.mul(xl, bf16Lo(r0)), f32x4.mul(xh, bf16Hi(r0))))
        a1 = f32x4.add(a1, f32x4.add(f32x4.mul(xl, bf16Lo(r1)), f32x4.mul(xh, bf16Hi(r1))))
        a2 = f32x4.add(a2, f32x4.add(f32x4.mul(xl, bf16Lo(r2)), f32x4.mul(xh, bf16Hi(r2))))
        a3 = f32x4.add(a3, f32x4.add(f32x4.mul(xl, bf16Lo(r3)), f32x4.mul(xh, bf16Hi(r3))))
      }
      let s0 = hsum(a0)
      let s1 = hsum(a1)
      let s2 = hsum(a2)
      let s3 = hsum(a3)
      for (; i < inDim; i++) {
        const xi = load<f32>(xt + ((<usize>i) << 2))
        s0 += xi * bf16At(w0, i)
        s1 += xi * bf16At(w1, i)
        s2 += xi * bf16At(w2, i)
        s3 += xi * bf16At(w3, i)
      }
      const ot = out + ((<usize>t * <usize>outDim + <usize>j) << 2)
      if (bias) {
        const bj = bias + ((<usize>j) << 2)
        s0 += load<f32>(bj)
        s1 += load<f32>(bj, 4)
        s2 += load<f32>(bj, 8)
        s3 += load<f32>(bj, 12)
      }
      store<f32>(ot, s0)
      store<f32>(ot, s1, 4)
      store<f32>(ot, s2, 8)
      store<f32>(ot, s3, 12)
    }
    for (; j < outDim; j++) {
      const wr = w + <usize>j * wRowBytes
      let s: f32 = 0
      for (let i = 0; i < inDim; i++) s += load<f32>(xt + ((<usize>i) << 2)) * bf16At(wr, i)
      if (bias) s += load<f32>(bias + ((<usize>j) << 2))
      store<f32>(out + ((<usize>t * <usize>outDim + <usize>j) << 2), s)
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Causal attention over a contiguous context (the caller gathered it through the page table)

/** out[n, numHeads·headDim]: token t (position startPos + t) attends to context rows
 *  [0, startPos + t]; query head h reads KV head h / (numHeads / numKvHeads).
 *  q: [n, numHeads·headDim]; k, v: [startPos + n, numKvHeads·headDim]; scores: f32 scratch of
 *  startPos + n entries. */
export function attention(
  out: usize,
  q: usize,
  k: usize,
  v: usize,
  scores: usize,
  n: i32,
  startPos: i32,
  numHeads: i32,
  numKvHeads: i32,
  headDim: i32,
  scale: f32,
): void {
  const qDim = numHeads * headDim
  const kvDim = numKvHeads * headDim
  const groupSize = numHeads / numKvHeads
  const vecEnd = headDim & ~3
  const kvRowBytes = (<usize>kvDim) << 2
  for (let t = 0; t < n; t++) {
    const numKeys = startPos + t + 1
    for (let head = 0; head < numHeads; head++) {
      const qh = q + ((<usize>t * <usize>qDim + <usize>head * <usize>headDim) << 2)
      const kvOff = <usize>(head / groupSize) * ((<usize>headDim) << 2)
      let max: f32 = -Infinity
      for (let p = 0; p < numKeys; p++) {
        const kp = k + <usize>p * kvRowBytes + kvOff
        let a = f32x4.splat(0)
        let i = 0
        for (; i < vecEnd; i += 4) {
          const o = (<usize>i) << 2
          a = f32x4.add(a, f32x4.mul(v128.load(qh + o), v128.load(kp + o)))
        }
        let dot = hsum(a)
        for (; i < headDim; i++)
          dot += load<f32>(qh + ((<usize>i) << 2)) * load<f32>(kp + ((<usize>i) << 2))
        const s = dot * scale
        store<f32>(scores + ((<usize>p) << 2), s)
        if (s > max) max = s
      }
      let sum: f32 = 0
      for (let p = 0; p < numKeys; p++) {
        const e = Mathf.exp(load<f32>(scores + ((<usize>p) << 2)) - max)
        store<f32>(scores + ((<usize>p) << 2), e)
        sum += e
      }
      const inv: f32 = 1 / sum
      const oh = out + ((<usize>t * <usize>qDim + <usize>head * <usize>headDim) << 2)
      memory.fill(oh, 0, (<usize>headDim) << 2)
      for (let p = 0; p < numKeys; p++) {
        const wgt = load<f32>(scores + ((<usize>p) << 2)) * inv
        const wv = f32x4.splat(wgt)
        const vp = v + <usize>p * kvRowBytes + kvOff
        let i = 0
        for (; i < vecEnd; i += 4) {
          const o = (<usize>i) << 2
          v128.store(oh + o, f32x4.add(v128.load(oh + o), f32x4.mul(wv, v128.load(vp + o))))
        }
        for (; i < headDim; i++) {
          const o = (<usize>i) << 2
          store<f32>(oh + o, load<f32>(oh + o) + wgt * load<f32>(vp + o))
        }
      }
    }
  }
}
