/** loadTokenizer: a Hugging Face tokenizer directory behind encode / decode / chat template. */
import assert from 'node:assert/strict'
import { existsSync, rmSync, writeFileSync } from 'node:fs'
import { join } from 'node:path'
import { fileURLToPath } from 'node:url'
import { after, describe, it } from 'node:test'
import { KvfenceError } from '../../src/common/errors.js'
import { loadTokenizer } from '../../src/model/tokenizer.js'
import { charIds, writeTestTokenizer } from '../router/helpers.js'

const dirs: string[] = []
const tempTokenizer = (...args: Parameters<typeof writeTestTokenizer>) => {
  const dir = writeTestTokenizer(...args)
  dirs.push(dir)
  return dir
}

describe('loadTokenizer', () => {
  after(() => dirs.forEach((d) => rmSync(d, { recursive: true, force: true })))

  it('encodes with BOS per add_bos_token and decodes back', () => {
    const tokenizer = loadTokenizer(tempTokenizer())
    assert.equal(tokenizer.bosTokenId, 1)
    assert.equal(tokenizer.eosTokenId, 2)
    assert.equal(tokenizer.bosToken, '<s>')
    assert.equal(tokenizer.vocabSize, 100)
    const ids = tokenizer.encode('Hi, you!\n')
    assert.deepEqual(ids, [1, ...charIds('Hi, you!\n')])
    assert.deepEqual(tokenizer.encode('Hi', { addSpecialTokens: false }), charIds('Hi'))
    assert.equal(tokenizer.decode(ids), 'Hi, you!\n')
    assert.equal(tokenizer.decode([...ids, 2], { skipSpecialTokens: false }), '<s>Hi, you!\n</s>')
    assert.equal(tokenizer.decode([]), '')
  })

  it('adds no BOS when add_bos_token is false', () => {
    const tokenizer = loadTokenizer(tempTokenizer({ add_bos_token: false }))
    assert.deepEqual(tokenizer.encode('ab'), charIds('ab'))
  })

  it('renders the chat template with the generation prompt', () => {
    const tokenizer = loadTokenizer(
      tempTokenizer(
        {},
        {
          chatTemplate:
            '{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}',
        },
      ),
    )
    assert.equal(
      tokenizer.applyChatTemplate([
        { role: 'system', content: 'S' },
        { role: 'user', content: 'U' },
      ]),
      '<s>[system]S</s>[user]U</s>[assistant]',
    )
  })

  it('refuses chat without a template, and a template that raises, as invalid_request', () => {
    const none = loadTokenizer(tempTokenizer({}, { chatTemplate: null }))
    assert.throws(() => none.applyChatTemplate([{ role: 'user', content: 'x' }]), {
      code: 'invalid_request',
      param: 'messages',
    })
    const strict = loadTokenizer(
      tempTokenizer(
        {},
        {
          chatTemplate:
            "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok",
        },
      ),
    )
    assert.equal(strict.applyChatTemplate([{ role: 'user', content: 'x' }]), 'ok')
    assert.throws(
      () => strict.applyChatTemplate([{ role: 'assistant', content: 'x' }]),
      /user first/,
    )
  })

  it('names the file when one is missing or invalid', () => {
    const dir = tempTokenizer()
    rmSync(join(dir, 'tokenizer_config.json'))
    assert.throws(
      () => loadTokenizer(dir),
      (err: unknown) => {
        assert.ok(err instanceof KvfenceError)
        assert.match(err.message, /cannot read .*tokenizer_config\.json/)
        return true
      },
    )
    const broken = tempTokenizer()
    writeFileSync(join(broken, 'tokenizer.json'), '{ not json')
    assert.throws(() => loadTokenizer(broken), /tokenizer\.json is not valid JSON/)
    const unknownBos = tempTokenizer({ bos_token: '<bos>' })
    assert.throws(() => loadTokenizer(unknownBos), /bos_token "<bos>" is not in the vocabulary/)
  })

  const bundled = fileURLToPath(new URL('../../../models/echo-tiny', import.meta.url))
  it(
    'loads the bundled echo-tiny tokenizer',
    { skip: !existsSync(join(bundled, 'tokenizer.json')) },
    () => {
      const tokenizer = loadTokenizer(bundled)
      assert.equal(tokenizer.vocabSize, 100)
      assert.equal(tokenizer.bosTokenId, 1)
      assert.equal(tokenizer.eosTokenId, 2)
      const ids = tokenizer.encode('Hello world\n')
      assert.equal(ids[0], 1)
      assert.equal(ids.length, 1 + 'Hello world\n'.length)
      assert.equal(tokenizer.decode(ids), 'Hello world\n')
      const chat = tokenizer.applyChatTemplate([{ role: 'user', content: 'Hi' }])
      assert.ok(chat.includes('Hi'))
    },
  )
})
