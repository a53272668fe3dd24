/** A generation request on another entrypoint (here `/v1/messages`) counts in the prompt ceiling
 *  as a completion does: its answered size grows the ceiling, its 5xx stops the growth there. The
 *  target sends over real TCP to a small engine that answers the first request (reporting its
 *  prompt tokens as Anthropic's `usage.input_tokens`) and fails the second with 500. */
import assert from 'node:assert/strict'
import { createServer } from 'node:http'
import type { AddressInfo } from 'node:net'
import { test } from 'node:test'
import { Budget } from '../../src/audit/budget.js'
import { PromptCeiling } from '../../src/audit/prompt-ceiling.js'
import { createTarget, type HttpResult } from '../../src/audit/target.js'

test('/v1/messages: an answered prompt grows the prompt ceiling, a 500 stops it', async () => {
  let numRequests = 0
  const server = createServer((req, res) => {
    req.resume()
    req.on('end', () => {
      numRequests++
      res.setHeader('content-type', 'application/json')
      if (numRequests === 1) {
        res.end(
          JSON.stringify({
            id: 'msg_1',
            type: 'message',
            role: 'assistant',
            content: [{ type: 'text', text: 'ok' }],
            usage: { input_tokens: 300, output_tokens: 1 },
          }),
        )
      } else {
        res.statusCode = 500
        res.end(JSON.stringify({ type: 'error', error: { type: 'api_error', message: 'died' } }))
      }
    })
  })
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r))
  try {
    const ceiling = new PromptCeiling(null, false)
    const tenant = { name: 'alice', key: 'key-alice' }
    const target = createTarget({
      baseUrl: `http://127.0.0.1:${(server.address() as AddressInfo).port}`,
      model: 'm',
      tenants: [tenant],
      budget: new Budget({ maxRequests: 10, maxSeconds: 30, concurrency: 1 }),
      requestTimeoutMs: 5_000,
      // As the audit feeds its ceiling (run.ts): the answer's tokens, else the sender's estimate.
      onCompletion: (request, result) =>
        ceiling.observe(
          request.isValid ?? true,
          result.promptTokens ?? request.estimatedPromptTokens ?? null,
          result,
        ),
    })
    const inputTokens = (h: HttpResult) =>
      (JSON.parse(h.body) as { usage?: { input_tokens?: number } }).usage?.input_tokens ?? null
    const send = (prompt: string) =>
      target.postGeneration(
        '/v1/messages',
        { model: 'm', max_tokens: 4, messages: [{ role: 'user', content: prompt }] },
        { tenant, prompt, maxTokens: 4, stream: false, promptTokensOf: inputTokens },
        (h) => h.status === 200,
      )
    assert.equal(ceiling.maxRequestTokens(), 256)
    assert.equal((await send('one two three')).status, 200)
    assert.equal(ceiling.maxRequestTokens(), 600) // twice the 300 tokens the answer reported
    assert.equal((await send('a longer prompt that kills it')).status, 500)
    assert.equal(ceiling.maxRequestTokens(), 300) // no larger than the largest answered
    assert.match(ceiling.describe(), /no larger since request #2 got a server error or no answer/)
  } finally {
    server.close()
  }
})
