/** `watchTenants`: a reload swaps the whole tenants file in, an invalid one keeps the previous
 *  tenants (logged at error), and the limiter's per-tenant state outlives a reload. */
import assert from 'node:assert/strict'
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { after, describe, it } from 'node:test'
import { loadClusterConfig } from '../../../src/config/cluster.js'
import { LimitError } from '../../../src/router/admission/limit-error.js'
import { createLimiter } from '../../../src/router/admission/limits.js'
import { apiKeyDigest, watchTenants } from '../../../src/router/tenants/tenants.js'
import { captureLogs } from '../../helpers/logs.js'

const dir = mkdtempSync(join(tmpdir(), 'kvfence-tenants-watch-'))

function tenantsYaml(tenants: { name: string; key: string; max?: number }[]): string {
  return `tenants:\n${tenants
    .map(
      (t) =>
        `  - name: ${t.name}\n    keySha256: ${apiKeyDigest(t.key)}\n` +
        (t.max === undefined ? '' : `    limits: { maxConcurrentRequests: ${t.max} }\n`),
    )
    .join('')}`
}

describe('watchTenants', () => {
  after(() => rmSync(dir, { recursive: true, force: true }))

  it('swaps in the new file on reload and keeps the old one when the new is invalid', () => {
    const path = join(dir, 'tenants.yaml')
    writeFileSync(
      path,
      tenantsYaml([
        { name: 'alpha', key: 'key-a' },
        { name: 'beta', key: 'key-b' },
      ]),
    )
    const { log, records } = captureLogs('info')
    const watcher = watchTenants(path, { log, intervalMs: 60_000 })
    try {
      const registry = watcher.registry
      assert.deepEqual(registry.authenticate('key-b'), {
        name: 'beta',
        limits: {},
        prefixCachePartition: { reservedPages: 0, numDefaultTenants: 2 },
      })

      writeFileSync(
        path,
        tenantsYaml([
          { name: 'alpha', key: 'key-a' },
          { name: 'gamma', key: 'key-c' },
        ]),
      )
      assert.equal(watcher.reload(), true)
      assert.equal(registry.authenticate('key-b'), null)
      assert.deepEqual(registry.authenticate('key-c'), {
        name: 'gamma',
        limits: {},
        prefixCachePartition: { reservedPages: 0, numDefaultTenants: 2 },
      })
      assert.deepEqual(registry.names, ['alpha', 'gamma'])

      for (const bad of ['tenants: [oops', 'tenants: []\n', '']) {
        writeFileSync(path, bad)
        assert.equal(watcher.reload(), false)
        assert.deepEqual(registry.names, ['alpha', 'gamma'])
        assert.deepEqual(registry.authenticate('key-a'), {
          name: 'alpha',
          limits: {},
          prefixCachePartition: { reservedPages: 0, numDefaultTenants: 2 },
        })
      }
      const errors = records().filter((l) => l.level === 50)
      assert.equal(errors.length, 3)
      assert.ok(
        errors.every(
          (l) => l.msg === 'tenants file reload failed; the previous tenants stay in force',
        ),
      )
    } finally {
      watcher.close()
    }
  })

  it('reads the tenants list of a cluster config file with its reader (router --config)', () => {
    const path = join(dir, 'cluster.yaml')
    const head = 'backend: { kind: vllm, url: "http://127.0.0.1:9" }\n'
    writeFileSync(path, head + tenantsYaml([{ name: 'alpha', key: 'key-a' }]))
    const watcher = watchTenants(path, {
      log: captureLogs('info').log,
      intervalMs: 60_000,
      read: (file) => loadClusterConfig(file).tenants,
    })
    try {
      assert.deepEqual(watcher.registry.names, ['alpha'])
      writeFileSync(path, head + tenantsYaml([{ name: 'beta', key: 'key-b' }]))
      assert.equal(watcher.reload(), true)
      assert.deepEqual(watcher.registry.authenticate('key-b'), {
        name: 'beta',
        limits: {},
        prefixCachePartition: { reservedPages: 0, numDefaultTenants: 1 },
      })
      assert.equal(watcher.registry.authenticate('key-a'), null)
      writeFileSync(path, tenantsYaml([{ name: 'gamma', key: 'key-c' }])) // neither workers nor backend
      assert.equal(watcher.reload(), false)
      assert.deepEqual(watcher.registry.names, ['beta'])
    } finally {
      watcher.close()
    }
  })

  it("keeps a remaining tenant's requests in flight counted across a reload", () => {
    const path = join(dir, 'limits.yaml')
    writeFileSync(
      path,
      tenantsYaml([
        { name: 'alpha', key: 'key-a', max: 1 },
        { name: 'beta', key: 'key-b' },
      ]),
    )
    const watcher = watchTenants(path, { log: captureLogs('info').log, intervalMs: 60_000 })
    try {
      const limiter = createLimiter()
      const alpha = watcher.registry.authenticate('key-a')!
      const ticket = limiter.admitTenant(alpha.name, alpha.limits, 10)

      writeFileSync(path, tenantsYaml([{ name: 'alpha', key: 'key-a', max: 1 }]))
      assert.equal(watcher.reload(), true)
      const again = watcher.registry.authenticate('key-a')!
      assert.throws(
        () => limiter.admitTenant(again.name, again.limits, 10),
        (err: unknown) => err instanceof LimitError && err.code === 'rate_limited',
      )
      ticket.release(0)
      limiter.admitTenant(again.name, again.limits, 10).release(0)
    } finally {
      watcher.close()
    }
  })
})
