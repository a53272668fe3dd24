/** A prompt the model's tokenizer cannot represent is refused with 400, naming the first
 *  character lost, before any worker is asked (the test tokenizer knows printable ASCII only). */
import assert from 'node:assert/strict'
import { test } from 'node:test'
import OpenAI from 'openai'
import { startHarness } from './helpers.js'

test('emoji in a chat message or a prompt: 400 invalid_request naming the character, no worker asked', async () => {
  const h = await startHarness()
  try {
    const chat = h.client().chat.completions.create({
      model: 'echo-test',
      messages: [
        { role: 'user', content: 'Hi' },
        { role: 'user', content: '🙂🙂' },
      ],
    })
    await assert.rejects(chat, (err: unknown) => {
      assert.ok(err instanceof OpenAI.BadRequestError)
      assert.equal(err.code, 'invalid_request')
      assert.equal(err.type, 'invalid_request_error')
      assert.equal(err.param, 'messages[1].content')
      assert.equal(
        err.message,
        `400 messages[1].content holds characters this model's tokenizer cannot represent (the first: "🙂", U+1F642); they would be dropped from the prompt`,
      )
      return true
    })
    const completion = h.client().completions.create({ model: 'echo-test', prompt: 'caf\u00e9' })
    await assert.rejects(completion, (err: unknown) => {
      assert.ok(err instanceof OpenAI.BadRequestError)
      assert.equal(err.param, 'prompt')
      assert.match(err.message, /\(the first: "é", U\+00E9\)/)
      return true
    })
    assert.equal(h.workers.numInternalRequests(), 0)
  } finally {
    await h.close()
  }
})

test('emoji in a Responses request: the error names the input item, the string input or the instructions it is in', async () => {
  const h = await startHarness()
  try {
    const cases: [Parameters<OpenAI['responses']['create']>[0], string][] = [
      [
        {
          model: 'echo-test',
          input: [
            { role: 'user', content: 'Hi' },
            { role: 'user', content: [{ type: 'input_text', text: '🙂' }] },
          ],
        },
        'input[1].content',
      ],
      [{ model: 'echo-test', input: 'Hi 🙂' }, 'input'],
      [{ model: 'echo-test', instructions: 'Be 🙂', input: 'Hi' }, 'instructions'],
    ]
    for (const [body, param] of cases) {
      await assert.rejects(h.client().responses.create(body), (err: unknown) => {
        assert.ok(err instanceof OpenAI.BadRequestError)
        assert.equal(err.param, param)
        assert.equal(
          err.message,
          `400 ${param} holds characters this model's tokenizer cannot represent (the first: "🙂", U+1F642); they would be dropped from the prompt`,
        )
        return true
      })
    }
    assert.equal(h.workers.numInternalRequests(), 0)
  } finally {
    await h.close()
  }
})
