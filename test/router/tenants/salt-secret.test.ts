/** Gateway mode's cache salts: routers given the same secret (`router.saltSecretFile` or
 *  `KVFENCE_SALT_SECRET`) send the engine the same `cache_salt` for a tenant, HMAC-SHA-256 of
 *  its name under that secret, so replicas and restarts share the engine's prefix cache per
 *  tenant; without one, each router process draws its own. Real router processes in front of a
 *  stand-in vLLM. */
import assert from 'node:assert/strict'
import type { ChildProcess } from 'node:child_process'
import { createHmac } from 'node:crypto'
import { mkdtempSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { after, before, describe, it } from 'node:test'
import { KvfenceError } from '../../../src/common/errors.js'
import { saltSecretFrom } from '../../../src/router/tenants/salt-secret.js'
import { newApiKey } from '../../../src/router/tenants/tenant-keys.js'
import { apiKeyDigest } from '../../../src/router/tenants/tenants.js'
import { type Engine, startEngine } from '../../helpers/engines.js'
import { freePort, startPart, stopAll } from '../../reliability/helpers.js'

const secret = 'a-shared-salt-secret-of-at-least-32-bytes'
const tenant = { name: 'tenant-a', key: newApiKey() }
const dir = mkdtempSync(join(tmpdir(), 'kvfence-salt-'))
let engine: Engine
const routers: ChildProcess[] = []

before(async () => {
  engine = await startEngine('vllm', { poolTokens: 4096, maxModelLen: 2048 })
  writeFileSync(join(dir, 'salt.secret'), `${secret}\n`)
})
after(async () => {
  await stopAll(routers)
  await engine.close()
})

/** Starts a router in gateway mode; returns its URL. */
async function startRouter(
  name: string,
  router: Record<string, unknown>,
  env: NodeJS.ProcessEnv = {},
): Promise<string> {
  const port = await freePort()
  const file = join(dir, `${name}.yaml`)
  const config = {
    router: { port, ...router },
    backend: { kind: 'vllm', url: engine.url, discoveryIntervalMs: 0 },
    tenants: [{ name: tenant.name, keySha256: apiKeyDigest(tenant.key) }],
  }
  writeFileSync(file, JSON.stringify(config)) // YAML holds JSON
  routers.push(await startPart(['router', '--config', file], 30_000, env))
  return `http://127.0.0.1:${port}`
}

/** The `cache_salt` the engine received for one chat request through `url`. */
async function saltVia(url: string): Promise<unknown> {
  const numBefore = engine.completions.length
  const res = await fetch(`${url}/v1/chat/completions`, {
    method: 'POST',
    headers: { authorization: `Bearer ${tenant.key}`, 'content-type': 'application/json' },
    body: JSON.stringify({
      model: 'tiny-engine',
      messages: [{ role: 'user', content: 'hello' }],
      max_tokens: 3,
    }),
  })
  assert.equal(res.status, 200, await res.text())
  assert.equal(engine.completions.length, numBefore + 1)
  return engine.completions[numBefore]!.cache_salt
}

describe('cache salts', () => {
  it('two routers with one secret (a file, the environment) send the same salt', async () => {
    const want = createHmac('sha256', Buffer.from(secret)).update(tenant.name).digest('base64url')
    const fromFile = await startRouter('file', { saltSecretFile: 'salt.secret' })
    const fromEnv = await startRouter('env', {}, { KVFENCE_SALT_SECRET: secret })
    assert.equal(await saltVia(fromFile), want)
    assert.equal(await saltVia(fromEnv), want)
  })

  it('two routers without a secret send different salts', async () => {
    const a = await saltVia(await startRouter('random-a', {}))
    const b = await saltVia(await startRouter('random-b', {}))
    assert.equal(typeof a, 'string')
    assert.notEqual(a, b)
  })

  it('refuses a short secret, and a secret given twice, without quoting it', () => {
    const short = join(dir, 'short.secret')
    writeFileSync(short, 'short-secret')
    assert.throws(
      () => saltSecretFrom({}, short),
      (err: unknown) =>
        err instanceof KvfenceError &&
        err.code === 'config_invalid' &&
        /holds 12 bytes; a salt secret needs at least 32/.test(err.message) &&
        !err.message.includes('short-secret'),
    )
    assert.throws(
      () => saltSecretFrom({ KVFENCE_SALT_SECRET: secret }, short),
      (err: unknown) => err instanceof KvfenceError && /not both/.test(err.message),
    )
    assert.equal(saltSecretFrom({}, undefined), null)
  })
})
