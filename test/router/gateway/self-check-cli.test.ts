/** `kvfence self-check` (in this process, src/cli/run.ts) against a gateway router in front of the
 *  vLLM stand-in: the token from the environment, the result per path, exit 1 when a path is not
 *  isolated, and one line with exit 2 when the router refuses. */
import assert from 'node:assert/strict'
import { after, before, describe, it } from 'node:test'
import { clusterTokenEnv, newClusterToken } from '../../../src/control/cluster-token.js'
import type { RunningRouter } from '../../../src/router/start.js'
import { kvfence } from '../../helpers/cli.js'
import { type Engine, startEngine } from '../../helpers/engines.js'
import { keys, writeTestTokenizer } from '../helpers.js'
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

  it('a check the engine does not answer keeps each path as it was (a salt-refusing engine stays unsalted); exit 2', async () => {
    // Hugging Face transformers serve refuses cache_salt with 422 (the openai stand-in does too);
    // the operator allows both paths unsalted. A check while it is down used to serve both
    // paths salted as "cannot tell": once it was back, every request got its 422.
    const plain = await startEngine('openai', { poolTokens: 512, maxModelLen: 512 })
    const allowing = await startGatewayRouter(plain, {
      backendModel: 'tiny-engine',
      kvPoolTokens: 512,
      tokenizerDir: writeTestTokenizer(),
      clusterToken: token,
      allowUnsalted: ['chat', 'completion'],
    })
    try {
      process.env[clusterTokenEnv] = token
      const before = JSON.parse(
        (await kvfence('self-check', '--url', allowing.url, '--json')).stdout,
      )
      const standings = (r: { paths: { endpoint: string; result: string; standing: string }[] }) =>
        r.paths.map((p) => [p.endpoint, p.result, p.standing])
      assert.deepEqual(standings(before), [
        ['chat', 'salt-refused', 'served-anyway'],
        ['completion', 'salt-refused', 'served-anyway'],
      ])
      plain.isDown = true
      const down = await kvfence('self-check', '--url', allowing.url, '--json')
      assert.equal(down.code, 2)
      assert.equal(
        down.stderr,
        `kvfence: the engine behind ${allowing.url} did not answer the self-check; each path keeps its earlier standing\n`,
      )
      assert.deepEqual(standings(JSON.parse(down.stdout)), [
        ['chat', 'cannot-tell', 'served-anyway'],
        ['completion', 'cannot-tell', 'served-anyway'],
      ])
      plain.isDown = false
      const res = await fetch(`${allowing.url}/v1/completions`, {
        method: 'POST',
        headers: { authorization: `Bearer ${keys.alpha}`, 'content-type': 'application/json' },
        body: JSON.stringify({ model: 'served', prompt: 'one two', max_tokens: 2 }),
      })
      assert.equal(res.status, 200, await res.clone().text())
      assert.equal('cache_salt' in plain.completions.at(-1)!, false)
    } finally {
      await allowing.close()
      await plain.close()
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
