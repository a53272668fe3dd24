/** Worker failures reach the client as OpenAI errors — a status, or in a stream an error event —
 *  and never as a normal finish. Workers' own messages stay in the router's log. */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import OpenAI from 'openai'
import { defaultReplyText, startHarness, waitFor } from './helpers.js'

const request = { model: 'echo-test', messages: [{ role: 'user' as const, content: 'Hi' }] }

describe('worker failures', () => {
  it('a decode worker out of capacity past the queue wait → 503 with Retry-After: 1, streamed or not', async () => {
    const h = await startHarness(
      { decodeRefusal: { status: 503, code: 'capacity_exhausted', message: '0 of 64 pages free' } },
      { queue: { maxQueueWaitMs: 20 } },
    )
    try {
      for (const stream of [false, true]) {
        const res = await h.post('/v1/chat/completions', { ...request, stream })
        assert.equal(res.status, 503)
        assert.equal(res.headers.get('retry-after'), '1')
        const { error } = (await res.json()) as { error: Record<string, unknown> }
        assert.equal(error.code, 'capacity_exhausted')
        assert.equal(error.type, 'server_error')
      }
      await assert.rejects(h.client().chat.completions.create(request), (err: unknown) => {
        assert.ok(err instanceof OpenAI.InternalServerError)
        assert.equal(err.status, 503)
        return true
      })
      assert.equal(h.workers.prefillRequests.length, 0, 'no prefill for a refused request')
    } finally {
      await h.close()
    }
  })

  it('a full prefill pool is waited for like a full decode pool: retried under a fresh request id and secret, after the previous decode request was closed', async () => {
    const h = await startHarness({
      prefillRefusal: { status: 503, code: 'capacity_exhausted', message: '0 of 64 pages free' },
      prefillRefusalTimes: 2,
    })
    try {
      const completion = await h.client().chat.completions.create(request)
      assert.equal(completion.choices[0].message.content, defaultReplyText)
      const attempts = h.workers.generateRequests
      assert.equal(attempts.length, 3)
      assert.equal(new Set(attempts.map((a) => a.requestId)).size, 3)
      assert.equal(new Set(attempts.map((a) => a.transferSecret)).size, 3)
      assert.deepEqual(
        h.workers.prefillRequests.map((p) => [p.requestId, p.transferSecret]),
        attempts.map((a) => [a.requestId, a.transferSecret]),
      )
      // Each refused attempt's decode request was closed before the next attempt went out.
      const events = h.workers.events
      for (let i = 0; i < 2; i++) {
        const closed = events.indexOf(`decode-closed ${attempts[i].requestId}`)
        assert.ok(closed !== -1, `attempt ${i}'s decode request was left open`)
        assert.ok(closed < events.indexOf(`generate ${attempts[i + 1].requestId}`))
      }
      assert.ok(!h.workers.decodeClosedEarly.includes(attempts[2].requestId))
      const metrics = await (await fetch(`${h.router.url}/metrics`)).text()
      assert.match(metrics, /kvfence_router_pool_full_retries_total 2\n/)
    } finally {
      await h.close()
    }
  })

  it('a prefill pool still full past the queue wait → 503 capacity_exhausted with Retry-After: 1', async () => {
    const h = await startHarness(
      { prefillRefusal: { status: 503, code: 'capacity_exhausted', message: '0 pages free' } },
      { queue: { maxQueueWaitMs: 20 } },
    )
    try {
      const res = await h.post('/v1/chat/completions', request)
      assert.equal(res.status, 503)
      assert.equal(res.headers.get('retry-after'), '1')
      const { error } = (await res.json()) as { error: { code: string } }
      assert.equal(error.code, 'capacity_exhausted')
      for (const attempt of h.workers.generateRequests) {
        await waitFor(() => h.workers.decodeClosedEarly.includes(attempt.requestId))
      }
    } finally {
      await h.close()
    }
  })

  it('a failed prefill → 502 transfer_failed, and the decode worker request is closed', async () => {
    const h = await startHarness({
      prefillRefusal: {
        status: 502,
        code: 'transfer_failed',
        message: 'NACK page 2 of transfer 9',
      },
    })
    try {
      const res = await h.post('/v1/chat/completions', request)
      assert.equal(res.status, 502)
      const { error } = (await res.json()) as { error: { code: string; message: string } }
      assert.equal(error.code, 'transfer_failed')
      assert.doesNotMatch(error.message, /NACK|page 2/, 'worker detail stays in the log')
      assert.match(h.logs.text(), /NACK page 2 of transfer 9/)
      const rid = h.workers.generateRequests[0].requestId
      await waitFor(() => h.workers.decodeClosedEarly.includes(rid))
    } finally {
      await h.close()
    }
  })

  it('an error event mid-stream → an in-stream error, no finish_reason, no [DONE]', async () => {
    const h = await startHarness({ decodeErrorAfterTokens: 3 })
    try {
      const stream = await h.client().chat.completions.create({ ...request, stream: true })
      const texts: string[] = []
      await assert.rejects(
        async () => {
          for await (const chunk of stream) {
            assert.equal(chunk.choices[0]?.finish_reason ?? null, null, 'no normal finish')
            texts.push(chunk.choices[0]?.delta.content ?? '')
          }
        },
        (err: unknown) => {
          assert.ok(err instanceof OpenAI.APIError)
          assert.equal(err.code, 'guard_violation')
          assert.doesNotMatch(err.message, /tenant beta/)
          return true
        },
      )
      assert.equal(texts.join(''), 'Hel')

      const raw = await (
        await h.post('/v1/completions', { model: 'echo-test', prompt: 'Hi', stream: true })
      ).text()
      const events = raw.split('\n\n').filter((e) => e !== '')
      assert.ok(!raw.includes('[DONE]'))
      assert.equal(JSON.parse(events.at(-1)!.slice('data: '.length)).error.code, 'guard_violation')
    } finally {
      await h.close()
    }
  })

  it("a worker's own 4xx (its G3 re-check) reaches the client without the worker's words", async () => {
    const h = await startHarness({
      prefillRefusal: {
        status: 400,
        code: 'context_length_exceeded',
        message: 'G3: prompt of 301 tokens exceeds this prefill worker’s KV capacity of 128 tokens',
      },
    })
    try {
      const res = await h.post('/v1/chat/completions', request)
      assert.equal(res.status, 400)
      const { error } = (await res.json()) as { error: { code: string; message: string } }
      assert.equal(error.code, 'context_length_exceeded')
      assert.doesNotMatch(error.message, /G3|worker http|127\.0\.0\.1|128 tokens/)
      assert.match(error.message, /exceed what the workers' KV pools can hold/)
    } finally {
      await h.close()
    }
  })

  it('an error event before the output is sent → a plain 500', async () => {
    const h = await startHarness({ decodeErrorAfterTokens: 0 })
    try {
      const res = await h.post('/v1/chat/completions', { ...request, stream: true })
      assert.equal(res.status, 500)
      assert.equal(
        ((await res.json()) as { error: { code: string } }).error.code,
        'guard_violation',
      )
    } finally {
      await h.close()
    }
  })

  it('a first token that prefill and decode disagree on fails the request before any output', async () => {
    const h = await startHarness({ prefillFirstTokenId: 50 })
    try {
      for (const stream of [false, true]) {
        const res = await h.post('/v1/chat/completions', { ...request, stream })
        assert.equal(res.status, 500, 'a plain error: not one token was streamed')
        const { error } = (await res.json()) as { error: { code: string } }
        assert.equal(error.code, 'guard_violation')
      }
      assert.match(h.logs.text(), /first token \d+ from decode, 50 from prefill/)
    } finally {
      await h.close()
    }
  })

  it('a prefill that covered less than the prompt (a placeholder) fails the request', async () => {
    const h = await startHarness({ prefillNumTokens: 1 })
    try {
      const res = await h.post('/v1/chat/completions', { ...request, stream: true })
      assert.equal(res.status, 500)
      assert.equal(
        ((await res.json()) as { error: { code: string } }).error.code,
        'guard_violation',
      )
      assert.match(h.logs.text(), /prefill sent 1 prompt tokens, want 21/)
    } finally {
      await h.close()
    }
  })

  it('with guards off, the router passes such a request through (the incident)', async () => {
    const h = await startHarness(
      { prefillNumTokens: 1, guardsEnabled: false },
      { guardsEnabled: false },
    )
    try {
      const completion = await h.client().chat.completions.create(request)
      assert.equal(completion.choices[0].finish_reason, 'stop')
    } finally {
      await h.close()
    }
  })

  it('a decode worker that went away → 503 worker_unavailable', async () => {
    const h = await startHarness()
    try {
      assert.equal((await fetch(`${h.router.url}/health`)).status, 200)
      await h.workers.close()
      const health = await fetch(`${h.router.url}/health`)
      assert.equal(health.status, 503, '/health must not say ok while a worker is gone')
      assert.deepEqual(await health.json(), {
        status: 'unavailable',
        reason: 'a worker is unreachable',
      })
      const res = await h.post('/v1/chat/completions', request)
      assert.equal(res.status, 503)
      assert.equal(
        ((await res.json()) as { error: { code: string } }).error.code,
        'worker_unavailable',
      )
    } finally {
      await h.close()
    }
  })
})
