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
} from '../../src/router/tenants.js'

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
    assert.deepEqual(tenants.authenticate('key-a'), { name: 'alpha', limits: {} })
    assert.deepEqual(tenants.authenticate('key-b'), { name: 'beta', limits: {} })
    assert.equal(tenants.authenticate('key-c'), null)
    assert.equal(tenants.authenticate(''), null)
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
