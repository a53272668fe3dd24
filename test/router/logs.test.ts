/** The router's log names request ids and tenants, never keys, prompts or completions. */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import { apiKeyDigest } from '../../src/router/tenants/tenants.js'
import OpenAI from 'openai'
import { defaultReplyText, keys, startHarness, waitFor } from './helpers.js'

describe('logging', () => {
  it('never writes an API key, its digest, a prompt or a completion', async () => {
    const h = await startHarness()
    const wrongKey = 'sk-wrong-0c9b8a7f6e'
    const secretPrompt = 'CANARY-PROMPT-5e1f'
    try {
      await h.client().chat.completions.create({
        model: 'echo-test',
        messages: [{ role: 'user', content: secretPrompt }],
      })
      const stream = await h.client(keys.beta).completions.create({
        model: 'echo-test',
        prompt: secretPrompt,
        stream: true,
      })
      for await (const _ of stream) void _
      await h
        .client(wrongKey)
        .models.list()
        .catch(() => undefined)
      await h.post('/v1/completions', { model: 'echo-test', prompt: secretPrompt, max_tokens: 0 })
      await h.post('/v1/completions', {
        model: 'echo-test',
        prompt: secretPrompt,
        cache_salt: keys.beta,
      })
      await h.post('/v1/completions', '{"prompt": "' + secretPrompt)

      const text = h.logs.text()
      assert.ok(h.logs.lines.length >= 6, 'the requests were logged')
      for (const secret of [keys.alpha, keys.beta, wrongKey]) {
        assert.ok(!text.includes(secret), 'a key appears in the log')
        assert.ok(!text.includes(apiKeyDigest(secret)), 'a key digest appears in the log')
      }
      assert.ok(!text.includes(secretPrompt), 'a prompt appears in the log')
      assert.ok(!text.includes(defaultReplyText), 'a completion appears in the log')

      const finished = h.logs.lines
        .map((l) => JSON.parse(l))
        .filter((l) => l.msg === 'request finished')
      assert.equal(finished.length, 5)
      for (const line of finished) {
        assert.match(line.rid, /^[0-9a-f]{32}$/)
        assert.ok(['alpha', 'beta'].includes(line.tenant))
        for (const field of ['status', 'promptTokens', 'completionTokens', 'ms']) {
          assert.equal(typeof line[field], 'number', field)
        }
      }
    } finally {
      await h.close()
    }
  })

  it('logs a request the drain deadline ends as warn (an operator stop), never error', async () => {
    // Both requests held after their first token, so the drain's 0 s deadline ends them: the
    // streamed one mid-stream (native/write-response.ts), the other before its answer (generation.ts).
    const h = await startHarness({ isHoldingReplies: true }, { drainSeconds: 0 })
    try {
      const isShuttingDown = (status: number | undefined) => (err: unknown) => {
        assert.ok(err instanceof OpenAI.APIError)
        assert.equal(err.status, status)
        assert.equal(err.code, 'shutting_down')
        return true
      }
      const client = h.client()
      const stream = await client.completions.create({
        model: 'echo-test',
        prompt: 'Hi',
        stream: true,
      })
      const whole = assert.rejects(
        client.completions.create({ model: 'echo-test', prompt: 'Hi' }),
        isShuttingDown(503),
      )
      await waitFor(() => h.workers.numHeld() === 2)
      await h.router.drain()
      // The stream's error event comes after its 200 head: the client's error has no status.
      await assert.rejects(async () => {
        for await (const _ of stream) void _
      }, isShuttingDown(undefined))
      await whole
      const records = h.logs.records()
      // pino's levels: 40 warn, 50 error.
      assert.deepEqual(
        records.filter((r) => r.level >= 50),
        [],
      )
      const ended = records.filter((r) => r.code === 'shutting_down')
      assert.deepEqual(
        ended.map((r) => [r.level, r.msg]),
        [
          [40, 'request ended: the drain deadline passed'],
          [40, 'request ended: the drain deadline passed'],
        ],
      )
    } finally {
      await h.close()
    }
  })
})
