/** Prompt tokenization and G2 admission, without sockets. */
import assert from 'node:assert/strict'
import { rmSync } from 'node:fs'
import { after, describe, it } from 'node:test'
import { admit } from '../../../src/router/admission/context-window.js'
import {
  chatPromptTokenIds,
  completionPromptTokenIds,
} from '../../../src/router/tokenize/prompt-ids.js'
import { loadTokenizer } from '../../../src/model/tokenizer.js'
import { parseChatRequest } from '../../../src/router/api/schemas.js'
import { KvfenceError } from '../../../src/common/errors.js'
import { bosId, charIds, writeTestTokenizer } from '../helpers.js'

const fields = { promptParam: 'prompt', maxTokensParam: 'max_tokens' } as const

describe('G2 admission', () => {
  it('admits prompt + max_tokens up to the window exactly', () => {
    assert.equal(admit(1000, 24, 1024, fields), 24)
    assert.throws(
      () => admit(1000, 25, 1024, fields),
      (err: unknown) => {
        assert.ok(err instanceof KvfenceError)
        assert.equal(err.code, 'context_length_exceeded')
        assert.equal(err.status, 400)
        assert.equal(err.param, 'max_tokens')
        assert.match(
          err.message,
          /maximum context length is 1024 tokens.*1025 tokens \(1000 in the prompt, 25 in the completion\)/,
        )
        return true
      },
    )
  })

  it('defaults max_tokens to the rest of the window, and needs room for one token', () => {
    assert.equal(admit(1000, null, 1024, fields), 24)
    assert.equal(admit(1023, null, 1024, fields), 1)
    assert.throws(() => admit(1024, null, 1024, fields), {
      code: 'context_length_exceeded',
      param: 'prompt',
    })
    assert.throws(() => admit(681_281, 1, 681_280, fields), { param: 'prompt' })
  })
})

describe('prompt tokens', () => {
  const plainDir = writeTestTokenizer()
  const bosTemplateDir = writeTestTokenizer(
    {},
    {
      chatTemplate: "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
    },
  )
  after(() => {
    rmSync(plainDir, { recursive: true, force: true })
    rmSync(bosTemplateDir, { recursive: true, force: true })
  })

  it('adds BOS once, whether or not the chat template writes it', () => {
    const messages = [{ role: 'user', content: 'Hi' }]
    assert.deepEqual(chatPromptTokenIds(loadTokenizer(plainDir), messages), [
      bosId,
      ...charIds('<user>Hi\n<assistant>'),
    ])
    assert.deepEqual(chatPromptTokenIds(loadTokenizer(bosTemplateDir), messages), [
      bosId,
      ...charIds('Hi'),
    ])
  })

  it("gives a message's name to the chat template", () => {
    const dir = writeTestTokenizer(
      {},
      {
        chatTemplate:
          "{% for m in messages %}{{ m['name'] or '-' }}:{{ m['content'] }};{% endfor %}",
      },
    )
    try {
      const { messages } = parseChatRequest({
        model: 'm',
        messages: [
          { role: 'user', content: 'Hi', name: 'ann' },
          { role: 'user', content: 'Yo' },
        ],
      })
      assert.deepEqual(chatPromptTokenIds(loadTokenizer(dir), messages), [
        bosId,
        ...charIds('ann:Hi;-:Yo;'),
      ])
    } finally {
      rmSync(dir, { recursive: true, force: true })
    }
  })

  it('takes token-id prompts as they are, within the vocabulary', () => {
    const tokenizer = loadTokenizer(plainDir)
    assert.deepEqual(completionPromptTokenIds(tokenizer, { tokenIds: [5, 99] }), [5, 99])
    assert.throws(() => completionPromptTokenIds(tokenizer, { tokenIds: [100] }), {
      code: 'invalid_request',
      param: 'prompt',
    })
  })
})
