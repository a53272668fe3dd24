/** Tokenization off the event loop: while one tenant's long prompt is tokenized (in a thread of
 *  the router's tokenizer pool), another tenant's small request is admitted, generated and
 *  answered. Ordering only, no timing: without the pool the long prompt held the event loop, so
 *  the small request was answered after it. */
import assert from 'node:assert/strict'
import { test } from 'node:test'
import { keys, startHarness, tokenizerWithLongToken } from './helpers.js'

test("a tenant's small request is answered while another tenant's long prompt is still being tokenized", async () => {
  const h = await startHarness({}, { modelDir: tokenizerWithLongToken() })
  try {
    const order: string[] = []
    // 900,000 characters: over the window (a 400 once counted), under the length bound.
    const long = h
      .post('/v1/completions', { model: 'echo-test', prompt: 'ab '.repeat(300_000) })
      .then(async (res) => {
        order.push(`long ${res.status}`)
        return (await res.json()) as { error: { code: string } }
      })
    await new Promise((resolve) => setTimeout(resolve, 50)) // the long body is on its way
    const small = await h
      .client(keys.beta)
      .completions.create({ model: 'echo-test', prompt: 'Hi', max_tokens: 3 })
    order.push('small 200')
    assert.equal(small.choices.length, 1)
    assert.equal((await long).error.code, 'context_length_exceeded')
    assert.deepEqual(order, ['small 200', 'long 400'])
  } finally {
    await h.close()
  }
})
