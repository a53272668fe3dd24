/** Tenants: a YAML file of names and key digests; a presented key finds its tenant by digest. */
import assert from 'node:assert/strict'
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { after, describe, it } from 'node:test'
import {
  apiKeyDigest,
  bearerKey,
  createTenantRegistry,
  loadTenants,
} from '../../../src/router/tenants/tenants.js'

const dir = mkdtempSync(join(tmpdir(), 'kvfence-tenants-'))
const write = (name: string, text: string) => {
  const path = join(dir, name)
  writeFileSync(path, text)
  return path
}

describe('tenants', () => {
  after(() => rmSync(dir, { recursive: true, force: true }))

  it('finds a tenant by its key, and nobody for another key', () => {
    const path = write(
      'tenants.yaml',
      `tenants:\n  - name: alpha\n    keySha256: ${apiKeyDigest('key-a').toUpperCase()}\n  - name: beta\n    keySha256: ${apiKeyDigest('key-b')}\n`,
    )
    const tenants = loadTenants(path)
    assert.deepEqual(tenants.names, ['alpha', 'beta'])
    assert.deepEqual(tenants.authenticate('key-a'), {
      name: 'alpha',
      limits: {},
      prefixCachePartition: { reservedPages: 0, numDefaultTenants: 2 },
    })
    assert.deepEqual(tenants.authenticate('key-b'), {
      name: 'beta',
      limits: {},
      prefixCachePartition: { reservedPages: 0, numDefaultTenants: 2 },
    })
    assert.equal(tenants.authenticate('key-c'), null)
    assert.equal(tenants.authenticate(''), null)
  })

  it('gives each tenant its prefix-cache partition under the whole file, never under traffic', () => {
    const record = (name: string, prefixCachePages?: number) => ({
      name,
      keySha256: apiKeyDigest(`key-${name}`),
      ...(prefixCachePages === undefined ? {} : { prefixCachePages }),
    })
    const partitions = (registry: ReturnType<typeof createTenantRegistry>, names: string[]) =>
      names.map((n) => registry.authenticate(`key-${n}`)!.prefixCachePartition)
    const two = createTenantRegistry([record('a'), record('b')])
    const split2 = { reservedPages: 0, numDefaultTenants: 2 }
    assert.deepEqual(partitions(two, ['a', 'b']), [split2, split2])
    // `keys add c` while the router runs: every tenant's next request carries the new split.
    const three = createTenantRegistry([record('a'), record('b'), record('c')])
    const split3 = { reservedPages: 0, numDefaultTenants: 3 }
    assert.deepEqual(partitions(three, ['a', 'b', 'c']), [split3, split3, split3])
    // Sizes by name are reserved first; the rest is split between the tenants without one.
    const sized = createTenantRegistry([record('a', 6), record('b'), record('c', 0)])
    assert.deepEqual(partitions(sized, ['a', 'b', 'c']), [
      { pages: 6, reservedPages: 6, numDefaultTenants: 1 },
      { reservedPages: 6, numDefaultTenants: 1 },
      { pages: 0, reservedPages: 6, numDefaultTenants: 1 },
    ])
    assert.throws(() => createTenantRegistry([record('a', -1)]), {
      message: 'tenants: 0.prefixCachePages: prefixCachePages must be an integer ≥ 0',
    })
  })

  it('refuses a missing file, bad YAML, a plain key and duplicates, naming the file', () => {
    assert.throws(
      () => loadTenants(join(dir, 'nope.yaml')),
      /cannot read tenants file .*nope\.yaml/,
    )
    assert.throws(() => loadTenants(write('bad.yaml', 'tenants: [')), /bad\.yaml is not valid YAML/)
    assert.throws(
      () => loadTenants(write('plain.yaml', 'tenants:\n  - name: a\n    key: sk-123\n')),
      /plain\.yaml: tenants\.0/,
    )
    const digest = apiKeyDigest('same')
    assert.throws(
      () =>
        createTenantRegistry([
          { name: 'a', keySha256: digest },
          { name: 'b', keySha256: digest },
        ]),
      /shares its key/,
    )
    assert.throws(
      () =>
        createTenantRegistry([
          { name: 'a', keySha256: digest },
          { name: 'a', keySha256: apiKeyDigest('other') },
        ]),
      /duplicate name a/,
    )
  })

  it('reads the key of a Bearer header only', () => {
    assert.equal(bearerKey('Bearer sk-1'), 'sk-1')
    assert.equal(bearerKey('bearer  sk-1 '), 'sk-1')
    assert.equal(bearerKey('Basic sk-1'), null)
    assert.equal(bearerKey('Bearer'), null)
    assert.equal(bearerKey(undefined), null)
  })
})
