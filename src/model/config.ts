/** A Hugging Face `config.json` for a Llama-architecture decoder, parsed once into a frozen value.
 *  Knows the architecture's hyper-parameters; knows nothing of weights or KV pools. */
import { readFileSync } from 'node:fs'
import { join } from 'node:path'
import { z } from 'zod'

const RawConfig = z.object({
  model_type: z.string().optional(),
  hidden_size: z.number().int().positive(),
  intermediate_size: z.number().int().positive(),
  num_hidden_layers: z.number().int().positive(),
  num_attention_heads: z.number().int().positive(),
  num_key_value_heads: z.number().int().positive().optional(),
  head_dim: z.number().int().positive().nullish(),
  vocab_size: z.number().int().positive(),
  max_position_embeddings: z.number().int().positive(),
  rms_norm_eps: z.number().positive(),
  rope_theta: z.number().positive().default(10_000),
  tie_word_embeddings: z.boolean().default(false),
  attention_bias: z.boolean().default(false),
  bos_token_id: z.number().int().nullish(),
  eos_token_id: z.union([z.number().int(), z.array(z.number().int())]).nullish(),
  hidden_act: z.string().default('silu'),
  rope_scaling: z.record(z.string(), z.unknown()).nullish(),
  use_sliding_window: z.boolean().optional(),
  mlp_bias: z.boolean().default(false),
})

/** Architectures whose HF modeling code this forward pass follows (`model_type`). Qwen2 differs
 *  from Llama only by its q/k/v biases; Mistral without a sliding window is Llama. */
const supportedModelTypes = ['llama', 'qwen2', 'mistral'] as const

/** Llama-3 RoPE frequency scaling (HF `modeling_rope_utils._compute_llama3_parameters`). */
export interface Llama3RopeScaling {
  ropeType: 'llama3'
  /** Wavelengths above `originalMaxPositionEmbeddings / lowFreqFactor` are stretched by this. */
  factor: number
  lowFreqFactor: number
  highFreqFactor: number
  /** Context length the model was pre-trained at (8192 for Llama 3.1). */
  originalMaxPositionEmbeddings: number
}

/** The hyper-parameters the forward pass needs (HF `LlamaConfig` names, camel-cased). */
export interface ModelConfig {
  modelType: string
  hiddenSize: number
  intermediateSize: number
  numLayers: number
  numHeads: number
  numKvHeads: number
  headDim: number
  vocabSize: number
  maxPositionEmbeddings: number
  rmsNormEps: number
  ropeTheta: number
  tieWordEmbeddings: boolean
  /** q/k/v projections carry a bias (Qwen2 always; Llama when `attention_bias`). */
  attentionBias: boolean
  /** o_proj carries a bias (Llama with `attention_bias`; never Qwen2). */
  outputBias: boolean
  bosTokenId: number | null
  eosTokenIds: number[]
  /** Null for plain RoPE (`rope_scaling` absent, null or `rope_type: "default"`). */
  ropeScaling: Llama3RopeScaling | null
}

/** Parse a config object. Throws an Error naming the bad field(s). */
export function parseModelConfig(raw: unknown, source = 'config.json'): ModelConfig {
  const parsed = RawConfig.safeParse(raw)
  if (!parsed.success) {
    const issues = parsed.error.issues
      .map((i) => `${i.path.join('.') || '(root)'}: ${i.message}`)
      .join('; ')
    throw new Error(`${source}: ${issues}`)
  }
  const c = parsed.data
  const modelType = c.model_type ?? 'llama'
  if (!(supportedModelTypes as readonly string[]).includes(modelType)) {
    throw new Error(
      `${source}: model_type ${JSON.stringify(modelType)} is not supported (${supportedModelTypes.join(', ')} are)`,
    )
  }
  if (c.hidden_act !== 'silu') {
    throw new Error(
      `${source}: hidden_act ${JSON.stringify(c.hidden_act)} is not supported (silu is)`,
    )
  }
  if (c.mlp_bias) throw new Error(`${source}: mlp_bias true is not supported`)
  if (c.use_sliding_window) throw new Error(`${source}: use_sliding_window true is not supported`)
  const ropeScaling = parseRopeScaling(c.rope_scaling ?? null, source)
  const numKvHeads = c.num_key_value_heads ?? c.num_attention_heads
  const headDim = c.head_dim ?? c.hidden_size / c.num_attention_heads
  if (c.num_attention_heads % numKvHeads !== 0) {
    throw new Error(
      `${source}: num_attention_heads ${c.num_attention_heads} is not a multiple of num_key_value_heads ${numKvHeads}`,
    )
  }
  if (!Number.isInteger(headDim) || headDim % 2 !== 0)
    throw new Error(`${source}: head_dim ${headDim} must be an even integer`)
  const eos = c.eos_token_id
  return Object.freeze({
    modelType,
    hiddenSize: c.hidden_size,
    intermediateSize: c.intermediate_size,
    numLayers: c.num_hidden_layers,
    numHeads: c.num_attention_heads,
    numKvHeads,
    headDim,
    vocabSize: c.vocab_size,
    maxPositionEmbeddings: c.max_position_embeddings,
    rmsNormEps: c.rms_norm_eps,
    ropeTheta: c.rope_theta,
    tieWordEmbeddings: c.tie_word_embeddings,
    attentionBias: c.attention_bias || modelType === 'qwen2',
    outputBias: c.attention_bias && modelType !== 'qwen2',
    bosTokenId: c.bos_token_id ?? null,
    eosTokenIds: eos == null ? [] : Array.isArray(eos) ? eos : [eos],
    ropeScaling,
  })
}

const Llama3Fields = z.object({
  factor: z.number().positive(),
  low_freq_factor: z.number().positive(),
  high_freq_factor: z.number().positive(),
  original_max_position_embeddings: z.number().int().positive(),
})

/** `rope_scaling`: null, `{rope_type: "default"}` or Llama-3's; `type` is the older spelling of
 *  `rope_type`. Every other scheme (linear, dynamic, yarn, longrope, ...) is refused by name. */
function parseRopeScaling(
  raw: Record<string, unknown> | null,
  source: string,
): Llama3RopeScaling | null {
  if (raw === null) return null
  const ropeType = raw.rope_type ?? raw.type
  if (ropeType === 'default') return null
  if (ropeType !== 'llama3') {
    throw new Error(
      `${source}: rope_scaling type ${JSON.stringify(ropeType)} is not supported (default, llama3 are)`,
    )
  }
  const parsed = Llama3Fields.safeParse(raw)
  if (!parsed.success) {
    const issues = parsed.error.issues
      .map((i) => `rope_scaling.${i.path.join('.')}: ${i.message}`)
      .join('; ')
    throw new Error(`${source}: ${issues}`)
  }
  const r = parsed.data
  if (r.high_freq_factor <= r.low_freq_factor) {
    throw new Error(
      `${source}: rope_scaling.high_freq_factor ${r.high_freq_factor} must exceed low_freq_factor ${r.low_freq_factor}`,
    )
  }
  return {
    ropeType: 'llama3',
    factor: r.factor,
    lowFreqFactor: r.low_freq_factor,
    highFreqFactor: r.high_freq_factor,
    originalMaxPositionEmbeddings: r.original_max_position_embeddings,
  }
}

/** Read and parse `DIR/config.json`. Throws when it is missing or invalid. */
export function loadModelConfig(dir: string): ModelConfig {
  const file = join(dir, 'config.json')
  let text: string
  try {
    text = readFileSync(file, 'utf8')
  } catch {
    throw new Error(`no config.json in model directory ${dir}`)
  }
  let raw: unknown
  try {
    raw = JSON.parse(text)
  } catch (err) {
    throw new Error(`${file}: not valid JSON (${(err as Error).message})`)
  }
  return parseModelConfig(raw, file)
}
