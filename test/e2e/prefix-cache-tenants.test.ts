/** The prefix cache's load side channel in a real cluster (router, prefill and decode workers as
 *  OS processes, a 16-page cache, a tenants file of two tenants without sizes), driven by the
 *  official `openai` client. With the default (each tenant its own partition, here 16 / 2 = 8
 *  pages, sent by the router from the tenants file) tenant A's `cached_tokens` and hit rate are
 *  identical with and without tenant B's flood of distinct prefixes (three times A's partition);
 *  with the explicit opt-out `--prefix-cache-shared` the same flood evicts every page of A's, so A
 *  sees B's load. A's answers stay exactly the single-process engine's either way. */
import assert from 'node:assert/strict'
import { readFileSync } from 'node:fs'
import { join } from 'node:path'
import { describe, it } from 'node:test'
import { startCluster, type Cluster } from '../../src/config/launch.js'
import { openaiClient, twoTenants } from '../helpers/cluster.js'
import { loadTokenizer } from '../../src/model/tokenizer.js'
import { echoModelDir } from '../helpers/paths.js'
import {
  echoOracle,
  floodPrompts,
  stoneGardenPrompt,
  stoneGardenSystem,
} from '../helpers/prefix-cache.js'

const { dir, tenants, tenantsFile } = twoTenants('kvfence-prefix-tenants-')

/** 111 and 108 tokens (BOS + characters): 6 full pages each, 5 of them shared, so A caches 7. */
const promptsA = [stoneGardenPrompt, `${stoneGardenSystem}user: and who keeps it?`]
/** B's flood: 4 prompts of 6 full pages each, no two sharing a first page: 24 pages. */
const promptsB = floodPrompts(4)

/** The single-process engine's text (greedy, no cache). */
const expected = echoOracle()
const tokenizer = loadTokenizer(echoModelDir)

/** A's rounds and B's flood against a cluster whose prefill worker gets `prefillArgs`. Returns
 *  A's cached tokens per round (first, quiet, after B's flood), B's, and the pages cached at the
 *  end. */
async function floodRun(prefillArgs: string[], name: string) {
  const cluster: Cluster = await startCluster({
    modelDir: echoModelDir,
    pageSize: 16,
    prefillPages: 64,
    decodePages: 64,
    prefixCachePages: 16,
    prefillArgs,
    tenantsFile,
    logDir: join(dir, `logs-${name}`),
  })
  try {
    /** Ask as `tenant`; returns the text and `usage.prompt_tokens_details.cached_tokens`. */
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
    /** A's two prompts, in order: their cached tokens; each answer checked against the engine's. */
    const tenantARound = async () => {
      const cached = []
      for (const prompt of promptsA) {
        const { text, cached: n } = await complete(0, prompt, 16)
        assert.equal(text, expected(prompt, 16))
        cached.push(n)
      }
      return cached
    }
    const first = await tenantARound()
    const quiet = await tenantARound()
    const flood = []
    for (const p of promptsB) flood.push((await complete(1, p, 1)).cached)
    const flooded = await tenantARound()
    const info = (await (await fetch(`${cluster.prefillUrl}/server_info`)).json()) as {
      numPagesCached: number
    }
    return { first, quiet, flood, flooded, numPagesCached: info.numPagesCached }
  } finally {
    await cluster.stop()
  }
}

/** Share of `cached` (one round of A's) that hit (cached_tokens > 0). */
const hitRate = (cached: (number | undefined)[]) =>
  cached.filter((n) => n !== undefined && n > 0).length / cached.length

describe('the prefix cache’s load side channel across a real cluster', () => {
  it('default: tenant A’s cached_tokens and hit rate are identical with and without B’s flood', async () => {
    for (const p of [...promptsA, ...promptsB]) assert.equal(tokenizer.encode(p).length > 96, true)
    const run = await floodRun([], 'default')
    // First round fills A's partition: a miss, then the 5 shared pages (80 tokens).
    assert.deepEqual(run.first, [0, 80])
    // Without a flood: each prompt's 6 whole pages short of its last token (96 tokens).
    assert.deepEqual(run.quiet, [96, 96])
    assert.deepEqual(run.flood, [0, 0, 0, 0])
    assert.deepEqual(run.flooded, run.quiet)
    assert.equal(hitRate(run.flooded), hitRate(run.quiet))
    assert.equal(hitRate(run.flooded), 1)
    // A's 7 pages and B's partition, full: B evicted only its own pages.
    assert.equal(run.numPagesCached, 7 + 8)
  })

  it('--prefix-cache-shared: the same flood evicts every page of A’s (the channel is there)', async () => {
    const run = await floodRun(['--prefix-cache-shared'], 'shared')
    assert.deepEqual(run.first, [0, 80])
    assert.deepEqual(run.quiet, [96, 96])
    assert.deepEqual(run.flood, [0, 0, 0, 0])
    // B's 24 pages went through the 16 shared ones: A's first prompt misses and caches its 6
    // pages again (evicting B's oldest), so A's second hits its 5 shared pages.
    assert.deepEqual(run.flooded, [0, 80])
    assert.equal(hitRate(run.quiet), 1)
    assert.equal(hitRate(run.flooded), 0.5)
    assert.equal(run.numPagesCached, 16)
    const warnings = readFileSync(join(dir, 'logs-shared', 'prefill.log'), 'utf8')
      .split('\n')
      .filter((l) => l.includes('"level":40') && l.includes('--prefix-cache-shared'))
    assert.equal(warnings.length, 1, 'the opt-out is logged as a warning at start')
  })
})
