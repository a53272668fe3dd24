/** The router's response bodies match OpenAI's published OpenAPI description (the schemas named
 *  below), checked by Ajv (JSON Schema 2020-12, the dialect of OpenAPI 3.1) with `ajv-formats`;
 *  `$ref`s resolve into the spec's own component schemas. Skipped when the spec file is not present
 *  (set KVFENCE_OPENAI_SPEC to its path). */
import assert from 'node:assert/strict'
import { after, before, describe, it } from 'node:test'
import type { ValidateFunction } from 'ajv/dist/2020.js'
import { hasSpec, loadValidators, specPath, specSkip, violations } from '../../helpers/openapi.js'
import { CompletionLogprobsBuilder, chatLogprobs } from '../../../src/router/api/logprobs.js'
import {
  chatChunk,
  chatCompletion,
  textCompletion,
  usageOf,
} from '../../../src/router/api/responses.js'
import { type Harness, keys, startHarness } from '../helpers.js'

// Each test is skipped (and counted as skipped, never as passed) when the spec is not there.
const skip = specSkip

describe('responses match the OpenAI OpenAPI description', () => {
  let h: Harness
  let schema: (name: string) => ValidateFunction
  const check = (name: string, value: unknown) =>
    assert.deepEqual(violations(schema(name), value), [], name)
  const sseEvents = async (res: Response) =>
    (await res.text())
      .split('\n\n')
      .filter((e) => e !== '' && e !== 'data: [DONE]')
      .map((e) => JSON.parse(e.slice('data: '.length)) as unknown)

  before(async () => {
    if (!hasSpec) return
    schema = loadValidators(specPath)
    h = await startHarness({ decodeErrorAfterTokens: undefined })
  })
  after(() => h?.close())

  it('validates a known-bad body as bad (the validator works)', { skip }, () => {
    const errors = violations(schema('CreateCompletionResponse'), {
      id: 'x',
      object: 'chat.completion',
      created: 1.5,
      choices: [{ index: 0, text: 'a', finish_reason: 'done' }],
    })
    assert.ok(errors.includes(" must have required property 'model'"), errors.join('; '))
    assert.ok(errors.includes('/object must be equal to one of the allowed values'))
    assert.ok(errors.includes('/created must be integer'))
    assert.ok(
      errors.includes('/choices/0/finish_reason must be equal to one of the allowed values'),
    )
    assert.ok(errors.includes("/choices/0 must have required property 'logprobs'"))
    // nullable beside a type: null passes where the spec allows it, and only there.
    const chat = schema('CreateChatCompletionStreamResponse')
    const chunk = (finishReason: unknown) => ({
      id: 'c',
      object: 'chat.completion.chunk',
      created: 1,
      model: 'm',
      choices: [{ index: 0, delta: {}, finish_reason: finishReason }],
    })
    assert.deepEqual(violations(chat, chunk(null)), [])
    assert.notDeepEqual(violations(chat, { ...chunk(null), created: null }), [])
  })

  it('chat.completion and chat.completion.chunk', { skip }, async () => {
    const body = { model: 'echo-test', messages: [{ role: 'user', content: 'Hi' }], max_tokens: 4 }
    check('CreateChatCompletionResponse', await (await h.post('/v1/chat/completions', body)).json())
    const chunks = await sseEvents(
      await h.post('/v1/chat/completions', {
        ...body,
        stream: true,
        stream_options: { include_usage: true },
      }),
    )
    assert.ok(chunks.length > 3)
    for (const chunk of chunks) check('CreateChatCompletionStreamResponse', chunk)
  })

  it('text_completion, plain and streamed', { skip }, async () => {
    const body = { model: 'echo-test', prompt: 'Hi', max_tokens: 4 }
    check('CreateCompletionResponse', await (await h.post('/v1/completions', body)).json())
    const chunks = await sseEvents(
      await h.post('/v1/completions', {
        ...body,
        stream: true,
        stream_options: { include_usage: true },
      }),
    )
    // Known gap in the spec: its legacy completion schema is shared by streamed chunks, yet OpenAI
    // (and vLLM) send `finish_reason: null` on every chunk but the last one of a choice.
    const completion = schema('CreateCompletionResponse')
    for (const chunk of chunks) {
      const isLast = (chunk as { choices: { finish_reason: unknown }[] }).choices.every(
        (c) => c.finish_reason !== null,
      )
      if (isLast) check('CreateCompletionResponse', chunk)
      else {
        const withReason = structuredClone(chunk) as { choices: { finish_reason: unknown }[] }
        for (const choice of withReason.choices) choice.finish_reason = 'length'
        assert.deepEqual(violations(completion, withReason), [], 'a mid-stream chunk')
      }
    }
    const finishes = chunks.flatMap((c) => (c as { choices: { finish_reason: unknown }[] }).choices)
    assert.equal(finishes.at(-1)!.finish_reason, 'length')
  })

  it('the model list and error bodies', { skip }, async () => {
    const models = await fetch(`${h.router.url}/v1/models`, {
      headers: { authorization: `Bearer ${keys.alpha}` },
    })
    check('ListModelsResponse', await models.json())
    check(
      'ErrorResponse',
      await (await h.post('/v1/completions', { model: 'echo-test', prompt: '' })).json(),
    )
    check(
      'ErrorResponse',
      await (await h.post('/v1/completions', {}, { authorization: 'Bearer nope' })).json(),
    )
  })

  // Real workers' logprobs are checked against the spec in test/e2e/sampling.test.ts; here the
  // router's builders, with the edge cases a small model rarely produces.
  it('bodies with logprobs, chat and completions, whole and chunked', { skip }, () => {
    const texts = ['é', '</s>', '__proto__', 'a']
    const tokenText = (id: number) => texts[id]
    const entries = [
      { tokenId: 0, logprobs: { logprob: -0.25, top: [{ tokenId: 0, logprob: -0.25 }] } },
      { tokenId: 2, logprobs: { logprob: -9999, top: [] } },
      {
        tokenId: 1,
        logprobs: {
          logprob: -1.5,
          top: [
            { tokenId: 3, logprob: -0.5 },
            { tokenId: 1, logprob: -1.5 },
          ],
        },
      },
    ]
    const h1 = { id: 'chatcmpl-1', created: 1, model: 'm' }
    const chat = chatLogprobs(entries, tokenText)
    assert.deepEqual(chat.content[0].bytes, [0xc3, 0xa9])
    check('CreateChatCompletionResponse', chatCompletion(h1, 'é', 'stop', usageOf(3, 3), chat))
    check('CreateChatCompletionStreamResponse', chatChunk(h1, { content: 'é' }, null, true, chat))
    check('CreateChatCompletionStreamResponse', chatChunk(h1, {}, 'stop', false, chat))
    const completion = new CompletionLogprobsBuilder(tokenText).next(entries)
    assert.deepEqual(completion.text_offset, [0, 1, 10])
    assert.equal(Object.getPrototypeOf(completion.top_logprobs[1]), Object.prototype)
    assert.deepEqual(Object.keys(completion.top_logprobs[1]), ['__proto__'])
    check(
      'CreateCompletionResponse',
      textCompletion({ ...h1, id: 'cmpl-1' }, 'é', 'stop', usageOf(3, 3), completion),
    )
  })
})
