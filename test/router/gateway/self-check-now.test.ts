/** The isolation self-check on demand: the operator (the cluster token, `x-kvfence-cluster-token`)
 *  runs it without a restart, gets `/server_info`'s report, and the paths it refuses change at
 *  once; a tenant's key never triggers it, and a router without a token refuses it. Against the
 *  vLLM stand-in of test/helpers/engines.ts, redeployed so that one path ignores the salt. */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import OpenAI from 'openai'
import { clusterTokenHeader, newClusterToken } from '../../../src/control/cluster-token.js'
import type { RunningRouter } from '../../../src/router/start.js'
import { startEngine } from '../../helpers/engines.js'
import { loadValidators, specSkip, violations } from '../../helpers/openapi.js'
import { keys } from '../helpers.js'
import { startGatewayRouter } from './engines.js'

const client = (router: RunningRouter) =>
  new OpenAI({ baseURL: `${router.url}/v1`, apiKey: keys.alpha, maxRetries: 0 })

/** `POST /isolation_self_check` with `headers`: the status and the JSON body. */
async function trigger(router: RunningRouter, headers: Record<string, string>) {
  const res = await fetch(`${router.url}/isolation_self_check`, { method: 'POST', headers })
  return { status: res.status, body: (await res.json()) as Record<string, unknown> }
}

async function serverInfoCheck(router: RunningRouter) {
  const info = (await (await fetch(`${router.url}/server_info`)).json()) as {
    isolationSelfCheck: { at: string; paths: { endpoint: string; result: string }[] }
  }
  return info.isolationSelfCheck
}

const resultsOf = (report: { paths: { endpoint: string; result: string }[] }) =>
  Object.fromEntries(report.paths.map((p) => [p.endpoint, p.result]))

describe('the isolation self-check on demand', { skip: specSkip }, () => {
  it('the operator runs it now: a path whose salt a redeploy dropped is refused at once; a tenant key cannot', async () => {
    const validator = loadValidators()
    const engine = await startEngine('vllm', {
      poolTokens: 1024,
      maxModelLen: 1024,
      prefixCache: 'salted',
    })
    const token = newClusterToken()
    const router = await startGatewayRouter(engine, { clusterToken: token })
    try {
      const atStart = await serverInfoCheck(router)
      assert.deepEqual(resultsOf(atStart), { chat: 'isolated', completion: 'isolated' })
      engine.saltIgnoredOn.add('chat') // a redeploy whose chat entrypoint drops the salt
      const numChecks = engine.selfChecks.length

      // A tenant's key, as a bearer key or in the operator's header, runs nothing.
      const tenantAttempts: Record<string, string>[] = [
        { authorization: `Bearer ${keys.alpha}` },
        { [clusterTokenHeader]: keys.alpha },
        {},
      ]
      for (const headers of tenantAttempts) {
        const refused = await trigger(router, headers)
        assert.equal(refused.status, 401)
        assert.deepEqual(violations(validator('ErrorResponse'), refused.body), [])
        assert.equal((refused.body.error as { code: string }).code, 'invalid_api_key')
      }
      assert.equal(engine.selfChecks.length, numChecks)
      assert.deepEqual(await serverInfoCheck(router), atStart)
      await client(router).chat.completions.create({
        model: 'served',
        messages: [{ role: 'user', content: 'one two' }],
      })

      const ran = await trigger(router, { [clusterTokenHeader]: token })
      assert.equal(ran.status, 200)
      assert.deepEqual(resultsOf(ran.body as never), { chat: 'shared', completion: 'isolated' })
      assert.equal(ran.body.numRequests, 6)
      assert.equal(engine.selfChecks.length, numChecks + 6)
      assert.deepEqual(await serverInfoCheck(router), ran.body)
      await assert.rejects(
        client(router).chat.completions.create({
          model: 'served',
          messages: [{ role: 'user', content: 'one two' }],
        }),
        (err: unknown) => {
          assert.ok(err instanceof OpenAI.APIError)
          assert.equal(err.status, 503)
          assert.equal(err.code, 'path_refused')
          return true
        },
      )
      await client(router).completions.create({ model: 'served', prompt: 'one two' })

      // The engine fixed, the operator's next run serves the path again.
      engine.saltIgnoredOn.clear()
      const again = await trigger(router, { [clusterTokenHeader]: token })
      assert.deepEqual(resultsOf(again.body as never), { chat: 'isolated', completion: 'isolated' })
      await client(router).chat.completions.create({
        model: 'served',
        messages: [{ role: 'user', content: 'one two' }],
      })
    } finally {
      await router.close()
      await engine.close()
    }
  })

  it('a router started without a cluster token refuses operator actions (403), and GET is 405', async () => {
    const engine = await startEngine('vllm', { poolTokens: 1024, maxModelLen: 1024 })
    const router = await startGatewayRouter(engine)
    try {
      const numChecks = engine.selfChecks.length
      const refused = await trigger(router, { [clusterTokenHeader]: 'anything' })
      assert.equal(refused.status, 403)
      assert.equal((refused.body.error as { code: string }).code, 'permission_denied')
      assert.match(
        (refused.body.error as { message: string }).message,
        /start it with KVFENCE_CLUSTER_TOKEN set/,
      )
      assert.equal(engine.selfChecks.length, numChecks)
      const get = await fetch(`${router.url}/isolation_self_check`)
      assert.equal(get.status, 405)
      assert.equal(get.headers.get('allow'), 'POST')
    } finally {
      await router.close()
      await engine.close()
    }
  })
})
