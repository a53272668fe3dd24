/** The completions endpoint, driven by the official `openai` client over real HTTP against
 *  stand-in prefill and decode workers. */
import assert from 'node:assert/strict'
import { after, before, describe, it } from 'node:test'
import type { Completion } from 'openai/resources/completions'
import { type Harness, bosId, charIds, defaultReplyText, startHarness } from './helpers.js'

describe('POST /v1/completions', () => {
  let h: Harness
  before(async () => {
    h = await startHarness()
  })
  after(() => h.close())

  it('answers a text prompt with a text_completion and exact usage (BOS counted)', async () => {
    const completion = await h.client().completions.create({
      model: 'echo-test',
      prompt: 'Once upon a time',
      max_tokens: 100,
    })
    assert.equal(completion.object, 'text_completion')
    assert.match(completion.id, /^cmpl-[0-9a-f]{32}$/)
    assert.deepEqual(completion.choices, [
      { index: 0, text: defaultReplyText, logprobs: null, finish_reason: 'stop' },
    ])
    const numPrompt = 1 + 'Once upon a time'.length
    assert.deepEqual(completion.usage, {
      prompt_tokens: numPrompt,
      completion_tokens: defaultReplyText.length + 1,
      total_tokens: numPrompt + defaultReplyText.length + 1,
      prompt_tokens_details: { cached_tokens: 0 },
    })
    const generate = h.workers.generateRequests.at(-1)!
    assert.deepEqual(generate.promptTokenIds, [bosId, ...charIds('Once upon a time')])
    assert.equal(generate.maxTokens, 100)
  })

  it('accepts a prompt of token ids as they are, and a one-element prompt list', async () => {
    const ids = charIds('abc')
    const completion = await h
      .client()
      .completions.create({ model: 'echo-test', prompt: ids, max_tokens: 4 })
    assert.equal(completion.usage?.prompt_tokens, 3)
    assert.deepEqual(h.workers.generateRequests.at(-1)!.promptTokenIds, ids)
    assert.equal(completion.choices[0].text, 'Hell')
    assert.equal(completion.choices[0].finish_reason, 'length')

    const listed = await h
      .client()
      .completions.create({ model: 'echo-test', prompt: ['abc'], max_tokens: 1 })
    assert.equal(listed.usage?.prompt_tokens, 4)
  })

  it('streams text_completion chunks, then a usage chunk and [DONE]', async () => {
    const stream = await h.client().completions.create({
      model: 'echo-test',
      prompt: 'Hi',
      stream: true,
      stream_options: { include_usage: true },
    })
    const chunks: Completion[] = []
    for await (const chunk of stream) chunks.push(chunk)
    assert.ok(chunks.every((c) => c.object === 'text_completion' && c.id === chunks[0].id))
    assert.equal(chunks.map((c) => c.choices[0]?.text ?? '').join(''), defaultReplyText)
    assert.deepEqual(
      chunks.flatMap((c) => (c.choices[0]?.finish_reason ? [c.choices[0].finish_reason] : [])),
      ['stop'],
    )
    const last = chunks.at(-1)!
    assert.deepEqual(last.choices, [])
    assert.deepEqual(last.usage, {
      prompt_tokens: 3,
      completion_tokens: defaultReplyText.length + 1,
      total_tokens: 3 + defaultReplyText.length + 1,
      prompt_tokens_details: { cached_tokens: 0 },
    })
  })

  it('ends the text before a stop string', async () => {
    const completion = await h
      .client()
      .completions.create({ model: 'echo-test', prompt: 'Hi', stop: ['lo'] })
    assert.equal(completion.choices[0].text, 'Hel')
    assert.equal(completion.choices[0].finish_reason, 'stop')
    assert.equal(completion.usage?.completion_tokens, 5)
  })

  it('ends the SSE body with data: [DONE]', async () => {
    const res = await h.post('/v1/completions', {
      model: 'echo-test',
      prompt: 'Hi',
      stream: true,
      max_tokens: 2,
    })
    assert.equal(res.status, 200)
    assert.match(res.headers.get('content-type') ?? '', /^text\/event-stream/)
    const body = await res.text()
    const events = body.split('\n\n').filter((e) => e !== '')
    assert.ok(events.every((e) => e.startsWith('data: ')))
    assert.equal(events.at(-1), 'data: [DONE]')
    assert.equal(JSON.parse(events.at(-2)!.slice(6)).choices[0].finish_reason, 'length')
  })

  it('passes logprobs (0..5 alternatives) and the sampling fields to the workers', async () => {
    const before = h.workers.generateRequests.length
    const res = await h.post('/v1/completions', {
      model: 'echo-test',
      prompt: 'Hi',
      max_tokens: 2,
      logprobs: 5,
      top_k: 40,
      min_p: 0.1,
      presence_penalty: 2,
      frequency_penalty: -2,
    })
    // The stand-ins send no log-probabilities: an error, never an answer without them.
    assert.equal(res.status, 500)
    assert.deepEqual(h.workers.generateRequests[before].sampling, {
      temperature: 1,
      topP: 1,
      topK: 40,
      minP: 0.1,
      presencePenalty: 2,
      frequencyPenalty: -2,
      seed: null,
      numLogprobs: 5,
    })
  })

  it('stops after a stop_token_ids token with finish_reason stop, streamed too', async () => {
    const body = {
      model: 'echo-test',
      prompt: 'Hi',
      // vLLM's extension, not in the openai client's types
      stop_token_ids: charIds('l'),
    } as unknown as { model: string; prompt: string }
    const completion = await h.client().completions.create(body)
    assert.equal(completion.choices[0].text, 'Hel')
    assert.equal(completion.choices[0].finish_reason, 'stop')
    assert.equal(completion.usage?.completion_tokens, 3)
    const stream = await h.client().completions.create({ ...body, stream: true })
    let text = ''
    let finish = null
    for await (const chunk of stream) {
      text += chunk.choices[0]?.text ?? ''
      finish = chunk.choices[0]?.finish_reason ?? finish
    }
    assert.deepEqual([text, finish], ['Hel', 'stop'])
  })

  it('refuses logprobs outside 0..5 and out-of-range sampling values with 400 naming the field', async () => {
    const cases: [Record<string, unknown>, string][] = [
      [{ logprobs: 6 }, 'logprobs'],
      [{ logprobs: -1 }, 'logprobs'],
      [{ logprobs: true }, 'logprobs'],
      [{ top_logprobs: 2 }, 'top_logprobs'], // a chat field
      [{ top_k: -3 }, 'top_k'],
      [{ min_p: 2 }, 'min_p'],
      [{ presence_penalty: -3 }, 'presence_penalty'],
      [{ frequency_penalty: 2.5 }, 'frequency_penalty'],
      [{ stop_token_ids: [1000] }, 'stop_token_ids[0]'],
    ]
    for (const [extra, param] of cases) {
      const res = await h.post('/v1/completions', { model: 'echo-test', prompt: 'Hi', ...extra })
      const body = (await res.json()) as { error: { param: string; code: string } }
      assert.equal(res.status, 400, JSON.stringify(extra))
      assert.equal(body.error.code, 'invalid_request', JSON.stringify(extra))
      assert.equal(body.error.param, param, JSON.stringify(extra))
    }
  })
})
