/** G8 at the router: a client that goes away, or a stop string that ends the output, closes the
 *  worker requests, which is how workers learn to abort. */
import assert from 'node:assert/strict'
import { connect } from 'node:net'
import { describe, it } from 'node:test'
import OpenAI from 'openai'
import { charIds, keys, startHarness, waitFor } from './helpers.js'

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

  it('a client that disconnects mid-body is logged as gone (499), not counted as a server error', async () => {
    const h = await startHarness()
    try {
      const url = new URL(h.router.url)
      const socket = connect(Number(url.port), url.hostname)
      await new Promise<void>((resolve) => socket.once('connect', resolve))
      // 10 of the 200 bytes the headers promise, then the connection goes away.
      socket.write(
        'POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\n' +
          `Authorization: Bearer ${keys.alpha}\r\nContent-Type: application/json\r\n` +
          'Content-Length: 200\r\n\r\n{"model": ',
      )
      await new Promise<void>((resolve) => socket.write('', () => resolve()))
      socket.destroy()
      await waitFor(() => h.logs.text().includes('"msg":"request finished"'))
      const lines = h.logs.lines.map((l) => JSON.parse(l) as Record<string, unknown>)
      const line = lines.find((l) => l.msg === 'request finished')!
      assert.equal(line.status, 499)
      assert.ok(lines.some((l) => l.msg === 'client went away' && l.code === 'request_aborted'))
      assert.ok(
        lines.every((l) => (l.level as number) < 50),
        'an error-level line for a client that left',
      )
      const metrics = await (await fetch(`${h.router.url}/metrics`)).text()
      assert.match(metrics, /kvfence_router_requests_total\{[^}]*status="499"[^}]*\} 1\n/)
      assert.doesNotMatch(metrics, /kvfence_router_requests_total\{[^}]*status="500"/)
      assert.equal(h.workers.numInternalRequests(), 0)
    } finally {
      await h.close()
    }
  })
})
