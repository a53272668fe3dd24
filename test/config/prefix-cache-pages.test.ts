/** `prefixCachePages` of a prefill worker (the threat model's `--prefix-cache-pages 0`) reaches
 *  the worker both ways a cluster is started here: a config file's `workers.prefill` entry
 *  (`serve --config`, clusterConfigPlan) and `startCluster`'s option (`serve --tenants`). The worker
 *  is forked with the flag, and with 0 a repeated prompt is never answered from the cache. A bad
 *  value is one line naming the field. */
import assert from 'node:assert/strict'
import type { ChildProcess } from 'node:child_process'
import { rmSync } from 'node:fs'
import { join } from 'node:path'
import { after, describe, it } from 'node:test'
import { pino } from 'pino'
import { parseClusterConfig } from '../../src/config/cluster.js'
import { clusterConfigPlan, launchCluster, startCluster } from '../../src/config/launch.js'
import { apiKeyDigest } from '../../src/router/tenants/tenants.js'
import { openaiClient, twoTenants } from '../helpers/cluster.js'
import { echoModelDir } from '../helpers/paths.js'

const { dir, tenants, tenantsFile } = twoTenants('kvfence-prefix-cache-pages-')
const records = tenants.map((t) => ({ name: t.name, keySha256: apiKeyDigest(t.key) }))
// Several pages of 16 tokens: with any cache, the second sending would reuse at least one.
const prompt =
  'system: you answer in the voice of the stone garden, Lm4Nb8Vc1Xz0 is the gate code. ' +
  'user: what opens the gate, and who keeps it when the garden sleeps?'

/** `cached_tokens` of the second of two identical prompts from the same tenant. */
async function cachedTokensOfRepeat(routerUrl: string): Promise<number | undefined> {
  const api = openaiClient(routerUrl, tenants[0].key)
  const ask = () =>
    api.completions.create({ model: 'echo-tiny', prompt, max_tokens: 4, temperature: 0 })
  await ask()
  return (await ask()).usage?.prompt_tokens_details?.cached_tokens
}

/** The value following `--prefix-cache-pages` in a forked part's arguments, or undefined. */
function prefixCacheFlag(child: ChildProcess): string | undefined {
  const i = child.spawnargs.indexOf('--prefix-cache-pages')
  return i === -1 ? undefined : child.spawnargs[i + 1]
}

describe('prefixCachePages', () => {
  after(() => rmSync(dir, { recursive: true, force: true }))

  it('validates on prefill entries started here, and is one line naming the field when bad', () => {
    const config =
      (prefill: unknown[], decode: unknown[] = [{ pages: 8 }]) =>
      () =>
        parseClusterConfig({ workers: { prefill, decode }, tenants: records }, 'c.yaml', dir)
    assert.deepEqual(config([{ pages: 64, prefixCachePages: 0 }])().workers!.prefill, [
      { pages: 64, prefixCachePages: 0 },
    ])
    assert.deepEqual(config([{ pages: 64, prefixCachePages: 64 }])().workers!.prefill, [
      { pages: 64, prefixCachePages: 64 },
    ])
    const cases: [unknown[], unknown[], string][] = [
      [[{ pages: 64, prefixCachePages: -1 }], [{ pages: 8 }], 'c.yaml: workers.prefill.0.prefixCachePages: must be an integer ≥ 0'],
      [[{ pages: 64, prefixCachePages: 1.5 }], [{ pages: 8 }], 'c.yaml: workers.prefill.0.prefixCachePages: must be an integer ≥ 0'],
      [[{ pages: 64, prefixCachePages: 'none' }], [{ pages: 8 }], 'c.yaml: workers.prefill.0.prefixCachePages: must be an integer ≥ 0'],
      [[{ pages: 64, prefixCachePages: 65 }], [{ pages: 8 }], 'c.yaml: workers.prefill.0.prefixCachePages: may not exceed pages'],
      [[{ url: 'http://10.0.0.7:8101', prefixCachePages: 0 }], [{ pages: 8 }], 'c.yaml: workers.prefill.0: Unrecognized key: "prefixCachePages"'],
      [[{ pages: 8 }], [{ pages: 8, prefixCachePages: 0 }], 'c.yaml: workers.decode.0: Unrecognized key: "prefixCachePages"'],
    ] // prettier-ignore
    for (const [prefill, decode, message] of cases) {
      assert.throws(config(prefill, decode), { name: 'KvfenceError', message })
    }
  })

  it('a config entry with prefixCachePages 0 forks the prefill worker with the flag; no cache hits', async () => {
    const config = parseClusterConfig(
      {
        model: echoModelDir,
        router: { port: 0, logLevel: 'warn' },
        workers: {
          pageSize: 16,
          prefill: [{ pages: 64, prefixCachePages: 0 }],
          decode: [{ pages: 64 }],
        },
        tenants: records,
      },
      'c.yaml',
      dir,
    )
    const cluster = await launchCluster(clusterConfigPlan(config, pino({ level: 'silent' })))
    try {
      const flags = cluster.children.map(prefixCacheFlag)
      const roles = cluster.children.map((c) =>
        c.spawnargs.find((a) => /^(prefill|decode)$/.test(a)),
      )
      assert.deepEqual(roles.map((role, i) => [role, flags[i]]).sort(), [
        ['decode', undefined],
        ['prefill', '0'],
      ])
      assert.equal(await cachedTokensOfRepeat(cluster.routerUrl), 0)
    } finally {
      await cluster.stop()
    }
  })

  it('startCluster({ prefixCachePages: 0 }) forks the prefill worker with the flag; no cache hits', async () => {
    const cluster = await startCluster({
      modelDir: echoModelDir,
      pageSize: 16,
      prefillPages: 64,
      decodePages: 64,
      prefixCachePages: 0,
      tenantsFile,
      logDir: join(dir, 'logs'),
      logLevel: 'warn',
    })
    try {
      assert.equal(prefixCacheFlag(cluster.processes.prefill), '0')
      assert.equal(prefixCacheFlag(cluster.processes.decode), undefined)
      assert.equal(await cachedTokensOfRepeat(cluster.routerUrl), 0)
    } finally {
      await cluster.stop()
    }
  })
})
