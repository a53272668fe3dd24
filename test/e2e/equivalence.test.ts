/** Disaggregated decode emits exactly the single-process tokens: a real cluster (router, prefill
 *  and decode workers as OS processes, KV pages over TCP, chunked prefill and continuous batching)
 *  answers the official `openai` client with exactly what `generateLocal` (one process, one pool,
 *  one sequence at a time) produces, at temperature 0, with a fixed seed at temperature 0.8, and
 *  with a fixed seed under top-k, min-p and the presence/frequency penalties (whose counts the
 *  prefill and decode workers each keep: the first token on one, the rest on the other), alone and
 *  under concurrent load from two tenants. */
import assert from 'node:assert/strict'
import { join } from 'node:path'
import { after, before, describe, it } from 'node:test'
import { startCluster, type Cluster } from '../../src/config/launch.js'
import type { Sampling } from '../../src/control/messages.js'
import { buildFaultConfig } from '../../src/engine/faults.js'
import { generateLocal } from '../../src/engine/local-engine.js'
import { createWorkerCore } from '../../src/engine/worker-core.js'
import { loadTokenizer } from '../../src/model/tokenizer.js'
import { loadModel } from '../../src/model/weights.js'
import { openaiClient as client, serverInfo, twoTenants } from '../helpers/cluster.js'
import { echoModelDir } from '../helpers/paths.js'

const { dir, tenants, tenantsFile } = twoTenants('kvfence-equivalence-')

const prompts = [
  'the river walks near the stone garden and Qx7vR2mK9pLt4Wz8 holds the quiet light',
  'hello there',
  'a market opens before the morning bread; the baker sings 7Yt2mW0q, the baker sings',
  'one two three four five six seven eight nine ten',
  'Zk3pQ9 Zk3pQ9 Zk3pQ9',
  // Longer than one 16-token page and than a prefill step shared by several prompts.
  'the small market opens before the morning bread, the green field after the summer rain, '.repeat(
    4,
  ),
  'x',
  'stone garden: Lm4Nb8Vc1Xz0 / green field: Pq2Rs6Tu9Wy3',
]

const tokenizer = loadTokenizer(echoModelDir)
const eos = tokenizer.eosTokenId === null ? [] : [tokenizer.eosTokenId]
const local = createWorkerCore({
  model: loadModel(echoModelDir),
  numPages: 128,
  pageSize: 16,
  faults: buildFaultConfig([], false, {}),
})

interface Want {
  text: string
  finishReason: 'stop' | 'length'
  completionTokens: number
}

/** The sampling fields beyond temperature and seed, as the API spells them. */
interface Extra {
  top_k?: number
  min_p?: number
  presence_penalty?: number
  frequency_penalty?: number
}

/** What the single-process engine answers. */
function expected(
  prompt: string,
  maxTokens: number,
  temperature: number,
  seed: number | null,
  extra: Extra = {},
): Want {
  const sampling: Sampling = {
    temperature,
    topP: 1,
    topK: extra.top_k ?? null,
    minP: extra.min_p ?? 0,
    presencePenalty: extra.presence_penalty ?? 0,
    frequencyPenalty: extra.frequency_penalty ?? 0,
    seed,
  }
  const out = generateLocal(local, tokenizer.encode(prompt), {
    maxTokens,
    sampling,
    stopTokenIds: eos,
  })
  return {
    text: tokenizer.decode(out.tokenIds),
    finishReason: out.finishReason,
    completionTokens: out.tokenIds.length,
  }
}

interface Ask {
  prompt: string
  maxTokens: number
  temperature: number
  seed: number | null
  tenant: number
  stream: boolean
  extra?: Extra
}

/** What the cluster answers, streamed or not. */
async function ask(cluster: Cluster, a: Ask): Promise<Want> {
  const api = client(cluster.routerUrl, tenants[a.tenant].key)
  const body = {
    model: 'echo-tiny',
    prompt: a.prompt,
    max_tokens: a.maxTokens,
    temperature: a.temperature,
    ...(a.seed === null ? {} : { seed: a.seed }),
    ...a.extra,
  }
  if (!a.stream) {
    const res = await api.completions.create(body)
    return {
      text: res.choices[0].text,
      finishReason: res.choices[0].finish_reason as Want['finishReason'],
      completionTokens: res.usage!.completion_tokens,
    }
  }
  const stream = await api.completions.create({
    ...body,
    stream: true,
    stream_options: { include_usage: true },
  })
  let text = ''
  let finishReason = ''
  let completionTokens = -1
  for await (const chunk of stream) {
    for (const c of chunk.choices) {
      text += c.text
      if (c.finish_reason) finishReason = c.finish_reason
    }
    if (chunk.usage) completionTokens = chunk.usage.completion_tokens
  }
  return { text, finishReason: finishReason as Want['finishReason'], completionTokens }
}

/** Eight requests from two tenants, mixed lengths, half of them streamed. */
function load(temperature: number, seedBase: number | null, extra: Extra = {}): Ask[] {
  return prompts.map((prompt, i) => ({
    prompt,
    maxTokens: 12 + 7 * i,
    temperature,
    seed: seedBase === null ? null : seedBase + i,
    tenant: i % 2,
    stream: i % 3 === 0,
    extra,
  }))
}

describe('disaggregated decode emits exactly the single-process tokens', () => {
  let cluster: Cluster
  before(async () => {
    cluster = await startCluster({
      modelDir: echoModelDir,
      pageSize: 16,
      prefillPages: 64,
      decodePages: 128,
      tenantsFile,
      logDir: join(dir, 'logs'),
    })
  })
  after(async () => cluster?.stop())

  it('at temperature 0, one request at a time', async () => {
    for (const a of load(0, null)) {
      assert.deepEqual(await ask(cluster, a), expected(a.prompt, a.maxTokens, 0, null), a.prompt)
    }
  })

  it('at temperature 0, eight concurrent requests from two tenants', async () => {
    const asks = load(0, null)
    const got = await Promise.all(asks.map((a) => ask(cluster, a)))
    got.forEach((g, i) =>
      assert.deepEqual(g, expected(asks[i].prompt, asks[i].maxTokens, 0, null), asks[i].prompt),
    )
  })

  it('at temperature 0.8 with a fixed seed, alone and under concurrent load', async () => {
    const asks = load(0.8, 4242)
    const want = asks.map((a) => expected(a.prompt, a.maxTokens, 0.8, a.seed))
    // Alone: the first and the longest request.
    for (const i of [0, 5]) assert.deepEqual(await ask(cluster, asks[i]), want[i])
    // Under load, twice: same seed, same tokens, whatever shares the decode steps.
    for (let round = 0; round < 2; round++) {
      const got = await Promise.all(asks.map((a) => ask(cluster, a)))
      got.forEach((g, i) => assert.deepEqual(g, want[i], `round ${round}: ${asks[i].prompt}`))
    }
  })

  it('with a fixed seed under top_k, min_p and penalties, alone and under concurrent load', async () => {
    const extra = { top_k: 12, min_p: 0.03, presence_penalty: 0.6, frequency_penalty: 0.35 }
    const asks = load(1.1, 9090, extra)
    const want = asks.map((a) => expected(a.prompt, a.maxTokens, 1.1, a.seed, extra))
    for (const i of [1, 5]) assert.deepEqual(await ask(cluster, asks[i]), want[i])
    const got = await Promise.all(asks.map((a) => ask(cluster, a)))
    got.forEach((g, i) => assert.deepEqual(g, want[i], asks[i].prompt))
    // The penalties are in effect: without them the same seeds give other text somewhere.
    const plain = asks.map((a) =>
      expected(a.prompt, a.maxTokens, 1.1, a.seed, { top_k: 12, min_p: 0.03 }),
    )
    assert.ok(
      plain.some((p, i) => p.text !== want[i].text),
      'penalties changed nothing',
    )
  })

  it('returns every page of both pools when the load is over', async () => {
    for (const url of [cluster.prefillUrl, cluster.decodeUrl]) {
      const info = await serverInfo(url)
      assert.equal(info.numPagesUsed, 0, url)
    }
  })
})
