/** The response sentinel's run lengths in tokens of a real byte-level BPE tokenizer (Qwen3's
 *  published one), without sockets. Token mode (native: prompts and answers as token ids, the
 *  answer's pieces made by the router's own TextStream): a run of 16 tokens is suspected, 15 are
 *  not, whatever their characters; block mode holds back tokens' text. Character mode (gateway):
 *  16 tokens are `16 × c ÷ t` characters, `c` and `t` the source tenant's prompt characters and
 *  counted tokens. Token ids and their texts were checked by hand against the vocabulary (`Ġ` a
 *  leading space). */
import assert from 'node:assert/strict'
import { after, describe, it } from 'node:test'
import { loadTokenizer } from '../../../src/model/tokenizer.js'
import { TextStream } from '../../../src/router/tokenize/text-stream.js'
import {
  type AnswerCheck,
  type SentinelEvent,
  type SentinelSettings,
  type SentinelUnit,
  buildSentinelSettings,
  createSentinel,
} from '../../../src/router/sentinel/sentinel.js'
import { qwen3TokenizerDir } from '../../helpers/qwen3.js'

const qwen3 = qwen3TokenizerDir()
after(() => qwen3.remove())
const tokenizer = loadTokenizer(qwen3.dir)

/** Tenant A's prompt: 166 characters, 35 Qwen3 tokens. */
const contract =
  'Our supplier contract with Halvorsen Freight renews on the first of March at a rate of four point two percent above the index, unless either party objects in writing.'
const contractIds = tokenizer.encode(contract)
/** Tokens 2–17 of the contract: ` contract| with| Hal|v|ors|en| Freight| re|news| on| the|
 *  first| of| March| at| a` — 16 tokens, 66 characters. */
const run16 = contractIds.slice(2, 18)
const run15 = contractIds.slice(2, 17)
const preamble = tokenizer.encode('Sure, here is the paragraph you asked for, word for word:')
const closing = tokenizer.encode('! Anything else?')

function sentinelOf(unit: SentinelUnit, fields: Partial<SentinelSettings> = {}) {
  const events: SentinelEvent[] = []
  const settings = buildSentinelSettings({ mode: 'observe', ...fields })
  const key = new Uint8Array(16).fill(9)
  return {
    sentinel: createSentinel({ settings, unit, onEvent: (e) => events.push(e), key }),
    events,
  }
}

/** Feeds `ids` to `check` as the native router does: each token through a TextStream, its text
 *  piece (maybe empty) with its id; the rest at the end. Returns what was released and the
 *  error thrown, and what was released after each token. */
function answerTokens(check: AnswerCheck, ids: readonly number[]) {
  const stream = new TextStream((t) => tokenizer.decode(t), [])
  let released = ''
  const afterEach: string[] = []
  try {
    for (const id of ids) {
      released += check.push(stream.push(id).text, [id])
      afterEach.push(released)
    }
    released += check.push(stream.finish().text, [])
    released += check.finish()
    return { released, afterEach, error: null }
  } catch (err) {
    return { released, afterEach, error: err as Error & { code?: string } }
  }
}

const tokenPrompt = (text: string) => {
  const ids = tokenizer.encode(text)
  return { texts: [text], tokenIds: ids, numTokens: ids.length }
}

describe('token mode with a BPE tokenizer (n = 8 tokens, minRunTokens = 16)', () => {
  it('the fixtures are what the comments say', () => {
    assert.equal(contract.length, 166)
    assert.equal(contractIds.length, 35)
    assert.equal(
      tokenizer.decode(run16),
      ' contract with Halvorsen Freight renews on the first of March at a',
    )
    assert.equal(tokenizer.decode(run16).length, 66)
    assert.equal(tokenizer.decode(run15).length, 64)
    // Neither neighbour continues the contract: `:` before, `!` after.
    assert.equal(tokenizer.decode(preamble.slice(-1)), ':')
    assert.equal(tokenizer.decode(closing.slice(0, 1)), '!')
  })

  it("a 16-token run of another tenant's prompt is suspected, 15 tokens (64 characters) are not", () => {
    const { sentinel, events } = sentinelOf('token')
    sentinel.admit('a', false, 'ra', tokenPrompt(contract))
    const b = tokenPrompt('Please quote the paragraph.')
    const clean = answerTokens(sentinel.admit('b', false, 'rb1', b), [
      ...preamble,
      ...run15,
      ...closing,
    ])
    assert.equal(clean.error, null)
    assert.deepEqual(events, [])
    answerTokens(sentinel.admit('b', false, 'rb2', b), [...preamble, ...run16, ...closing])
    assert.deepEqual(events, [
      {
        kind: 'suspected',
        rid: 'rb2',
        tenant: 'b',
        sourceTenant: 'a',
        runTokens: 16,
        runCharacters: null,
      },
    ])
  })

  it("the answering tenant's own prompt is no evidence, in tokens too", () => {
    const { sentinel, events } = sentinelOf('token')
    sentinel.admit('a', false, 'ra', tokenPrompt(contract))
    answerTokens(sentinel.admit('b', false, 'rb', tokenPrompt(`Repeat: ${contract}`)), run16)
    assert.deepEqual(events, [])
  })

  it("block mode holds back 7 tokens' text, then the whole run, and releases exactly the text before it", () => {
    const { sentinel } = sentinelOf('token', { mode: 'block' })
    sentinel.admit('a', false, 'ra', tokenPrompt(contract))
    const b = tokenPrompt('Please quote the paragraph.')
    const clean = answerTokens(sentinel.admit('b', false, 'rb1', b), [...preamble, ...closing])
    assert.equal(clean.error, null)
    assert.equal(clean.released, tokenizer.decode([...preamble, ...closing]))
    // After each token, all but the last 7 tokens' text has gone out.
    clean.afterEach.forEach((released, i) => {
      const ids = [...preamble, ...closing].slice(0, Math.max(0, i + 1 - 7))
      assert.equal(released, tokenizer.decode(ids), `after token ${i}`)
    })
    const leak = answerTokens(sentinel.admit('b', false, 'rb2', b), [
      ...preamble,
      ...run16,
      ...closing,
    ])
    assert.equal(leak.error?.code, 'answer_withheld')
    assert.equal(leak.released, tokenizer.decode(preamble))
  })

  it('a token whose text is half a character holds the piece that completes it', () => {
    // 🙂 is two byte-level tokens; the first decodes to nothing on its own.
    const ids = tokenizer.encode('ab 🙂 cdefghijklmnopqrstuvwxyz')
    const { sentinel } = sentinelOf('token', { mode: 'block' })
    const result = answerTokens(sentinel.admit('b', false, 'rb', tokenPrompt('x')), ids)
    assert.equal(result.released, 'ab 🙂 cdefghijklmnopqrstuvwxyz')
    for (const released of result.afterEach) assert.ok(!released.includes('\uFFFD'), released)
  })
})

describe('character mode, 16 tokens measured on the source tenant’s prompts', () => {
  it('Qwen3 counts 35 tokens in 166 characters: ⌈16 × 166 ÷ 35⌉ = 76 characters are suspected, 75 are not', () => {
    const { sentinel, events } = sentinelOf('character')
    sentinel.admit('a', false, 'ra', { texts: [contract], tokenIds: null, numTokens: 35 })
    const b = { texts: ['Please quote the paragraph.'], tokenIds: null, numTokens: 6 }
    const answer = (text: string, rid: string) => {
      const check = sentinel.admit('b', false, rid, b)
      for (const c of `Sure: ${text}!`) check.push(c)
      check.finish()
    }
    answer(contract.slice(0, 75), 'rb1')
    assert.deepEqual(events, [])
    answer(contract.slice(0, 76), 'rb2')
    assert.deepEqual(events, [
      {
        kind: 'suspected',
        rid: 'rb2',
        tenant: 'b',
        sourceTenant: 'a',
        runTokens: 16, // ⌊76 × 35 ÷ 166⌋
        runCharacters: 76,
      },
    ])
  })
})
