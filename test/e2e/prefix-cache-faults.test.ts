/** The prefix cache's three faults injected into real clusters (router, prefill and decode workers,
 *  control channel and KV over loopback TCP), two tenants talking through the official `openai`
 *  client, each shown both ways as in faults.test.ts. The offload faults' clusters run in this
 *  process (test/helpers/in-process-cluster.ts: no part is killed, signalled or timed); the
 *  publish-partial clusters are OS processes, since the client's abort must reach P while P
 *  computes the prompt, which one event loop running both cannot show. The reference for every answer is the
 *  single-process engine (`generateLocal`, no cache) at temperature 0.
 *
 *  - `offload-load-as-hit`, with the offload tier on disk only: tenant A's prompt, evicted from an
 *    8-page cache by tenant B's, goes to files; the test zeroes the K/V in those files (a damaged
 *    disk). Guards on: the load fails its checksum, G4 refuses it, a counted miss; A is recomputed
 *    (`cached_tokens` 0) and answers the reference. Guards off: the damaged pages are used, counted
 *    as hits: `cached_tokens` 96 and another answer.
 *  - `offload-key-without-tenant`, host ring: A's pages evicted to the ring under keys without the
 *    tenant; then B sends A's very prompt. Guards on: G4's tenant check refuses A's pages (B's
 *    `cached_tokens` 0). Guards off: B hits A's pages (`cached_tokens` 96): the membership leak.
 *  - `publish-partial`: a 945-token prompt (four prefill chunks; the gate code in the last) is
 *    abandoned by its client while P prefills it, then sent again. Guards on: G5 refuses to cache
 *    the unfinished pages (a counted trip), the prompt is recomputed and answers the reference.
 *    Guards off: its 59 pages are published, unwritten ones included, and the prompt sent again
 *    hits all 944 tokens and answers otherwise. The abort must land before P starts the transfer;
 *    a run where it landed later (the prefill had finished) is retried with a fresh prompt, at most
 *    three times. */
import assert from 'node:assert/strict'
import { readdirSync, readFileSync, writeFileSync } from 'node:fs'
import { join } from 'node:path'
import { after, before, describe, it } from 'node:test'
import OpenAI from 'openai'
import { startCluster } from '../../src/config/launch.js'
import { loadTokenizer } from '../../src/model/tokenizer.js'
import { loadModel } from '../../src/model/weights.js'
import { openaiClient, pagesUsed, twoTenants } from '../helpers/cluster.js'
import {
  startInProcessCluster,
  type InProcessCluster as Cluster,
  type InProcessClusterOptions,
} from '../helpers/in-process-cluster.js'
import { echoModelDir } from '../helpers/paths.js'
import {
  echoOracle,
  floodPrompts,
  offloadDiskDir,
  stoneGardenPrompt,
} from '../helpers/prefix-cache.js'

const {
  dir,
  tenants: [tenantA, tenantB],
  tenantsFile,
} = twoTenants('kvfence-prefix-faults-')

/** BOS + 110 characters: 111 tokens, 6 full pages of 16. */
const promptA = stoneGardenPrompt
/** B's two prompts: 6 full pages each, so A's 6 pages all leave the 8-page cache. */
const promptsB = floodPrompts(2)

/** A directory of its own (0700, as mkdtemp makes it) for each disk tier. */
const loadAsHitDirs = { on: offloadDiskDir('on'), off: offloadDiskDir('off') }

type Shape = Pick<
  InProcessClusterOptions,
  'prefillPages' | 'decodePages' | 'prefillFaults' | 'disableGuards' | 'prefixCache'
>
const unsafeEnv = { ...process.env, KVFENCE_ALLOW_FAULTS: '1' }

// Every cluster here shares one prefix-cache budget between tenants (`--prefix-cache-shared`):
// the faults act on eviction to the offload tier by another tenant's prompts, and publish-partial
// needs the whole cache for one tenant's 59 pages, which a default partition would halve.
const small = { prefillPages: 64, decodePages: 64 }
/** The disk tier only (`--prefix-cache-offload-dir`, `--prefix-cache-offload-disk-bytes`). */
const disk = (d: string) => ({
  prefixCachePages: 8,
  prefixCacheShared: true,
  prefixCacheOffloadDir: d,
  prefixCacheOffloadDiskBytes: 1 << 20,
})
/** The host ring only (`--prefix-cache-offload-bytes`). */
const host = { prefixCachePages: 8, prefixCacheShared: true, prefixCacheOffloadBytes: 1 << 20 }
/** publish-partial, as OS processes: room in P for the cache's 59 pages beside the prompt's 60. */
const large = {
  modelDir: echoModelDir,
  pageSize: 16,
  prefillPages: 128,
  decodePages: 64,
  prefixCachePages: 64,
  prefillFaults: ['publish-partial'],
  prefillArgs: ['--prefix-cache-shared'],
  tenantsFile,
  logLevel: 'warn' as const,
  env: unsafeEnv,
}

const configs = {
  loadAsHitOn: {
    ...small,
    prefillFaults: ['offload-load-as-hit'],
    prefixCache: disk(loadAsHitDirs.on),
  },
  loadAsHitOff: {
    ...small,
    prefillFaults: ['offload-load-as-hit'],
    prefixCache: disk(loadAsHitDirs.off),
    disableGuards: true,
  },
  keyWithoutTenantOn: {
    ...small,
    prefillFaults: ['offload-key-without-tenant'],
    prefixCache: host,
  },
  keyWithoutTenantOff: {
    ...small,
    prefillFaults: ['offload-key-without-tenant'],
    prefixCache: host,
    disableGuards: true,
  },
} satisfies Record<string, Shape>
type ConfigName = keyof typeof configs | 'publishPartialOn' | 'publishPartialOff'

const model = loadModel(echoModelDir)
const clusters = new Map<ConfigName, Cluster>()
before(async () => {
  for (const [name, shape] of Object.entries(configs)) {
    const cluster = await startInProcessCluster({
      modelDir: echoModelDir,
      model,
      pageSize: 16,
      tenantsFile,
      ...shape,
    })
    clusters.set(name as ConfigName, cluster)
  }
  // One after another: the processes' start-up (model load, wasm compile) is CPU-bound.
  clusters.set('publishPartialOn', await startCluster({ ...large, logDir: join(dir, 'on') }))
  clusters.set(
    'publishPartialOff',
    await startCluster({ ...large, disableGuards: true, logDir: join(dir, 'off') }),
  )
})
after(async () => {
  await Promise.all([...clusters.values()].map((c) => c.stop()))
  model.kernels.close()
})

function get(name: ConfigName): Cluster {
  const cluster = clusters.get(name)
  assert.ok(cluster, `cluster ${name} did not start`)
  return cluster
}

/** The sum of a worker's `/metrics` samples of `name` whose labels include `labels`. */
async function metric(url: string, name: string, labels = ''): Promise<number> {
  const text = await (await fetch(`${url}/metrics`)).text()
  let sum = 0
  for (const line of text.split('\n')) {
    if (!line.startsWith(`${name}{`) && !line.startsWith(`${name} `)) continue
    if (labels !== '' && !line.includes(labels)) continue
    sum += Number(line.slice(line.lastIndexOf(' ') + 1))
  }
  return sum
}

const offloadLoads = (cluster: Cluster, outcome: 'hit' | 'refused') =>
  metric(cluster.prefillUrl, 'kvfence_prefix_cache_offload_loads_total', `outcome="${outcome}"`)

/** One completion at temperature 0: its text and `cached_tokens`. */
async function complete(cluster: Cluster, key: string, prompt: string, maxTokens: number) {
  const res = await openaiClient(cluster.routerUrl, key, 30_000).completions.create({
    model: 'echo-tiny',
    prompt,
    max_tokens: maxTokens,
    temperature: 0,
  })
  return { text: res.choices[0].text, cached: res.usage?.prompt_tokens_details?.cached_tokens }
}

const tokenizer = loadTokenizer(echoModelDir)
const oracle = echoOracle()
/** The single-process engine's text for `prompt` at temperature 0 (all `maxTokens`, past an end
 *  of sequence). */
function oracleText(prompt: string, maxTokens: number): string {
  const text = oracle(prompt, maxTokens, { stopAtEos: false })
  // An empty oracle would make every comparison below pass on a broken model.
  assert.ok(text.trim().length > 0, 'the single-process engine gave no text')
  return text
}

/** A caches `promptA` (cold, the reference answer), then B's prompts push its 6 pages out of the
 *  8-page cache into the offload tier. */
async function cacheThenEvict(cluster: Cluster): Promise<void> {
  assert.equal(tokenizer.encode(promptA).length, 111)
  assert.deepEqual(await complete(cluster, tenantA.key, promptA, 16), {
    text: oracleText(promptA, 16),
    cached: 0,
  })
  for (const p of promptsB) assert.equal((await complete(cluster, tenantB.key, p, 1)).cached, 0)
}

/** Zero the K/V of every entry file in `d` (header kept: a disk that lost the data, not the
 *  framing). Returns the number of files damaged. */
function zeroPayloads(d: string): number {
  const names = readdirSync(d).filter((n) => n.endsWith('.kv'))
  for (const name of names) {
    const file = readFileSync(join(d, name))
    file.fill(0, 12 + file.readUInt32LE(8))
    writeFileSync(join(d, name), file)
  }
  return names.length
}

describe('offload-load-as-hit (a failed load from the offload tier taken for a hit), disk tier', () => {
  it('guards on: the damaged page fails its checksum, G4 refuses it: a counted miss, the reference answer', async () => {
    const cluster = get('loadAsHitOn')
    await cacheThenEvict(cluster)
    assert.ok(zeroPayloads(loadAsHitDirs.on) >= 6)
    assert.deepEqual(await complete(cluster, tenantA.key, promptA, 16), {
      text: oracleText(promptA, 16),
      cached: 0,
    })
    // The chain stops at its first page: one refusal, nothing used.
    assert.equal(await offloadLoads(cluster, 'refused'), 1)
    assert.equal(await offloadLoads(cluster, 'hit'), 0)
  })

  it('guards off: the zeroed pages are used and counted as hits; the answer is built on them', async () => {
    const cluster = get('loadAsHitOff')
    await cacheThenEvict(cluster)
    assert.ok(zeroPayloads(loadAsHitDirs.off) >= 6)
    const got = await complete(cluster, tenantA.key, promptA, 16)
    assert.equal(got.cached, 96)
    assert.notEqual(got.text, oracleText(promptA, 16))
    assert.equal(await offloadLoads(cluster, 'hit'), 6)
    assert.equal(await offloadLoads(cluster, 'refused'), 0)
  })
})

describe('offload-key-without-tenant (offload entries keyed by tokens alone), host tier', () => {
  it('guards on: B asking A’s prompt finds A’s entries, G4’s tenant check refuses them: B is not told', async () => {
    const cluster = get('keyWithoutTenantOn')
    await cacheThenEvict(cluster)
    assert.deepEqual(await complete(cluster, tenantB.key, promptA, 16), {
      text: oracleText(promptA, 16),
      cached: 0,
    })
    assert.equal(await offloadLoads(cluster, 'refused'), 1)
    assert.equal(await offloadLoads(cluster, 'hit'), 0)
  })

  it('guards off: B hits A’s offloaded pages, so B learns A sent this prompt', async () => {
    const cluster = get('keyWithoutTenantOff')
    await cacheThenEvict(cluster)
    assert.deepEqual(await complete(cluster, tenantB.key, promptA, 16), {
      text: oracleText(promptA, 16),
      cached: 96,
    })
    assert.equal(await offloadLoads(cluster, 'hit'), 6)
  })
})

describe('publish-partial (an abandoned prefill’s pages published to the prefix cache)', () => {
  /** BOS + 944 characters = 945 tokens: prefill chunks of 256, 256, 256 and 177 tokens; the gate
   *  code sits in the last chunk and the prompt ends by starting it again, so the answer is read
   *  from pages the abandoned prefill never reached. `variant` makes each try's prompt new. */
  const longPrompt = (variant: number) =>
    `${variant}`.padEnd(900, ' the small market opens before the morning bread.') +
    ' the gate code: Lm4Nb8Vc1Xz0Pq2R' +
    ' code: Lm4Nb'

  /** Send `prompt` as tenant A and leave as soon as P holds pages for it. Returns whether the
   *  abort landed while P was still prefilling (P began no transfer for it). */
  async function abandon(cluster: Cluster, prompt: string): Promise<boolean> {
    const transfersBefore = await metric(cluster.prefillUrl, 'kvfence_transfers_total')
    const abort = new AbortController()
    const pending = openaiClient(cluster.routerUrl, tenantA.key, 30_000).completions.create(
      { model: 'echo-tiny', prompt, max_tokens: 6, temperature: 0 },
      { signal: abort.signal },
    )
    const deadline = Date.now() + 10_000
    while ((await pagesUsed(cluster))[0] === 0) {
      assert.ok(Date.now() < deadline, 'the prefill worker never took pages for the prompt')
      await new Promise((r) => setTimeout(r, 1))
    }
    abort.abort()
    await assert.rejects(pending, OpenAI.APIUserAbortError)
    // Let P see the abort and release (or publish) the prompt's pages.
    const idle = Date.now() + 5_000
    while ((await pagesUsed(cluster)).some((n) => n !== 0) && Date.now() < idle)
      await new Promise((r) => setTimeout(r, 20))
    return (await metric(cluster.prefillUrl, 'kvfence_transfers_total')) === transfersBefore
  }

  /** Abandon a fresh long prompt (at most three tries until the abort lands during the prefill),
   *  then send it again; returns its answer and the reference. */
  async function abandonThenResend(cluster: Cluster) {
    for (let variant = 0; variant < 3; variant++) {
      const prompt = longPrompt(variant)
      assert.equal(tokenizer.encode(prompt).length, 945)
      if (!(await abandon(cluster, prompt))) continue
      const again = await complete(cluster, tenantA.key, prompt, 6)
      const want = oracleText(prompt, 6)
      // Every page published and the right answer: P computed the whole prompt before it saw the
      // abort (seen once in a full run), so no page was left unwritten. Not the case under test.
      if (again.cached === 944 && again.text === want) continue
      return { again, want }
    }
    assert.fail('the abort never landed while the prompt was being prefilled (three tries)')
  }

  it('guards on: G5 refuses the unfinished pages (a counted trip); sent again the prompt is recomputed', async () => {
    const cluster = get('publishPartialOn')
    const { again, want } = await abandonThenResend(cluster)
    assert.deepEqual(again, { text: want, cached: 0 })
    assert.ok(
      (await metric(cluster.prefillUrl, 'kvfence_guard_trips_total', 'guard="G5"')) >= 1,
      'G5 counted no trip',
    )
  })

  it('guards off: the unfinished pages are published; sent again the prompt hits them all and answers wrongly', async () => {
    const cluster = get('publishPartialOff')
    const { again, want } = await abandonThenResend(cluster)
    assert.equal(again.cached, 944)
    assert.notEqual(again.text, want)
    assert.notEqual(again.text.slice(0, 1), want.slice(0, 1), 'the first token is already wrong')
  })
})
