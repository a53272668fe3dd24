/** The prefix cache's per-tenant cap (`prefixCachePagesPerTenant`), its opt-out to one shared
 *  budget (`prefixCacheShared`) and offload tier (`prefixCacheOffloadBytes`; `prefixCacheOffloadDir`
 *  with `prefixCacheOffloadDiskBytes`) on a config file's prefill entry: accepted when in range (a
 *  relative directory resolved against the config file's), and a bad value is one line naming the
 *  field. */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import { parseClusterConfig } from '../../src/config/cluster.js'
import { newApiKey } from '../../src/router/tenants/tenant-keys.js'
import { apiKeyDigest } from '../../src/router/tenants/tenants.js'

const records = [{ name: 'tenant-a', keySha256: apiKeyDigest(newApiKey()) }]
const config = (prefill: unknown[]) => () =>
  parseClusterConfig(
    { workers: { prefill, decode: [{ pages: 8 }] }, tenants: records },
    'c.yaml',
    '/',
  )

describe('prefix-cache settings of a prefill entry', () => {
  it('accepts a partition within the cache and any offload size ≥ 0', () => {
    const entry = {
      pages: 64,
      prefixCachePages: 16,
      prefixCachePagesPerTenant: 8,
      prefixCacheOffloadBytes: 0,
    }
    assert.deepEqual(config([entry])().workers!.prefill, [entry])
    const shared = { pages: 64, prefixCachePages: 16, prefixCacheShared: true }
    assert.deepEqual(config([shared])().workers!.prefill, [shared])
  })

  it('resolves a relative offload directory against the config file’s, keeps an absolute one', () => {
    const parse = (dir: string) =>
      parseClusterConfig(
        {
          workers: {
            prefill: [{ pages: 64, prefixCacheOffloadDir: dir, prefixCacheOffloadDiskBytes: 4096 }],
            decode: [{ pages: 8 }],
          },
          tenants: records,
        },
        '/etc/kvfence/c.yaml',
        '/etc/kvfence',
      ).workers!.prefill[0]
    assert.deepEqual(parse('offload'), {
      pages: 64,
      prefixCacheOffloadDir: '/etc/kvfence/offload',
      prefixCacheOffloadDiskBytes: 4096,
    })
    assert.equal(
      (parse('/var/kv') as { prefixCacheOffloadDir: string }).prefixCacheOffloadDir,
      '/var/kv',
    )
  })

  it('is one line naming the field when bad', () => {
    const at = 'c.yaml: workers.prefill.0'
    const cases: [unknown, string][] = [
      [{ pages: 64, prefixCachePages: 16, prefixCachePagesPerTenant: 17 }, `${at}.prefixCachePagesPerTenant: may not exceed prefixCachePages`],
      [{ pages: 64, prefixCachePagesPerTenant: 0 }, `${at}.prefixCachePagesPerTenant: must be an integer ≥ 1`],
      [{ pages: 64, prefixCachePagesPerTenant: 'all' }, `${at}.prefixCachePagesPerTenant: must be an integer ≥ 1`],
      [{ pages: 64, prefixCacheOffloadBytes: -1 }, `${at}.prefixCacheOffloadBytes: must be an integer ≥ 0`],
      [{ pages: 64, prefixCacheOffloadDir: '/d' }, `${at}.prefixCacheOffloadDir: give both prefixCacheOffloadDir and prefixCacheOffloadDiskBytes, or neither`],
      [{ pages: 64, prefixCacheOffloadDiskBytes: 10 }, `${at}.prefixCacheOffloadDir: give both prefixCacheOffloadDir and prefixCacheOffloadDiskBytes, or neither`],
      [{ pages: 64, prefixCacheOffloadDir: '/d', prefixCacheOffloadDiskBytes: 0 }, `${at}.prefixCacheOffloadDiskBytes: must be an integer ≥ 1`],
      [{ pages: 64, prefixCacheShared: 'yes' }, `${at}.prefixCacheShared: must be true or false`],
      [{ pages: 64, prefixCacheShared: true, prefixCachePagesPerTenant: 4 }, `${at}.prefixCachePagesPerTenant: is a partition, not for a shared cache (prefixCacheShared: true)`],
    ] // prettier-ignore
    for (const [entry, message] of cases) {
      assert.throws(config([entry]), { name: 'KvfenceError', message })
    }
  })
})
