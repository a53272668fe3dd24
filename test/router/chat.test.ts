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
  waitFor,
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
    assert.deepEqual(generate.sampling, {
      temperature: 0,
      topP: 1,
      topK: null,
      minP: 0,
      presencePenalty: 0,
      frequencyPenalty: 0,
      seed: 7,
      numLogprobs: null,
    })
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

  it('passes top_k, min_p, the penalties, the seed and logprobs to the workers as validated', async () => {
    /** What the workers were asked for; the reply's status (the stand-ins send no
     *  log-probabilities, so a request asking for them fails with 500, never answers without). */
    const ask = async (extra: Record<string, unknown>, status = 200) => {
      const before = h.workers.generateRequests.length
      const res = await h.post('/v1/chat/completions', {
        model: 'echo-test',
        messages: [{ role: 'user', content: 'Hi' }],
        max_tokens: 2,
        ...extra,
      })
      assert.equal(res.status, status, await res.text())
      const generate = h.workers.generateRequests[before]
      const prefill = h.workers.prefillRequests.find((p) => p.requestId === generate.requestId)!
      assert.deepEqual(prefill.sampling, generate.sampling)
      return generate
    }
    const generate = await ask(
      {
        temperature: 0.7,
        top_p: 0.9,
        top_k: 5,
        min_p: 0.05,
        presence_penalty: -0.5,
        frequency_penalty: 1.5,
        seed: 11,
        logprobs: true,
        top_logprobs: 3,
      },
      500,
    )
    assert.deepEqual(generate.sampling, {
      temperature: 0.7,
      topP: 0.9,
      topK: 5,
      minP: 0.05,
      presencePenalty: -0.5,
      frequencyPenalty: 1.5,
      seed: 11,
      numLogprobs: 3,
    })
    // vLLM's spellings of "no top-k": -1 and 0; logprobs without top_logprobs: the token's own only.
    assert.equal((await ask({ top_k: -1 })).sampling.topK, null)
    assert.equal((await ask({ top_k: 0 })).sampling.topK, null)
    assert.equal((await ask({ logprobs: true }, 500)).sampling.numLogprobs, 0)
    assert.equal((await ask({ logprobs: false, top_logprobs: 0 })).sampling.numLogprobs, null)
  })

  it('stops after a stop_token_ids token (kept in the text, as vLLM does) with finish_reason stop', async () => {
    const comma = charIds(',')[0]
    const before = h.workers.generateRequests.length
    const completion = await h.client().chat.completions.create({
      model: 'echo-test',
      messages: [{ role: 'user', content: 'Hi' }],
      // @ts-expect-error vLLM's extension, not in the openai client's types
      stop_token_ids: [comma, 90],
    })
    assert.deepEqual(h.workers.generateRequests[before].stopTokenIds, [eosId, comma, 90])
    assert.equal(completion.choices[0].message.content, 'Hello,')
    assert.equal(completion.choices[0].finish_reason, 'stop')
    assert.equal(completion.usage?.completion_tokens, 'Hello,'.length)
  })

  it('ignore_eos (vLLM/SGLang): EOS is not a stop token; the output runs on to max_tokens', async () => {
    const before = h.workers.generateRequests.length
    const completion = await h.client().chat.completions.create({
      model: 'echo-test',
      messages: [{ role: 'user', content: 'Hi' }],
      max_tokens: 15,
      // @ts-expect-error vLLM's and SGLang's extension, not in the openai client's types
      ignore_eos: true,
      best_of: 1, // sent by SGLang's serving benchmark: accepted at its no-op value
    })
    assert.deepEqual(h.workers.generateRequests[before].stopTokenIds, [])
    // The stand-in's 14 characters, then EOS counted as a generated token (a special token: no
    // text), then max_tokens: finish_reason length.
    assert.equal(completion.choices[0].message.content, defaultReplyText)
    assert.equal(completion.usage?.completion_tokens, 15)
    assert.equal(completion.choices[0].finish_reason, 'length')
    // ignore_eos: false is the default: EOS stops the output.
    await h.client().chat.completions.create({
      model: 'echo-test',
      messages: [{ role: 'user', content: 'Hi' }],
      // @ts-expect-error as above
      ignore_eos: false,
    })
    assert.deepEqual(h.workers.generateRequests[before + 1].stopTokenIds, [eosId])
  })

  it('refuses out-of-range sampling values with 400 naming the field', async () => {
    const cases: [Record<string, unknown>, string][] = [
      [{ top_k: -2 }, 'top_k'],
      [{ top_k: 1.5 }, 'top_k'],
      [{ min_p: 1.01 }, 'min_p'],
      [{ min_p: -0.1 }, 'min_p'],
      [{ presence_penalty: 2.5 }, 'presence_penalty'],
      [{ frequency_penalty: -2.01 }, 'frequency_penalty'],
      [{ logprobs: true, top_logprobs: 21 }, 'top_logprobs'],
      [{ logprobs: true, top_logprobs: -1 }, 'top_logprobs'],
      [{ top_logprobs: 2 }, 'top_logprobs'],
      [{ logprobs: 1 }, 'logprobs'],
      [{ stop_token_ids: [5, -1] }, 'stop_token_ids[1]'],
      [{ stop_token_ids: 5 }, 'stop_token_ids'],
      // The test vocabulary has ids 0..99.
      [{ stop_token_ids: [100] }, 'stop_token_ids[0]'],
      [{ seed: 0.5 }, 'seed'],
      [{ ignore_eos: 'yes' }, 'ignore_eos'],
      [{ best_of: 2 }, 'best_of'],
    ]
    const numInternal = h.workers.numInternalRequests()
    for (const [extra, param] of cases) {
      await assert.rejects(
        h.client().chat.completions.create({
          model: 'echo-test',
          messages: [{ role: 'user', content: 'Hi' }],
          ...extra,
        }),
        (err: unknown) => {
          const e = err as { status?: number; param?: string; code?: string }
          assert.equal(e.status, 400, JSON.stringify(extra))
          assert.equal(e.code, 'invalid_request', JSON.stringify(extra))
          assert.equal(e.param, param, JSON.stringify(extra))
          return true
        },
      )
    }
    assert.equal(
      h.workers.numInternalRequests(),
      numInternal,
      'no refused request reached a worker',
    )
  })

  it('closes the worker requests when the output ends at the very first token (G8)', async () => {
    const before = h.workers.generateRequests.length
    const completion = await h.client().chat.completions.create({
      model: 'echo-test',
      messages: [{ role: 'user', content: 'Hi' }],
      stop: 'H',
      max_tokens: 50,
    })
    assert.equal(completion.choices[0].message.content, '')
    assert.equal(completion.choices[0].finish_reason, 'stop')
    assert.equal(completion.usage?.completion_tokens, 1)
    const rid = h.workers.generateRequests[before].requestId
    await waitFor(() => h.workers.decodeClosedEarly.includes(rid))
  })
})
