/** A chat body of many tiny messages (a megabyte holds tens of thousands) is bounded before the
 *  schema validates them, and a chat of more than a few messages is tokenized in the tokenizer
 *  pool's threads, whatever its characters: one tenant's big body never holds the event loop
 *  another tenant's small request needs. The bound is OpenAI's (and Azure OpenAI's): 2048
 *  messages; any body, 8192 JSON objects and arrays, counted before it is parsed. No timing: where the work runs is observed on the main thread's tokenizer. */
import assert from 'node:assert/strict'
import { after, before, describe, it } from 'node:test'
import { rmSync } from 'node:fs'
import { type Tokenizer, loadTokenizer } from '../../../src/model/tokenizer.js'
import { maxJsonContainers } from '../../../src/router/api/http.js'
import {
  type ParsedChatRequest,
  maxChatContentParts,
  maxChatMessages,
  parseChatRequest,
} from '../../../src/router/api/schemas.js'
import { checkedPromptTokenIds } from '../../../src/router/tokenize/prompt-ids.js'
import {
  createTokenizerPool,
  inlineMaxMessages,
} from '../../../src/router/tokenize/tokenizer-pool.js'
import { type Harness, startHarness, writeTestTokenizer } from '../helpers.js'
import { inProcessTokenizer } from '../../helpers/in-process-tokenizer.js'

const emptyMessages = (n: number) =>
  Array.from({ length: n }, () => ({ role: 'user', content: '' }))

interface ErrorBody {
  error: { code: string; param: string | null; message: string }
}

describe('the size of a chat body', () => {
  let h: Harness
  before(async () => {
    h = await startHarness()
  })
  after(async () => {
    await h.close()
  })

  it('is bounded at 2048 messages, with a 400 naming messages', async () => {
    assert.equal(maxChatMessages, 2048)
    const res = await h.post('/v1/chat/completions', {
      model: 'echo-test',
      messages: emptyMessages(2049),
    })
    assert.equal(res.status, 400)
    const body = (await res.json()) as ErrorBody
    assert.equal(body.error.code, 'invalid_request')
    assert.equal(body.error.param, 'messages')
    assert.equal(
      body.error.message,
      "Invalid 'messages': array too long. Expected an array with maximum length 2048, but got an array with length 2049 instead.",
    )
    assert.equal(h.workers.numInternalRequests(), 0)
  })

  it('refuses a body of more than 8192 JSON objects and arrays before parsing it', async () => {
    assert.equal(maxJsonContainers, 8192)
    // Over 64 KB, so that it is counted; 10,000 empty objects as messages, 10,002 in all.
    const body = JSON.stringify({
      model: 'echo-test',
      user: 'u'.repeat(70_000),
      messages: Array.from({ length: 10_000 }, () => ({})),
    })
    const res = await h.post('/v1/chat/completions', body)
    assert.equal(res.status, 400)
    const error = ((await res.json()) as ErrorBody).error
    assert.equal(error.code, 'invalid_request')
    assert.equal(error.message, 'the request body holds more than 8192 JSON objects and arrays')
    assert.equal(h.workers.numInternalRequests(), 0)
  })

  it('counts no brace or bracket inside a string, escaped quotes included', async () => {
    // 30,000 × `"{[` in a string: 90,000 would-be containers behind escaped quotes.
    const res = await h.post('/v1/chat/completions', {
      model: 'echo-test',
      user: '"{['.repeat(30_000),
      messages: [{ role: 'user', content: 'Hi' }],
      max_tokens: 3,
    })
    assert.equal(res.status, 200)
  })

  it('lets 2048 messages through to the window check', async () => {
    // The test template renders each empty message as `<user>\n`: 7 tokens, so 2048 messages are
    // 14,336 tokens and the BOS, over the 4,096-token window.
    const res = await h.post('/v1/chat/completions', {
      model: 'echo-test',
      messages: emptyMessages(2048),
    })
    assert.equal(res.status, 400)
    const body = (await res.json()) as ErrorBody
    assert.equal(body.error.code, 'context_length_exceeded')
    assert.equal(body.error.param, 'messages')
  })

  it('is bounded at 2048 text parts in all, naming the message past the bound', async () => {
    assert.equal(maxChatContentParts, 2048)
    const parts = (n: number) => Array.from({ length: n }, () => ({ type: 'text', text: 'a' }))
    const res = await h.post('/v1/chat/completions', {
      model: 'echo-test',
      messages: [
        { role: 'user', content: parts(2000) },
        { role: 'user', content: parts(49) },
      ],
    })
    assert.equal(res.status, 400)
    const body = (await res.json()) as ErrorBody
    assert.equal(body.error.code, 'invalid_request')
    assert.equal(body.error.param, 'messages[1].content')
  })
})

/** `tokenizer` (frozen), as a copy whose methods count the calls made to them. */
function counting(tokenizer: Tokenizer): { tokenizer: Tokenizer; numCalls: () => number } {
  let numCalls = 0
  const copy: Record<string, unknown> = {}
  for (const key of Object.keys(tokenizer)) {
    const value: unknown = tokenizer[key as keyof Tokenizer]
    copy[key] =
      typeof value === 'function'
        ? (...args: unknown[]) => {
            numCalls++
            return (value as (...a: unknown[]) => unknown).apply(tokenizer, args)
          }
        : value
  }
  return { tokenizer: copy as unknown as Tokenizer, numCalls: () => numCalls }
}

describe('where a chat prompt is tokenized', () => {
  const dir = writeTestTokenizer()
  const reference = loadTokenizer(dir)
  const chatOf = (numMessages: number): ParsedChatRequest =>
    parseChatRequest({
      model: 'echo-test',
      messages: Array.from({ length: numMessages }, () => ({ role: 'user', content: '' })),
    })
  after(() => rmSync(dir, { recursive: true, force: true }))

  it(`inline up to ${inlineMaxMessages} messages, by a pool member (not the main tokenizer) past that even with no characters`, async () => {
    assert.equal(inlineMaxMessages, 8)
    const main = counting(loadTokenizer(dir))
    const pool = createTokenizerPool({
      modelDir: dir,
      startTokenizer: inProcessTokenizer,
      tokenizer: main.tokenizer,
      numProcesses: 1,
    })
    try {
      const signal = new AbortController().signal
      const few = chatOf(8)
      assert.deepEqual(
        [...(await pool.tokenize(few, 'alpha', signal)).ids!],
        checkedPromptTokenIds(reference, few),
      )
      const numInline = main.numCalls()
      assert.ok(numInline > 0, 'eight messages are tokenized inline')
      // 2048 empty messages: `<user>\n` each (7 tokens) after the BOS.
      const many = chatOf(2048)
      const { numTokens, ids } = await pool.tokenize(many, 'alpha', signal)
      assert.equal(numTokens, 1 + 2048 * 7 + '<assistant>'.length)
      assert.deepEqual([...ids!], checkedPromptTokenIds(reference, many))
      assert.equal(main.numCalls(), numInline, 'the main thread tokenized none of the 2048')
    } finally {
      await pool.close()
    }
  })
})

describe('the messages of a chat body, parsed without the schema when plain', () => {
  it('keeps each plain message as given, name included', () => {
    const parsed = parseChatRequest({
      model: 'echo-test',
      messages: [
        { role: 'system', content: 'Be brief.' },
        { role: 'user', content: 'Hi', name: 'ann' },
        { content: '', role: 'assistant' },
      ],
    })
    assert.deepEqual(parsed.messages, [
      { role: 'system', content: 'Be brief.' },
      { role: 'user', content: 'Hi', name: 'ann' },
      { role: 'assistant', content: '' },
    ])
  })

  it('leaves any other message to the schema, which names the field at fault', () => {
    const faultOf = (message: object) => {
      try {
        parseChatRequest({
          model: 'echo-test',
          messages: [{ role: 'user', content: 'Hi' }, message],
        })
      } catch (err) {
        return (err as { param: string | null }).param
      }
      return 'accepted'
    }
    assert.equal(faultOf({ role: 'user', content: 'Hi', name: null }), 'messages[1].name')
    assert.equal(faultOf({ role: 'wizard', content: 'Hi' }), 'messages[1].role')
    assert.equal(faultOf({ role: 'user', content: 'Hi', nmae: 'ann' }), 'messages[1].nmae')
    assert.equal(faultOf({ role: 'user' }), 'messages[1].content')
    assert.equal(faultOf({ role: 'user', content: [{ type: 'text', text: 'a' }] }), 'accepted')
  })
})
