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
  hidden_act: z.literal('silu').default('silu'),
})

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
  /** q/k/v projections carry a bias (Qwen2). */
  attentionBias: boolean
  bosTokenId: number | null
  eosTokenIds: number[]
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
    modelType: c.model_type ?? 'llama',
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
    attentionBias: c.attention_bias || c.model_type === 'qwen2',
    bosTokenId: c.bos_token_id ?? null,
    eosTokenIds: eos == null ? [] : Array.isArray(eos) ? eos : [eos],
  })
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
