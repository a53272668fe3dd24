/** Through the gateway with a local copy of the engine's tokenizer: text that tokenizer cannot
 *  represent is refused with 400 naming the first character lost, as the native router refuses
 *  it, and the engine is not asked (it was sent on with the characters dropped: a trial found
 *  "héllo 日本" answered 200 with 6 prompt tokens). The test tokenizer knows printable ASCII only. */
import assert from 'node:assert/strict'
import { test } from 'node:test'
import OpenAI from 'openai'
import { startEngine } from '../../helpers/engines.js'
import { keys, writeTestTokenizer } from '../helpers.js'
import { startGatewayRouter } from './engines.js'

test('gateway: a character the local tokenizer drops is a 400 naming it on chat, completions and Responses; the engine is not asked', async () => {
  const engine = await startEngine('vllm', { poolTokens: 1024, maxModelLen: 1024 })
  const router = await startGatewayRouter(engine, { tokenizerDir: writeTestTokenizer() })
  const client = new OpenAI({ baseURL: `${router.url}/v1`, apiKey: keys.alpha, maxRetries: 0 })
  const lost = (param: string) =>
    `400 ${param} holds characters this model's tokenizer cannot represent (the first: "é", U+00E9); they would be dropped from the prompt`
  try {
    const cases: [Promise<unknown>, string][] = [
      [client.completions.create({ model: 'served', prompt: 'h\u00e9llo' }), 'prompt'],
      [
        client.chat.completions.create({
          model: 'served',
          messages: [
            { role: 'user', content: 'Hi' },
            { role: 'user', content: 'h\u00e9llo' },
          ],
        }),
        'messages[1].content',
      ],
      [client.responses.create({ model: 'served', input: 'h\u00e9llo' }), 'input'],
    ]
    for (const [request, param] of cases) {
      await assert.rejects(request, (err: unknown) => {
        assert.ok(err instanceof OpenAI.BadRequestError)
        assert.equal(err.code, 'invalid_request')
        assert.equal(err.param, param)
        assert.equal(err.message, lost(param))
        return true
      })
    }
    assert.deepEqual(engine.completions, [])
  } finally {
    await router.close()
    await engine.close()
  }
})
