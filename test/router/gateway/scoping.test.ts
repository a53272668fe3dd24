/** Gateway mode keeps each tenant's ids and the engine's operational surface to itself: a client's
 *  request id goes back to that client only and never reaches the engine, OpenAI's `user` is
 *  scoped to the tenant, and no engine endpoint but generation is reachable through the router;
 *  the router's own endpoints carry no key, no salt and no prompt text. Against the stand-ins of
 *  test/helpers/engines.ts. */
import assert from 'node:assert/strict'
import { createHmac, randomBytes } from 'node:crypto'
import { describe, it } from 'node:test'
import { startEngine } from '../../helpers/engines.js'
import { keys, waitFor, writeTestTokenizer } from '../helpers.js'
import { startGatewayRouter } from './engines.js'

/** Posts a chat request as `key` with `headers` and `extra` body fields. */
function chat(
  url: string,
  key: string,
  content: string,
  headers: Record<string, string> = {},
  extra: Record<string, unknown> = {},
) {
  return fetch(`${url}/v1/chat/completions`, {
    method: 'POST',
    headers: { authorization: `Bearer ${key}`, 'content-type': 'application/json', ...headers },
    body: JSON.stringify({ model: 'served', messages: [{ role: 'user', content }], ...extra }),
  })
}

describe('gateway scoping', () => {
  it("a client's request id is echoed to it alone and never reaches the engine; user is scoped to the tenant", async () => {
    const engine = await startEngine('vllm', {
      poolTokens: 1024,
      maxModelLen: 1024,
      tokenDelayMs: 20,
    })
    const router = await startGatewayRouter(engine)
    try {
      // Both tenants choose the same ids, in flight at once.
      const [a, b] = await Promise.all([
        chat(router.url, keys.alpha, 'from alpha', { 'x-request-id': 'same-id' }, { user: 'bob' }),
        chat(
          router.url,
          keys.beta,
          'from beta',
          { 'x-client-request-id': 'same-id' },
          { user: 'bob' },
        ),
      ])
      assert.equal(a.status, 200)
      assert.equal(b.status, 200)
      assert.equal(a.headers.get('x-client-request-id'), 'same-id')
      assert.equal(b.headers.get('x-client-request-id'), 'same-id')
      const [ridA, ridB] = [a.headers.get('x-request-id')!, b.headers.get('x-request-id')!]
      assert.match(ridA, /^[0-9a-f]{32}$/)
      assert.match(ridB, /^[0-9a-f]{32}$/)
      assert.notEqual(ridA, ridB)
      const [bodyA, bodyB] = (await Promise.all([a.json(), b.json()])) as { id: string }[]
      assert.equal(bodyA.id, `chatcmpl-${ridA}`)
      assert.equal(bodyB.id, `chatcmpl-${ridB}`)

      assert.equal(engine.completions.length, 2)
      const sent = JSON.stringify([engine.completions, engine.completionHeaders])
      assert.ok(!sent.includes('same-id'), 'no client id reached the engine')
      assert.ok(!sent.includes('"bob"'), 'no client user reached the engine as sent')
      const users = engine.completions.map((c) => c.user as string)
      assert.match(users[0], /^u-[A-Za-z0-9_-]{43}$/)
      assert.notEqual(users[0], users[1], "two tenants' bob are two users")

      // A later request of alpha's bob is the same user at the engine.
      await (await chat(router.url, keys.alpha, 'again', {}, { user: 'bob' })).json()
      const alphaUser = engine.completions.find((c) =>
        JSON.stringify(c.messages).includes('from alpha'),
      )!.user
      assert.equal(engine.completions[2].user, alphaUser)

      const refused = await chat(router.url, keys.alpha, 'x', {}, { request_id: 'same-id' })
      assert.equal(refused.status, 400)
      const error = ((await refused.json()) as { error: { param: string; message: string } }).error
      assert.equal(error.param, 'request_id')
      assert.match(error.message, /request_id is an internal field set by the server/)
      assert.equal(engine.completions.length, 3, 'the refused request never reached the engine')
    } finally {
      await router.close()
      await engine.close()
    }
  })

  it("no engine operational endpoint is reachable with a tenant's key; the router's own carry no key, salt or prompt", async () => {
    const engine = await startEngine('sglang', { poolTokens: 1024, maxModelLen: 1024 })
    const engineKey = `sk-engine-${randomBytes(12).toString('hex')}`
    const saltSecret = randomBytes(32)
    const router = await startGatewayRouter(engine, {
      apiKey: engineKey,
      saltSecret,
      tokenizerDir: writeTestTokenizer(),
    })
    try {
      const canary = `CANARY${randomBytes(8).toString('hex')}`
      assert.equal((await chat(router.url, keys.alpha, `remember ${canary} please`)).status, 200)
      const engineRoutesBefore = engine.routes.length

      // Operational endpoints of SGLang, vLLM, llama.cpp and TGI (`/server_info`, `/metrics` and
      // `/health` are the router's own: read below).
      const operational = [
        'GET /slots',
        'GET /get_server_info',
        'GET /get_model_info',
        'GET /props',
        'POST /props',
        'GET /info',
        'POST /flush_cache',
        'POST /update_weights_from_disk',
        'POST /update_weights',
        'POST /start_profile',
        'POST /stop_profile',
        'POST /abort_request',
        'POST /tokenize',
        'POST /detokenize',
        'GET /health_generate',
        'GET /v1/slots',
        'POST /slots/0?action=save',
        'GET /load',
        'GET /version',
      ]
      for (const op of operational) {
        const [method, path] = op.split(' ')
        for (const auth of [
          { authorization: `Bearer ${keys.alpha}` },
          {} as Record<string, string>,
        ]) {
          const res = await fetch(`${router.url}${path}`, { method, headers: auth })
          const text = await res.text()
          assert.ok(res.status >= 400, `${op} answered ${res.status}: ${text}`)
          assert.ok(!text.includes(canary), `${op} shows the canary`)
        }
      }
      assert.deepEqual(engine.routes.slice(engineRoutesBefore), [], 'nothing reached the engine')

      const secrets = [
        canary,
        keys.alpha,
        keys.beta,
        engineKey,
        saltSecret.toString('hex'),
        saltSecret.toString('base64'),
        saltSecret.toString('base64url'),
        createHmac('sha256', saltSecret).update('alpha').digest('base64url'), // alpha's salt
      ]
      for (const path of [
        '/server_info',
        '/metrics',
        '/health',
        '/v1/models',
        '/v1/models/served',
      ]) {
        for (const auth of [
          { authorization: `Bearer ${keys.alpha}` },
          {} as Record<string, string>,
        ]) {
          const text = await (await fetch(`${router.url}${path}`, { headers: auth })).text()
          for (const secret of secrets) {
            assert.ok(!text.includes(secret), `${path} carries a secret or prompt text`)
          }
        }
      }
    } finally {
      await router.close()
      await engine.close()
    }
  })

  it('a client that leaves mid-answer is counted 499, not a server error (trial: 500 internal_error)', async () => {
    const engine = await startEngine('vllm', {
      poolTokens: 1024,
      maxModelLen: 1024,
      tokenDelayMs: 100,
      numTokens: 50,
    })
    const router = await startGatewayRouter(engine)
    try {
      for (const stream of [true]) {
        const leave = new AbortController()
        const res = fetch(`${router.url}/v1/chat/completions`, {
          method: 'POST',
          headers: { authorization: `Bearer ${keys.alpha}`, 'content-type': 'application/json' },
          body: JSON.stringify({
            model: 'served',
            messages: [{ role: 'user', content: 'hi' }],
            stream,
          }),
          signal: leave.signal,
        })
        await new Promise((r) => setTimeout(r, 300))
        leave.abort()
        await res.then(
          (r) => r.body?.cancel().catch(() => undefined),
          () => undefined,
        )
      }
      let metrics = ''
      await waitFor(() => {
        void fetch(`${router.url}/metrics`)
          .then((r) => r.text())
          .then((t) => (metrics = t))
          .catch(() => undefined)
        return /kvfence_router_requests_total\{endpoint="chat",tenant="alpha",status="499"\} 1/.test(
          metrics,
        )
      }, 10_000).catch(() =>
        assert.fail(
          metrics
            .split('\n')
            .filter((l) => l.includes('requests_total'))
            .join('\n'),
        ),
      )
      assert.doesNotMatch(metrics, /status="500"/)
    } finally {
      await router.close()
      await engine.close()
    }
  })
})
