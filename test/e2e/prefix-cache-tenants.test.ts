/** Prefix-cache partitions in a real cluster (router, prefill and decode workers as OS processes,
 *  the prefill worker started with `--prefix-cache-pages 16 --prefix-cache-pages-per-tenant 8`),
 *  driven by the official `openai` client: tenant A's `cached_tokens` are the same with and
 *  without tenant B's flood of distinct prefixes (three times A's partition), and A's answers stay
 *  exactly the single-process engine's. With one shared budget the same flood would evict every
 *  page of A's (test/kv/prefix-cache-isolation.test.ts shows that control on the cache itself). */
import assert from 'node:assert/strict'
import { join } from 'node:path'
import { after, before, describe, it } from 'node:test'
import { startCluster, type Cluster } from '../../src/config/launch.js'
import { buildFaultConfig } from '../../src/engine/faults.js'
import { generateLocal } from '../../src/engine/local-engine.js'
import { createWorkerCore } from '../../src/engine/worker-core.js'
import { loadTokenizer } from '../../src/model/tokenizer.js'
import { loadModel } from '../../src/model/weights.js'
import { openaiClient, twoTenants } from '../helpers/cluster.js'
import { echoModelDir } from '../helpers/paths.js'

const { dir, tenants, tenantsFile } = twoTenants('kvfence-prefix-tenants-')

const shared =
  'system: you answer in the voice of the stone garden, Lm4Nb8Vc1Xz0 is the gate code. '
/** 111 and 108 tokens (BOS + characters): 6 full pages each, 5 of them shared, so A caches 7. */
const promptsA = [`${shared}user: what opens the gate?`, `${shared}user: and who keeps it?`]
/** B's flood: 4 prompts of 6 full pages each, no two sharing a first page: 24 pages. */
const promptsB = Array.from(
  { length: 4 },
  (_, i) =>
    `${i}${i}${i} flood: the river carries salt past the mill at dawn, again and again, while the wheel turns. `,
)

const tokenizer = loadTokenizer(echoModelDir)
const local = createWorkerCore({
  model: loadModel(echoModelDir),
  numPages: 64,
  pageSize: 16,
  faults: buildFaultConfig([], false, {}),
})

function expected(prompt: string, maxTokens: number): string {
  const out = generateLocal(local, tokenizer.encode(prompt), {
    maxTokens,
    sampling: { temperature: 0, topP: 1, seed: null },
    stopTokenIds: tokenizer.eosTokenId === null ? [] : [tokenizer.eosTokenId],
  })
  return tokenizer.decode(out.tokenIds)
}

describe('prefix-cache partitions across a real cluster', () => {
  let cluster: Cluster
  before(async () => {
    cluster = await startCluster({
      modelDir: echoModelDir,
      pageSize: 16,
      prefillPages: 64,
      decodePages: 64,
      prefixCachePages: 16,
      prefillArgs: ['--prefix-cache-pages-per-tenant', '8'],
      tenantsFile,
      logDir: join(dir, 'logs'),
    })
  })
  after(async () => cluster?.stop())

  /** Ask as `tenant`; returns the text and `usage.prompt_tokens_details.cached_tokens`. */
  async function complete(tenant: number, prompt: string, maxTokens: number) {
    const api = openaiClient(cluster.routerUrl, tenants[tenant].key)
    const res = await api.completions.create({
      model: 'echo-tiny',
      prompt,
      max_tokens: maxTokens,
      temperature: 0,
    })
    return { text: res.choices[0].text, cached: res.usage?.prompt_tokens_details?.cached_tokens }
  }

  /** A's two prompts, in order: their cached tokens; each answer checked against the engine's. */
  async function tenantARound(): Promise<(number | undefined)[]> {
    const cached = []
    for (const prompt of promptsA) {
      const { text, cached: n } = await complete(0, prompt, 16)
      assert.equal(text, expected(prompt, 16))
      cached.push(n)
    }
    return cached
  }

  it('tenant A’s cached_tokens are identical with and without tenant B’s flood', async () => {
    for (const p of [...promptsA, ...promptsB]) assert.equal(tokenizer.encode(p).length > 96, true)
    // First round fills A's partition: a miss, then the 5 shared pages (80 tokens).
    assert.deepEqual(await tenantARound(), [0, 80])
    // Without a flood: each prompt's 6 whole pages short of its last token (96 tokens).
    const quiet = await tenantARound()
    assert.deepEqual(quiet, [96, 96])
    for (const p of promptsB) assert.equal((await complete(1, p, 1)).cached, 0)
    assert.deepEqual(await tenantARound(), quiet)
    const info = (await (await fetch(`${cluster.prefillUrl}/server_info`)).json()) as {
      numPagesCached: number
    }
    // A's 7 pages and B's partition, full: B evicted only its own pages.
    assert.equal(info.numPagesCached, 7 + 8)
  })
})
