/** Model benchmark: decode and prefill speed of the forward pass, and how close decode comes to
 *  the memory-bandwidth bound (every weight is read once per decoded token), for the bundled model
 *  and a SmolLM2-135M-shaped checkpoint with random weights generated in memory (F32 and BF16
 *  storage). All figures are medians over repeats, measured in this one run.
 *
 *  Every model is measured with 1 and 2 compute threads in the same run (`threads` in each row;
 *  `thread_speedups` gives the 2-over-1 ratios).
 *
 *  Decode is measured at batch 1 (`forward`, one sequence per call) and at batch 8
 *  (`forwardBatch`, eight sequences per step, as the decode worker's continuous batching runs
 *  them).
 *
 *  Args: `--repeats N` (default 3), `--decode-tokens N` (default 32), `--prefill-tokens N`
 *  (default 1000), `--threads N` (the most threads measured, default 2: rows for 1 and N),
 *  `--min-ms N` (each figure of a repeat is timed over at least N ms of whole runs, default 300),
 *  `--skip-135m`.
 *
 *  The bound: decode_bound_tokens_per_s = read bandwidth ÷ weight bytes read per token, with the
 *  streaming read bandwidth measured in the same run by as many threads as the row computes with
 *  (one thread's bandwidth is not a bound for two), through the same kernels' threads and SIMD
 *  width (read-bandwidth.ts). Decode reads its weights and writes almost nothing, so a copy (a read
 *  and a write per byte) is no bound for it: the copy bandwidth is kept beside it as a second
 *  figure (`decode_copy_bound_ratio`).
 *
 *  prefill_vs_gemm_peak: the prefill's FLOP/s (its linears, attention over the causal pairs and the
 *  last token's LM head) over the best FLOP/s one linear of the model's own shapes reaches at the
 *  prefill's token count with the same kernels and threads, measured right beside the prefill in
 *  each repeat (after it in even repeats, before it in odd ones).
 *
 *  Each ratio is the median of its per-repeat ratios with its spread (`NAME_spread`); a ratio to
 *  a bound also says whether the bound held (`NAME_bound_holds`; when not, `NAME_defect`: the
 *  "bound" as measured is no bound, a defect of the bench, not a figure above 1 to read). */
import { makeGuards } from '../src/kv/guards.js'
import { KvPool } from '../src/kv/pool.js'
import { parseModelConfig } from '../src/model/config.js'
import { forward, forwardBatch, makeRope } from '../src/model/forward.js'
import { weightBytes, type LinearWeights } from '../src/model/linear.js'
import type { RawTensor } from '../src/model/safetensors.js'
import { loadModel, modelFromTensors, type Model } from '../src/model/weights.js'
import { echoModelDir } from '../test/helpers/paths.js'
import { lastLevelCacheBytes, openCopyMeter, type CopyMeter } from './copy-bandwidth.js'
import { boundFields, ratioFields } from './ratio.js'
import { openReadMeter, type ReadMeter } from './read-bandwidth.js'

/** SmolLM2-135M's config.json (HuggingFaceTB/SmolLM2-135M), max positions cut to what is run. */
export const smolLm2Config = {
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

/** Random weights of a config as stored tensors (uniform, ±0.05; norms 1), F32 or BF16. */
export function randomTensors(rawConfig: object, dtype: 'F32' | 'BF16'): Map<string, RawTensor> {
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

/** The matrices of the model's layers and its LM head. */
function layerMatrices(model: Model): LinearWeights[] {
  return model.layers.flatMap((w) => [w.wq, w.wk, w.wv, w.wo, w.wGate, w.wUp, w.wDown])
}

/** FLOPs of a prefill of `numPromptTokens` tokens from position 0: 2 per weight per token in the
 *  layers' linears, 4 × headDim per head per causal (query, key) pair in attention (QKᵀ, then
 *  scores × V), and the LM head for the last token only; norms, RoPE and SwiGLU are left out
 *  (under 1 % at these shapes). */
function prefillFlops(model: Model, numPromptTokens: number): number {
  const c = model.config
  const n = numPromptTokens
  const linears = layerMatrices(model).reduce((s, w) => s + w.inDim * w.outDim, 0)
  const attention = c.numLayers * c.numHeads * 4 * c.headDim * ((n * (n + 1)) / 2)
  return 2 * n * linears + attention + 2 * model.lmHead.inDim * model.lmHead.outDim
}

/** Bytes of weights one decoded token reads: every matrix once (the tied embedding as LM head). */
function decodeWeightBytes(model: Model): number {
  return [model.lmHead, ...layerMatrices(model)].reduce((s, m) => s + weightBytes(m), 0)
}

interface Measured {
  model: string
  storage: string
  kernels: string
  threads: number
  parameters_bytes_per_token: number
  /** Streaming read bandwidth with as many threads as this row computes with (GB/s): the bound's
   *  divisor. */
  read_bandwidth_gb_per_s: number
  /** Copy bandwidth with as many threads (GB/s), for comparison. */
  copy_bandwidth_gb_per_s: number
  decode_tokens_per_s: number
  decode_bound_tokens_per_s: number
  /** Decode over the read bound. */
  decode_bound_ratio: number
  /** Decode over copy bandwidth ÷ weight bytes (not a bound: a copy also writes). */
  decode_copy_bound_ratio: number
  /** Tokens per second over all eight sequences of a batched decode step. */
  decode_tokens_per_s_batch8: number
  /** Batch-8 over batch-1 decode throughput. */
  decode_batch8_speedup: number
  prefill_tokens: number
  prefill_tokens_per_s: number
  prefill_gflop_per_s: number
  /** Best FLOP/s of one linear of the model's shapes at the prefill's token count (10⁹/s). */
  gemm_peak_gflop_per_s: number
  /** prefill_gflop_per_s over gemm_peak_gflop_per_s. */
  prefill_vs_gemm_peak: number
}

interface Options {
  repeats: number
  decodeTokens: number
  numPromptTokens: number
  /** Each figure of a repeat is timed over at least this long (ms), in whole runs. */
  minMs: number
}

/** One repeat's rates (tokens/s) of a model. */
interface Rates {
  decode: number
  batch8: number
  prefill: number
  /** Best FLOP/s of one linear at the prefill's token count. */
  gemm: number
}

/** Tokens/s of `runOnce` (which times itself: returns [tokens, seconds]) repeated until at least
 *  `minMs` of timed work: a tiny model's 32-token decode lasts ~3 ms, where one preemption by
 *  another process or a timer tick would decide the figure. */
function rateOver(minMs: number, runOnce: () => [number, number]): number {
  let tokens = 0
  let seconds = 0
  do {
    const [t, s] = runOnce()
    tokens += t
    seconds += s
  } while (seconds * 1000 < minMs)
  return tokens / seconds
}

/** A function that measures one repeat (batch-1 decode, batch-8 decode, prefill, the GEMM peak)
 *  of `model`; `sampleBandwidth` is called right after the decode in even repeats and right
 *  before it in odd ones, and the GEMM peak runs right after the prefill in even repeats and
 *  right before it in odd ones: each figure sits beside its bound, alternately first. */
function repeatOf(model: Model, o: Options): (r: number, sampleBandwidth: () => void) => Rates {
  const c = model.config
  const numPromptTokens = Math.min(o.numPromptTokens, c.maxPositionEmbeddings - 1)
  const pageSize = 16
  const pool = new KvPool(
    {
      // One prefill-sized sequence, or eight short decode sequences (16-token prompts).
      numPages: Math.max(
        Math.ceil((numPromptTokens + o.decodeTokens + 16) / pageSize) + 1,
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
  const ids = Array.from({ length: numPromptTokens }, (_, i) => (i * 7919 + 13) % c.vocabSize)
  const gemm = gemmPeakOf(model, numPromptTokens, o.minMs)
  const run = (fn: (seq: { lease: ReturnType<KvPool['allocate']> }) => [number, number]) => {
    const lease = pool.allocate(pool.shape.numPages, 1, 1)
    try {
      return fn({ lease })
    } finally {
      pool.release(lease)
    }
  }
  const seconds = (t0: bigint) => Number(process.hrtime.bigint() - t0) / 1e9
  const decode = () =>
    rateOver(o.minMs, () =>
      run((seq) => {
        const prompt = ids.slice(0, 16)
        forward(model, rope, pool, seq, prompt, 0)
        let token = 1
        const t0 = process.hrtime.bigint()
        for (let i = 0; i < o.decodeTokens; i++) {
          const logits = forward(model, rope, pool, seq, [token], prompt.length + i)
          token = logits[0] > logits[1] ? 2 : 3
        }
        return [o.decodeTokens, seconds(t0)]
      }),
    )
  const prefill = () =>
    rateOver(o.minMs, () =>
      run((seq) => {
        const t0 = process.hrtime.bigint()
        forward(model, rope, pool, seq, ids, 0)
        return [numPromptTokens, seconds(t0)]
      }),
    )
  return (r, sampleBandwidth) => {
    const isEven = r % 2 === 0
    if (!isEven) sampleBandwidth()
    const decodeRate = decode()
    if (isEven) sampleBandwidth()
    const batch8 = rateOver(o.minMs, () =>
      decodeBatch(model, rope, pool, ids.slice(0, 16), o.decodeTokens),
    )
    const gemmFirst = isEven ? 0 : gemm()
    const prefillRate = prefill()
    return {
      decode: decodeRate,
      batch8,
      prefill: prefillRate,
      gemm: isEven ? gemm() : gemmFirst,
    }
  }
}

/** A function that measures the best FLOP/s of one linear over the distinct shapes of the
 *  model's layer matrices, each at `n` tokens and timed over at least `minMs`. */
function gemmPeakOf(model: Model, n: number, minMs: number): () => number {
  const K = model.kernels
  const shapes = new Map<string, LinearWeights>()
  for (const w of layerMatrices(model)) shapes.set(`${w.dtype} ${w.outDim}x${w.inDim}`, w)
  const maxIn = Math.max(...[...shapes.values()].map((w) => w.inDim))
  const maxOut = Math.max(...[...shapes.values()].map((w) => w.outDim))
  const x = K.allocF32(n * maxIn).fill(0.01)
  const out = K.allocF32(n * maxOut)
  return () => {
    let best = 0
    for (const w of shapes.values()) {
      const flops = 2 * n * w.inDim * w.outDim
      const rate = rateOver(minMs, () => {
        const t0 = process.hrtime.bigint()
        K.linear(out.subarray(0, n * w.outDim), x.subarray(0, n * w.inDim), w, null, n)
        return [flops, Number(process.hrtime.bigint() - t0) / 1e9]
      })
      best = Math.max(best, rate)
    }
    return best
  }
}

/** A row of the JSON from a model's repeats, against the read and copy bandwidths (GB/s) of its
 *  thread count sampled beside each repeat's decode (`samples.read[r]` beside `rates[r]`). The
 *  ratios to a bound are the medians of per-repeat ratios, with their spreads and whether the
 *  bound held (bench/ratio.ts). */
function summarise(
  model: Model,
  storage: string,
  samples: { read: number[]; copy: number[] },
  rates: Rates[],
  o: Options,
): Measured & Record<string, unknown> {
  const bandwidth = { read: median(samples.read), copy: median(samples.copy) }
  const bytes = decodeWeightBytes(model)
  const bound = (bandwidth.read * 1e9) / bytes
  const numTokens = Math.min(o.numPromptTokens, model.config.maxPositionEmbeddings - 1)
  const flopsPerToken = prefillFlops(model, numTokens) / numTokens
  const decodeBound = boundFields(
    'decode_bound_ratio',
    rates.map((x, r) => x.decode / ((samples.read[r] * 1e9) / bytes)),
  )
  const decodeCopy = ratioFields(
    'decode_copy_bound_ratio',
    rates.map((x, r) => x.decode / ((samples.copy[r] * 1e9) / bytes)),
  )
  const gemmPeak = boundFields(
    'prefill_vs_gemm_peak',
    rates.map((x) => (x.prefill * flopsPerToken) / x.gemm),
  )
  const decode = median(rates.map((r) => r.decode))
  const batch8 = median(rates.map((r) => r.batch8))
  const numPromptTokens = Math.min(o.numPromptTokens, model.config.maxPositionEmbeddings - 1)
  const prefill = median(rates.map((r) => r.prefill))
  const prefillFlopPerS = (prefill / numPromptTokens) * prefillFlops(model, numPromptTokens)
  const gemm = median(rates.map((r) => r.gemm))
  return {
    model: model.name,
    storage,
    kernels: model.kernels.name,
    threads: model.kernels.threads,
    parameters_bytes_per_token: bytes,
    read_bandwidth_gb_per_s: round(bandwidth.read, 2),
    copy_bandwidth_gb_per_s: round(bandwidth.copy, 2),
    decode_tokens_per_s: round(decode),
    decode_bound_tokens_per_s: round(bound),
    decode_bound_ratio: decodeBound.decode_bound_ratio as number,
    ...decodeBound,
    decode_copy_bound_ratio: decodeCopy.decode_copy_bound_ratio as number,
    ...decodeCopy,
    decode_tokens_per_s_batch8: round(batch8),
    decode_batch8_speedup: round(batch8 / decode, 2),
    prefill_tokens: numPromptTokens,
    prefill_tokens_per_s: round(prefill),
    prefill_gflop_per_s: round(prefillFlopPerS / 1e9, 2),
    gemm_peak_gflop_per_s: round(gemm / 1e9, 2),
    prefill_vs_gemm_peak: gemmPeak.prefill_vs_gemm_peak as number,
    ...gemmPeak,
  }
}

const round = (x: number, digits = 1) => Number(x.toFixed(digits))

/** Sequences per step of the batched decode measurement. */
const batchSize = 8

/** Decode of {@link batchSize} sequences prefilled with `prompt` (untimed), then `steps` batched
 *  steps of one token each (every weight matrix streamed once per step): [tokens over all
 *  sequences, seconds]. */
function decodeBatch(
  model: Model,
  rope: ReturnType<typeof makeRope>,
  pool: KvPool,
  prompt: number[],
  steps: number,
): [number, number] {
  const seqs = Array.from({ length: batchSize }, (_, i) => ({
    lease: pool.allocate(pool.pagesFor(prompt.length + steps), i + 1, 1),
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
    return [batchSize * steps, Number(process.hrtime.bigint() - t0) / 1e9]
  } finally {
    for (const seq of seqs) pool.release(seq.lease)
  }
}

/** Bytes read (and copied) per bandwidth round: ≥ 4× the last-level cache (at least 256 MiB),
 *  like the weights of a real model, which no cache holds. */
function bandwidthBytes(): number {
  return Math.min(2 * 1024 ** 3, Math.max(256 * 1024 ** 2, 4 * lastLevelCacheBytes()))
}

/** Rounds (median) of each bandwidth sample. */
const bandwidthRounds = 3

/** The untimed warm-up repeat of each model (short: it only has to get the JIT past its first
 *  tiers on every path a repeat takes). */
const warmUp: Options = { repeats: 1, decodeTokens: 8, numPromptTokens: 64, minMs: 50 }

/** Run the model benchmark; returns the JSON described in the module comment. */
export async function benchModel(args: string[]): Promise<object> {
  const o: Options = {
    repeats: flag(args, '--repeats', 3),
    decodeTokens: flag(args, '--decode-tokens', 32),
    numPromptTokens: flag(args, '--prefill-tokens', 1000),
    minMs: flag(args, '--min-ms', 300),
  }
  const maxThreads = flag(args, '--threads', 2)
  const threadCounts = maxThreads > 1 ? [1, maxThreads] : [1]
  const copyMeters = new Map<number, CopyMeter>()
  const readMeters = new Map<number, ReadMeter>()
  /** Every bandwidth sample per thread count, GB/s. */
  const copySamples = new Map<number, number[]>(threadCounts.map((t) => [t, []]))
  const readSamples = new Map<number, number[]>(threadCounts.map((t) => [t, []]))
  const results: Measured[] = []
  /** Measure one checkpoint at every thread count, each in its own kernels (closed after). The
   *  thread counts take turns within each repeat after one untimed warm-up each, so that neither
   *  JIT warm-up nor a change in the machine's load favours the one measured later; within each
   *  timed repeat a read- and a copy-bandwidth sample with the same thread count is taken right
   *  beside the decode (after it in even repeats, before it in odd ones), so that a row's bound
   *  is measured under the load its speed was, and each ratio is taken per repeat. */
  const measureAll = (make: (threads: number) => Model, storage: string) => {
    const models: Model[] = []
    try {
      for (const threads of threadCounts) models.push(make(threads))
      const repeats = models.map((m) => repeatOf(m, o))
      const rates: Rates[][] = models.map(() => [])
      const rowSamples: { read: number[]; copy: number[] }[] = models.map(() => ({
        read: [],
        copy: [],
      }))
      for (const m of models) repeatOf(m, warmUp)(0, () => {})
      for (let r = 0; r < o.repeats; r++)
        repeats.forEach((once, i) => {
          const threads = models[i].kernels.threads
          const sampleBandwidth = () => {
            const read = readMeters.get(threads)!.measure(bandwidthRounds)
            const copy = copyMeters.get(threads)!.measure(bandwidthRounds)
            rowSamples[i].read.push(read)
            rowSamples[i].copy.push(copy)
            readSamples.get(threads)!.push(read)
            copySamples.get(threads)!.push(copy)
          }
          rates[i].push(once(r, sampleBandwidth))
        })
      models.forEach((m, i) => {
        results.push(summarise(m, storage, rowSamples[i], rates[i], o))
      })
    } finally {
      for (const m of models) m.kernels.close()
    }
  }
  try {
    for (const threads of threadCounts) {
      copyMeters.set(threads, await openCopyMeter(threads, bandwidthBytes()))
      readMeters.set(threads, openReadMeter(threads, bandwidthBytes()))
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
  } finally {
    for (const meter of copyMeters.values()) await meter.close()
    for (const meter of readMeters.values()) meter.close()
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
  const bandwidthRows = (samples: Map<number, number[]>, meters: Map<number, { bytes: number }>) =>
    threadCounts.map((t) => ({
      threads: t,
      gb_per_s: round(median(samples.get(t)!), 2),
      gb_per_s_min: round(Math.min(...samples.get(t)!), 2),
      gb_per_s_max: round(Math.max(...samples.get(t)!), 2),
      samples: samples.get(t)!.length,
      bytes: meters.get(t)!.bytes,
    }))
  return {
    read_bandwidth: bandwidthRows(readSamples, readMeters),
    copy_bandwidth: bandwidthRows(copySamples, copyMeters),
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
      "decode_bound = read bandwidth / weight bytes read per token; the read bandwidth of a row is measured in this run with as many threads as the row computes with (the kernels' compute threads summing chunks of a buffer ≥ 4× the last-level cache with 128-bit SIMD loads; median of 3 rounds after each timed repeat, median over the repeats); a model whose weights fit in the caches (the bundled echo model: 1.5 MB) is not bound by it and can pass 1",
      'decode_copy_bound_ratio: decode over copy bandwidth / weight bytes (each thread copying its own share between two private buffers); a copy reads and writes every byte, so this is no bound for decode, which only reads',
      "prefill_vs_gemm_peak: prefill FLOP/s (2 per weight per token in the layers, 4 x headDim per head per causal pair in attention, the last token's LM head) over the best FLOP/s of one linear of the model's layer shapes at the prefill's token count, same kernels and threads, beside the prefill in each repeat (alternately first); the median of per-repeat ratios; _bound_holds false means the peak as measured is no bound (a defect of the bench)",
      'each figure is timed over ≥ --min-ms of whole runs per repeat; the thread counts of a model take turns within each repeat after a short untimed warm-up each',
    ],
  }
}
