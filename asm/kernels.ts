// WebAssembly SIMD compute kernels for the forward pass (AssemblyScript; compiled by
// `npm run build:wasm` to dist/src/model/kernels.wasm). The plain TypeScript kernels in
// src/model/kernels.ts are the oracle these must match (test/model/kernels.test.ts).
//
// Every argument is a byte address in the one (imported, shared) memory or a count; nothing is
// allocated here. Matrices are row-major; weights are `[outDim, inDim]` (PyTorch `nn.Linear`).
// BF16 weights are the top 16 bits of an F32: widened in registers by interleaving with zeros.

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

// BF16 weights are widened by interleaving them with zeros: 16-bit lanes [0, w0, 0, w1, …] read
// as i32 lanes are w_k << 16, the F32 value of w_k (V8 emits one unpack instruction per four
// weights), and x is used as it is.

/** The F32 values of BF16 weights 0..3 of the eight in `raw`. */
function bf16Lo(raw: v128): v128 {
  return v128.shuffle<i16>(v128.splat<i32>(0), raw, 0, 8, 1, 9, 2, 10, 3, 11)
}

/** The F32 values of BF16 weights 4..7 of the eight in `raw`. */
function bf16Hi(raw: v128): v128 {
  return v128.shuffle<i16>(v128.splat<i32>(0), raw, 4, 12, 5, 13, 6, 14, 7, 15)
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

/** BF16, one token (x row at xt) × rows j..j+7: each x load serves eight rows (decode). */
function bf16Token1Rows8(
  out: usize,
  xt: usize,
  w: usize,
  bias: usize,
  t: i32,
  j: i32,
  inDim: i32,
  outDim: i32,
  vecEnd: i32,
): void {
  const wRowBytes = (<usize>inDim) << 1
  const w0 = w + <usize>j * wRowBytes
  let a0 = f32x4.splat(0)
  let a1 = f32x4.splat(0)
  let a2 = f32x4.splat(0)
  let a3 = f32x4.splat(0)
  let a4 = f32x4.splat(0)
  let a5 = f32x4.splat(0)
  let a6 = f32x4.splat(0)
  let a7 = f32x4.splat(0)
  let i = 0
  for (; i < vecEnd; i += 8) {
    const xl = v128.load(xt + ((<usize>i) << 2))
    const xh = v128.load(xt + ((<usize>i) << 2), 16)
    let r = w0 + ((<usize>i) << 1)
    let raw = v128.load(r)
    a0 = f32x4.add(a0, bf16Dot(xl, xh, bf16Lo(raw), bf16Hi(raw)))
    r += wRowBytes
    raw = v128.load(r)
    a1 = f32x4.add(a1, bf16Dot(xl, xh, bf16Lo(raw), bf16Hi(raw)))
    r += wRowBytes
    raw = v128.load(r)
    a2 = f32x4.add(a2, bf16Dot(xl, xh, bf16Lo(raw), bf16Hi(raw)))
    r += wRowBytes
    raw = v128.load(r)
    a3 = f32x4.add(a3, bf16Dot(xl, xh, bf16Lo(raw), bf16Hi(raw)))
    r += wRowBytes
    raw = v128.load(r)
    a4 = f32x4.add(a4, bf16Dot(xl, xh, bf16Lo(raw), bf16Hi(raw)))
    r += wRowBytes
    raw = v128.load(r)
    a5 = f32x4.add(a5, bf16Dot(xl, xh, bf16Lo(raw), bf16Hi(raw)))
    r += wRowBytes
    raw = v128.load(r)
    a6 = f32x4.add(a6, bf16Dot(xl, xh, bf16Lo(raw), bf16Hi(raw)))
    r += wRowBytes
    raw = v128.load(r)
    a7 = f32x4.add(a7, bf16Dot(xl, xh, bf16Lo(raw), bf16Hi(raw)))
  }
  bf16RowEnd(out, xt, w0, bias, t, j, inDim, outDim, i, a0)
  bf16RowEnd(out, xt, w0 + wRowBytes, bias, t, j + 1, inDim, outDim, i, a1)
  bf16RowEnd(out, xt, w0 + 2 * wRowBytes, bias, t, j + 2, inDim, outDim, i, a2)
  bf16RowEnd(out, xt, w0 + 3 * wRowBytes, bias, t, j + 3, inDim, outDim, i, a3)
  bf16RowEnd(out, xt, w0 + 4 * wRowBytes, bias, t, j + 4, inDim, outDim, i, a4)
  bf16RowEnd(out, xt, w0 + 5 * wRowBytes, bias, t, j + 5, inDim, outDim, i, a5)
  bf16RowEnd(out, xt, w0 + 6 * wRowBytes, bias, t, j + 6, inDim, outDim, i, a6)
  bf16RowEnd(out, xt, w0 + 7 * wRowBytes, bias, t, j + 7, inDim, outDim, i, a7)
}

/** Finish one output of a one-token BF16 row: lanes of `a` added, scalar tail from `from`, bias. */
function bf16RowEnd(
  out: usize,
  xt: usize,
  wr: usize,
  bias: usize,
  t: i32,
  j: i32,
  inDim: i32,
  outDim: i32,
  from: i32,
  a: v128,
): void {
  let s = hsum(a)
  for (let i = from; i < inDim; i++) s += load<f32>(xt + ((<usize>i) << 2)) * bf16At(wr, i)
  storeOut(out, bias, t, j, outDim, s)
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
    for (; j + 7 < rowEnd; j += 8) bf16Token1Rows8(out, xt, w, bias, t, j, inDim, outDim, vecEnd)
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
// Vectorised e^x (Cephes `expf`, S. L. Moshier): x = n·ln2 + r with |r| ≤ ln2/2 (ln2 split in two
// parts so n·C1 is exact), e^r by a degree-7 polynomial, then × 2^n built in the exponent bits.
// 2^n is applied as 2^⌊n/2⌋ · 2^(n−⌊n/2⌋) so that n = 128 (x up to 89) overflows to +∞ and n down
// to −150 underflows through the subnormals to 0 instead of wrapping the exponent field.
// Max relative error against Math.exp over x ∈ [−87, 88] (normal results): 8.1e-8, measured on
// 7,000,001 evenly spaced points, so under one f32 ulp (2^-23 ≈ 1.19e-7); test/model/exp.test.ts
// sweeps it against a 1.2e-7 bound. −∞ → 0, +∞ → +∞, NaN → NaN.

const expLog2e: f32 = Mathf.LOG2E
const expC1: f32 = 0.693359375
const expC2: f32 = -2.1219444e-4

function pow2i(n: v128): v128 {
  return i32x4.shl(i32x4.add(n, i32x4.splat(127)), 23)
}

/** e^x in every lane of x. */
function expV(x: v128): v128 {
  x = f32x4.min(f32x4.max(x, f32x4.splat(-104)), f32x4.splat(89))
  const n = f32x4.nearest(f32x4.mul(x, f32x4.splat(expLog2e)))
  let r = f32x4.sub(x, f32x4.mul(n, f32x4.splat(expC1)))
  r = f32x4.sub(r, f32x4.mul(n, f32x4.splat(expC2)))
  const z = f32x4.mul(r, r)
  let p = f32x4.splat(1.98756915e-4)
  p = f32x4.add(f32x4.mul(p, r), f32x4.splat(1.3981999507e-3))
  p = f32x4.add(f32x4.mul(p, r), f32x4.splat(8.3334519073e-3))
  p = f32x4.add(f32x4.mul(p, r), f32x4.splat(4.1665795894e-2))
  p = f32x4.add(f32x4.mul(p, r), f32x4.splat(1.6666665459e-1))
  p = f32x4.add(f32x4.mul(p, r), f32x4.splat(5.0000001201e-1))
  const y = f32x4.add(f32x4.add(f32x4.mul(p, z), r), f32x4.splat(1))
  const ni = i32x4.trunc_sat_f32x4_s(n)
  const n1 = i32x4.shr_s(ni, 1)
  return f32x4.mul(f32x4.mul(y, pow2i(n1)), pow2i(i32x4.sub(ni, n1)))
}

/** e^x of one value, by the same arithmetic as a lane of {@link expV}. */
function expS(x: f32): f32 {
  return f32x4.extract_lane(expV(f32x4.splat(x)), 0)
}

/** out[i] = e^x[i] for i < count (the vector exp of the softmax and SiLU, exported for its test). */
export function expF32(out: usize, x: usize, count: i32): void {
  let i = 0
  for (; i + 3 < count; i += 4) {
    const o = (<usize>i) << 2
    v128.store(out + o, expV(v128.load(x + o)))
  }
  for (; i < count; i++) store<f32>(out + ((<usize>i) << 2), expS(load<f32>(x + ((<usize>i) << 2))))
}

/** Sum of the lanes as (l0 + l2) + (l1 + l3): the order {@link sum4} uses per lane. */
function sum1(a: v128): f32 {
  return (
    f32x4.extract_lane(a, 0) +
    f32x4.extract_lane(a, 2) +
    (f32x4.extract_lane(a, 1) + f32x4.extract_lane(a, 3))
  )
}

/** [Σ a0, Σ a1, Σ a2, Σ a3]: four horizontal sums in one vector, each as (l0 + l2) + (l1 + l3). */
function sum4(a0: v128, a1: v128, a2: v128, a3: v128): v128 {
  const s01 = f32x4.add(f32x4.shuffle(a0, a1, 0, 1, 4, 5), f32x4.shuffle(a0, a1, 2, 3, 6, 7))
  const s23 = f32x4.add(f32x4.shuffle(a2, a3, 0, 1, 4, 5), f32x4.shuffle(a2, a3, 2, 3, 6, 7))
  return f32x4.add(f32x4.shuffle(s01, s23, 0, 2, 4, 6), f32x4.shuffle(s01, s23, 1, 3, 5, 7))
}

/** Σ q[i]·k[i] over the scalar tail i ∈ [from, to) (head sizes not a multiple of 4). */
function dotTail(q: usize, k: usize, from: i32, to: i32): f32 {
  let s: f32 = 0
  for (let i = from; i < to; i++)
    s += load<f32>(q + ((<usize>i) << 2)) * load<f32>(k + ((<usize>i) << 2))
  return s
}

// ---------------------------------------------------------------------------------------------
// Causal attention over a contiguous context (the caller gathered it through the page table,
// after the pool checked every page: this kernel never sees a page)

/** Per-instance results of {@link scorePair} (each thread has its own instance, so its own). */
let pairMaxA: f32 = -Infinity
let pairMaxB: f32 = -Infinity

/** Scaled scores q·k_p · scale of one query row (q at qh) for keys p ∈ [from, to) into
 *  scores[p]: four keys at a time (one shuffle tree instead of four horizontal sums), then one
 *  at a time. Returns max(max, those scores). Each score's arithmetic is the same whichever path
 *  computes it (lane sums (l0 + l2) + (l1 + l3), then the tail, then × scale). */
function scoreRow(
  qh: usize,
  kh: usize,
  kvRowBytes: usize,
  scores: usize,
  from: i32,
  to: i32,
  headDim: i32,
  scale: f32,
  max: f32,
): f32 {
  const vecEnd = headDim & ~3
  const scaleV = f32x4.splat(scale)
  let maxV = f32x4.splat(max)
  let p = from
  for (; p + 3 < to; p += 4) {
    const k0 = kh + <usize>p * kvRowBytes
    const k1 = k0 + kvRowBytes
    const k2 = k1 + kvRowBytes
    const k3 = k2 + kvRowBytes
    let a0 = f32x4.splat(0)
    let a1 = f32x4.splat(0)
    let a2 = f32x4.splat(0)
    let a3 = f32x4.splat(0)
    for (let i = 0; i < vecEnd; i += 4) {
      const o = (<usize>i) << 2
      const qv = v128.load(qh + o)
      a0 = f32x4.add(a0, f32x4.mul(qv, v128.load(k0 + o)))
      a1 = f32x4.add(a1, f32x4.mul(qv, v128.load(k1 + o)))
      a2 = f32x4.add(a2, f32x4.mul(qv, v128.load(k2 + o)))
      a3 = f32x4.add(a3, f32x4.mul(qv, v128.load(k3 + o)))
    }
    let s = sum4(a0, a1, a2, a3)
    if (vecEnd < headDim) s = f32x4.add(s, tail4(qh, k0, kvRowBytes, vecEnd, headDim))
    s = f32x4.mul(s, scaleV)
    v128.store(scores + ((<usize>p) << 2), s)
    maxV = f32x4.max(maxV, s)
  }
  max = Mathf.max(
    Mathf.max(f32x4.extract_lane(maxV, 0), f32x4.extract_lane(maxV, 1)),
    Mathf.max(f32x4.extract_lane(maxV, 2), f32x4.extract_lane(maxV, 3)),
  )
  for (; p < to; p++) {
    const kp = kh + <usize>p * kvRowBytes
    let a = f32x4.splat(0)
    for (let i = 0; i < vecEnd; i += 4) {
      const o = (<usize>i) << 2
      a = f32x4.add(a, f32x4.mul(v128.load(qh + o), v128.load(kp + o)))
    }
    const s = (sum1(a) + dotTail(qh, kp, vecEnd, headDim)) * scale
    store<f32>(scores + ((<usize>p) << 2), s)
    max = Mathf.max(max, s)
  }
  return max
}

/** The scalar tails of four keys' dot products (rows k0, k0 + kvRowBytes, …) as one vector. */
function tail4(qh: usize, k0: usize, kvRowBytes: usize, from: i32, to: i32): v128 {
  let tail = f32x4.splat(dotTail(qh, k0, from, to))
  tail = f32x4.replace_lane(tail, 1, dotTail(qh, k0 + kvRowBytes, from, to))
  tail = f32x4.replace_lane(tail, 2, dotTail(qh, k0 + 2 * kvRowBytes, from, to))
  return f32x4.replace_lane(tail, 3, dotTail(qh, k0 + 3 * kvRowBytes, from, to))
}

/** {@link scoreRow} for two query rows (qa, qb) over the same keys p ∈ [0, to), to a multiple of
 *  4: every key load serves both rows. Same arithmetic per score as scoreRow. Their maxima go to
 *  pairMaxA, pairMaxB. */
function scorePair(
  qa: usize,
  qb: usize,
  kh: usize,
  kvRowBytes: usize,
  sa: usize,
  sb: usize,
  to: i32,
  headDim: i32,
  scale: f32,
): void {
  const vecEnd = headDim & ~3
  const scaleV = f32x4.splat(scale)
  let maxA = f32x4.splat(-Infinity)
  let maxB = f32x4.splat(-Infinity)
  for (let p = 0; p < to; p += 4) {
    const k0 = kh + <usize>p * kvRowBytes
    const k1 = k0 + kvRowBytes
    const k2 = k1 + kvRowBytes
    const k3 = k2 + kvRowBytes
    let a0 = f32x4.splat(0)
    let a1 = f32x4.splat(0)
    let a2 = f32x4.splat(0)
    let a3 = f32x4.splat(0)
    let b0 = f32x4.splat(0)
    let b1 = f32x4.splat(0)
    let b2 = f32x4.splat(0)
    let b3 = f32x4.splat(0)
    for (let i = 0; i < vecEnd; i += 4) {
      const o = (<usize>i) << 2
      const qav = v128.load(qa + o)
      const qbv = v128.load(qb + o)
      let kv = v128.load(k0 + o)
      a0 = f32x4.add(a0, f32x4.mul(qav, kv))
      b0 = f32x4.add(b0, f32x4.mul(qbv, kv))
      kv = v128.load(k1 + o)
      a1 = f32x4.add(a1, f32x4.mul(qav, kv))
      b1 = f32x4.add(b1, f32x4.mul(qbv, kv))
      kv = v128.load(k2 + o)
      a2 = f32x4.add(a2, f32x4.mul(qav, kv))
      b2 = f32x4.add(b2, f32x4.mul(qbv, kv))
      kv = v128.load(k3 + o)
      a3 = f32x4.add(a3, f32x4.mul(qav, kv))
      b3 = f32x4.add(b3, f32x4.mul(qbv, kv))
    }
    let s = sum4(a0, a1, a2, a3)
    let r = sum4(b0, b1, b2, b3)
    if (vecEnd < headDim) {
      s = f32x4.add(s, tail4(qa, k0, kvRowBytes, vecEnd, headDim))
      r = f32x4.add(r, tail4(qb, k0, kvRowBytes, vecEnd, headDim))
    }
    s = f32x4.mul(s, scaleV)
    r = f32x4.mul(r, scaleV)
    v128.store(sa + ((<usize>p) << 2), s)
    v128.store(sb + ((<usize>p) << 2), r)
    maxA = f32x4.max(maxA, s)
    maxB = f32x4.max(maxB, r)
  }
  pairMaxA = Mathf.max(
    Mathf.max(f32x4.extract_lane(maxA, 0), f32x4.extract_lane(maxA, 1)),
    Mathf.max(f32x4.extract_lane(maxA, 2), f32x4.extract_lane(maxA, 3)),
  )
  pairMaxB = Mathf.max(
    Mathf.max(f32x4.extract_lane(maxB, 0), f32x4.extract_lane(maxB, 1)),
    Mathf.max(f32x4.extract_lane(maxB, 2), f32x4.extract_lane(maxB, 3)),
  )
}

/** Softmax of scores[0, numKeys) in place, as the probabilities e^(s − max) · (1 / Σ e): the
 *  vector exp four at a time, the sum per lane (lanes added (l0 + l2) + (l1 + l3)), then the
 *  scalar tail; each probability is the exact f32 product the weighted sum of V uses. */
function softmaxRow(scores: usize, numKeys: i32, max: f32): void {
  const maxS = f32x4.splat(max)
  let sumV = f32x4.splat(0)
  let p = 0
  for (; p + 3 < numKeys; p += 4) {
    const sp = scores + ((<usize>p) << 2)
    const e = expV(f32x4.sub(v128.load(sp), maxS))
    v128.store(sp, e)
    sumV = f32x4.add(sumV, e)
  }
  let sum = sum1(sumV)
  for (; p < numKeys; p++) {
    const sp = scores + ((<usize>p) << 2)
    const e = expS(load<f32>(sp) - max)
    store<f32>(sp, e)
    sum += e
  }
  const inv: f32 = 1 / sum
  const invV = f32x4.splat(inv)
  p = 0
  for (; p + 3 < numKeys; p += 4) {
    const sp = scores + ((<usize>p) << 2)
    v128.store(sp, f32x4.mul(v128.load(sp), invV))
  }
  for (; p < numKeys; p++) {
    const sp = scores + ((<usize>p) << 2)
    store<f32>(sp, load<f32>(sp) * inv)
  }
}

/** oh[c] = Σ_{p < numKeys} probs[p] · v_p[c] for the head's columns c (V rows at vh, kvRowBytes
 *  apart), summed in key order from 0, the output held in registers 32 columns at a time. */
function weightedRow(
  oh: usize,
  probs: usize,
  vh: usize,
  kvRowBytes: usize,
  numKeys: i32,
  headDim: i32,
): void {
  let i = 0
  for (; i + 31 < headDim; i += 32) {
    let c0 = f32x4.splat(0)
    let c1 = f32x4.splat(0)
    let c2 = f32x4.splat(0)
    let c3 = f32x4.splat(0)
    let c4 = f32x4.splat(0)
    let c5 = f32x4.splat(0)
    let c6 = f32x4.splat(0)
    let c7 = f32x4.splat(0)
    let vp = vh + ((<usize>i) << 2)
    for (let p = 0; p < numKeys; p++) {
      const w = v128.load32_splat(probs + ((<usize>p) << 2))
      c0 = f32x4.add(c0, f32x4.mul(w, v128.load(vp)))
      c1 = f32x4.add(c1, f32x4.mul(w, v128.load(vp, 16)))
      c2 = f32x4.add(c2, f32x4.mul(w, v128.load(vp, 32)))
      c3 = f32x4.add(c3, f32x4.mul(w, v128.load(vp, 48)))
      c4 = f32x4.add(c4, f32x4.mul(w, v128.load(vp, 64)))
      c5 = f32x4.add(c5, f32x4.mul(w, v128.load(vp, 80)))
      c6 = f32x4.add(c6, f32x4.mul(w, v128.load(vp, 96)))
      c7 = f32x4.add(c7, f32x4.mul(w, v128.load(vp, 112)))
      vp += kvRowBytes
    }
    const ob = oh + ((<usize>i) << 2)
    v128.store(ob, c0)
    v128.store(ob, c1, 16)
    v128.store(ob, c2, 32)
    v128.store(ob, c3, 48)
    v128.store(ob, c4, 64)
    v128.store(ob, c5, 80)
    v128.store(ob, c6, 96)
    v128.store(ob, c7, 112)
  }
  weightedColumns(oh, probs, vh, kvRowBytes, numKeys, i, headDim)
}

/** The columns [from, headDim) of {@link weightedRow}: four at a time, then one at a time. */
function weightedColumns(
  oh: usize,
  probs: usize,
  vh: usize,
  kvRowBytes: usize,
  numKeys: i32,
  from: i32,
  headDim: i32,
): void {
  let i = from
  for (; i + 3 < headDim; i += 4) {
    let c = f32x4.splat(0)
    let vp = vh + ((<usize>i) << 2)
    for (let p = 0; p < numKeys; p++) {
      c = f32x4.add(c, f32x4.mul(v128.load32_splat(probs + ((<usize>p) << 2)), v128.load(vp)))
      vp += kvRowBytes
    }
    v128.store(oh + ((<usize>i) << 2), c)
  }
  for (; i < headDim; i++) {
    let c: f32 = 0
    let vp = vh + ((<usize>i) << 2)
    for (let p = 0; p < numKeys; p++) {
      c += load<f32>(probs + ((<usize>p) << 2)) * load<f32>(vp)
      vp += kvRowBytes
    }
    store<f32>(oh + ((<usize>i) << 2), c)
  }
}

/** {@link weightedRow} for two rows whose keys are [0, numKeys) and [0, numKeys + 1) (tokens t
 *  and t + 1): each V load serves both, 16 columns at a time; the second row's last key is added
 *  last, as weightedRow adds it. */
function weightedPair(
  oa: usize,
  ob: usize,
  pa: usize,
  pb: usize,
  vh: usize,
  kvRowBytes: usize,
  numKeys: i32,
  headDim: i32,
): void {
  let i = 0
  for (; i + 15 < headDim; i += 16) {
    let c0 = f32x4.splat(0)
    let c1 = f32x4.splat(0)
    let c2 = f32x4.splat(0)
    let c3 = f32x4.splat(0)
    let d0 = f32x4.splat(0)
    let d1 = f32x4.splat(0)
    let d2 = f32x4.splat(0)
    let d3 = f32x4.splat(0)
    let vp = vh + ((<usize>i) << 2)
    for (let p = 0; p < numKeys; p++) {
      const wa = v128.load32_splat(pa + ((<usize>p) << 2))
      const wb = v128.load32_splat(pb + ((<usize>p) << 2))
      let x = v128.load(vp)
      c0 = f32x4.add(c0, f32x4.mul(wa, x))
      d0 = f32x4.add(d0, f32x4.mul(wb, x))
      x = v128.load(vp, 16)
      c1 = f32x4.add(c1, f32x4.mul(wa, x))
      d1 = f32x4.add(d1, f32x4.mul(wb, x))
      x = v128.load(vp, 32)
      c2 = f32x4.add(c2, f32x4.mul(wa, x))
      d2 = f32x4.add(d2, f32x4.mul(wb, x))
      x = v128.load(vp, 48)
      c3 = f32x4.add(c3, f32x4.mul(wa, x))
      d3 = f32x4.add(d3, f32x4.mul(wb, x))
      vp += kvRowBytes
    }
    const wb = v128.load32_splat(pb + ((<usize>numKeys) << 2))
    d0 = f32x4.add(d0, f32x4.mul(wb, v128.load(vp)))
    d1 = f32x4.add(d1, f32x4.mul(wb, v128.load(vp, 16)))
    d2 = f32x4.add(d2, f32x4.mul(wb, v128.load(vp, 32)))
    d3 = f32x4.add(d3, f32x4.mul(wb, v128.load(vp, 48)))
    const o = (<usize>i) << 2
    v128.store(oa + o, c0)
    v128.store(oa + o, c1, 16)
    v128.store(oa + o, c2, 32)
    v128.store(oa + o, c3, 48)
    v128.store(ob + o, d0)
    v128.store(ob + o, d1, 16)
    v128.store(ob + o, d2, 32)
    v128.store(ob + o, d3, 48)
  }
  weightedColumns(oa, pa, vh, kvRowBytes, numKeys, i, headDim)
  weightedColumns(ob, pb, vh, kvRowBytes, numKeys + 1, i, headDim)
}

/** out[n, numHeads·headDim], query heads [headStart, headEnd) only: token t (position
 *  startPos + t) attends to context rows [0, startPos + t]; query head h reads KV head
 *  h / (numHeads / numKvHeads).
 *  q: [n, numHeads·headDim]; k, v: [startPos + n, numKvHeads·headDim]; scores: f32 scratch of
 *  2 × ⌈(startPos + n) / 4⌉ × 4 entries (two rows; never written past them).
 *
 *  Per query row, three passes over a scores row that stays in L1: scaled q·k four keys at a
 *  time, then the softmax by the vector exp (probabilities stored), then Σ p·v with the output
 *  held in registers. Tokens go in pairs (t, t + 1) where they can: every K and V load then
 *  serves two rows, halving the traffic from L2, which bounds these loops. (A FlashAttention-
 *  style online softmax would save the n × n score matrix a GPU writes to HBM; here there are
 *  only two L1-resident rows, and the running rescale would cost more than the second pass.)
 *  Every query row's arithmetic depends only on its own position, never on n, headStart, the
 *  pairing or where a thread's block starts: bit-identical splits. */
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
  const kvRowBytes = (<usize>kvDim) << 2
  const headBytes = (<usize>headDim) << 2
  const qRowBytes = (<usize>qDim) << 2
  const scoresB = scores + (((<usize>(startPos + n + 3)) & ~3) << 2)
  let t = 0
  for (; t + 1 < n; t += 2) {
    const numKeys = startPos + t + 1 // token t's; token t + 1 has one more
    const pairEnd = numKeys & ~3
    for (let head = headStart; head < headEnd; head++) {
      const qa = q + <usize>t * qRowBytes + <usize>head * headBytes
      const qb = qa + qRowBytes
      const kvOff = <usize>(head / groupSize) * headBytes
      scorePair(qa, qb, k + kvOff, kvRowBytes, scores, scoresB, pairEnd, headDim, scale)
      const maxA = scoreRow(
        qa,
        k + kvOff,
        kvRowBytes,
        scores,
        pairEnd,
        numKeys,
        headDim,
        scale,
        pairMaxA,
      )
      const maxB = scoreRow(
        qb,
        k + kvOff,
        kvRowBytes,
        scoresB,
        pairEnd,
        numKeys + 1,
        headDim,
        scale,
        pairMaxB,
      )
      softmaxRow(scores, numKeys, maxA)
      softmaxRow(scoresB, numKeys + 1, maxB)
      const oa = out + <usize>t * qRowBytes + <usize>head * headBytes
      weightedPair(oa, oa + qRowBytes, scores, scoresB, v + kvOff, kvRowBytes, numKeys, headDim)
    }
  }
  for (; t < n; t++) {
    const numKeys = startPos + t + 1
    for (let head = headStart; head < headEnd; head++) {
      const qh = q + <usize>t * qRowBytes + <usize>head * headBytes
      const kvOff = <usize>(head / groupSize) * headBytes
      const max = scoreRow(qh, k + kvOff, kvRowBytes, scores, 0, numKeys, headDim, scale, -Infinity)
      softmaxRow(scores, numKeys, max)
      const oh = out + <usize>t * qRowBytes + <usize>head * headBytes
      weightedRow(oh, scores, v + kvOff, kvRowBytes, numKeys, headDim)
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Element-wise steps of the forward pass (single-threaded: memory-bound and cheap next to the
// linears, but several times faster here than in JS). Oracles: src/model/kernels.ts.

/** RMSNorm row by row: out[t] = x[t] / sqrt(mean(x[t]²) + eps) ⊙ weight; x, out: [n, d]. */
export function rmsNorm(out: usize, x: usize, weight: usize, n: i32, d: i32, eps: f64): void {
  const vecEnd = d & ~3
  const rowBytes = (<usize>d) << 2
  for (let t = 0; t < n; t++) {
    const xr = x + <usize>t * rowBytes
    const or = out + <usize>t * rowBytes
    let a = f32x4.splat(0)
    let i = 0
    for (; i < vecEnd; i += 4) {
      const xv = v128.load(xr + ((<usize>i) << 2))
      a = f32x4.add(a, f32x4.mul(xv, xv))
    }
    let ss = sum1(a)
    for (; i < d; i++) {
      const xi = load<f32>(xr + ((<usize>i) << 2))
      ss += xi * xi
    }
    const inv = <f32>(1 / Math.sqrt(<f64>ss / <f64>d + eps))
    const iv = f32x4.splat(inv)
    i = 0
    for (; i < vecEnd; i += 4) {
      const o = (<usize>i) << 2
      v128.store(or + o, f32x4.mul(f32x4.mul(v128.load(xr + o), iv), v128.load(weight + o)))
    }
    for (; i < d; i++) {
      const o = (<usize>i) << 2
      store<f32>(or + o, load<f32>(xr + o) * inv * load<f32>(weight + o))
    }
  }
}

/** SwiGLU in place: gate[i] = silu(gate[i]) · up[i], silu(g) = g / (1 + e^−g); count floats. */
export function swiglu(gate: usize, up: usize, count: i32): void {
  const one = f32x4.splat(1)
  let i = 0
  for (; i + 3 < count; i += 4) {
    const o = (<usize>i) << 2
    const g = v128.load(gate + o)
    const s = f32x4.div(g, f32x4.add(one, expV(f32x4.neg(g))))
    v128.store(gate + o, f32x4.mul(s, v128.load(up + o)))
  }
  for (; i < count; i++) {
    const o = (<usize>i) << 2
    const g = load<f32>(gate + o)
    store<f32>(gate + o, (g / (1 + expS(-g))) * load<f32>(up + o))
  }
}

/** Residual add: x[i] += y[i] for i < count. */
export function addInPlace(x: usize, y: usize, count: i32): void {
  let i = 0
  for (; i + 3 < count; i += 4) {
    const o = (<usize>i) << 2
    v128.store(x + o, f32x4.add(v128.load(x + o), v128.load(y + o)))
  }
  for (; i < count; i++) {
    const o = (<usize>i) << 2
    store<f32>(x + o, load<f32>(x + o) + load<f32>(y + o))
  }
}

// ---------------------------------------------------------------------------------------------
// Streaming read: what bounds decode, which reads every weight once per token and writes little.

/** out[0] = the sum of x[0..count) (F32), read with the linear kernels' SIMD width: four 4-lane
 *  accumulators, one 64-byte line per step, so that the loop is limited by memory, not by the
 *  latency of one chain of adds. The order of the adds is fixed (lanes, then accumulators, then
 *  the scalar tail): the same sum for the same range. The benchmark's read-bandwidth meter. */
export function sumF32(out: usize, x: usize, count: i32): void {
  let a0 = f32x4.splat(0)
  let a1 = f32x4.splat(0)
  let a2 = f32x4.splat(0)
  let a3 = f32x4.splat(0)
  let i = 0
  for (; i + 15 < count; i += 16) {
    const p = x + ((<usize>i) << 2)
    a0 = f32x4.add(a0, v128.load(p))
    a1 = f32x4.add(a1, v128.load(p, 16))
    a2 = f32x4.add(a2, v128.load(p, 32))
    a3 = f32x4.add(a3, v128.load(p, 48))
  }
  let s = hsum(f32x4.add(f32x4.add(a0, a1), f32x4.add(a2, a3)))
  for (; i < count; i++) s += load<f32>(x + ((<usize>i) << 2))
  store<f32>(out, s)
}

/** RoPE in place, rotate-half convention: row t of x ([n, numHeads·headDim]) is rotated by the
 *  angles whose cosines and sines are row t of cos, sin ([n, headDim / 2]); every head alike. */
export function rope(x: usize, cos: usize, sin: usize, n: i32, numHeads: i32, headDim: i32): void {
  const half = headDim >> 1
  const halfBytes = (<usize>half) << 2
  const headBytes = (<usize>headDim) << 2
  for (let t = 0; t < n; t++) {
    const ct = cos + <usize>t * halfBytes
    const st = sin + <usize>t * halfBytes
    for (let head = 0; head < numHeads; head++) {
      const xa = x + (<usize>t * <usize>numHeads + <usize>head) * headBytes
      const xb = xa + halfBytes
      let i = 0
      for (; i + 3 < half; i += 4) {
        const o = (<usize>i) << 2
        const a = v128.load(xa + o)
        const b = v128.load(xb + o)
        const c = v128.load(ct + o)
        const s = v128.load(st + o)
        v128.store(xa + o, f32x4.sub(f32x4.mul(a, c), f32x4.mul(b, s)))
        v128.store(xb + o, f32x4.add(f32x4.mul(b, c), f32x4.mul(a, s)))
      }
      for (; i < half; i++) {
        const o = (<usize>i) << 2
        const a = load<f32>(xa + o)
        const b = load<f32>(xb + o)
        const c = load<f32>(ct + o)
        const s = load<f32>(st + o)
        store<f32>(xa + o, a * c - b * s)
        store<f32>(xb + o, b * c + a * s)
      }
    }
  }
}
