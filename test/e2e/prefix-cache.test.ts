/** The prefix cache in a real cluster (router, prefill and decode workers as OS processes, KV over
 *  TCP, the prefill worker's default cache of a quarter of its pool), driven by the official
 *  `openai` client: a tenant's prompts that share a prefix hit the cache and still answer exactly
 *  what the single-process engine (`generateLocal`, no cache) answers; another tenant sending the
 *  same prompt never hits; cached pages are not counted as used, so the pool reads idle again. */
import assert from 'node:assert/strict'
import { join } from 'node:path'
import { after, before, describe, it } from 'node:test'
import { startCluster, type Cluster } from '../../src/config/launch.js'
import { ServerInfo } from '../../src/control/messages.js'
import { openaiClient, twoTenants } from '../helpers/cluster.js'
import { echoModelDir } from '../helpers/paths.js'
import { echoOracle, stoneGardenPrompt, stoneGardenSystem } from '../helpers/prefix-cache.js'

const { dir, tenants, tenantsFile } = twoTenants('kvfence-prefix-cache-')

const prompts = [stoneGardenPrompt, `${stoneGardenSystem}user: and who keeps it?`]

/** The single-process engine's text (greedy, no cache). */
const expected = echoOracle()

describe('prefix cache across a real cluster', () => {
  let cluster: Cluster
  before(async () => {
    cluster = await startCluster({
      modelDir: echoModelDir,
      pageSize: 16,
      prefillPages: 64, // default cache: 16 pages
      decodePages: 64,
      tenantsFile,
      logDir: join(dir, 'logs'),
    })
  })
  after(async () => cluster?.stop())

  /** `usage.prompt_tokens_details.cached_tokens` of the last answer. */
  let lastCachedTokens: number | undefined
  async function complete(tenant: number, prompt: string): Promise<string> {
    const api = openaiClient(cluster.routerUrl, tenants[tenant].key)
    const res = await api.completions.create({
      model: 'echo-tiny',
      prompt,
      max_tokens: 24,
      temperature: 0,
    })
    lastCachedTokens = res.usage?.prompt_tokens_details?.cached_tokens
    return res.choices[0].text
  }

  /** The prefill worker's prefix-cache counters. */
  async function cacheCounters(): Promise<{ hit: number; miss: number; tokens: number }> {
    const text = await (await fetch(`${cluster.prefillUrl}/metrics`)).text()
    const value = (re: RegExp) => Number(re.exec(text)?.[1] ?? 0)
    return {
      hit: value(/^kvfence_prefix_cache_requests_total\{[^}]*outcome="hit"[^}]*\} (\d+)/m),
      miss: value(/^kvfence_prefix_cache_requests_total\{[^}]*outcome="miss"[^}]*\} (\d+)/m),
      tokens: value(/^kvfence_prefix_cache_cached_tokens_total\{[^}]*\} (\d+)/m),
    }
  }

  it('a tenant’s shared prefix hits and the answer is exactly the single-process one', async () => {
    assert.equal(await complete(0, prompts[0]), expected(prompts[0], 24))
    assert.deepEqual(await cacheCounters(), { hit: 0, miss: 1, tokens: 0 })
    assert.equal(await complete(0, prompts[1]), expected(prompts[1], 24))
    // The prompts share BOS + 84 + 6 characters ("user: ") = 91 tokens: 5 whole pages, 80 tokens.
    assert.deepEqual(await cacheCounters(), { hit: 1, miss: 1, tokens: 80 })
    assert.equal(lastCachedTokens, 80)
  })

  it('another tenant sending the same prompt never hits', async () => {
    assert.equal(await complete(1, prompts[0]), expected(prompts[0], 24))
    assert.deepEqual(await cacheCounters(), { hit: 1, miss: 2, tokens: 80 })
    assert.equal(lastCachedTokens, 0)
  })

  it('cached pages are reported apart: no page is used by a request once the load is over', async () => {
    const info = ServerInfo.parse(await (await fetch(`${cluster.prefillUrl}/server_info`)).json())
    assert.equal(info.numPagesUsed, 0)
    // A: prompt 0 (111 tokens, 6 full pages), prompt 1 (108 tokens) adds its 6th page; B: 6 of its own.
    assert.equal(info.numPagesCached, 13)
  })
  it("a worker's /metrics also carries its process's memory figures (prom-client defaults)", async () => {
    const text = await (await fetch(`${cluster.prefillUrl}/metrics`)).text()
    const rss = /^process_resident_memory_bytes (\d+)$/m.exec(text)
    assert.ok(rss && Number(rss[1]) > 1024 * 1024, 'no process_resident_memory_bytes')
    assert.match(text, /^nodejs_heap_size_used_bytes \d+$/m)
    assert.match(
      text,
      /^kvfence_guard_trips_total\{guard="G5",role="prefill"\} 0$/m,
      'its own metrics are still there',
    )
  })
})
