/** Model benchmark: decode and prefill speed of the forward pass, and how close decode comes to
 *  the memory-bandwidth bound (every weight is read once per decoded token), for the bundled model
 *  and a SmolLM2-135M-shaped checkpoint with random weights generated in memory (F32 and BF16
 *  storage). All figures are medians over repeats, measured in this one run.
 *
 *  Every model is measured with 1 and 2 compute threads in the same run (`threads` in each row;
 *  `thread_speedups` gives the 2-over-1 ratios).
 *
 *  Args: `--repeats N` (default 3), `--decode-tokens N` (default 32), `--prefill-tokens N`
 *  (default 1000), `--threads N` (the most threads measured, default 2: rows for 1 and N),
 *  `--skip-135m`. Decode is measured at batch 1 (`forward`, one sequence per call) and at
 *  batch 8 (`forwardBatch`, eight sequences per step, as the decode worker's continuous batching
 *  runs them). */
import { makeGuards } from '../src/kv/guards.js'
import { KvPool } from '../src/kv/pool.js'
import { parseModelConfig } from '../src/model/config.js'
import { forward, forwardBatch, makeRope } from '../src/model/forward.js'
import { weightBytes, type LinearWeights } from '../src/model/linear.js'
import type { RawTensor } from '../src/model/safetensors.js'
import { loadModel, modelFromTensors, type Model } from '../src/model/weights.js'
import { echoModelDir } from '../test/helpers/paths.js'

/** SmolLM2-135M's config.json (HuggingFaceTB/SmolLM2-135M), max positions cut to what is run. */
const smolLm2Config = {
  model_type: 'llama',
  hidden_size: 576,
  intermediate_size: 1536,
  num_hidden_layers: 30,
  num_attention_heads: 9,
  num_key_value_heads: 3,
  vocab_size: 49152,
  max_position_embeddings: 2048,
  rms_norm_eps: 1e-5,
  rope_theta: 100000,
  tie_word_embeddings: true,
}

function median(xs: number[]): number {
  const s = [...xs].sort((a, b) => a - b)
  const m = s.length >> 1
  return s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2
}

function flag(args: string[], name: string, fallback: number): number {
  const at = args.indexOf(name)
  if (at < 0) return fallback
  const v = Number(args[at + 1])
  if (!Number.isInteger(v) || v <= 0) throw new Error(`${name} needs a positive integer`)
  return v
}

/** Large-buffer copy bandwidth, GB/s (read + write counted as bytes copied, as memcpy figures are). */
function copyBandwidth(repeats: number): number {
  const n = 64 * 1024 * 1024 // 256 MiB of F32: far beyond the caches, like the weights
  const src = new Float32Array(n).fill(1)
  const dst = new Float32Array(n)
  const rates: number[] = []
  for (let r = 0; r < repeats + 1; r++) {
    const t0 = process.hrtime.bigint()
    dst.set(src)
    const s = Number(process.hrtime.bigint() - t0) / 1e9
    if (r > 0) rates.push(src.byteLength / s / 1e9) // the first pass faults pages in
  }
  return median(rates)
}

/** Random weights of a config as stored tensors (uniform, ±0.05; norms 1), F32 or BF16. */
function randomTensors(rawConfig: object, dtype: 'F32' | 'BF16'): Map<string, RawTensor> {
  const c = parseModelConfig(rawConfig, 'SmolLM2-135M shape')
  const tensors = new Map<string, RawTensor>()
  let state = 0x12345678
  const add = (name: string, shape: number[], isNorm = false) => {
    const count = shape.reduce((a, b) => a * b, 1)
    const f32 = new Float32Array(count)
    if (isNorm) f32.fill(1)
    else
      for (let i = 0; i < count; i++) {
        state ^= state << 13
        state ^= state >>> 17
        state ^= state << 5
        f32[i] = ((state >>> 0) / 2 ** 32 - 0.5) * 0.1
      }
    const bytes =
      dtype === 'F32'
        ? new Uint8Array(f32.buffer)
        : new Uint8Array(Uint16Array.from(new Uint32Array(f32.buffer), (u) => u >>> 16).buffer)
    tensors.set(name, { dtype, shape, bytes })
  }
  const { hiddenSize: d, intermediateSize: ff, numHeads: H, numKvHeads: KV, headDim: hd } = c
  add('model.embed_tokens.weight', [c.vocabSize, d])
  for (let i = 0; i < c.numLayers; i++) {
    const p = `model.layers.${i}.`
    add(`${p}input_layernorm.weight`, [d], true)
    add(`${p}self_attn.q_proj.weight`, [H * hd, d])
    add(`${p}self_attn.k_proj.weight`, [KV * hd, d])
    add(`${p}self_attn.v_proj.weight`, [KV * hd, d])
    add(`${p}self_attn.o_proj.weight`, [d, H * hd])
    add(`${p}post_attention_layernorm.weight`, [d], true)
    add(`${p}mlp.gate_proj.weight`, [ff, d])
    add(`${p}mlp.up_proj.weight`, [ff, d])
    add(`${p}mlp.down_proj.weight`, [d, ff])
  }
  add('model.norm.weight', [d], true)
  return tensors
}

/** Bytes of weights one decoded token reads: every matrix once (the tied embedding as LM head). */
function decodeWeightBytes(model: Model): number {
  const mats: LinearWeights[] = [model.lmHead]
  for (const w of model.layers) mats.push(w.wq, w.wk, w.wv, w.wo, w.wGate, w.wUp, w.wDown)
  return mats.reduce((s, m) => s + weightBytes(m), 0)
}

interface Measured {
  model: string
  storage: string
  kernels: string
  threads: number
  parameters_bytes_per_token: number
  decode_tokens_per_s: number
  decode_bound_tokens_per_s: number
  decode_bound_ratio: number
  /** Tokens per second over all eight sequences of a batched decode step. */
  decode_tokens_per_s_batch8: number
  /** Batch-8 over batch-1 decode throughput. */
  decode_batch8_speedup: number
  prefill_tokens: number
  prefill_tokens_per_s: number
}

function measure(
  model: Model,
  storage: string,
  bandwidth: number,
  o: { repeats: number; decodeTokens: number; prefillTokens: number },
): Measured {
  const c = model.config
  const prefillTokens = Math.min(o.prefillTokens, c.maxPositionEmbeddings - 1)
  const pageSize = 16
  const pool = new KvPool(
    {
      // One prefill-sized sequence, or eight short decode sequences (16-token prompts).
      numPages: Math.max(
        Math.ceil((prefillTokens + o.decodeTokens + 16) / pageSize) + 1,
        batchSize * Math.ceil((16 + o.decodeTokens) / pageSize),
      ),
      pageSize,
      numLayers: c.numLayers,
      numKvHeads: c.numKvHeads,
      headDim: c.headDim,
    },
    makeGuards(true),
  )
  const rope = makeRope(model)
  const ids = Array.from({ length: prefillTokens }, (_, i) => (i * 7919 + 13) % c.vocabSize)
  const run = (
    fn: (seq: { pageTable: ReturnType<KvPool['allocate']>; owner: number }) => number,
  ) => {
    const pageTable = pool.allocate(pool.shape.numPages, 1, 1)
    try {
      return fn({ pageTable, owner: 1 })
    } finally {
      pool.release(pageTable, 1)
    }
  }
  const decodeRates: number[] = []
  const batchRates: number[] = []
  const prefillRates: number[] = []
  for (let r = 0; r < o.repeats; r++) {
    decodeRates.push(
      run((seq) => {
        const prompt = ids.slice(0, 16)
        forward(model, rope, pool, seq, prompt, 0)
        let token = 1
        const t0 = process.hrtime.bigint()
        for (let i = 0; i < o.decodeTokens; i++) {
          const logits = forward(model, rope, pool, seq, [token], prompt.length + i)
          token = logits[0] > logits[1] ? 2 : 3
        }
        return o.decodeTokens / (Number(process.hrtime.bigint() - t0) / 1e9)
      }),
    )
    batchRates.push(decodeBatch(model, rope, pool, ids.slice(0, 16), o.decodeTokens))
    prefillRates.push(
      run((seq) => {
        const t0 = process.hrtime.bigint()
        forward(model, rope, pool, seq, ids, 0)
        return prefillTokens / (Number(process.hrtime.bigint() - t0) / 1e9)
      }),
    )
  }
  const bytes = decodeWeightBytes(model)
  const bound = (bandwidth * 1e9) / bytes
  const decode = median(decodeRates)
  const batch8 = median(batchRates)
  return {
    model: model.name,
    storage,
    kernels: model.kernels.name,
    threads: model.kernels.threads,
    parameters_bytes_per_token: bytes,
    decode_tokens_per_s: round(decode),
    decode_bound_tokens_per_s: round(bound),
    decode_bound_ratio: round(decode / bound, 3),
    decode_tokens_per_s_batch8: round(batch8),
    decode_batch8_speedup: round(batch8 / decode, 2),
    prefill_tokens: prefillTokens,
    prefill_tokens_per_s: round(median(prefillRates)),
  }
}

const round = (x: number, digits = 1) => Number(x.toFixed(digits))

/** Sequences per step of the batched decode measurement. */
const batchSize = 8

/** Decode tokens/s over all sequences: {@link batchSize} sequences prefilled with `prompt`, then
 *  `steps` batched steps of one token each (every weight matrix streamed once per step). */
function decodeBatch(
  model: Model,
  rope: ReturnType<typeof makeRope>,
  pool: KvPool,
  prompt: number[],
  steps: number,
): number {
  const seqs = Array.from({ length: batchSize }, (_, i) => ({
    owner: i + 1,
    pageTable: pool.allocate(pool.pagesFor(prompt.length + steps), i + 1, 1),
  }))
  try {
    for (const seq of seqs) forward(model, rope, pool, seq, prompt, 0)
    const tokens = seqs.map((_, i) => i + 1)
    const t0 = process.hrtime.bigint()
    for (let step = 0; step < steps; step++) {
      const results = forwardBatch(
        model,
        rope,
        pool,
        seqs.map((seq, i) => ({ ...seq, tokenIds: [tokens[i]], startPos: prompt.length + step })),
      )
      results.forEach((r, i) => {
        if ('error' in r) throw r.error
        tokens[i] = r.logits[0] > r.logits[1] ? 2 : 3
      })
    }
    return (batchSize * steps) / (Number(process.hrtime.bigint() - t0) / 1e9)
  } finally {
    for (const seq of seqs) pool.release(seq.pageTable, seq.owner)
  }
}

/** Run the model benchmark; returns the JSON described in the module comment. */
export async function benchModel(args: string[]): Promise<object> {
  const o = {
    repeats: flag(args, '--repeats', 3),
    decodeTokens: flag(args, '--decode-tokens', 32),
    prefillTokens: flag(args, '--prefill-tokens', 1000),
  }
  const maxThreads = flag(args, '--threads', 2)
  const threadCounts = maxThreads > 1 ? [1, maxThreads] : [1]
  const bandwidth = copyBandwidth(5)
  const results: Measured[] = []
  /** Measure one checkpoint at every thread count, each in its own kernels (closed after). */
  const measureAll = (make: (threads: number) => Model, storage: string) => {
    for (const threads of threadCounts) {
      const model = make(threads)
      try {
        results.push(measure(model, storage, bandwidth, o))
      } finally {
        model.kernels.close()
      }
    }
  }
  measureAll((threads) => loadModel(echoModelDir, { threads }), 'F32')
  if (!args.includes('--skip-135m')) {
    for (const dtype of ['F32', 'BF16'] as const) {
      const config = parseModelConfig(smolLm2Config, 'SmolLM2-135M shape')
      const tensors = randomTensors(smolLm2Config, dtype)
      measureAll(
        (threads) => modelFromTensors(`SmolLM2-135M-shape`, config, tensors, { threads }),
        dtype,
      )
    }
  }
  const row = (model: string, storage: string, threads: number) =>
    results.find((r) => r.model === model && r.storage === storage && r.threads === threads)
  const ratio = (a: number | undefined, b: number | undefined) =>
    a !== undefined && b !== undefined ? round(a / b, 2) : null
  const smol = 'SmolLM2-135M-shape'
  const threadSpeedups = results
    .filter((r) => r.threads === maxThreads && maxThreads > 1)
    .map((r) => {
      const one = row(r.model, r.storage, 1)
      return {
        model: r.model,
        storage: r.storage,
        threads: `${maxThreads} over 1`,
        decode: ratio(r.decode_tokens_per_s, one?.decode_tokens_per_s),
        decode_batch8: ratio(r.decode_tokens_per_s_batch8, one?.decode_tokens_per_s_batch8),
        prefill: ratio(r.prefill_tokens_per_s, one?.prefill_tokens_per_s),
      }
    })
  return {
    copy_bandwidth_gb_per_s: round(bandwidth, 2),
    threads: threadCounts,
    batch: 1,
    batch_batched: batchSize,
    repeats: o.repeats,
    models: results,
    thread_speedups: threadSpeedups,
    bf16_over_f32_decode: Object.fromEntries(
      threadCounts.map((t) => [
        `threads_${t}`,
        ratio(row(smol, 'BF16', t)?.decode_tokens_per_s, row(smol, 'F32', t)?.decode_tokens_per_s),
      ]),
    ),
    notes: [
      'decode_tokens_per_s: batch 1 (forward, one sequence per call); decode_tokens_per_s_batch8: eight sequences per forwardBatch step, tokens counted over all of them',
      'threads: the WebAssembly SIMD kernels split each linear by output rows (attention by heads) between the calling thread and threads − 1 helper threads over one shared memory; results are bit-identical to 1 thread',
      'decode_bound = copy bandwidth / weight bytes read per token (measured in this run)',
    ],
  }
}
