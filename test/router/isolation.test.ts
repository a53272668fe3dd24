/** No tenant can name, abort, read or time another tenant's request: ids are drawn by the router
 *  (128 random bits), never taken from a client, and no endpoint takes one. Also: the operations
 *  surface (`/metrics` with worker state, `--log-content`, `cached_tokens`). */
import assert from 'node:assert/strict'
import http from 'node:http'
import { describe, it } from 'node:test'
import { keys, rawRequest, startHarness } from './helpers.js'

const chat = { model: 'echo-test', messages: [{ role: 'user' as const, content: 'Hi' }] }

describe('request ids and tenant isolation', () => {
  it('a client-sent x-request-id is ignored: the router draws a fresh 128-bit id', async () => {
    const h = await startHarness()
    try {
      const chosen = 'a'.repeat(32)
      const ids = new Set<string>()
      for (let i = 0; i < 3; i++) {
        const res = await h.post('/v1/chat/completions', chat, { 'x-request-id': chosen })
        const body = (await res.json()) as { id: string }
        const rid = res.headers.get('x-request-id')!
        assert.match(rid, /^[0-9a-f]{32}$/)
        assert.notEqual(rid, chosen)
        assert.equal(body.id, `chatcmpl-${rid}`)
        ids.add(rid)
      }
      assert.equal(ids.size, 3)
      assert.deepEqual(
        h.workers.generateRequests.map((r) => r.requestId),
        [...ids],
        'the workers saw exactly the router-drawn ids',
      )
    } finally {
      await h.close()
    }
  })

  it('no endpoint takes a request id: abort, read and cancel routes do not exist', async () => {
    const h = await startHarness()
    try {
      const res = await h.client(keys.alpha).chat.completions.create(chat)
      const rid = res.id.slice('chatcmpl-'.length)
      const attempts: [string, string][] = [
        ['POST', `/abort_request`],
        ['POST', `/v1/abort`],
        ['DELETE', `/v1/chat/completions/${res.id}`],
        ['GET', `/v1/chat/completions/${res.id}`],
        ['POST', `/v1/chat/completions/${res.id}/cancel`],
        ['GET', `/v1/requests/${rid}`],
        ['POST', `/internal/generate`],
        ['POST', `/internal/prefill`],
      ]
      for (const [method, path] of attempts) {
        const r = await fetch(`${h.router.url}${path}`, {
          method,
          headers: { authorization: `Bearer ${keys.beta}`, 'content-type': 'application/json' },
          body: method === 'GET' || method === 'DELETE' ? undefined : JSON.stringify({ rid }),
        })
        assert.equal(r.status, 404, `${method} ${path}`)
        assert.equal(((await r.json()) as { error: { code: string } }).error.code, 'not_found')
      }
      const bodyRid = await h.post(
        '/v1/chat/completions',
        { ...chat, rid },
        {
          authorization: `Bearer ${keys.beta}`,
        },
      )
      assert.equal(bodyRid.status, 400)
      assert.equal(((await bodyRid.json()) as { error: { param: string } }).error.param, 'rid')
      assert.equal(h.workers.generateRequests.length, 1, 'only the first request reached a worker')
    } finally {
      await h.close()
    }
  })
})

describe('credentials', () => {
  // Between the two Authorization headers: none, or 2,000 short ones (Node's default
  // maxHeadersCount drops every header after the 2,000th, the second key with them: a
  // fresh-user trial got 200 as the first tenant that way, within the 16 KiB header limit).
  for (const numBetween of [0, 2000]) {
    it(`two Authorization headers (two tenants’ keys, ${numBetween} headers between) are refused with 401, not served as the first`, async () => {
      await twoKeysRefused(numBetween)
    })
  }
  const twoKeysRefused = async (numBetween: number) => {
    const h = await startHarness()
    try {
      const body = JSON.stringify(chat)
      // On a raw socket: the only way to send one header name twice.
      const head = [
        'POST /v1/chat/completions HTTP/1.1',
        `host: ${new URL(h.router.url).host}`,
        `authorization: Bearer ${keys.alpha}`,
        ...Array.from({ length: numBetween }, (_, i) => `x${i}: 1`),
        `authorization: Bearer ${keys.beta}`,
        'content-type: application/json',
        `content-length: ${Buffer.byteLength(body)}`,
        'connection: close',
      ]
      const answer = await rawRequest(h.router.url, `${head.join('\r\n')}\r\n\r\n${body}`)
      assert.equal(answer.status, 401, answer.body)
      assert.deepEqual(JSON.parse(answer.body), {
        error: {
          message: 'Send one Authorization header; this request has 2.',
          type: 'authentication_error',
          param: null,
          code: 'invalid_api_key',
        },
      })
      assert.equal(h.workers.generateRequests.length, 0)
    } finally {
      await h.close()
    }
  }
})

describe('operations', () => {
  it('GET /metrics reports TTFT, TPOT, transfers, and each worker’s pages and guard trips', async () => {
    const h = await startHarness({ guardTrips: { G3: 2, G5: 0 } })
    try {
      await h.client().chat.completions.create(chat)
      const text = await (await fetch(`${h.router.url}/metrics`)).text()
      assert.match(text, /kvfence_router_ttft_seconds_count\{endpoint="chat"\} 1/)
      assert.match(text, /kvfence_router_tpot_seconds_count\{endpoint="chat"\} 1/)
      assert.match(text, /kvfence_router_transfers_total\{status="ok"\} 1/)
      // Prompt of 21 tokens in 16-token pages: 2 pages.
      assert.match(text, /kvfence_router_transfer_pages_total 2/)
      for (const role of ['prefill', 'decode']) {
        const url = role === 'prefill' ? h.workers.prefillUrl : h.workers.decodeUrl
        const labels = `worker="${url}",role="${role}"`
        assert.ok(text.includes(`kvfence_worker_up{${labels}} 1`), role)
        assert.ok(text.includes(`kvfence_worker_kv_pages_free{${labels}} 64`), role)
        assert.ok(text.includes(`kvfence_worker_kv_pages_used{${labels}} 0`), role)
        assert.ok(text.includes(`kvfence_worker_guard_trips_total{${labels},guard="G3"} 2`), role)
        assert.ok(text.includes(`kvfence_worker_guard_trips_total{${labels},guard="G5"} 0`), role)
      }
      await h.workers.close()
      const down = await (await fetch(`${h.router.url}/metrics`)).text()
      assert.ok(down.includes(`kvfence_worker_up{worker="${h.workers.decodeUrl}",role="decode"} 0`))
    } finally {
      await h.close()
    }
  })

  it('usage.prompt_tokens_details.cached_tokens passes on what the decode worker reports', async () => {
    const h = await startHarness({ cachedTokens: 16 })
    try {
      const completion = await h.client().chat.completions.create(chat)
      assert.equal(completion.usage?.prompt_tokens_details?.cached_tokens, 16)
    } finally {
      await h.close()
    }
  })

  it("no /v1/ path reaches the operators' paths through dot segments or encoded slashes", async () => {
    // Sent as written (fetch would resolve the dots first): a proxy that forwards only /v1/* passes them.
    const paths = [
      '/v1/%2e%2e/metrics',
      '/v1/../server_info',
      '/v1/models/../../metrics',
      '/v1/%2E%2E/server_info',
      '/v1/./models',
      '/v1/%2e%2e%2fmetrics',
    ]
    const h = await startHarness()
    try {
      for (const path of paths) {
        const status = await new Promise<number>((resolve, reject) => {
          const req = http.request(
            {
              host: '127.0.0.1',
              port: Number(new URL(h.router.url).port),
              path,
              headers: { authorization: `Bearer ${keys.alpha}` },
            },
            (res) => {
              res.resume()
              resolve(res.statusCode ?? 0)
            },
          )
          req.on('error', reject)
          req.end()
        })
        assert.equal(status, 404, path)
      }
    } finally {
      await h.close()
    }
  })

  it('--log-content logs the prompt and completion; without it, neither', async () => {
    const secret = 'CANARY-9d2e'
    const h = await startHarness({}, { logContent: true })
    try {
      await h.client().chat.completions.create({
        ...chat,
        messages: [{ role: 'user', content: secret }],
      })
      const line = h.logs.lines.map((l) => JSON.parse(l)).find((l) => l.msg === 'request finished')
      assert.deepEqual(line.prompt, [{ role: 'user', content: secret }])
      assert.equal(line.completion, 'Hello, tenant!')
      // Completions: the prompt itself, not the whole body (it was logged with every field).
      await h.client().completions.create({ model: 'echo-test', prompt: secret, max_tokens: 3 })
      const lines = h.logs.lines
        .map((l) => JSON.parse(l))
        .filter((l) => l.msg === 'request finished')
      assert.equal(lines.at(-1).prompt, secret)
      assert.ok(!h.logs.text().includes(keys.alpha))
    } finally {
      await h.close()
    }
  })
})
