/** The auditor on surfaces other than kvfence, SGLang and vLLM: llama.cpp's server, Hugging Face
 *  TGI and a plain OpenAI-compatible server that reports nothing. The readers are checked on the
 *  shapes the engines publish (examples of llama.cpp's tools/server/README.md and TGI's `Info`
 *  schema), then whole audits run against stand-ins of each surface over real HTTP: a correct
 *  engine draws no warning, a misconfigured one (a context over its pool) is found, and a server
 *  that reports nothing gets an inconclusive that says what could not be tested and why. */
import assert from 'node:assert/strict'
import { describe, test } from 'node:test'
import { runAudit, type AuditReport, type ProbeName } from '../../src/audit/index.js'
import { parseMetrics } from '../../src/audit/discovery.js'
import { readLlamaCppProps, readLlamaCppSlots, readTgiInfo } from '../../src/audit/surfaces.js'
import { standInTenants, startStandIn, type StandInOptions } from './standins.js'

async function audit(options: StandInOptions, probes: ProbeName[]): Promise<AuditReport> {
  const standIn = await startStandIn('safe', options)
  try {
    return await runAudit({ target: standIn.url, tenants: standInTenants, seed: 5, probes })
  } finally {
    await standIn.close()
  }
}

const rows = (report: AuditReport): string[][] =>
  report.findings.map((f) => [f.probe, f.verdict, f.title])

describe('readers, on the shapes the engines publish', () => {
  test("llama.cpp /props (README example): one slot's n_ctx is the context, the pool of one request and the input limit + 1", () => {
    const props = {
      default_generation_settings: { id: 0, id_task: -1, n_ctx: 1024, is_processing: false },
      total_slots: 1,
      model_path: '../models/Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf',
    }
    assert.deepEqual(readLlamaCppProps(props), {
      engine: 'llamacpp',
      advertised: [
        { endpoint: '/props', field: 'default_generation_settings.n_ctx (one slot)', tokens: 1024 },
      ],
      pools: [
        { endpoint: '/props', field: 'default_generation_settings.n_ctx (one slot)', tokens: 1024 },
      ],
      inputLimits: [
        {
          endpoint: '/props',
          field: 'default_generation_settings.n_ctx (prompt < n_ctx)',
          tokens: 1024,
        },
      ],
      largestInputTokens: 1023,
      pageSizes: [],
      numRunning: null,
    })
    // A build that reports the whole cache too: it is a pool, never the context.
    const whole = readLlamaCppProps({ ...props, total_slots: 4, n_ctx: 4096 })
    assert.deepEqual(
      whole?.pools.map((s) => [s.field, s.tokens]),
      [
        ['default_generation_settings.n_ctx (one slot)', 1024],
        ['n_ctx (whole cache)', 4096],
      ],
    )
    assert.deepEqual(
      whole?.advertised.map((s) => s.tokens),
      [1024],
    )
    // Not llama.cpp's: nothing read.
    assert.equal(readLlamaCppProps({ total_slots: 1 }), null)
    assert.equal(readLlamaCppProps([]), null)
  })

  test('llama.cpp /slots (README example: 2 slots of 65536, both processing)', () => {
    const slot = (id: number) => ({ id, id_task: 135, n_ctx: 65536, is_processing: true })
    const reading = readLlamaCppSlots([slot(0), slot(1)])
    assert.deepEqual(reading?.advertised, [
      { endpoint: '/slots', field: '[0].n_ctx (one slot)', tokens: 65536 },
    ])
    assert.equal(reading?.largestInputTokens, 65535)
    assert.equal(reading?.numRunning, 2)
    assert.equal(readLlamaCppSlots([{ id: 0 }]), null)
  })

  test("TGI /info (its schema's example): max_total_tokens is one request's context, max_batch_total_tokens the pool, max_input_length accepted as is", () => {
    const info = {
      model_id: 'bigscience/blomm-560m',
      max_concurrent_requests: 128,
      max_input_length: 1024,
      max_total_tokens: 2048,
      max_batch_total_tokens: 32000,
      router: 'text-generation-router',
      version: '0.5.0',
    }
    assert.deepEqual(readTgiInfo(info), {
      engine: 'tgi',
      advertised: [{ endpoint: '/info', field: 'max_total_tokens', tokens: 2048 }],
      pools: [{ endpoint: '/info', field: 'max_batch_total_tokens', tokens: 32000 }],
      inputLimits: [{ endpoint: '/info', field: 'max_input_length', tokens: 1024 }],
      largestInputTokens: 1024,
      pageSizes: [],
      numRunning: null,
    })
    // v3 names the input limit max_input_tokens and reports its page size.
    const v3 = readTgiInfo({
      ...info,
      max_input_length: undefined,
      max_input_tokens: 30000,
      block_size: 32,
    })
    assert.deepEqual(v3?.inputLimits, [
      { endpoint: '/info', field: 'max_input_tokens', tokens: 30000 },
    ])
    assert.deepEqual(v3?.pageSizes, [{ endpoint: '/info', field: 'block_size', tokens: 32 }])
    assert.equal(
      readTgiInfo({ max_total_tokens: 2048 }),
      null,
      'not TGI without its router or batch budget',
    )
  })
})

test("vLLM's cache_config_info: blocks × block size, except for a sliding-window cache (no bound on one request)", () => {
  const info = (labels: string) =>
    `vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="2048"${labels}} 1.0\n`
  assert.deepEqual(parseMetrics(info(',sliding_window="None"')), [
    {
      endpoint: '/metrics',
      field: 'vllm:cache_config_info num_gpu_blocks × block_size',
      tokens: 32768,
    },
  ])
  assert.deepEqual(parseMetrics(info(',sliding_window="4096"')), [])
})

describe("llama.cpp's server", () => {
  test('a correct one (4 slots of 384, the training context 131072 listed): capacity, boundary and error-handling clean', async () => {
    const report = await audit({ flavour: 'llamacpp' }, ['capacity', 'boundary', 'error-handling'])
    assert.deepEqual(rows(report), [
      ['capacity', 'clean', 'advertised context 384 tokens fits the KV pool of 384 tokens'],
      ['boundary', 'clean', 'rejected every prompt larger than 384 tokens with a 4xx'],
      [
        'error-handling',
        'clean',
        'refused all 6 invalid requests with a 4xx (or clamped max_tokens); refused with a 5xx and an error object instead of a 4xx: malformed JSON',
      ],
    ])
    const capacity = report.findings[0].evidence
    assert.deepEqual(capacity.inputRule, {
      engine: 'llamacpp',
      rule: "one slot's n_ctx is both the context and the KV one request may hold; a prompt of n_ctx tokens or more is refused",
      largestInputTokens: 383,
      inputLimitSources: [
        {
          endpoint: '/props',
          field: 'default_generation_settings.n_ctx (prompt < n_ctx)',
          tokens: 384,
        },
      ],
    })
    // The largest input llama.cpp accepts was sent and accepted: the control of the refusals.
    const sizes = report.findings[1].evidence.sizes as { labels: string; status: number }[]
    assert.deepEqual(
      sizes.map((s) => [s.labels, s.status]),
      [
        ['pool-1/context-1/input-limit', 200],
        ['pool/context', 400],
        ['pool+1/context+1', 400],
      ],
    )
    // Negative and wrongly typed max_tokens mean "no limit" to llama.cpp: answered, not judged.
    const cases = report.findings[2].evidence.cases as { case: string; result: string }[]
    assert.deepEqual(
      cases.map((c) => [c.case, c.result]),
      [
        ['malformed JSON', 'rejected-5xx'],
        ['missing prompt', 'rejected'],
        ['negative max_tokens', 'accepted'],
        ['max_tokens not a number', 'accepted'],
        ['max_tokens over the context', 'accepted'],
        ['prompt twice the limit', 'rejected'],
      ],
    )
  })

  test('4 separate slots of 384 with the whole cache (1536) reported: the slot is compared, the whole cache is the largest pool', async () => {
    const report = await audit({ flavour: 'llamacpp', wholeCacheTokens: 1536 }, ['capacity'])
    assert.deepEqual(rows(report), [
      ['capacity', 'clean', 'advertised context 384 tokens fits the KV pool of 384 tokens'],
    ])
    assert.deepEqual(
      (report.findings[0].evidence.poolSources as { tokens: number }[]).map((s) => s.tokens),
      [384, 1536],
    )
  })

  test('a slot of 1024 over a whole cache of 384: the misconfiguration is found, and the prompts over the pool it takes', async () => {
    const report = await audit({ flavour: 'llamacpp', contextTokens: 1024 }, [
      'capacity',
      'boundary',
    ])
    assert.deepEqual(rows(report), [
      ['capacity', 'warning', 'advertised context 1024 tokens > effective KV pool 384 tokens'],
      ['boundary', 'warning', 'accepted a prompt larger than the KV pool (385, 1023 > 384 tokens)'],
    ])
  })
})

describe('Hugging Face TGI', () => {
  test('a correct one (max_total_tokens 384 within max_batch_total_tokens 384): clean, no config warning', async () => {
    const report = await audit({ flavour: 'tgi' }, ['capacity', 'boundary', 'error-handling'])
    assert.deepEqual(rows(report), [
      ['capacity', 'clean', 'advertised context 384 tokens fits the KV pool of 384 tokens'],
      ['boundary', 'clean', 'rejected every prompt larger than 384 tokens with a 4xx'],
      [
        'error-handling',
        'clean',
        'refused all 6 invalid requests with a 4xx (or clamped max_tokens)',
      ],
    ])
    const capacity = report.findings[0].evidence
    assert.deepEqual(capacity.advertisedSources, [
      { endpoint: '/info', field: 'max_total_tokens', tokens: 384 },
    ])
    assert.deepEqual(capacity.poolSources, [
      { endpoint: '/info', field: 'max_batch_total_tokens', tokens: 384 },
    ])
    assert.equal((capacity.inputRule as { largestInputTokens: number }).largestInputTokens, 383)
  })

  test('max_total_tokens 1024 over max_batch_total_tokens 384: found', async () => {
    const report = await audit({ flavour: 'tgi', contextTokens: 1024 }, ['capacity'])
    assert.deepEqual(rows(report), [
      ['capacity', 'warning', 'advertised context 1024 tokens > effective KV pool 384 tokens'],
    ])
  })
})

describe('a plain OpenAI-compatible server that reports nothing', () => {
  test('capacity and boundary inconclusive, saying what was asked, what cannot be tested and which flags give it', async () => {
    const report = await audit({ flavour: 'plain' }, ['capacity', 'boundary'])
    assert.deepEqual(rows(report), [
      [
        'capacity',
        'inconclusive',
        'could not read the advertised context window or the KV pool capacity from the endpoint (/v1/models 200, /server_info 404, /get_server_info 404, /metrics 404, /props 404, /slots 404, /info 404): whether a prompt over the KV pool is refused cannot be tested without it; give --context-window and --kv-pool-tokens',
      ],
      [
        'boundary',
        'inconclusive',
        'neither the KV pool nor the context window is known: no size to test',
      ],
    ])
  })
})
