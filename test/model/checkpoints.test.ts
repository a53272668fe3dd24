/** The forward pass against every architecture variant of models/test/ (written by
 *  tools/checkpoints/make.py): logits at every position must match the float64 PyTorch
 *  re-implementation of HF Llama/Qwen2 (≤ 1e-4), with the SIMD kernels and with the plain
 *  TypeScript ones, prefilling in one step or decoding token by token over scattered pages. */
import assert from 'node:assert/strict'
import { createHash } from 'node:crypto'
import { readdirSync, readFileSync } from 'node:fs'
import { join } from 'node:path'
import { describe, it } from 'node:test'
import { parseModelConfig } from '../../src/model/config.js'
import { forward, makeRope } from '../../src/model/forward.js'
import { createTsKernels } from '../../src/model/kernels.js'
import { toF32 } from '../../src/model/linear.js'
import { loadSafetensors, parseSafetensorsRaw } from '../../src/model/safetensors.js'
import { loadModel, modelFromTensors } from '../../src/model/weights.js'
import { repoRoot } from '../helpers/paths.js'
import { maxAbsDiff, scatteredSequence } from './helpers.js'

interface Reference {
  storage_dtype: 'F32' | 'BF16' | 'F16'
  ids: number[]
  tensors_f32_sha256: Record<string, string>
  logits: number[][]
}

const root = join(repoRoot, 'models', 'test')
const variants = readdirSync(root).sort()
const readReference = (name: string) =>
  JSON.parse(readFileSync(join(root, name, 'reference.json'), 'utf8')) as Reference
const sha256 = (a: Float32Array) =>
  createHash('sha256')
    .update(new Uint8Array(a.buffer, a.byteOffset, a.byteLength))
    .digest('hex')

describe('tiny checkpoints of each supported architecture', () => {
  it('covers Llama, Llama-3 RoPE scaling, Qwen2, SmolLM2 and F32/BF16/F16 storage', () => {
    assert.deepEqual(variants, [
      'llama-attention-bias',
      'llama-gqa-4-1',
      'llama3-rope-bf16',
      'qwen2-bias-f16',
      'smollm2-tied',
    ])
  })

  for (const name of variants) {
    describe(name, () => {
      const ref = readReference(name)
      const dir = join(root, name)

      it('stores tensors that convert exactly to the F32 values torch rounded them to', () => {
        const tensors = loadSafetensors(join(dir, 'model.safetensors'))
        assert.deepEqual([...tensors.keys()].sort(), Object.keys(ref.tensors_f32_sha256).sort())
        for (const [key, t] of tensors)
          assert.equal(sha256(t.data), ref.tensors_f32_sha256[key], key)
        // The matrices as the model holds them (BF16 kept as BF16) widen to the same values.
        const model = loadModel(dir)
        assert.equal(
          sha256(toF32(model.embed)),
          ref.tensors_f32_sha256['model.embed_tokens.weight'],
        )
        const wq = model.layers[0].wq
        assert.equal(wq.dtype, ref.storage_dtype === 'BF16' ? 'bf16' : 'f32')
        assert.equal(
          sha256(toF32(wq)),
          ref.tensors_f32_sha256['model.layers.0.self_attn.q_proj.weight'],
        )
      })

      for (const kernels of ['wasm-simd', 'ts'] as const) {
        it(`matches the PyTorch logits at every position (≤ 1e-4), ${kernels} kernels, one prefill`, () => {
          const model = loadModel(dir, kernels === 'ts' ? { kernels: createTsKernels() } : {})
          assert.equal(model.kernels.name, kernels)
          const { pool, seq } = scatteredSequence(model, 4, ref.ids.length)
          const logits = forward(model, makeRope(model), pool, seq, ref.ids, 0, true)
          const V = model.config.vocabSize
          for (let t = 0; t < ref.ids.length; t++) {
            const diff = maxAbsDiff(logits.subarray(t * V, (t + 1) * V), ref.logits[t])
            assert.ok(diff <= 1e-4, `position ${t}: max |Δ| ${diff}`)
          }
        })
      }

      it('matches them decoding token by token after a partial prefill (≤ 1e-4)', () => {
        const model = loadModel(dir)
        const rope = makeRope(model)
        const { pool, seq } = scatteredSequence(model, 3, ref.ids.length)
        const split = Math.floor(ref.ids.length / 2)
        forward(model, rope, pool, seq, ref.ids.slice(0, split), 0)
        for (let t = split; t < ref.ids.length; t++) {
          const row = forward(model, rope, pool, seq, [ref.ids[t]], t)
          const diff = maxAbsDiff(row, ref.logits[t])
          assert.ok(diff <= 1e-4, `position ${t}: max |Δ| ${diff}`)
        }
        pool.check()
      })
    })
  }
})

describe('unsupported checkpoints get a clear error', () => {
  const base = JSON.parse(readFileSync(join(root, 'llama3-rope-bf16', 'config.json'), 'utf8'))
  const parse = (patch: Record<string, unknown>) => () => parseModelConfig({ ...base, ...patch })

  it('refuses RoPE scaling types other than default and llama3, naming the type', () => {
    for (const type of ['linear', 'dynamic', 'yarn', 'longrope']) {
      assert.throws(parse({ rope_scaling: { rope_type: type, factor: 4 } }), {
        message: `config.json: rope_scaling type "${type}" is not supported (default, llama3 are)`,
      })
    }
    // The older spelling `type` is read too, and "default" means plain RoPE.
    assert.throws(parse({ rope_scaling: { type: 'yarn', factor: 4 } }), /rope_scaling type "yarn"/)
    assert.equal(parse({ rope_scaling: { rope_type: 'default' } })().ropeScaling, null)
    assert.throws(
      parse({ rope_scaling: { rope_type: 'llama3', factor: 8 } }),
      /rope_scaling\.low_freq_factor/,
    )
  })

  it('refuses activations other than SiLU and unknown architectures', () => {
    assert.throws(parse({ hidden_act: 'gelu' }), {
      message: 'config.json: hidden_act "gelu" is not supported (silu is)',
    })
    assert.throws(parse({ model_type: 'qwen3' }), {
      message: 'config.json: model_type "qwen3" is not supported (llama, qwen2, mistral are)',
    })
    assert.throws(parse({ model_type: 'qwen2', use_sliding_window: true }), /use_sliding_window/)
  })

  it('names a missing tensor, and a tensor the config does not describe', () => {
    const dir = join(root, 'qwen2-bias-f16')
    const config = parseModelConfig(JSON.parse(readFileSync(join(dir, 'config.json'), 'utf8')))
    const tensors = parseSafetensorsRaw(readFileSync(join(dir, 'model.safetensors')))
    const without = new Map(tensors)
    without.delete('model.layers.1.self_attn.k_proj.bias')
    assert.throws(() => modelFromTensors('m', config, without), {
      message: 'model m: missing tensor model.layers.1.self_attn.k_proj.bias',
    })
    // A Llama config (no attention_bias) over Qwen2 tensors: the biases would be silently dropped.
    assert.throws(
      () => modelFromTensors('m', { ...config, modelType: 'llama', attentionBias: false }, tensors),
      {
        message:
          'model m: unexpected tensors model.layers.0.self_attn.q_proj.bias, model.layers.0.self_attn.k_proj.bias, model.layers.0.self_attn.v_proj.bias, ... (not part of a llama model as configured)',
      },
    )
    const untied = { ...config, tieWordEmbeddings: false }
    assert.throws(() => modelFromTensors('m', untied, tensors), {
      message: 'model m: missing tensor lm_head.weight and tie_word_embeddings is false',
    })
  })
})
