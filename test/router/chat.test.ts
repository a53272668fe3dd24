/** The chat completions endpoint, driven by the official `openai` client over real HTTP against
 *  stand-in prefill and decode workers. */
import assert from 'node:assert/strict'
import { after, before, describe, it } from 'node:test'
import {
  type Harness,
  bosId,
  charIds,
  defaultReplyText,
  eosId,
  keys,
  startHarness,
  testChatTemplate,
} from './helpers.js'

/** Prompt tokens of one user message under the test template: BOS + the rendered text. */
function chatPromptTokens(content: string): number {
  assert.ok(testChatTemplate.includes('<assistant>'))
  return 1 + `<user>${content}\n<assistant>`.length
}

describe('POST /v1/chat/completions', () => {
  let h: Harness
  before(async () => {
    h = await startHarness()
  })
  after(() => h.close())

  it("answers with the decode worker's tokens as text, and exact usage", async () => {
    const completion = await h.client().chat.completions.create({
      model: 'echo-test',
      messages: [{ role: 'user', content: 'Hi there' }],
    })
    assert.equal(completion.object, 'chat.completion')
    assert.match(completion.id, /^chatcmpl-[0-9a-f]{32}$/)
    assert.equal(completion.model, 'echo-test')
    assert.equal(typeof completion.created, 'number')
    assert.deepEqual(completion.choices, [
      {
        index: 0,
        message: { role: 'assistant', content: defaultReplyText, refusal: null },
        logprobs: null,
        finish_reason: 'stop',
      },
    ])
    const numPrompt = chatPromptTokens('Hi there')
    const numCompletion = defaultReplyText.length + 1 // + EOS
    assert.deepEqual(completion.usage, {
      prompt_tokens: numPrompt,
      completion_tokens: numCompletion,
      total_tokens: numPrompt + numCompletion,
      prompt_tokens_details: { cached_tokens: 0 },
    })
  })

  it('sends the workers the tenant, the templated prompt with BOS, and a fresh id and secret', async () => {
    const before = h.workers.generateRequests.length
    await h.client(keys.beta).chat.completions.create({
      model: 'echo-test',
      messages: [
        { role: 'system', content: 'Be brief.' },
        { role: 'user', content: [{ type: 'text', text: 'Hi' }] },
      ],
      max_tokens: 3,
      temperature: 0,
      seed: 7,
    })
    const generate = h.workers.generateRequests[before]
    const prefill = h.workers.prefillRequests.find((p) => p.requestId === generate.requestId)!
    assert.equal(generate.tenant, 'beta')
    assert.deepEqual(generate.promptTokenIds, [
      bosId,
      ...charIds('<system>Be brief.\n<user>Hi\n<assistant>'),
    ])
    assert.equal(generate.maxTokens, 3)
    assert.deepEqual(generate.sampling, { temperature: 0, topP: 1, seed: 7 })
    assert.deepEqual(generate.stopTokenIds, [eosId])
    assert.deepEqual(prefill.promptTokenIds, generate.promptTokenIds)
    assert.equal(prefill.transferSecret, generate.transferSecret)
    assert.equal(prefill.tenant, 'beta')
    const earlier = h.workers.generateRequests.slice(0, before)
    assert.ok(
      earlier.every(
        (g) => g.requestId !== generate.requestId && g.transferSecret !== generate.transferSecret,
      ),
    )
  })

  it('defaults max_tokens to the rest of the context window', async () => {
    const before = h.workers.generateRequests.length
    await h.client().chat.completions.create({
      model: 'echo-test',
      messages: [{ role: 'user', content: 'abc' }],
    })
    const window = h.router.config.contextWindow
    assert.equal(h.workers.generateRequests[before].maxTokens, window - chatPromptTokens('abc'))
  })

  it('stops at max_tokens with finish_reason length', async () => {
    const completion = await h.client().chat.completions.create({
      model: 'echo-test',
      messages: [{ role: 'user', content: 'Hi' }],
      max_tokens: 5,
    })
    assert.equal(completion.choices[0].message.content, defaultReplyText.slice(0, 5))
    assert.equal(completion.choices[0].finish_reason, 'length')
    assert.equal(completion.usage?.completion_tokens, 5)
  })

  it('streams chunks whose deltas add up to the text, then a usage chunk and [DONE]', async () => {
    const stream = await h.client().chat.completions.create({
      model: 'echo-test',
      messages: [{ role: 'user', content: 'Hi there' }],
      stream: true,
      stream_options: { include_usage: true },
    })
    const chunks = []
    for await (const chunk of stream) chunks.push(chunk)
    const first = chunks[0]
    assert.equal(first.object, 'chat.completion.chunk')
    assert.deepEqual(first.choices[0].delta, { role: 'assistant', content: '' })
    assert.ok(chunks.every((c) => c.id === first.id && c.created === first.created))
    const text = chunks.map((c) => c.choices[0]?.delta.content ?? '').join('')
    assert.equal(text, defaultReplyText)
    const finishes = chunks
      .map((c) => c.choices[0]?.finish_reason ?? null)
      .filter((f) => f !== null)
    assert.deepEqual(finishes, ['stop'])
    const last = chunks.at(-1)!
    assert.deepEqual(last.choices, [])
    const numPrompt = chatPromptTokens('Hi there')
    assert.deepEqual(last.usage, {
      prompt_tokens: numPrompt,
      completion_tokens: defaultReplyText.length + 1,
      total_tokens: numPrompt + defaultReplyText.length + 1,
      prompt_tokens_details: { cached_tokens: 0 },
    })
    assert.ok(chunks.slice(0, -1).every((c) => c.usage === null))
  })

  it('streams without usage fields unless asked', async () => {
    const stream = await h.client().chat.completions.create({
      model: 'echo-test',
      messages: [{ role: 'user', content: 'x' }],
      stream: true,
      max_tokens: 2,
    })
    const chunks = []
    for await (const chunk of stream) chunks.push(chunk)
    assert.ok(chunks.every((c) => !('usage' in c)))
    assert.equal(chunks.at(-1)!.choices[0].finish_reason, 'length')
  })

  it('ends at a stop string, which is not part of the text', async () => {
    const completion = await h.client().chat.completions.create({
      model: 'echo-test',
      messages: [{ role: 'user', content: 'Hi' }],
      stop: ['zzz', ', ten'],
    })
    assert.equal(completion.choices[0].message.content, 'Hello')
    assert.equal(completion.choices[0].finish_reason, 'stop')
    assert.equal(completion.usage?.completion_tokens, 'Hello, ten'.length)
  })

  it('never streams part of a stop string', async () => {
    const stream = await h.client().chat.completions.create({
      model: 'echo-test',
      messages: [{ role: 'user', content: 'Hi' }],
      stop: 'tenant!',
      stream: true,
    })
    let text = ''
    let finish = null
    for await (const chunk of stream) {
      text += chunk.choices[0]?.delta.content ?? ''
      finish = chunk.choices[0]?.finish_reason ?? finish
    }
    assert.equal(text, 'Hello, ')
    assert.equal(finish, 'stop')
  })
})
