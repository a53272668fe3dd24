/** Load limits: per-tenant concurrency and tokens per minute (429 + Retry-After), the bounded
 *  router queue (503 + Retry-After), and a momentarily full KV pool (retried, then 503). */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import OpenAI from 'openai'
import { KvfenceError } from '../../../src/common/errors.js'
import { LimitError } from '../../../src/router/admission/limit-error.js'
import { createLimiter } from '../../../src/router/admission/limits.js'
import { apiKeyDigest } from '../../../src/router/tenants/tenants.js'
import { keys, startHarness, waitFor } from '../helpers.js'

const chat = { model: 'echo-test', messages: [{ role: 'user' as const, content: 'Hi' }] }

describe('limiter', () => {
  it('refuses a tenant past its concurrency with 429, and admits it again after a release', () => {
    const limiter = createLimiter()
    const limits = { maxConcurrentRequests: 2 }
    const a = limiter.admitTenant('alpha', limits, 10)
    limiter.admitTenant('alpha', limits, 10)
    assert.throws(
      () => limiter.admitTenant('alpha', limits, 10),
      (err: unknown) =>
        err instanceof LimitError &&
        err.status === 429 &&
        err.retryAfterSec === 1 &&
        /2 requests in flight.*2 at once/.test(err.message),
    )
    limiter.admitTenant('beta', limits, 10) // other tenants are not affected
    a.release(0)
    a.release(0) // idempotent
    limiter.admitTenant('alpha', limits, 10)
    limiter.check()
  })

  it('charges tokens per minute, refunds unused ones, and says when enough are back', () => {
    let now = 0
    const limiter = createLimiter(undefined, () => now)
    const limits = { tokensPerMinute: 600 } // 10 tokens per second
    const first = limiter.admitTenant('alpha', limits, 500)
    assert.throws(
      () => limiter.admitTenant('alpha', limits, 200),
      (err: unknown) => err instanceof LimitError && err.retryAfterSec === 10, // 100 short
    )
    first.release(300) // 300 of the 500 were not used
    limiter.admitTenant('alpha', limits, 200).release(0) // 400 left → 200 left
    now = 5_000 // + 50 tokens
    assert.throws(
      () => limiter.admitTenant('alpha', limits, 300),
      (err: unknown) => err instanceof LimitError && err.retryAfterSec === 5, // 250 + 50 short
    )
    assert.throws(
      () => limiter.admitTenant('alpha', limits, 601),
      (err: unknown) =>
        err instanceof LimitError &&
        /more than the limit of your key, 600 tokens per minute/.test(err.message),
    )
  })

  it('queues past maxConcurrentRequests, refuses past maxQueuedRequests, hands slots on in order', async () => {
    const limiter = createLimiter({
      maxConcurrentRequests: 1,
      maxQueuedRequests: 2,
      maxQueueWaitMs: 5_000,
    })
    const signal = new AbortController().signal
    const running = await limiter.acquireSlot(signal)
    const order: number[] = []
    const second = limiter.acquireSlot(signal).then((s) => (order.push(2), s))
    const third = limiter.acquireSlot(signal).then((s) => (order.push(3), s))
    limiter.check()
    await assert.rejects(limiter.acquireSlot(signal), (err: unknown) => {
      assert.ok(err instanceof LimitError)
      assert.equal(err.status, 503)
      assert.equal(err.code, 'capacity_exhausted')
      assert.match(err.message, /1 requests running and 2 queued/)
      return true
    })
    running.release()
    ;(await second).release()
    ;(await third).release()
    assert.deepEqual(order, [2, 3])
    assert.equal(limiter.numRunning, 0)
    limiter.check()
  })

  it('a queued request that waits too long gets 503; one whose client leaves is dropped', async () => {
    const limiter = createLimiter({
      maxConcurrentRequests: 1,
      maxQueuedRequests: 4,
      maxQueueWaitMs: 20,
    })
    const slot = await limiter.acquireSlot(new AbortController().signal)
    await assert.rejects(
      limiter.acquireSlot(new AbortController().signal),
      /waited 20 ms in the queue/,
    )
    const leaving = new AbortController()
    const pending = limiter.acquireSlot(leaving.signal)
    leaving.abort()
    await assert.rejects(
      pending,
      (err: unknown) => err instanceof KvfenceError && err.code === 'request_aborted',
    )
    assert.equal(limiter.numQueued, 0)
    slot.release()
    limiter.check()
  })
})

describe('limits at the router', () => {
  it('a tenant over its concurrency gets 429 with Retry-After; another tenant is served', async () => {
    const h = await startHarness(
      { tokenDelayMs: 20 },
      {
        tenants: [
          {
            name: 'alpha',
            keySha256: apiKeyDigest(keys.alpha),
            limits: { maxConcurrentRequests: 1 },
          },
          { name: 'beta', keySha256: apiKeyDigest(keys.beta) },
        ],
      },
    )
    try {
      const slow = h.client().chat.completions.create(chat)
      await waitFor(() => h.workers.generateRequests.length === 1)
      const res = await h.post('/v1/chat/completions', chat)
      assert.equal(res.status, 429)
      assert.equal(res.headers.get('retry-after'), '1')
      const { error } = (await res.json()) as { error: { code: string; type: string } }
      assert.equal(error.code, 'rate_limited')
      assert.equal(error.type, 'rate_limit_error')
      await assert.rejects(h.client().chat.completions.create(chat), OpenAI.RateLimitError)
      // Refused before its prompt is tokenized: token ids outside the vocabulary, which
      // tokenizing would refuse with 400, get the 429 (a tenant at its limit cannot make the
      // router tokenize large prompts for nothing).
      const untokenized = await h.post('/v1/completions', {
        model: 'echo-test',
        prompt: [100_000],
        max_tokens: 1,
      })
      assert.equal(untokenized.status, 429)
      const other = await h.client(keys.beta).chat.completions.create(chat)
      assert.equal(other.choices[0].finish_reason, 'stop')
      await slow
      assert.equal(h.workers.generateRequests.length, 2, 'refused requests never reached a worker')
      const metrics = await (await fetch(`${h.router.url}/metrics`)).text()
      assert.match(
        metrics,
        /kvfence_router_requests_total\{endpoint="chat",tenant="alpha",status="429"\} 2/,
      )
      assert.match(metrics, /kvfence_router_admission_rejections_total\{reason="tenant_limit"\} 3/)
    } finally {
      await h.close()
    }
  })

  it('a tenant out of tokens per minute gets 429 with the seconds to wait', async () => {
    const h = await startHarness(
      {},
      {
        tenants: [
          { name: 'alpha', keySha256: apiKeyDigest(keys.alpha), limits: { tokensPerMinute: 60 } },
        ],
      },
    )
    try {
      // Prompt: BOS + "<user>Hi\n<assistant>" = 21 tokens; + max_tokens 30 = 51 of 60.
      await h.client().chat.completions.create({ ...chat, max_tokens: 30 })
      // 15 completion tokens were used, so 15 were refunded: 24 left; 51 more need 27 = 27 s.
      const res = await h.post('/v1/chat/completions', { ...chat, max_tokens: 30 })
      assert.equal(res.status, 429)
      assert.equal(res.headers.get('retry-after'), '27')
    } finally {
      await h.close()
    }
  })

  it('a request larger than the whole tokens-per-minute limit: 429 that tells clients not to retry', async () => {
    const h = await startHarness(
      {},
      {
        tenants: [
          { name: 'alpha', keySha256: apiKeyDigest(keys.alpha), limits: { tokensPerMinute: 60 } },
        ],
      },
    )
    try {
      // 21 prompt tokens + max_tokens 100 > 60: no wait can make room for it.
      const raw = await h.post('/v1/chat/completions', { ...chat, max_tokens: 100 })
      assert.equal(raw.status, 429)
      assert.equal(raw.headers.get('x-should-retry'), 'false')
      assert.equal(raw.headers.get('retry-after'), null)
      // The official client (2 retries by default) gives up at once: one more request, not three
      // (it used to wait Retry-After: 60 before each retry).
      const client = new OpenAI({
        baseURL: `${h.router.url}/v1`,
        apiKey: keys.alpha,
        maxRetries: 2,
      })
      await assert.rejects(
        client.chat.completions.create({ ...chat, max_tokens: 100 }),
        (err: unknown) => err instanceof OpenAI.RateLimitError,
      )
      const metrics = await (await fetch(`${h.router.url}/metrics`)).text()
      assert.match(
        metrics,
        /kvfence_router_requests_total\{endpoint="chat",tenant="alpha",status="429"\} 2\n/,
      )
    } finally {
      await h.close()
    }
  })

  it('the router queue full → 503 with Retry-After', async () => {
    const h = await startHarness(
      { tokenDelayMs: 30 },
      { queue: { maxConcurrentRequests: 1, maxQueuedRequests: 1, maxQueueWaitMs: 10_000 } },
    )
    try {
      const running = h.client().chat.completions.create(chat)
      await waitFor(() => h.workers.generateRequests.length === 1)
      const queued = h.client().chat.completions.create(chat)
      for (let numQueued = 0; numQueued !== 1;) {
        const info = (await (await fetch(`${h.router.url}/server_info`)).json()) as {
          numQueued: number
        }
        numQueued = info.numQueued
      }
      const res = await h.post('/v1/chat/completions', chat)
      assert.equal(res.status, 503)
      assert.equal(res.headers.get('retry-after'), '1')
      assert.match(
        ((await res.json()) as { error: { message: string } }).error.message,
        /1 requests running and 1 queued/,
      )
      const [a, b] = await Promise.all([running, queued])
      assert.equal(a.choices[0].finish_reason, 'stop')
      assert.equal(b.choices[0].finish_reason, 'stop')
      // Shedding load is logged as a warning, not as an error an operator would be paged for.
      const lines = h.logs.lines.map((l) => JSON.parse(l) as { level: number; msg: string })
      assert.ok(lines.some((l) => l.level === 40 && l.msg === 'request shed for load'))
      assert.deepEqual(
        lines.filter((l) => l.level >= 50),
        [],
      )
    } finally {
      await h.close()
    }
  })

  it('a decode worker whose pool is momentarily full is asked again, and the request succeeds', async () => {
    const h = await startHarness({
      decodeRefusal: { status: 503, code: 'capacity_exhausted', message: '0 of 64 pages free' },
      decodeRefusalTimes: 2,
    })
    try {
      const completion = await h.client().chat.completions.create(chat)
      assert.equal(completion.choices[0].message.content, 'Hello, tenant!')
      assert.equal(h.workers.numRefused(), 2)
      const metrics = await (await fetch(`${h.router.url}/metrics`)).text()
      assert.match(metrics, /kvfence_router_pool_full_retries_total 2/)
    } finally {
      await h.close()
    }
  })
})
