/** `kvfence self-check` (in this process, src/cli/run.ts) against a gateway router in front of the
 *  vLLM stand-in: the token from the environment, the result per path, exit 1 when a path is not
 *  isolated, and one line with exit 2 when the router refuses. */
import assert from 'node:assert/strict'
import { after, before, describe, it } from 'node:test'
import { clusterTokenEnv, newClusterToken } from '../../../src/control/cluster-token.js'
import type { RunningRouter } from '../../../src/router/start.js'
import { kvfence } from '../../helpers/cli.js'
import { type Engine, startEngine } from '../../helpers/engines.js'
import { startGatewayRouter } from './engines.js'

describe('kvfence self-check', () => {
  let engine: Engine
  let router: RunningRouter
  const token = newClusterToken()
  const tokenBefore = process.env[clusterTokenEnv]
  before(async () => {
    engine = await startEngine('vllm', {
      poolTokens: 1024,
      maxModelLen: 1024,
      prefixCache: 'salted',
    })
    router = await startGatewayRouter(engine, { clusterToken: token })
  })
  after(async () => {
    if (tokenBefore === undefined) delete process.env[clusterTokenEnv]
    else process.env[clusterTokenEnv] = tokenBefore
    await router?.close()
    await engine?.close()
  })

  it('prints each path and the cost; exits 1 once a path ignores the salt', async () => {
    process.env[clusterTokenEnv] = token
    const clean = await kvfence('self-check', '--url', router.url)
    assert.equal(clean.code, 0, clean.stderr)
    const lines = clean.stdout.trimEnd().split('\n')
    assert.match(
      lines[0],
      /^chat: isolated \(the same salt reused \d+ cached tokens, another salt 0\)$/,
    )
    assert.match(lines[1], /^completion: isolated /)
    assert.match(lines[2], /^6 requests, \d+ tokens, \d+\.\d\d s$/)
    assert.ok(!clean.stdout.includes(token))

    engine.saltIgnoredOn.add('completion')
    const found = await kvfence('self-check', '--url', router.url, '--json')
    assert.equal(found.code, 1)
    const report = JSON.parse(found.stdout) as {
      paths: { endpoint: string; result: string; standing: string }[]
    }
    assert.deepEqual(
      report.paths.map((p) => [p.endpoint, p.result, p.standing]),
      [
        ['chat', 'isolated', 'served'],
        ['completion', 'shared', 'refused'],
      ],
    )
    const said = await kvfence('self-check', '--url', router.url)
    assert.equal(said.code, 1)
    assert.match(said.stdout.split('\n')[1], /^completion: shared \(.*\): refused by the router$/)
    engine.saltIgnoredOn.clear()
  })

  it('a path the operator allowed unsalted: its line says it is served anyway, exit 1 still', async () => {
    const shared = await startEngine('vllm', {
      poolTokens: 1024,
      maxModelLen: 1024,
      prefixCache: 'salted',
    })
    shared.saltIgnoredOn.add('completion')
    const allowing = await startGatewayRouter(shared, {
      clusterToken: token,
      allowUnsalted: ['completion'],
    })
    try {
      process.env[clusterTokenEnv] = token
      const result = await kvfence('self-check', '--url', allowing.url)
      assert.equal(result.code, 1)
      const lines = result.stdout.trimEnd().split('\n')
      assert.match(lines[0], /^chat: isolated \([^)]*\)$/)
      assert.match(
        lines[1],
        /^completion: shared \(.*\): served anyway \(allowUnsalted or guards off\)$/,
      )
    } finally {
      await allowing.close()
      await shared.close()
    }
  })

  it('refuses in one line without the token, with a wrong one, and with a bad URL', async () => {
    delete process.env[clusterTokenEnv]
    const missing = await kvfence('self-check', '--url', router.url)
    assert.equal(missing.code, 2)
    assert.equal(
      missing.stderr,
      `kvfence: ${clusterTokenEnv} is not set: it is the credential of operator actions\n`,
    )
    process.env[clusterTokenEnv] = 'not-the-token'
    const wrong = await kvfence('self-check', '--url', router.url)
    assert.equal(wrong.code, 2)
    assert.match(
      wrong.stderr,
      /^kvfence: the router at .* answered HTTP 401: This is an operator action: .*\n$/,
    )
    const badUrl = await kvfence('self-check', '--url', `${router.url}/v1`)
    assert.equal(badUrl.code, 2)
    assert.match(badUrl.stderr, /expected the router's base URL/)
  })
})
