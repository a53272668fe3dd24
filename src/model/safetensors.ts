/** Reader for the safetensors format (https://github.com/huggingface/safetensors, "Format"):
 *  8-byte little-endian u64 header length N, N bytes of JSON header
 *  `{name: {dtype, shape, data_offsets: [begin, end]}, __metadata__?}`, then the raw little-endian
 *  tensor bytes, offsets relative to the end of the header. F32, F16 and BF16 are converted to F32.
 *  Knows bytes and dtypes; knows nothing of model architectures. */
import { readFileSync } from 'node:fs'

/** A tensor converted to F32, row-major. */
export interface Tensor {
  shape: number[]
  data: Float32Array
}

const bytesPerElement: Record<string, number> = { F32: 4, F16: 2, BF16: 2 }

/** A tensor as stored: its dtype, shape and little-endian bytes (a view into the file buffer). */
export interface RawTensor {
  dtype: 'F32' | 'F16' | 'BF16'
  shape: number[]
  bytes: Uint8Array
}

/** Parse a safetensors buffer into F32 tensors by name. Throws on a malformed header, an
 *  unsupported dtype, or offsets outside the file or disagreeing with the shape. */
export function parseSafetensors(buf: Uint8Array, source = 'safetensors'): Map<string, Tensor> {
  const tensors = new Map<string, Tensor>()
  for (const [name, t] of parseSafetensorsRaw(buf, source)) {
    tensors.set(name, { shape: t.shape, data: rawToF32(t) })
  }
  return tensors
}

/** Parse a safetensors buffer into tensors as stored (no conversion); same checks as
 *  {@link parseSafetensors}. */
export function parseSafetensorsRaw(
  buf: Uint8Array,
  source = 'safetensors',
): Map<string, RawTensor> {
  if (buf.byteLength < 8) throw new Error(`${source}: file too short (${buf.byteLength} bytes)`)
  const view = new DataView(buf.buffer, buf.byteOffset, buf.byteLength)
  const headerLen = Number(view.getBigUint64(0, true))
  if (headerLen > buf.byteLength - 8)
    throw new Error(`${source}: header length ${headerLen} exceeds the file`)
  let header: unknown
  try {
    header = JSON.parse(new TextDecoder().decode(buf.subarray(8, 8 + headerLen)))
  } catch {
    throw new Error(`${source}: header is not valid JSON`)
  }
  if (!isObject(header)) throw new Error(`${source}: header is not a JSON object`)
  const dataStart = 8 + headerLen
  const tensors = new Map<string, RawTensor>()
  for (const [name, entry] of Object.entries(header)) {
    if (name === '__metadata__') continue
    if (!isObject(entry))
      throw new Error(
        `${source}: tensor ${name} is not an object with dtype, shape and data_offsets`,
      )
    const { dtype, shape, data_offsets: offsets } = entry
    if (typeof dtype !== 'string' || !Object.hasOwn(bytesPerElement, dtype)) {
      throw new Error(
        `${source}: tensor ${name} has unsupported dtype ${dtype} (F32, F16, BF16 are)`,
      )
    }
    if (!Array.isArray(shape) || !shape.every(isCount)) {
      throw new Error(
        `${source}: tensor ${name} shape ${JSON.stringify(shape)} is not a list of non-negative integers`,
      )
    }
    if (!Array.isArray(offsets) || offsets.length !== 2 || !offsets.every(isCount)) {
      throw new Error(
        `${source}: tensor ${name} data_offsets ${JSON.stringify(offsets)} is not [begin, end]`,
      )
    }
    const size = bytesPerElement[dtype]
    const count = shape.reduce((a, b) => a * b, 1)
    const [begin, end] = offsets
    if (end - begin !== count * size || dataStart + end > buf.byteLength || begin < 0) {
      throw new Error(
        `${source}: tensor ${name} offsets [${begin}, ${end}] do not match shape [${shape}] ${dtype}`,
      )
    }
    const bytes = buf.subarray(dataStart + begin, dataStart + end)
    tensors.set(name, { dtype: dtype as RawTensor['dtype'], shape, bytes })
  }
  return tensors
}

function isObject(x: unknown): x is Record<string, unknown> {
  return typeof x === 'object' && x !== null && !Array.isArray(x)
}

function isCount(x: unknown): x is number {
  return Number.isSafeInteger(x) && (x as number) >= 0
}

/** Read and parse a safetensors file into F32 tensors. */
export function loadSafetensors(file: string): Map<string, Tensor> {
  return parseSafetensors(readFileSync(file), file)
}

/** Number of elements of a tensor. */
export function numElements(t: { shape: number[] }): number {
  return t.shape.reduce((a, b) => a * b, 1)
}

/** A stored tensor converted to F32 (exact for F16 and BF16), into `out` when given. */
export function rawToF32(
  t: RawTensor,
  out: Float32Array = new Float32Array(numElements(t)),
): Float32Array {
  const { bytes, dtype } = t
  const count = numElements(t)
  // Byte copies assume a little-endian host (x86, ARM as Node runs them), like the file.
  if (dtype === 'F32') {
    new Uint8Array(out.buffer, out.byteOffset, count * 4).set(bytes)
  } else if (dtype === 'BF16') {
    // BF16 is the top half of an F32: shift into place.
    const u16 = rawToU16(t)
    const u32 = new Uint32Array(out.buffer, out.byteOffset, count)
    for (let i = 0; i < count; i++) u32[i] = u16[i] << 16
  } else {
    const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength)
    for (let i = 0; i < count; i++) out[i] = f16ToF32(view.getUint16(i * 2, true))
  }
  return out
}

/** The 16-bit words of an F16 or BF16 tensor, unconverted, into `out` when given. */
export function rawToU16(
  t: RawTensor,
  out: Uint16Array = new Uint16Array(numElements(t)),
): Uint16Array {
  new Uint8Array(out.buffer, out.byteOffset, numElements(t) * 2).set(t.bytes)
  return out
}

/** IEEE 754 binary16 → number (subnormals, infinities and NaN included). */
export function f16ToF32(h: number): number {
  const sign = h & 0x8000 ? -1 : 1
  const exp = (h >> 10) & 0x1f
  const frac = h & 0x3ff
  if (exp === 0) return sign * frac * 2 ** -24
  if (exp === 0x1f) return frac ? Number.NaN : sign * Infinity
  return sign * (1 + frac / 1024) * 2 ** (exp - 15)
}
