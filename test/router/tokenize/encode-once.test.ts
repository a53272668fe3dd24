/** A prompt is encoded once on its way to the workers: the check for characters the tokenizer
 *  would drop decodes the very ids the workers get (`Tokenizer.encodeChecked`), for a completion's
 *  text and for a chat's rendered prompt. The ids and the lost character are exactly what
 *  `encode` and `firstLostCharacter` give separately. Encodings are counted on the tokenizer
 *  library's own `encode`. */
import assert from 'node:assert/strict'
import { rmSync } from 'node:fs'
import { after, describe, it } from 'node:test'
import { Tokenizer as HfTokenizer } from '@huggingface/tokenizers'
import { KvfenceError } from '../../../src/common/errors.js'
import { loadTokenizer } from '../../../src/model/tokenizer.js'
import { requestParsers } from '../../../src/router/api/schemas.js'
import { checkedPromptTokenIds } from '../../../src/router/tokenize/prompt-ids.js'
import { bosId, charIds, writeTestTokenizer } from '../helpers.js'

/** Runs `f`, counting the tokenizer library's encodings meanwhile. */
function countEncodes<T>(f: () => T): { value: T; numEncodes: number } {
  const proto = HfTokenizer.prototype as unknown as { encode: (...args: unknown[]) => unknown }
  const original = proto.encode
  let numEncodes = 0
  proto.encode = function (this: unknown, ...args: unknown[]) {
    numEncodes++
    return original.apply(this, args)
  }
  try {
    return { value: f(), numEncodes }
  } finally {
    proto.encode = original
  }
}

describe('a prompt is encoded once', () => {
  // BOS added as tokenizer_config.json's add_bos_token says; and, without that key, as the
  // tokenizer's own post-processor (TemplateProcessing: `<s>` then the text) says.
  const configured = writeTestTokenizer()
  const byPostProcessor = writeTestTokenizer({ add_bos_token: undefined, add_eos_token: undefined })
  after(() => {
    for (const dir of [configured, byPostProcessor]) rmSync(dir, { recursive: true, force: true })
  })

  it('encodeChecked gives encode’s ids and firstLostCharacter’s answer', () => {
    for (const dir of [configured, byPostProcessor]) {
      const tokenizer = loadTokenizer(dir)
      for (const text of ['Hello, workers!', '', 'caf\u00e9 ok', 'a<s>b', '🙂']) {
        for (const addSpecialTokens of [true, false]) {
          assert.deepEqual(tokenizer.encodeChecked(text, { addSpecialTokens }), {
            ids: tokenizer.encode(text, { addSpecialTokens }),
            lost: tokenizer.firstLostCharacter(text),
          })
        }
      }
      // Hand-checked: BOS, then one id per printable ASCII character.
      assert.deepEqual(tokenizer.encodeChecked('Hi!').ids, [bosId, ...charIds('Hi!')])
      assert.deepEqual(tokenizer.encodeChecked('caf\u00e9').lost, '\u00e9')
    }
  })

  it('a completion’s text and a chat’s rendered prompt: one encoding each', () => {
    const tokenizer = loadTokenizer(configured)
    const completion = requestParsers.completion({ model: 'm', prompt: 'Hello, workers!' })
    const ids = countEncodes(() => checkedPromptTokenIds(tokenizer, completion))
    assert.deepEqual(ids, { value: [bosId, ...charIds('Hello, workers!')], numEncodes: 1 })

    const messages = [
      { role: 'system', content: 'Be brief.' },
      { role: 'user', content: 'Hi' },
    ]
    const chat = requestParsers.chat({ model: 'm', messages })
    const chatIds = countEncodes(() => checkedPromptTokenIds(tokenizer, chat))
    const rendered = '<system>Be brief.\n<user>Hi\n<assistant>' // the test chat template's
    assert.deepEqual(chatIds, { value: [bosId, ...charIds(rendered)], numEncodes: 1 })
  })

  it('a chat losing a character still names the message that holds it', () => {
    const tokenizer = loadTokenizer(configured)
    const chat = requestParsers.chat({
      model: 'm',
      messages: [
        { role: 'user', content: 'Hi' },
        { role: 'user', content: 'na\u00efve 🙂' },
      ],
    })
    assert.throws(
      () => checkedPromptTokenIds(tokenizer, chat),
      (err: unknown) =>
        err instanceof KvfenceError &&
        err.code === 'invalid_request' &&
        err.param === 'messages[1].content' &&
        err.message.includes('(the first: "\u00ef", U+00EF)'),
    )
  })
})
