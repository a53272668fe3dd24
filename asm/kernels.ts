// WebAssembly SIMD compute kernels for the forward pass (AssemblyScript; compiled by
// `npm run build:wasm` to dist/src/model/kernels.wasm). The plain TypeScript kernels in
// src/model/kernels.ts are the oracle these must match (test/model/kernels.test.ts).
//
// Every argument is a byte address in the one (imported, shared) memory or a count; nothing is
// allocated here. Matrices are row-major; weights are `[outDim, inDim]` (PyTorch `nn.Linear`).
// BF16 weights are the top 16 bits of an F32: widened in registers by a 16-bit shift.

// ---------------------------------------------------------------------------------------------
// Linear layers: out[n, outDim] = x[n, inDim] · Wᵀ + bias (bias = 0: none), for output columns
// [rowStart, rowEnd) only (rows of W), so that threads can share one call's rows. Every path
// computes an output element in the same order (4-lane products summed per lane, lanes added,
// scalar tail, then bias), so the result is the same whatever n is and wherever a range starts.

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

/** x_lo·w_lo + x_hi·w_hi: eight products folded into four lanes, in one fixed order. */
function bf16Dot(xl: v128, xh: v128, wl: v128, wh: v128): v128 {
  return f32x4.add(f32x4.mul(xl, wl), f32x4.mul(xh, wh))
}

function bf16At(w: usize, i: usize): f32 {
  return reinterpret<f32>((<u32>load<u16>(w + (i << 1))) << 16)
}

/** Bytes of weight rows a prefill block reads before moving on (well inside L2). */
const blockBytes = 128 * 1024

/** Store s + bias[j] (or s alone: adding 0 would turn −0 into +0) at out[t, j]. */
function storeOut(out: usize, bias: usize, t: i32, j: i32, outDim: i32, s: f32): void {
  if (bias) s += load<f32>(bias + ((<usize>j) << 2))
  store<f32>(out + ((<usize>t * <usize>outDim + <usize>j) << 2), s)
}

/** F32, tokens t..t+3 × rows j, j+1: out[t+a, j+b] for a < 4, b < 2. */
function f32Tokens4Rows2(
  out: usize,
  x: usize,
  w: usize,
  bias: usize,
  t: i32,
  j: i32,
  inDim: i32,
  outDim: i32,
  vecEnd: i32,
): void {
  const rowBytes = (<usize>inDim) << 2
  const x0 = x + <usize>t * rowBytes
  const x1 = x0 + rowBytes
  const x2 = x1 + rowBytes
  const x3 = x2 + rowBytes
  const w0 = w + <usize>j * rowBytes
  const w1 = w0 + rowBytes
  let a00 = f32x4.splat(0)
  let a10 = f32x4.splat(0)
  let a20 = f32x4.splat(0)
  let a30 = f32x4.splat(0)
  let a01 = f32x4.splat(0)
  let a11 = f32x4.splat(0)
  let a21 = f32x4.splat(0)
  let a31 = f32x4.splat(0)
  let i = 0
  for (; i < vecEnd; i += 4) {
    const o = (<usize>i) << 2
    const v0 = v128.load(w0 + o)
    const v1 = v128.load(w1 + o)
    const y0 = v128.load(x0 + o)
    const y1 = v128.load(x1 + o)
    const y2 = v128.load(x2 + o)
    const y3 = v128.load(x3 + o)
    a00 = f32x4.add(a00, f32x4.mul(y0, v0))
    a10 = f32x4.add(a10, f32x4.mul(y1, v0))
    a20 = f32x4.add(a20, f32x4.mul(y2, v0))
    a30 = f32x4.add(a30, f32x4.mul(y3, v0))
    a01 = f32x4.add(a01, f32x4.mul(y0, v1))
    a11 = f32x4.add(a11, f32x4.mul(y1, v1))
    a21 = f32x4.add(a21, f32x4.mul(y2, v1))
    a31 = f32x4.add(a31, f32x4.mul(y3, v1))
  }
  let s00 = hsum(a00)
  let s10 = hsum(a10)
  let s20 = hsum(a20)
  let s30 = hsum(a30)
  let s01 = hsum(a01)
  let s11 = hsum(a11)
  let s21 = hsum(a21)
  let s31 = hsum(a31)
  for (; i < inDim; i++) {
    const o = (<usize>i) << 2
    const v0 = load<f32>(w0 + o)
    const v1 = load<f32>(w1 + o)
    const y0 = load<f32>(x0 + o)
    const y1 = load<f32>(x1 + o)
    const y2 = load<f32>(x2 + o)
    const y3 = load<f32>(x3 + o)
    s00 += y0 * v0
    s10 += y1 * v0
    s20 += y2 * v0
    s30 += y3 * v0
    s01 += y0 * v1
    s11 += y1 * v1
    s21 += y2 * v1
    s31 += y3 * v1
  }
  storeOut(out, bias, t, j, outDim, s00)
  storeOut(out, bias, t + 1, j, outDim, s10)
  storeOut(out, bias, t + 2, j, outDim, s20)
  storeOut(out, bias, t + 3, j, outDim, s30)
  storeOut(out, bias, t, j + 1, outDim, s01)
  storeOut(out, bias, t + 1, j + 1, outDim, s11)
  storeOut(out, bias, t + 2, j + 1, outDim, s21)
  storeOut(out, bias, t + 3, j + 1, outDim, s31)
}

/** F32, tokens t..t+3 × row j. */
function f32Tokens4Row1(
  out: usize,
  x: usize,
  w: usize,
  bias: usize,
  t: i32,
  j: i32,
  inDim: i32,
  outDim: i32,
  vecEnd: i32,
): void {
  const rowBytes = (<usize>inDim) << 2
  const x0 = x + <usize>t * rowBytes
  const x1 = x0 + rowBytes
  const x2 = x1 + rowBytes
  const x3 = x2 + rowBytes
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
  storeOut(out, bias, t, j, outDim, s0)
  storeOut(out, bias, t + 1, j, outDim, s1)
  storeOut(out, bias, t + 2, j, outDim, s2)
  storeOut(out, bias, t + 3, j, outDim, s3)
}

/** BF16, tokens t..t+3 × rows j, j+1. */
function bf16Tokens4Rows2(
  out: usize,
  x: usize,
  w: usize,
  bias: usize,
  t: i32,
  j: i32,
  inDim: i32,
  outDim: i32,
  vecEnd: i32,
): void {
  const xRowBytes = (<usize>inDim) << 2
  const wRowBytes = (<usize>inDim) << 1
  const x0 = x + <usize>t * xRowBytes
  const x1 = x0 + xRowBytes
  const x2 = x1 + xRowBytes
  const x3 = x2 + xRowBytes
  const w0 = w + <usize>j * wRowBytes
  const w1 = w0 + wRowBytes
  let a00 = f32x4.splat(0)
  let a10 = f32x4.splat(0)
  let a20 = f32x4.splat(0)
  let a30 = f32x4.splat(0)
  let a01 = f32x4.splat(0)
  let a11 = f32x4.splat(0)
  let a21 = f32x4.splat(0)
  let a31 = f32x4.splat(0)
  let i = 0
  for (; i < vecEnd; i += 8) {
    const o = (<usize>i) << 2
    const ow = (<usize>i) << 1
    const r0 = v128.load(w0 + ow)
    const r1 = v128.load(w1 + ow)
    const l0 = bf16Lo(r0)
    const h0 = bf16Hi(r0)
    const l1 = bf16Lo(r1)
    const h1 = bf16Hi(r1)
    let yl = v128.load(x0 + o)
    let yh = v128.load(x0 + o, 16)
    a00 = f32x4.add(a00, bf16Dot(yl, yh, l0, h0))
    a01 = f32x4.add(a01, bf16Dot(yl, yh, l1, h1))
    yl = v128.load(x1 + o)
    yh = v128.load(x1 + o, 16)
    a10 = f32x4.add(a10, bf16Dot(yl, yh, l0, h0))
    a11 = f32x4.add(a11, bf16Dot(yl, yh, l1, h1))
    yl = v128.load(x2 + o)
    yh = v128.load(x2 + o, 16)
    a20 = f32x4.add(a20, bf16Dot(yl, yh, l0, h0))
    a21 = f32x4.add(a21, bf16Dot(yl, yh, l1, h1))
    yl = v128.load(x3 + o)
    yh = v128.load(x3 + o, 16)
    a30 = f32x4.add(a30, bf16Dot(yl, yh, l0, h0))
    a31 = f32x4.add(a31, bf16Dot(yl, yh, l1, h1))
  }
  let s00 = hsum(a00)
  let s10 = hsum(a10)
  let s20 = hsum(a20)
  let s30 = hsum(a30)
  let s01 = hsum(a01)
  let s11 = hsum(a11)
  let s21 = hsum(a21)
  let s31 = hsum(a31)
  for (; i < inDim; i++) {
    const o = (<usize>i) << 2
    const v0 = bf16At(w0, i)
    const v1 = bf16At(w1, i)
    const y0 = load<f32>(x0 + o)
    const y1 = load<f32>(x1 + o)
    const y2 = load<f32>(x2 + o)
    const y3 = load<f32>(x3 + o)
    s00 += y0 * v0
    s10 += y1 * v0
    s20 += y2 * v0
    s30 += y3 * v0
    s01 += y0 * v1
    s11 += y1 * v1
    s21 += y2 * v1
    s31 += y3 * v1
  }
  storeOut(out, bias, t, j, outDim, s00)
  storeOut(out, bias, t + 1, j, outDim, s10)
  storeOut(out, bias, t + 2, j, outDim, s20)
  storeOut(out, bias, t + 3, j, outDim, s30)
  storeOut(out, bias, t, j + 1, outDim, s01)
  storeOut(out, bias, t + 1, j + 1, outDim, s11)
  storeOut(out, bias, t + 2, j + 1, outDim, s21)
  storeOut(out, bias, t + 3, j + 1, outDim, s31)
}

/** BF16, tokens t..t+3 × row j. */
function bf16Tokens4Row1(
  out: usize,
  x: usize,
  w: usize,
  bias: usize,
  t: i32,
  j: i32,
  inDim: i32,
  outDim: i32,
  vecEnd: i32,
): void {
  const xRowBytes = (<usize>inDim) << 2
  const wRowBytes = (<usize>inDim) << 1
  const x0 = x + <usize>t * xRowBytes
  const x1 = x0 + xRowBytes
  const x2 = x1 + xRowBytes
  const x3 = x2 + xRowBytes
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
    a0 = f32x4.add(a0, bf16Dot(v128.load(x0 + o), v128.load(x0 + o, 16), lo, hi))
    a1 = f32x4.add(a1, bf16Dot(v128.load(x1 + o), v128.load(x1 + o, 16), lo, hi))
    a2 = f32x4.add(a2, bf16Dot(v128.load(x2 + o), v128.load(x2 + o, 16), lo, hi))
    a3 = f32x4.add(a3, bf16Dot(v128.load(x3 + o), v128.load(x3 + o, 16), lo, hi))
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
  storeOut(out, bias, t, j, outDim, s0)
  storeOut(out, bias, t + 1, j, outDim, s1)
  storeOut(out, bias, t + 2, j, outDim, s2)
  storeOut(out, bias, t + 3, j, outDim, s3)
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
  rowStart: i32,
  rowEnd: i32,
): void {
  const vecEnd = inDim & ~3
  const rowBytes = (<usize>inDim) << 2
  // Prefill: a block of weight rows (about blockBytes, so it stays in cache) serves every group of
  // four tokens before the next block is read; inside it, each weight load serves four tokens and
  // each token load two rows.
  const groups = n & ~3
  const blockRows = max(2, (blockBytes / <i32>rowBytes) & ~1)
  for (let jb = rowStart; jb < rowEnd; jb += blockRows) {
    const jEnd = min(jb + blockRows, rowEnd)
    for (let t = 0; t < groups; t += 4) {
      let j = jb
      for (; j + 1 < jEnd; j += 2) f32Tokens4Rows2(out, x, w, bias, t, j, inDim, outDim, vecEnd)
      if (j < jEnd) f32Tokens4Row1(out, x, w, bias, t, j, inDim, outDim, vecEnd)
    }
  }
  let t = groups
  for (; t < n; t++) {
    const xt = x + <usize>t * rowBytes
    let j = rowStart
    for (; j + 3 < rowEnd; j += 4) {
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
    for (; j < rowEnd; j++) {
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
  rowStart: i32,
  rowEnd: i32,
): void {
  const vecEnd = inDim & ~7
  const xRowBytes = (<usize>inDim) << 2
  const wRowBytes = (<usize>inDim) << 1
  const groups = n & ~3
  const blockRows = max(2, (blockBytes / <i32>wRowBytes) & ~1)
  for (let jb = rowStart; jb < rowEnd; jb += blockRows) {
    const jEnd = min(jb + blockRows, rowEnd)
    for (let t = 0; t < groups; t += 4) {
      let j = jb
      for (; j + 1 < jEnd; j += 2) bf16Tokens4Rows2(out, x, w, bias, t, j, inDim, outDim, vecEnd)
      if (j < jEnd) bf16Tokens4Row1(out, x, w, bias, t, j, inDim, outDim, vecEnd)
    }
  }
  let t = groups
  for (; t < n; t++) {
    const xt = x + <usize>t * xRowBytes
    let j = rowStart
    for (; j + 3 < rowEnd; j += 4) {
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
        a0 = f32x4.add(a0, bf16Dot(xl, xh, bf16Lo(r0), bf16Hi(r0)))
        a1 = f32x4.add(a1, bf16Dot(xl, xh, bf16Lo(r1), bf16Hi(r1)))
        a2 = f32x4.add(a2, bf16Dot(xl, xh, bf16Lo(r2), bf16Hi(r2)))
        a3 = f32x4.add(a3, bf16Dot(xl, xh, bf16Lo(r3), bf16Hi(r3)))
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
    for (; j < rowEnd; j++) {
      // Leftover rows: the same vector-then-tail order as the rows above (not a plain scalar
      // sum), so a row's output does not depend on where a thread's row range ends.
      const wr = w + <usize>j * wRowBytes
      let a = f32x4.splat(0)
      let i = 0
      for (; i < vecEnd; i += 8) {
        const o = (<usize>i) << 2
        const r = v128.load(wr + ((<usize>i) << 1))
        a = f32x4.add(a, bf16Dot(v128.load(xt + o), v128.load(xt + o, 16), bf16Lo(r), bf16Hi(r)))
      }
      let s = hsum(a)
      for (; i < inDim; i++) s += load<f32>(xt + ((<usize>i) << 2)) * bf16At(wr, i)
      if (bias) s += load<f32>(bias + ((<usize>j) << 2))
      store<f32>(out + ((<usize>t * <usize>outDim + <usize>j) << 2), s)
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Causal attention over a contiguous context (the caller gathered it through the page table)

/** out[n, numHeads·headDim], query heads [headStart, headEnd) only: token t (position
 *  startPos + t) attends to context rows [0, startPos + t]; query head h reads KV head
 *  h / (numHeads / numKvHeads).
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
  headStart: i32,
  headEnd: i32,
): void {
  const qDim = numHeads * headDim
  const kvDim = numKvHeads * headDim
  const groupSize = numHeads / numKvHeads
  const vecEnd = headDim & ~3
  const kvRowBytes = (<usize>kvDim) << 2
  for (let t = 0; t < n; t++) {
    const numKeys = startPos + t + 1
    for (let head = headStart; head < headEnd; head++) {
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
