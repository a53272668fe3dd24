/** G1 while running: after the workers restart with smaller pools, the router notices (every
 *  `capacityRecheckMs`, and right after a worker failure) and stops promising a context window
 *  the pools can no longer hold: it shrinks it with clampContext, else refuses new requests. */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import { type Harness, defaultReplyText, startHarness, waitFor } from './helpers.js'

// Stand-ins: 64 pages × 16 tokens = 1024 tokens of KV at start; 32 pages = 512 after "restart".
const request = { model: 'echo-test', messages: [{ role: 'user' as const, content: 'Hi' }] }

async function errorOf(h: Harness, body: object): Promise<{ status: number; code: string }> {
  const res = await h.post('/v1/chat/completions', body)
  const json = (await res.json()) as { error?: { code: string } }
  return { status: res.status, code: json.error?.code ?? 'none' }
}

async function maxModelLen(h: Harness): Promise<number> {
  const models = await h.client().models.list()
  return (models.data[0] as unknown as { max_model_len: number }).max_model_len
}

describe('G1 re-checked while running', () => {
  it('guards on: a pool shrunk below the window → 503 for new requests, an error log naming both numbers; service back when it grows', async () => {
    const h = await startHarness({}, { capacityRecheckMs: 20 })
    try {
      h.workers.setNumPages(32)
      await waitFor(() => h.logs.text().includes('refusing new requests'))
      const numBefore = h.workers.numInternalRequests()
      assert.deepEqual(await errorOf(h, request), { status: 503, code: 'worker_unavailable' })
      assert.equal(h.workers.numInternalRequests(), numBefore, 'a refused request reached a worker')
      const refusal = h.logs.lines
        .map((l) => JSON.parse(l) as { level: number; msg: string })
        .find((l) => l.msg.includes('refusing new requests'))!
      assert.equal(refusal.level, 50)
      assert.match(
        refusal.msg,
        /context window 1024 exceeds the effective KV capacity 512 tokens \(limited by prefill worker http:\/\/127\.0\.0\.1:\d+ KV pool \(32 pages × 16 tokens\)\)/,
      )
      const info = (await (await fetch(`${h.router.url}/server_info`)).json()) as Record<
        string,
        unknown
      >
      assert.equal(info.contextWindow, 1024)
      assert.equal(info.effectiveCapacityTokens, 512)

      h.workers.setNumPages(64)
      await waitFor(() => h.logs.text().includes('hold the context window again'))
      const completion = await h.client().chat.completions.create(request)
      assert.equal(completion.choices[0].message.content, defaultReplyText)
    } finally {
      await h.close()
    }
  })

  it('clampContext: the advertised window shrinks to the pool, and admission follows it', async () => {
    const h = await startHarness({}, { capacityRecheckMs: 20, clampContext: true })
    try {
      assert.equal(await maxModelLen(h), 1024)
      h.workers.setNumPages(32)
      await waitFor(() => h.logs.text().includes('context window now 512'))
      assert.equal(await maxModelLen(h), 512)
      // 21 prompt tokens (BOS + "<user>Hi\n<assistant>") + 500 > 512; it was admitted before.
      assert.deepEqual(await errorOf(h, { ...request, max_tokens: 500 }), {
        status: 400,
        code: 'context_length_exceeded',
      })
      const completion = await h.client().chat.completions.create({ ...request, max_tokens: 400 })
      assert.equal(completion.choices[0].message.content, defaultReplyText)
    } finally {
      await h.close()
    }
  })

  it('a worker failure triggers the re-check at once, without waiting for the interval', async () => {
    const h = await startHarness(
      {
        decodeRefusal: { status: 503, code: 'worker_unavailable', message: 'restarting' },
        decodeRefusalTimes: 1,
      },
      { capacityRecheckMs: 3_600_000 },
    )
    try {
      h.workers.setNumPages(32)
      assert.deepEqual(await errorOf(h, request), { status: 503, code: 'worker_unavailable' })
      await waitFor(() => h.logs.text().includes('refusing new requests'))
      assert.deepEqual(await errorOf(h, request), { status: 503, code: 'worker_unavailable' })
      assert.equal(h.workers.generateRequests.length, 1, 'the refused request reached a worker')
    } finally {
      await h.close()
    }
  })

  it('guards off (the incident’s configuration): the window stays, with a warning', async () => {
    const h = await startHarness(
      { guardsEnabled: false },
      { capacityRecheckMs: 20, guardsEnabled: false },
    )
    try {
      h.workers.setNumPages(32)
      await waitFor(() => h.logs.text().includes('UNSAFE: context window 1024 exceeds'))
      assert.equal(await maxModelLen(h), 1024)
      const completion = await h.client().chat.completions.create(request)
      assert.equal(completion.choices[0].message.content, defaultReplyText)
    } finally {
      await h.close()
    }
  })
})
