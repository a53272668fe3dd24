/** Llama-architecture weights (Llama, Qwen2, SmolLM2, Mistral without sliding window) loaded from
 *  a Hugging Face directory (`config.json` + `model.safetensors`), checked against the config's
 *  shapes, and placed in the memory of the compute kernels that will use them. HF tensor names:
 *  `model.embed_tokens.weight`, `model.layers.{i}.self_attn.{q,k,v,o}_proj.{weight,bias}`,
 *  `model.layers.{i}.mlp.{gate,up,down}_proj.weight`, `model.layers.{i}.{input,post_attention}_layernorm.weight`,
 *  `model.norm.weight`, `lm_head.weight` (absent, or ignored, when embeddings are tied, as in HF). */
import { existsSync, readFileSync } from 'node:fs'
import { availableParallelism } from 'node:os'
import { basename, join } from 'node:path'
import { loadModelConfig, type ModelConfig } from './config.js'
import { createWasmKernels, type WasmKernelOptions } from './kernels-wasm.js'
import type { Kernels, LinearWeights } from './linear.js'
import { parseSafetensorsRaw, rawToF32, rawToU16, type RawTensor } from './safetensors.js'

/** One decoder layer. Matrices are `[outFeatures, inFeatures]` (PyTorch `nn.Linear`). */
export interface LayerWeights {
  inputNorm: Float32Array // [hidden]
  wq: LinearWeights // [numHeads * headDim, hidden]
  wk: LinearWeights // [numKvHeads * headDim, hidden]
  wv: LinearWeights // [numKvHeads * headDim, hidden]
  bq: Float32Array | null // [numHeads * headDim]
  bk: Float32Array | null // [numKvHeads * headDim]
  bv: Float32Array | null // [numKvHeads * headDim]
  wo: LinearWeights // [hidden, numHeads * headDim]
  bo: Float32Array | null // [hidden]
  postNorm: Float32Array // [hidden]
  wGate: LinearWeights // [intermediate, hidden]
  wUp: LinearWeights // [intermediate, hidden]
  wDown: LinearWeights // [hidden, intermediate]
}

/** A loaded model: its config, its name, its weights and the kernels whose memory holds them. */
export interface Model {
  name: string
  config: ModelConfig
  kernels: Kernels
  embed: LinearWeights // [vocab, hidden]
  layers: LayerWeights[]
  norm: Float32Array // [hidden]
  lmHead: LinearWeights // [vocab, hidden]; the embedding itself when tied
}

/** Options of {@link loadModel} and {@link modelFromTensors}. */
export interface LoadOptions {
  /** Kernels to compute with and to hold the weights (default: the WebAssembly SIMD kernels). */
  kernels?: Kernels
  /** Threads of the default WebAssembly kernels, the caller's included (default 1; see
   *  {@link defaultThreads} for serving). Not allowed together with `kernels`. Close the model's
   *  kernels (`model.kernels.close()`) to stop the helper threads. */
  threads?: number
  /** Keep BF16-stored matrices as BF16 (exact; half the bytes per token). Default true; false
   *  widens them to F32. F16 is always widened to F32 (exact). */
  keepBf16?: boolean
  /** Passed to the default WebAssembly kernels ({@link WasmKernelOptions.onFailure}): called once
   *  when their compute threads fail. Not allowed together with `kernels`. */
  onComputeFailure?: WasmKernelOptions['onFailure']
}

/** Compute threads a serving process (and `kvfence generate`) uses when none are asked for:
 *  min(2, available cores). Library callers get 1 unless they ask. */
export function defaultThreads(): number {
  return Math.min(2, availableParallelism())
}

/** Buffers some checkpoints carry that the forward pass recomputes; skipped, not refused. */
const ignoredTensor = /\.rotary_emb\.inv_freq$/

/** Build a {@link Model} from stored tensors by HF name. Throws naming any missing, mis-shaped or
 *  unexpected tensor (e.g. a bias the config does not announce). */
export function modelFromTensors(
  name: string,
  config: ModelConfig,
  tensors: Map<string, RawTensor>,
  options: LoadOptions = {},
): Model {
  if (options.kernels && (options.threads !== undefined || options.onComputeFailure))
    throw new Error('give either kernels or threads, not both')
  const kernels =
    options.kernels ??
    createWasmKernels({ threads: options.threads, onFailure: options.onComputeFailure })
  try {
    return buildModel(name, config, tensors, kernels, options)
  } catch (err) {
    if (!options.kernels) kernels.close() // ours: do not leave helper threads behind
    throw err
  }
}

function buildModel(
  name: string,
  config: ModelConfig,
  tensors: Map<string, RawTensor>,
  kernels: Kernels,
  options: LoadOptions,
): Model {
  const keepBf16 = options.keepBf16 ?? true
  const { hiddenSize: d, intermediateSize: ff, numHeads, numKvHeads, headDim, vocabSize } = config
  const used = new Set<string>()
  const get = (key: string, shape: number[]): RawTensor => {
    const t = tensors.get(key)
    if (!t) throw new Error(`model ${name}: missing tensor ${key}`)
    if (t.shape.length !== shape.length || t.shape.some((s, i) => s !== shape[i])) {
      throw new Error(`model ${name}: tensor ${key} has shape [${t.shape}], expected [${shape}]`)
    }
    used.add(key)
    return t
  }
  const vector = (key: string, size: number): Float32Array =>
    rawToF32(get(key, [size]), kernels.allocF32(size))
  const bias = (key: string, size: number, isPresent: boolean): Float32Array | null =>
    isPresent ? vector(key, size) : null
  const matrix = (key: string, outDim: number, inDim: number): LinearWeights => {
    const t = get(key, [outDim, inDim])
    if (t.dtype === 'BF16' && keepBf16)
      return { dtype: 'bf16', outDim, inDim, data: rawToU16(t, kernels.allocU16(outDim * inDim)) }
    return { dtype: 'f32', outDim, inDim, data: rawToF32(t, kernels.allocF32(outDim * inDim)) }
  }

  const q = numHeads * headDim
  const kv = numKvHeads * headDim
  const layers: LayerWeights[] = []
  for (let i = 0; i < config.numLayers; i++) {
    const p = `model.layers.${i}.`
    layers.push({
      inputNorm: vector(`${p}input_layernorm.weight`, d),
      wq: matrix(`${p}self_attn.q_proj.weight`, q, d),
      wk: matrix(`${p}self_attn.k_proj.weight`, kv, d),
      wv: matrix(`${p}self_attn.v_proj.weight`, kv, d),
      bq: bias(`${p}self_attn.q_proj.bias`, q, config.attentionBias),
      bk: bias(`${p}self_attn.k_proj.bias`, kv, config.attentionBias),
      bv: bias(`${p}self_attn.v_proj.bias`, kv, config.attentionBias),
      wo: matrix(`${p}self_attn.o_proj.weight`, d, q),
      bo: bias(`${p}self_attn.o_proj.bias`, d, config.outputBias),
      postNorm: vector(`${p}post_attention_layernorm.weight`, d),
      wGate: matrix(`${p}mlp.gate_proj.weight`, ff, d),
      wUp: matrix(`${p}mlp.up_proj.weight`, ff, d),
      wDown: matrix(`${p}mlp.down_proj.weight`, d, ff),
    })
  }
  const embed = matrix('model.embed_tokens.weight', vocabSize, d)
  const norm = vector('model.norm.weight', d)
  let lmHead: LinearWeights
  if (config.tieWordEmbeddings) {
    lmHead = embed
    if (tensors.has('lm_head.weight')) used.add('lm_head.weight') // HF ties it to the embedding
  } else {
    if (!tensors.has('lm_head.weight'))
      throw new Error(
        `model ${name}: missing tensor lm_head.weight and tie_word_embeddings is false`,
      )
    lmHead = matrix('lm_head.weight', vocabSize, d)
  }
  const unexpected = [...tensors.keys()].filter((k) => !used.has(k) && !ignoredTensor.test(k))
  if (unexpected.length > 0) {
    throw new Error(
      `model ${name}: unexpected tensor${unexpected.length > 1 ? 's' : ''} ${unexpected.slice(0, 3).join(', ')}${unexpected.length > 3 ? ', ...' : ''} (not part of a ${config.modelType} model as configured)`,
    )
  }
  return { name, config, kernels, embed, layers, norm, lmHead }
}

/** Load `DIR/config.json` and `DIR/model.safetensors`. The model is named after the directory.
 *  Throws a one-line error when a file is missing or does not match the config. */
export function loadModel(dir: string, options: LoadOptions = {}): Model {
  const config = loadModelConfig(dir)
  const file = join(dir, 'model.safetensors')
  if (!existsSync(file)) throw new Error(`no model.safetensors in model directory ${dir}`)
  const tensors = parseSafetensorsRaw(readFileSync(file), file)
  return modelFromTensors(basename(dir.replace(/\/+$/, '')), config, tensors, options)
}
