/** The load side channel one tier down, in a real cluster (router, prefill and decode workers as OS
 *  processes, a tenants file of two tenants without sizes), driven by the official `openai`
 *  client: tenant A's hits from the offload tier (host ring above a disk tier) and its
 *  `cached_tokens` are identical with and without tenant B's flood of distinct prefixes, a flood
 *  that goes through B's share of both tiers; with the opt-out `--prefix-cache-shared` the same
 *  flood pushes every offloaded page of A's out, so A sees B's load.
 *
 *  A sees the same room in both runs: by default a 16-page cache split 8/8 and tiers of 4 pages of
 *  host memory and 320,000 disk bytes, each tenant's share half of each (2 pages, 160,000 bytes);
 *  shared, an 8-page cache and tiers of 2 pages and 160,000 bytes for both tenants. A's round is two
 *  prompts of 6 full pages (12 pages over an 8-page share), so each pushes 4 of the other's pages
 *  down and loads its own 4 back. Hand-traced (least recently used, a chain's deepest page first):
 *  after the first round A holds pages 2–3 of prompt 1 in host memory and 4–5 on disk; each later
 *  round loads 1 page of each prompt from host memory and 3 from disk (2 and 6 per round) and ends
 *  in that same state, so every quiet round is alike. A's answers are the single-process engine's
 *  (temperature 0) every time. Two clusters, one after the other. */
import assert from 'node:assert/strict'
import { join } from 'node:path'
import { describe, it } from 'node:test'
import { startCluster } from '../../src/config/launch.js'
import { openaiClient, twoTenants } from '../helpers/cluster.js'
import { loadTokenizer } from '../../src/model/tokenizer.js'
import { echoModelDir } from '../helpers/paths.js'
import {
  echoOracle,
  echoPageBytes,
  floodPrompts,
  metricSum,
  offloadDiskDir,
  stoneGardenPrompt,
} from '../helpers/prefix-cache.js'

const { dir, tenants, tenantsFile } = twoTenants('kvfence-offload-tenants-')

/** A's two prompts: BOS + 110 characters, 111 tokens, 6 full pages each, no page in common. */
const promptsA = [
  stoneGardenPrompt,
  'notes: the lighthouse keeper logs each ship by flag and hour, Qr7Tp2Ws9Ke5 is the ledger key. user: who sailed',
]
/** B's flood: 6 prompts of 6 full pages each, no two sharing a first page: 36 pages. */
const promptsB = floodPrompts(6)

/** A tenant's disk share: about 8 files of a page and its header. */
const diskShare = 160_000

/** The single-process engine's text (greedy, no cache). */
const expected = echoOracle()
const tokenizer = loadTokenizer(echoModelDir)

/** Three rounds of A's, B's flood, a fourth round of A's, and B's first prompt again, against a
 *  cluster of `prefixCachePages` and `prefillArgs`. Per round of A's: its cached tokens and its
 *  verified loads by tier; B's cached tokens and the pages evicted from the cache during the
 *  flood (each went to the offload tier). */
async function run(name: string, prefixCachePages: number, prefillArgs: string[]) {
  const cluster = await startCluster({
    modelDir: echoModelDir,
    pageSize: 16,
    prefillPages: 64,
    decodePages: 64,
    prefixCachePages,
    prefillArgs,
    tenantsFile,
    logDir: join(dir, `logs-${name}`),
  })
  try {
    const metrics = async () => {
      const text = await (await fetch(`${cluster.prefillUrl}/metrics`)).text()
      const loads = (tier: string) =>
        metricSum(text, 'kvfence_prefix_cache_offload_loads_total', [
          'outcome="hit"',
          `tier="${tier}"`,
        ])
      const refused = metricSum(text, 'kvfence_prefix_cache_offload_loads_total', [
        'outcome="refused"',
      ])
      const evicted = metricSum(text, 'kvfence_prefix_cache_evictions_total')
      return { host: loads('host'), disk: loads('disk'), refused, evicted }
    }
    const complete = async (tenant: number, prompt: string, maxTokens: number) => {
      const api = openaiClient(cluster.routerUrl, tenants[tenant].key)
      const res = await api.completions.create({
        model: 'echo-tiny',
        prompt,
        max_tokens: maxTokens,
        temperature: 0,
      })
      return { text: res.choices[0].text, cached: res.usage?.prompt_tokens_details?.cached_tokens }
    }
    const tenantARound = async () => {
      const before = await metrics()
      const cached = []
      for (const prompt of promptsA) {
        const { text, cached: n } = await complete(0, prompt, 8)
        assert.equal(text, expected(prompt, 8))
        cached.push(n)
      }
      const now = await metrics()
      assert.equal(now.refused, 0)
      return { cached, loads: { host: now.host - before.host, disk: now.disk - before.disk } }
    }
    const rounds = [await tenantARound(), await tenantARound(), await tenantARound()]
    const beforeFlood = await metrics()
    const flood = []
    for (const p of promptsB) flood.push((await complete(1, p, 1)).cached)
    const evicted = (await metrics()).evicted - beforeFlood.evicted
    const flooded = await tenantARound()
    const againB = (await complete(1, promptsB[0], 1)).cached
    return { rounds, flood, evicted, flooded, againB }
  } finally {
    await cluster.stop()
  }
}

/** Flags of a host ring of `hostPages` pages above a fresh disk tier of `diskBytes`. */
const tiers = (hostPages: number, diskBytes: number) => [
  '--prefix-cache-offload-bytes',
  String(hostPages * echoPageBytes),
  '--prefix-cache-offload-dir',
  offloadDiskDir('tenants-disk'),
  '--prefix-cache-offload-disk-bytes',
  String(diskBytes),
]

/** A's rounds after the first: each prompt's 6 pages short of its last token (96 tokens), 4 of
 *  them loaded back from the tiers. */
const steady = { cached: [96, 96], loads: { host: 2, disk: 6 } }

describe('the offload tiers’ load side channel across a real cluster', () => {
  it('default: A’s offload hits and cached_tokens are identical with and without B’s flood', async () => {
    for (const p of promptsA) assert.equal(tokenizer.encode(p).length, 111)
    for (const p of promptsB) assert.equal(tokenizer.encode(p).length, 98)
    const r = await run('default', 16, tiers(4, 2 * diskShare))
    // The claim first: the round after B's flood is the quiet round before it.
    assert.deepEqual(r.flooded, r.rounds[2])
    assert.deepEqual(r.rounds[0], { cached: [0, 0], loads: { host: 0, disk: 0 } })
    assert.deepEqual(r.rounds.slice(1), [steady, steady])
    assert.deepEqual(r.flood, [0, 0, 0, 0, 0, 0])
    // B's 36 pages through its 8-page partition: 28 went down to its tiers' shares (2 pages of
    // host memory, about 8 files), which kept only its latest: its first prompt is gone.
    assert.equal(r.evicted, 28)
    assert.equal(r.againB, 0)
  })

  it('--prefix-cache-shared: the same flood pushes A’s offloaded pages out (the channel is there)', async () => {
    const r = await run('shared', 8, [...tiers(2, diskShare), '--prefix-cache-shared'])
    // Alone, A sees what it sees by default.
    assert.deepEqual(r.rounds[0], { cached: [0, 0], loads: { host: 0, disk: 0 } })
    assert.deepEqual(r.rounds.slice(1), [steady, steady])
    assert.deepEqual(r.flood, [0, 0, 0, 0, 0, 0])
    // A's 8 pages in the cache and B's 28 went down, and the tiers kept only B's latest.
    assert.equal(r.evicted, 36)
    assert.deepEqual(r.flooded, { cached: [0, 0], loads: { host: 0, disk: 0 } })
  })
})
