/** The safetensors reader against buffers built by hand, byte by byte, following the format
 *  (https://github.com/huggingface/safetensors, "Format"): u64 LE header length, JSON header
 *  (may be padded with spaces), then little-endian tensor bytes at offsets relative to the data.
 *  Expected values are the IEEE 754 meanings of the bit patterns, worked out in the comments. */
import assert from 'node:assert/strict'
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { describe, it } from 'node:test'
import { f16ToF32, loadSafetensors, parseSafetensors } from '../../src/model/safetensors.js'

/** A safetensors file: 8-byte LE header length, the header text, then `data`. */
function build(header: unknown, data: number[] = [], headerLen?: number): Uint8Array {
  const text = typeof header === 'string' ? header : JSON.stringify(header)
  const json = new TextEncoder().encode(text)
  const out = new Uint8Array(8 + json.length + data.length)
  new DataView(out.buffer).setBigUint64(0, BigInt(headerLen ?? json.length), true)
  out.set(json, 8)
  out.set(data, 8 + json.length)
  return out
}

/** Little-endian bytes of 16-bit patterns. */
const le16 = (...words: number[]) => words.flatMap((w) => [w & 0xff, w >> 8])

// F32, little-endian: 1.0 = 0x3F800000, −2.0 = 0xC0000000, 0.15625 = 1.25 × 2^−3 = 0x3E200000.
const f32Bytes = [0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x00, 0xc0, 0x00, 0x00, 0x20, 0x3e]
// F16: sign | 5-bit exponent (bias 15) | 10-bit fraction.
const f16Words = [
  0x3c00, // 1.0
  0xc000, // −2.0
  0x7bff, // (1 + 1023/1024) × 2^15 = 65504, the largest finite
  0x0001, // 1/1024 × 2^−14 = 2^−24, the smallest subnormal
  0x03ff, // 1023 × 2^−24, the largest subnormal
  0x0400, // 2^−14, the smallest normal
  0x3555, // (1 + 341/1024) × 2^−2 = 0.333251953125
  0x8000, // −0
  0x7c00, // +∞
  0xfc00, // −∞
]
const f16Values = [
  1,
  -2,
  65504,
  2 ** -24,
  1023 * 2 ** -24,
  2 ** -14,
  0.333251953125,
  -0,
  Infinity,
  -Infinity,
]
// BF16: the top 16 bits of an F32.
const bf16Words = [
  0x3f80, // 1.0
  0x4049, // 0x40490000 = (1 + 0x49/128) × 2 = 3.140625
  0xc000, // −2.0
  0xbf80, // −1.0
  0x7f80, // +∞
  0x0001, // 0x00010000 = 2^16 × 2^−149 = 2^−133
]
const bf16Values = [1, 3.140625, -2, -1, Infinity, 2 ** -133]

/** Header with F32 [3] at [0, 12), F16 [2, 5] at [12, 32), BF16 [6] at [32, 44), an F32 scalar at
 *  [44, 48) and an empty F16 [0, 4] at [48, 48), padded with spaces to a multiple of 8 bytes. */
function goodFile(): Uint8Array {
  const header = {
    __metadata__: { format: 'pt' },
    'w.f32': { dtype: 'F32', shape: [3], data_offsets: [0, 12] },
    'w.f16': { dtype: 'F16', shape: [2, 5], data_offsets: [12, 32] },
    'w.bf16': { dtype: 'BF16', shape: [6], data_offsets: [32, 44] },
    scalar: { dtype: 'F32', shape: [], data_offsets: [44, 48] },
    empty: { dtype: 'F16', shape: [0, 4], data_offsets: [48, 48] },
  }
  let text = JSON.stringify(header)
  text += ' '.repeat((8 - (text.length % 8)) % 8)
  // −0.5 = 0xBF000000.
  return build(text, [
    ...f32Bytes,
    ...le16(...f16Words),
    ...le16(...bf16Words),
    0x00,
    0x00,
    0x00,
    0xbf,
  ])
}

function expectGood(tensors: Map<string, { shape: number[]; data: Float32Array }>) {
  assert.deepEqual([...tensors.keys()], ['w.f32', 'w.f16', 'w.bf16', 'scalar', 'empty'])
  assert.deepEqual(tensors.get('w.f32'), { shape: [3], data: new Float32Array([1, -2, 0.15625]) })
  assert.deepEqual(tensors.get('w.f16')!.shape, [2, 5])
  assert.deepEqual([...tensors.get('w.f16')!.data], f16Values)
  assert.ok(Object.is(tensors.get('w.f16')!.data[7], -0), 'F16 0x8000 is −0')
  assert.deepEqual(tensors.get('w.bf16')!.shape, [6])
  assert.deepEqual([...tensors.get('w.bf16')!.data], bf16Values)
  assert.deepEqual(tensors.get('scalar'), { shape: [], data: new Float32Array([-0.5]) })
  assert.deepEqual(tensors.get('empty'), { shape: [0, 4], data: new Float32Array(0) })
}

describe('safetensors reader', () => {
  it('reads F32, F16 and BF16 tensors to the exact F32 values of their bit patterns', () => {
    expectGood(parseSafetensors(goodFile()))
  })

  it('reads a buffer that starts at an odd offset of a larger one (no alignment assumed)', () => {
    const file = goodFile()
    const larger = new Uint8Array(file.length + 3)
    larger.set(file, 3)
    expectGood(parseSafetensors(larger.subarray(3)))
  })

  it('loads a file from disk', () => {
    const dir = mkdtempSync(join(tmpdir(), 'kvfence-st-'))
    try {
      const file = join(dir, 'model.safetensors')
      writeFileSync(file, goodFile())
      expectGood(loadSafetensors(file))
      writeFileSync(file, new Uint8Array(3))
      assert.throws(() => loadSafetensors(file), { message: `${file}: file too short (3 bytes)` })
    } finally {
      rmSync(dir, { recursive: true, force: true })
    }
  })

  it('converts F16 NaN to NaN', () => {
    assert.ok(Number.isNaN(f16ToF32(0x7e00)))
    assert.ok(Number.isNaN(f16ToF32(0xfc01)))
  })

  const w = (entry: unknown) => ({ w: entry })
  const malformed: [string, Uint8Array, string][] = [
    ['a file shorter than the length field', new Uint8Array(5), 'bad.st: file too short (5 bytes)'],
    [
      'a header length beyond the file',
      build('{}', [], 1000),
      'bad.st: header length 1000 exceeds the file',
    ],
    [
      'a header that is not JSON',
      build('{"w": {"dtype": "F32",'),
      'bad.st: header is not valid JSON',
    ],
    ['a header that is not an object', build('[1, 2]'), 'bad.st: header is not a JSON object'],
    ['a null header', build('null'), 'bad.st: header is not a JSON object'],
    [
      'an unsupported dtype (I64)',
      build({ ids: { dtype: 'I64', shape: [1], data_offsets: [0, 8] } }, [1, 0, 0, 0, 0, 0, 0, 0]),
      'bad.st: tensor ids has unsupported dtype I64 (F32, F16, BF16 are)',
    ],
    [
      'a dtype named after an Object property',
      build(w({ dtype: 'constructor', shape: [1], data_offsets: [0, 4] }), [0, 0, 0, 0]),
      'bad.st: tensor w has unsupported dtype constructor (F32, F16, BF16 are)',
    ],
    [
      'offsets spanning fewer bytes than the shape needs',
      build(w({ dtype: 'F32', shape: [2, 2], data_offsets: [0, 12] }), Array(16).fill(0)),
      'bad.st: tensor w offsets [0, 12] do not match shape [2,2] F32',
    ],
    [
      'offsets beyond the end of the file',
      build(w({ dtype: 'BF16', shape: [4], data_offsets: [0, 8] }), Array(6).fill(0)),
      'bad.st: tensor w offsets [0, 8] do not match shape [4] BF16',
    ],
    [
      'offsets in reverse order',
      build(w({ dtype: 'F16', shape: [0], data_offsets: [4, 0] }), Array(4).fill(0)),
      'bad.st: tensor w offsets [4, 0] do not match shape [0] F16',
    ],
    [
      'a tensor entry that is not an object',
      build(w(5)),
      'bad.st: tensor w is not an object with dtype, shape and data_offsets',
    ],
    [
      'a tensor without shape',
      build(w({ dtype: 'F32', data_offsets: [0, 0] })),
      'bad.st: tensor w shape undefined is not a list of non-negative integers',
    ],
    [
      'a negative dimension',
      build(w({ dtype: 'F32', shape: [-1, -4], data_offsets: [0, 16] }), Array(16).fill(0)),
      'bad.st: tensor w shape [-1,-4] is not a list of non-negative integers',
    ],
    [
      'a tensor without data_offsets',
      build(w({ dtype: 'F32', shape: [0] })),
      'bad.st: tensor w data_offsets undefined is not [begin, end]',
    ],
  ]
  for (const [what, buf, message] of malformed) {
    it(`rejects ${what} with a clear message`, () => {
      assert.throws(
        () => parseSafetensors(buf, 'bad.st'),
        (err: unknown) => {
          assert.ok(err instanceof Error)
          assert.equal(
            err.constructor,
            Error,
            `a plain Error, not ${err.constructor.name}: ${err.message}`,
          )
          assert.equal(err.message, message)
          return true
        },
      )
    })
  }
})
