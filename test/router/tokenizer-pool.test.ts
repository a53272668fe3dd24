/** Tokenization off the event loop: while one tenant's long prompt is tokenized (in a thread of
 *  the router's tokenizer pool), another tenant's small request is admitted, generated and
 *  answered; queued prompts are taken tenant by tenant. Ordering only, no timing: without the
 *  pool the long prompt held the event loop, so the small request was answered after it. */
import assert from 'node:assert/strict'
import { test } from 'node:test'
import { rmSync } from 'node:fs'
import { loadTokenizer } from '../../src/model/tokenizer.js'
import { requestParsers } from '../../src/router/schemas.js'
import { createTokenizerPool } from '../../src/router/tokenizer-pool.js'
import { keys, startHarness, tokenizerWithLongToken, writeTestTokenizer } from './helpers.js'

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

test("the pool's threads take queued prompts tenant by tenant, first come first served within each", async () => {
  const modelDir = writeTestTokenizer()
  const pool = createTokenizerPool({
    modelDir,
    tokenizer: loadTokenizer(modelDir),
    numThreads: 1,
    inlineMaxChars: 0, // every prompt goes to the thread
  })
  try {
    const order: string[] = []
    const signal = new AbortController().signal
    const ask = (tenant: string, name: string) => {
      const parsed = requestParsers.completion({ model: 'echo-test', prompt: name.repeat(300) })
      return pool.tokenize(parsed, tenant, signal).then((ids) => {
        assert.equal(ids.length, 1 + 300 * name.length) // BOS and one id per character
        order.push(name)
      })
    }
    // alpha's six prompts are queued before beta's two, all while the one thread is busy.
    const all = ['a1', 'a2', 'a3', 'a4', 'a5', 'a6'].map((name) => ask('alpha', name))
    all.push(ask('beta', 'b1'), ask('beta', 'b2'))
    await Promise.all(all)
    // a1 takes the thread at once; then the tenants in turn, alpha first (it queued first):
    // a2, b1, a3, b2, and alpha's rest. First come first served was a1…a6 b1 b2.
    assert.deepEqual(order, ['a1', 'a2', 'b1', 'a3', 'b2', 'a4', 'a5', 'a6'])
  } finally {
    pool.close()
    rmSync(modelDir, { recursive: true, force: true })
  }
})
