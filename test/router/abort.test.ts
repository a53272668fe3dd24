/** G8 at the router: a client that goes away, or a stop string that ends the output, closes the
 *  worker requests, which is how workers learn to abort. */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import OpenAI from 'openai'
import { charIds, startHarness, waitFor } from './helpers.js'

const longReply = () => charIds('Hello ' + 'a'.repeat(300))

describe('abort propagation (G8)', () => {
  it('aborting a stream closes the decode worker request', async () => {
    const h = await startHarness({ reply: longReply, tokenDelayMs: 10 })
    try {
      const abort = new AbortController()
      const stream = await h
        .client()
        .chat.completions.create(
          { model: 'echo-test', messages: [{ role: 'user', content: 'Hi' }], stream: true },
          { signal: abort.signal },
        )
      let rid = ''
      try {
        for await (const chunk of stream) {
          rid = chunk.id.slice('chatcmpl-'.length)
          if (chunk.choices[0]?.delta.content) abort.abort()
        }
      } catch (err) {
        assert.ok(err instanceof OpenAI.APIUserAbortError) // the client may end quietly instead
      }
      assert.match(rid, /^[0-9a-f]{32}$/)
      await waitFor(() => h.workers.decodeClosedEarly.includes(rid))
      await waitFor(() => h.logs.text().includes('"status":499'))
    } finally {
      await h.close()
    }
  })

  it('a client leaving during prefill closes both worker requests', async () => {
    const h = await startHarness({ prefillDelayMs: 400 })
    try {
      const abort = new AbortController()
      const pending = h
        .client()
        .completions.create({ model: 'echo-test', prompt: 'Hi' }, { signal: abort.signal })
      await waitFor(() => h.workers.prefillRequests.length === 1)
      abort.abort()
      await assert.rejects(pending, OpenAI.APIUserAbortError)
      const rid = h.workers.generateRequests[0].requestId
      await waitFor(
        () =>
          h.workers.decodeClosedEarly.includes(rid) && h.workers.prefillClosedEarly.includes(rid),
      )
    } finally {
      await h.close()
    }
  })

  it('a matched stop string closes the decode worker request', async () => {
    const h = await startHarness({ reply: longReply, tokenDelayMs: 5 })
    try {
      const completion = await h
        .client()
        .completions.create({ model: 'echo-test', prompt: 'Hi', stop: 'aaa' })
      assert.equal(completion.choices[0].text, 'Hello ')
      assert.equal(completion.choices[0].finish_reason, 'stop')
      assert.equal(completion.usage?.completion_tokens, 9)
      const rid = completion.id.slice('cmpl-'.length)
      await waitFor(() => h.workers.decodeClosedEarly.includes(rid))
    } finally {
      await h.close()
    }
  })
})
