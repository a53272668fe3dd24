/** The prefix cache's offload tier in a real cluster (router, prefill and decode workers as OS
 *  processes; the prefill worker started with `--prefix-cache-pages 8` and an offload tier in host
 *  memory, on disk, or both: two pages of host memory above the disk; `--prefix-cache-shared`: one
 *  budget for both tenants, so that B can evict A), driven by the official
 *  `openai` client: tenant A's pages, evicted from the 8-page cache by tenant B's flood, come back
 *  from the offload tier when A asks again: A's `cached_tokens` are those of a cache that never
 *  evicted, its answer is exactly the single-process engine's (the cold answer, temperature 0),
 *  and the prefill worker counts the verified loads of each tier. Clusters one after another. */
import assert from 'node:assert/strict'
import { join } from 'node:path'
import { after, before, describe, it } from 'node:test'
import { startCluster, type Cluster } from '../../src/config/launch.js'
import { loadTokenizer } from '../../src/model/tokenizer.js'
import { openaiClient, twoTenants } from '../helpers/cluster.js'
import { echoModelDir } from '../helpers/paths.js'
import {
  echoOracle,
  echoPageBytes,
  floodPrompts,
  offloadDiskDir,
  stoneGardenPrompt,
} from '../helpers/prefix-cache.js'

const { dir, tenants, tenantsFile } = twoTenants('kvfence-prefix-offload-')

/** BOS + 110 characters: 111 tokens, 6 full pages of 16. */
const promptA = stoneGardenPrompt
/** B's two prompts: 6 full pages each, so A's 6 pages are all evicted from the 8-page cache. */
const promptsB = floodPrompts(2)

const tokenizer = loadTokenizer(echoModelDir)
/** The single-process engine's text (greedy, no cache). */
const expected = echoOracle()

const diskArgs = () => [
  '--prefix-cache-offload-dir',
  offloadDiskDir('e2e'),
  '--prefix-cache-offload-disk-bytes',
  String(1 << 20),
]

/** Each tier's flags and the verified loads A's 6 pages must count, by tier. */
const tiers = {
  host: { args: ['--prefix-cache-offload-bytes', String(1 << 20)], hits: { host: 6, disk: 0 } },
  disk: { args: diskArgs(), hits: { host: 0, disk: 6 } },
  // Two pages of host memory: A's last-evicted pages stay there until B's push them down.
  'host+disk': {
    args: ['--prefix-cache-offload-bytes', String(2 * echoPageBytes), ...diskArgs()],
    hits: { host: 0, disk: 6 },
  },
}

for (const [tier, { args, hits }] of Object.entries(tiers))
  describe(`prefix-cache offload tier (${tier}) across a real cluster`, () => {
    let cluster: Cluster
    before(async () => {
      cluster = await startCluster({
        modelDir: echoModelDir,
        pageSize: 16,
        prefillPages: 64,
        decodePages: 64,
        prefixCachePages: 8,
        prefillArgs: [...args, '--prefix-cache-shared'],
        tenantsFile,
        logDir: join(dir, tier),
      })
    })
    after(async () => cluster?.stop())

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

    it('pages evicted by another tenant come back verified; the answer is the single-process one', async () => {
      assert.equal(tokenizer.encode(promptA).length, 111)
      const want = expected(promptA, 16)
      assert.deepEqual(await complete(0, promptA, 16), { text: want, cached: 0 })
      for (const p of promptsB) assert.equal((await complete(1, p, 1)).cached, 0)
      // 6 whole pages short of the last token, all loaded back from the ring.
      assert.deepEqual(await complete(0, promptA, 16), { text: want, cached: 96 })
      const text = await (await fetch(`${cluster.prefillUrl}/metrics`)).text()
      const loads = (outcome: string, from: string) =>
        text
          .split('\n')
          .filter((l) => l.startsWith('kvfence_prefix_cache_offload_loads_total{'))
          .filter((l) => l.includes(`outcome="${outcome}"`) && l.includes(`tier="${from}"`))
          .reduce((sum, l) => sum + Number(l.slice(l.lastIndexOf(' ') + 1)), 0)
      assert.deepEqual({ host: loads('hit', 'host'), disk: loads('hit', 'disk') }, hits)
      assert.equal(loads('refused', 'host') + loads('refused', 'disk'), 0)
    })
  })
