/** Bugs of the same shapes as other engines' prefix-cache bugs, tried against a real cluster
 *  (router, prefill and decode workers as OS processes, the official `openai` client; pages of 16
 *  tokens, prefill chunks of 256, a 64-page cache of which each of the two tenants gets 32):
 *  - the same prompt twice at lengths that are exact multiples of the page size and of the
 *    prefill chunk size, and one token off them: the second answer equals the first (cold) and
 *    the single-process engine's at temperature 0, and `cached_tokens` is exactly the whole pages
 *    before the last prompt token, `floor((n − 1) / 16) × 16`, computed by hand below;
 *  - an abort during a long prefill followed at once by the same prompt: nothing of the aborted
 *    prefill is cached (0 cached tokens) and the answer is the cold one. */
import assert from 'node:assert/strict'
import { join } from 'node:path'
import { after, before, describe, it } from 'node:test'
import { startCluster, type Cluster } from '../../src/config/launch.js'
import { prefillChunkTokens } from '../../src/engine/prefill-worker.js'
import { loadTokenizer } from '../../src/model/tokenizer.js'
import { openaiClient, serverInfo, twoTenants } from '../helpers/cluster.js'
import { echoModelDir } from '../helpers/paths.js'
import { echoOracle } from '../helpers/prefix-cache.js'

const { dir, tenants, tenantsFile } = twoTenants('kvfence-prefix-lengths-')
const pageSize = 16
const tokenizer = loadTokenizer(echoModelDir)
/** The single-process engine's text for `prompt` (greedy, no cache). */
const expected = echoOracle(128)

/** A prompt of exactly `numTokens` tokens (BOS + one token per character) that starts with
 *  `head`, so that no two prompts of the test share a first page. */
function promptOf(head: string, numTokens: number): string {
  const filler = ' the stone garden keeps its gate code Lm4Nb8Vc1Xz0 by the river'
  let text = head
  while (text.length < numTokens - 1) text += filler
  const prompt = text.slice(0, numTokens - 1)
  assert.equal(tokenizer.encode(prompt).length, numTokens)
  return prompt
}

describe('prefix cache at page and chunk boundaries, and after an abort, in a real cluster', () => {
  let cluster: Cluster
  before(async () => {
    cluster = await startCluster({
      modelDir: echoModelDir,
      pageSize,
      prefillPages: 192,
      decodePages: 128,
      prefixCachePages: 64,
      tenantsFile,
      logDir: join(dir, 'logs'),
    })
  })
  after(async () => cluster?.stop())

  async function complete(prompt: string, maxTokens: number, signal?: AbortSignal) {
    const api = openaiClient(cluster.routerUrl, tenants[0].key)
    const res = await api.completions.create(
      { model: 'echo-tiny', prompt, max_tokens: maxTokens, temperature: 0 },
      { signal },
    )
    return { text: res.choices[0].text, cached: res.usage?.prompt_tokens_details?.cached_tokens }
  }

  it('cached_tokens is exact and the cached answer is the cold one at every boundary ±1', async () => {
    assert.equal(prefillChunkTokens, 256)
    // n → whole pages before the last prompt token, by hand: floor((n − 1) / 16) × 16.
    const cases: [number, number][] = [
      [15, 0],
      [16, 0],
      [17, 16],
      [31, 16],
      [32, 16],
      [33, 32],
      [255, 240],
      [256, 240],
      [257, 256],
      [511, 496],
      [512, 496],
      [513, 512],
    ]
    for (const [n, numCached] of cases) {
      const prompt = promptOf(`#${n}#`, n)
      const cold = await complete(prompt, 8)
      const warm = await complete(prompt, 8)
      assert.deepEqual([cold.cached, warm.cached], [0, numCached], `${n} tokens`)
      assert.equal(warm.text, cold.text, `${n} tokens: cached answer`)
      assert.equal(cold.text, expected(prompt, 8), `${n} tokens: the single-process answer`)
    }
  })

  it('an abort during a long prefill leaves nothing cached; the same prompt at once is cold', async () => {
    // A few tries: the abort must land while the prompt is being prefilled, not after.
    let numDuringPrefill = 0
    for (let attempt = 0; attempt < 4 && numDuringPrefill === 0; attempt++) {
      const prompt = promptOf(`!abort ${attempt}!`, 1000)
      const abort = new AbortController()
      const sent = complete(prompt, 8, abort.signal).then(
        () => 'answered',
        () => 'aborted',
      )
      // P leases the prompt's pages when its prefill starts (cached pages are not counted).
      while ((await serverInfo(cluster.prefillUrl)).numPagesUsed === 0) {
        await new Promise((resolve) => setTimeout(resolve, 1))
      }
      abort.abort()
      assert.equal(await sent, 'aborted')
      const again = await complete(prompt, 8)
      assert.equal(again.text, expected(prompt, 8), 'the answer after the abort is the cold one')
      // Nothing else of this tenant's ran in between, so the re-sent prompt finds either nothing
      // (the abort landed in the prefill, which published nothing) or, had the prefill completed
      // before the abort, its sealed pages: the first 32 (the tenant's partition), 512 tokens.
      assert.ok([0, 512].includes(again.cached!), `cached_tokens ${again.cached}`)
      if (again.cached === 0) numDuringPrefill += 1
    }
    assert.equal(numDuringPrefill > 0, true, 'no abort landed during a prefill in 4 tries')
  })
})
