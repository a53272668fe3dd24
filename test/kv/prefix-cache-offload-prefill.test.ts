/** The offload tier inside the prefill worker, with a real decode worker over loopback TCP: tenant
 *  A's pages, evicted from a 5-page prefix cache by tenant B's prompt, go to the host-memory ring
 *  (or, with only a directory, to files on disk) and come back verified when A asks again; A's tokens are exactly the single-process engine's
 *  (`generateLocal`, no cache), and the loads are counted. The pool's and cache's invariants are
 *  checked after every request. The cache is one budget shared by all tenants
 *  (`prefixCacheShared`), so that B's prompt can evict A's pages at all. */
import assert from 'node:assert/strict'
import { mkdtempSync, readdirSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { after, before, describe, it } from 'node:test'
import type { PrefillResult } from '../../src/control/messages.js'
import { PrefillWorker } from '../../src/engine/prefill-worker.js'
import {
  greedyOracle as oracle,
  makeRequest,
  runRequest,
  startPair,
  tokensOf,
  type Pair,
} from '../engine/pair.js'

/** BOS + 85 characters: 86 tokens, 5 full pages of 16. */
const promptA = tokensOf(
  'stone garden: Lm4Nb8Vc1Xz0 / green field: Pq2Rs6Tu9Wy3 / river: Kd5 -- first question',
)
const promptB = tokensOf(
  'the small market opens before the morning bread, the baker sings and the mill turns',
)

const tiers = {
  host: { prefixCacheOffloadBytes: 1 << 20 },
  disk: {
    prefixCacheOffloadDir: mkdtempSync(join(tmpdir(), 'kvfence-offload-prefill-')),
    prefixCacheOffloadDiskBytes: 1 << 20,
  },
}

for (const [tier, offload] of Object.entries(tiers))
  describe(`prefill with a prefix cache and an offload tier (${tier})`, () => {
    let pair: Pair
    let prefill: PrefillWorker
    const results: PrefillResult[] = []

    before(async () => {
      pair = await startPair({ pageSize: 16, prefillPages: 24, decodePages: 32 })
      prefill = new PrefillWorker(pair.p, {
        prefixCachePages: 5,
        prefixCacheShared: true,
        ...offload,
      })
      const run = prefill.prefill.bind(prefill)
      prefill.prefill = async (req, signal) => {
        const result = await run(req, signal)
        results.push(result)
        return result
      }
    })
    after(async () => {
      prefill?.close()
      await pair?.close()
    })

    async function ask(tenant: string, prompt: number[]) {
      const outcome = await runRequest({ ...pair, prefill }, makeRequest(tenant, prompt, 16))
      assert.equal(outcome.prefillError, null)
      assert.equal(outcome.decodeError, null)
      pair.p.pool.check()
      prefill.checkCache()
      return { tokenIds: outcome.tokenIds, cachedTokens: results.at(-1)!.cachedTokens }
    }

    async function offloadLoads(outcome: string): Promise<number> {
      const name = 'kvfence_prefix_cache_offload_loads_total'
      const text = await pair.p.metrics.registry.getSingleMetricAsString(name)
      const line = text
        .split('\n')
        .find((l) => l.startsWith(`${name}{outcome="${outcome}",tier="${tier}"} `))
      return line === undefined ? 0 : Number(line.split(' ')[1])
    }

    it(`pages evicted by another tenant come back from the ${tier} tier, and the tokens are exact`, async () => {
      assert.equal(promptA.length, 86)
      assert.equal(promptB.length, 84)
      assert.deepEqual((await ask('tenant-a', promptA)).tokenIds, oracle(promptA, 16))
      // B's 5 pages evict all 5 of A's (one shared budget): they go to the offload tier.
      await ask('tenant-b', promptB)
      if ('prefixCacheOffloadDir' in offload)
        assert.equal(readdirSync(offload.prefixCacheOffloadDir).length, 5)
      const again = await ask('tenant-a', promptA)
      assert.equal(again.cachedTokens, 80)
      assert.deepEqual(again.tokenIds, oracle(promptA, 16))
      assert.equal(await offloadLoads('hit'), 5)
      assert.equal(await offloadLoads('refused'), 0)
    })
  })
