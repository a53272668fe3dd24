/** Offload benchmark: the time to first token of a 1,000-token prompt whose 992-token prefix
 *  (62 full pages of 16) is found in the prefix cache's pool pages, in the host-memory offload
 *  tier, in the disk tier, or nowhere (cold), measured in one run as medians over repeats.
 *
 *  In process, with a real decode worker over loopback TCP (the transfer is part of TTFT, as in a
 *  disaggregated cluster); no router or HTTP. TTFT runs from the request's start to the decode
 *  worker's first token. Three prefill workers of the same model, one per configuration: the cache
 *  alone (62 pages: its pool hits and the cold prompts), the cache above a host ring of 124 pages,
 *  and the cache above a disk tier (a fresh 0700 directory under the OS temp dir). For an offload
 *  hit the prompt is sent once, then one other 1,000-token prompt of the same tenant pushes all 62
 *  of its pages out of the cache into the tier; the prompt sent again loads them back (verified).
 *  Every timed request reports `cached_tokens` (992 for a hit, 0 cold): the bench fails otherwise.
 *
 *  Args: `--repeats N` (default 5), `--model echo|135m` (default echo: the bundled 2-layer model,
 *  whose prefill is cheap, so the figures show mostly what loading and transferring pages costs;
 *  135m: SmolLM2-135M's shape with random F32 weights, whose prefill costs what a small real
 *  model's does; the decode worker's bootstrap wait is raised to 15 min for the bench, since a cold
 *  prefill of it outlasts the product's 30 s on a loaded machine),
 *  `--threads N` (compute threads, default 2). */
import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import type { PrefillResult } from '../src/control/messages.js'
import { DecodeWorker } from '../src/engine/decode-worker.js'
import { buildFaultConfig } from '../src/engine/faults.js'
import { PrefillWorker, type PrefillWorkerOptions } from '../src/engine/prefill-worker.js'
import { createWorkerCore } from '../src/engine/worker-core.js'
import { parseModelConfig } from '../src/model/config.js'
import { loadModel, modelFromTensors, type Model } from '../src/model/weights.js'
import { TransferServer } from '../src/transfer/index.js'
import { makeRequest, runRequest, type Pair } from '../test/engine/pair.js'
import { echoModelDir } from '../test/helpers/paths.js'
import { randomTensors, smolLm2Config } from './model.js'
import { spreadOf } from './ratio.js'

const pageSize = 16
const promptTokens = 1000
/** Full pages of the prompt a hit can cover: floor((1000 - 1) / 16). */
const prefixPages = 62

/** The decode worker's wait for a transfer to begin, ms (the product's is 30 s). */
const benchBootstrapWaitMs = 15 * 60_000
/** The partition the router sends for the one tenant of a tenants file without sizes: the whole
 *  cache (a request without one would not be cached at all). */
const onlyTenant = { reservedPages: 0, numDefaultTenants: 1 }

function median(xs: number[]): number {
  const s = [...xs].sort((a, b) => a - b)
  const m = s.length >> 1
  return s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2
}

function flag(args: string[], name: string, fallback: string): string {
  const at = args.indexOf(name)
  return at < 0 ? fallback : (args[at + 1] ?? '')
}

function positive(args: string[], name: string, fallback: number): number {
  const v = Number(flag(args, name, String(fallback)))
  if (!Number.isInteger(v) || v <= 0) throw new Error(`${name} needs a positive integer`)
  return v
}

/** A prefill worker of `options` and a decode worker over loopback TCP, both on `model`. */
async function startPairOf(model: Model, options: PrefillWorkerOptions): Promise<Pair> {
  const faults = buildFaultConfig([], false, {})
  const p = createWorkerCore({ model, numPages: 2 * prefixPages + 8, pageSize, faults })
  const d = createWorkerCore({ model, numPages: prefixPages + 8, pageSize, faults })
  // The bootstrap wait is a hang bound here: a cold 1,000-token prefill of the 135M shape on a
  // loaded 2-core machine outlasts the product's 30 s, and the bench times TTFT, not that wait.
  const decode = new DecodeWorker(d, { bootstrapTimeoutMs: benchBootstrapWaitMs })
  const receiver = new TransferServer(decode.receiverHooks, {})
  await new Promise<void>((resolve) => receiver.listen(0, '127.0.0.1', resolve))
  const address = receiver.address()
  const port = typeof address === 'object' && address !== null ? address.port : 0
  const prefill = new PrefillWorker(p, options)
  return {
    prefill,
    decode,
    receiver,
    p,
    d,
    port,
    close: async () => {
      prefill.close()
      await new Promise<void>((resolve) => receiver.close(() => resolve()))
    },
  }
}

/** Run one request of `tokenIds`; its TTFT (ms) and the prompt tokens taken from the cache. */
async function timeFirstToken(pair: Pair, tokenIds: number[]) {
  let cachedTokens = -1
  const run = pair.prefill.prefill.bind(pair.prefill)
  pair.prefill.prefill = async (req, signal) => {
    const result: PrefillResult = await run(req, signal)
    cachedTokens = result.cachedTokens ?? 0
    return result
  }
  const start = performance.now()
  let ttft = NaN
  const request = { ...makeRequest('tenant-a', tokenIds, 1), prefixCachePartition: onlyTenant }
  const outcome = await runRequest(pair, request, {
    onToken: (n) => {
      if (n === 1) ttft = performance.now() - start
    },
  })
  pair.prefill.prefill = run
  if (outcome.error !== null) throw new Error(`request failed: ${outcome.error.message}`)
  return { ttft, cachedTokens }
}

/** Runs the benchmark; returns its JSON report. */
export async function benchOffload(args: string[]): Promise<object> {
  const repeats = positive(args, '--repeats', 5)
  const threads = positive(args, '--threads', 2)
  const which = flag(args, '--model', 'echo')
  if (which !== 'echo' && which !== '135m') throw new Error('--model is echo or 135m')
  const model =
    which === 'echo'
      ? loadModel(echoModelDir, { threads })
      : modelFromTensors(
          'SmolLM2-135M-shape',
          parseModelConfig(smolLm2Config, 'SmolLM2-135M shape'),
          randomTensors(smolLm2Config, 'F32'),
          { threads },
        )
  const { numLayers, numKvHeads, headDim } = model.config
  const pageBytes = 2 * numLayers * pageSize * numKvHeads * headDim * 4
  const dir = mkdtempSync(join(tmpdir(), 'kvfence-bench-offload-'))
  const cache = { prefixCachePages: prefixPages }
  const pairs = {
    pool: await startPairOf(model, cache),
    host: await startPairOf(model, {
      ...cache,
      prefixCacheOffloadBytes: 2 * prefixPages * pageBytes,
    }),
    disk: await startPairOf(model, {
      ...cache,
      prefixCacheOffloadDir: dir,
      prefixCacheOffloadDiskBytes: 2 * prefixPages * pageBytes,
    }),
  }
  const vocab = model.config.vocabSize
  let next = 0
  /** A fresh prompt: its first token differs from every earlier prompt's, so nothing hits it. */
  const freshPrompt = () => {
    const first = 3 + (next++ % (vocab - 3))
    return Array.from({ length: promptTokens }, (_, i) =>
      i === 0 ? first : 3 + ((first * 7919 + i * 104729) % (vocab - 3)),
    )
  }
  const ttft: Record<'pool' | 'host' | 'disk' | 'cold', number[]> = {
    pool: [],
    host: [],
    disk: [],
    cold: [],
  }
  const expect = (got: number, want: number, what: string) => {
    if (got !== want) throw new Error(`${what}: cached_tokens ${got}, expected ${want}`)
  }
  try {
    // One untimed request per worker first: the first prefill pays for compiling and allocating.
    for (const pair of Object.values(pairs)) await timeFirstToken(pair, freshPrompt())
    for (let r = 0; r < repeats; r++) {
      const cold = await timeFirstToken(pairs.pool, freshPrompt())
      expect(cold.cachedTokens, 0, 'cold')
      ttft.cold.push(cold.ttft)
      const warm = freshPrompt()
      await timeFirstToken(pairs.pool, warm)
      const pool = await timeFirstToken(pairs.pool, warm)
      expect(pool.cachedTokens, prefixPages * pageSize, 'pool')
      ttft.pool.push(pool.ttft)
      for (const tier of ['host', 'disk'] as const) {
        const prompt = freshPrompt()
        await timeFirstToken(pairs[tier], prompt)
        await timeFirstToken(pairs[tier], freshPrompt()) // pushes prompt's pages into the tier
        const hit = await timeFirstToken(pairs[tier], prompt)
        expect(hit.cachedTokens, prefixPages * pageSize, tier)
        ttft[tier].push(hit.ttft)
      }
    }
  } finally {
    for (const pair of Object.values(pairs)) await pair.close()
    rmSync(dir, { recursive: true, force: true })
  }
  const ms = (xs: number[]) => Math.round(median(xs) * 100) / 100
  const medians = {
    pool: ms(ttft.pool),
    host: ms(ttft.host),
    disk: ms(ttft.disk),
    cold: ms(ttft.cold),
  }
  // Per repeat, each tier's time over the cold one measured in the same repeat; the median of
  // those with its spread (bench/ratio.ts), not a ratio of two medians.
  const overCold = (tier: 'pool' | 'host' | 'disk') =>
    spreadOf(ttft[tier].map((x, r) => x / ttft.cold[r]))
  return {
    model: which === 'echo' ? 'echo-tiny' : 'SmolLM2-135M shape, random F32 weights',
    threads,
    repeats,
    prompt_tokens: promptTokens,
    cached_tokens_on_hit: prefixPages * pageSize,
    page_bytes: pageBytes,
    ttft_ms_median: medians,
    ttft_over_cold: {
      pool: overCold('pool').median,
      host: overCold('host').median,
      disk: overCold('disk').median,
    },
    ttft_over_cold_spread: {
      pool: overCold('pool'),
      host: overCold('host'),
      disk: overCold('disk'),
    },
    ttft_ms_all: ttft,
  }
}
