/** Llama-architecture weights loaded from a Hugging Face directory (`config.json` +
 *  `model.safetensors`), checked against the config's shapes. HF tensor names:
 *  `model.embed_tokens.weight`, `model.layers.{i}.self_attn.{q,k,v,o}_proj.{weight,bias}`,
 *  `model.layers.{i}.mlp.{gate,up,down}_proj.weight`, `model.layers.{i}.{input,post_attention}_layernorm.weight`,
 *  `model.norm.weight`, `lm_head.weight` (absent when embeddings are tied). */
import { existsSync } from 'node:fs'
import { basename, join } from 'node:path'
import { loadModelConfig, type ModelConfig } from './config.js'
import { loadSafetensors, type Tensor } from './safetensors.js'

/** One decoder layer. Matrices are row-major `[outFeatures, inFeatures]` (PyTorch `nn.Linear`). */
export interface LayerWeights {
  inputNorm: Float32Array // [hidden]
  wq: Float32Array // [numHeads * headDim, hidden]
  wk: Float32Array // [numKvHeads * headDim, hidden]
  wv: Float32Array // [numKvHeads * headDim, hidden]
  bq: Float32Array | null // [numHeads * headDim]
  bk: Float32Array | null // [numKvHeads * headDim]
  bv: Float32Array | null // [numKvHeads * headDim]
  wo: Float32Array // [hidden, numHeads * headDim]
  postNorm: Float32Array // [hidden]
  wGate: Float32Array // [intermediate, hidden]
  wUp: Float32Array // [intermediate, hidden]
  wDown: Float32Array // [hidden, intermediate]
}

/** A loaded model: its config, its name, and its weights. */
export interface Model {
  name: string
  config: ModelConfig
  embed: Float32Array // [vocab, hidden]
  layers: LayerWeights[]
  norm: Float32Array // [hidden]
  lmHead: Float32Array // [vocab, hidden]; the embedding itself when tied
}

/** Build a {@link Model} from tensors by HF name. Throws naming any missing or mis-shaped tensor. */
export function modelFromTensors(
  name: string,
  config: ModelConfig,
  tensors: Map<string, Tensor>,
): Model {
  const { hiddenSize: d, intermediateSize: ff, numHeads, numKvHeads, headDim, vocabSize } = config
  const take = (key: string, shape: number[]): Float32Array => {
    const t = tensors.get(key)
    if (!t) throw new Error(`model ${name}: missing tensor ${key}`)
    if (t.shape.length !== shape.length || t.shape.some((s, i) => s !== shape[i])) {
      throw new Error(`model ${name}: tensor ${key} has shape [${t.shape}], expected [${shape}]`)
    }
    return t.data
  }
  const maybe = (key: string, shape: number[]): Float32Array | null =>
    tensors.has(key) ? take(key, shape) : null
  const layers: LayerWeights[] = []
  for (let i = 0; i < config.numLayers; i++) {
    const p = `model.layers.${i}.`
    layers.push({
      inputNorm: take(`${p}input_layernorm.weight`, [d]),
      wq: take(`${p}self_attn.q_proj.weight`, [numHeads * headDim, d]),
      wk: take(`${p}self_attn.k_proj.weight`, [numKvHeads * headDim, d]),
      wv: take(`${p}self_attn.v_proj.weight`, [numKvHeads * headDim, d]),
      bq: maybe(`${p}self_attn.q_proj.bias`, [numHeads * headDim]),
      bk: maybe(`${p}self_attn.k_proj.bias`, [numKvHeads * headDim]),
      bv: maybe(`${p}self_attn.v_proj.bias`, [numKvHeads * headDim]),
      wo: take(`${p}self_attn.o_proj.weight`, [d, numHeads * headDim]),
      postNorm: take(`${p}post_attention_layernorm.weight`, [d]),
      wGate: take(`${p}mlp.gate_proj.weight`, [ff, d]),
      wUp: take(`${p}mlp.up_proj.weight`, [ff, d]),
      wDown: take(`${p}mlp.down_proj.weight`, [d, ff]),
    })
  }
  const embed = take('model.embed_tokens.weight', [vocabSize, d])
  const lmHead = tensors.has('lm_head.weight')
    ? take('lm_head.weight', [vocabSize, d])
    : config.tieWordEmbeddings
      ? embed
      : null
  if (!lmHead)
    throw new Error(`model ${name}: missing tensor lm_head.weight and embeddings are not tied`)
  return { name, config, embed, layers, norm: take('model.norm.weight', [d]), lmHead }
}

/** Load `DIR/config.json` and `DIR/model.safetensors`. The model is named after the directory.
 *  Throws a one-line error when a file is missing or does not match the config. */
export function loadModel(dir: string): Model {
  const config = loadModelConfig(dir)
  const file = join(dir, 'model.safetensors')
  if (!existsSync(file)) throw new Error(`no model.safetensors in model directory ${dir}`)
  return modelFromTensors(basename(dir.replace(/\/+$/, '')), config, loadSafetensors(file))
}
