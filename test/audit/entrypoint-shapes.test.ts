/** planTrials, and parseEntrypointAnswer against answers in each API's documented shape: the text, prompt and
 *  cached-token counts read from each, and what is not an answer. Bodies written from the public
 *  references: Anthropic's Messages API (`usage.input_tokens` counts only the tokens after the
 *  last cache read or write: the total is input + cache_read + cache_creation), SGLang's
 *  `/generate` (`meta_info.prompt_tokens`, `cached_tokens`), llama.cpp's `/completion`
 *  (`timings.prompt_n` counts the tokens evaluated, `cache_n` those reused), OpenAI's Responses
 *  (`usage.input_tokens_details.cached_tokens`; streamed `response.output_text.delta` events). */
import assert from 'node:assert/strict'
import { test } from 'node:test'
import fc from 'fast-check'
import {
  entrypointNames,
  parseEntrypointAnswer,
  type EntrypointName,
} from '../../src/audit/probes/entrypoint-shapes.js'
import { planTrials } from '../../src/audit/probes/entrypoints.js'
import type { HttpResult } from '../../src/audit/target.js'

function http(body: unknown, status = 200, contentType = 'application/json'): HttpResult {
  return {
    status,
    failure: null,
    failureDetail: null,
    contentType,
    body: typeof body === 'string' ? body : JSON.stringify(body),
    firstByteMs: 1,
    requestNumber: 1,
    atMs: 1,
  }
}
const read = (name: EntrypointName, h: HttpResult) => {
  const a = parseEntrypointAnswer(name, h)
  return [a.isAnswered, a.text, a.promptTokens, a.cachedTokens]
}

test('Anthropic messages: text blocks joined; prompt = input + cache read + cache creation', () => {
  const body = {
    id: 'msg_01',
    type: 'message',
    role: 'assistant',
    content: [
      { type: 'text', text: 'Hello ' },
      { type: 'tool_use', id: 't', name: 'x', input: {} },
      { type: 'text', text: 'there' },
    ],
    stop_reason: 'max_tokens',
    usage: {
      input_tokens: 21,
      cache_creation_input_tokens: 0,
      cache_read_input_tokens: 188,
      output_tokens: 8,
    },
  }
  assert.deepEqual(read('messages', http(body)), [true, 'Hello there', 209, 188])
})

test('SGLang /generate and llama.cpp /completion: text and counts; llama.cpp without timings falls back to tokens_cached', () => {
  const sglang = {
    text: ' w0 w1',
    meta_info: {
      id: 'r1',
      prompt_tokens: 120,
      cached_tokens: 96,
      completion_tokens: 2,
      finish_reason: { type: 'length', length: 2 },
    },
  }
  assert.deepEqual(read('generate', http(sglang)), [true, ' w0 w1', 120, 96])
  const llama = {
    content: 'ok',
    tokens_evaluated: 120,
    tokens_cached: 119,
    timings: { prompt_n: 24, cache_n: 96, predicted_n: 2 },
    stop: true,
  }
  assert.deepEqual(read('completion', http(llama)), [true, 'ok', 120, 96])
  const { timings: _t, ...old } = llama
  assert.deepEqual(read('completion', http(old)), [true, 'ok', 120, 119])
})

test('Responses, JSON and streamed: output_text parts, cached tokens, the function call and the id', () => {
  const response = {
    id: 'resp_1',
    object: 'response',
    status: 'completed',
    output: [
      {
        type: 'function_call',
        id: 'fc_1',
        call_id: 'call_9',
        name: 'lookup',
        arguments: '{"id":"7"}',
        status: 'completed',
      },
      {
        type: 'message',
        role: 'assistant',
        content: [{ type: 'output_text', text: 'a b', annotations: [] }],
      },
    ],
    usage: {
      input_tokens: 50,
      input_tokens_details: { cached_tokens: 32 },
      output_tokens: 2,
      total_tokens: 52,
    },
  }
  const json = parseEntrypointAnswer('responses', http(response))
  assert.deepEqual(
    [json.isAnswered, json.text, json.promptTokens, json.cachedTokens, json.responseId],
    [true, 'a b', 50, 32, 'resp_1'],
  )
  assert.deepEqual(json.functionCalls, [
    { callId: 'call_9', name: 'lookup', arguments: '{"id":"7"}' },
  ])
  const events = [
    { type: 'response.created', response: { ...response, status: 'in_progress', output: [] } },
    { type: 'response.output_text.delta', output_index: 0, content_index: 0, delta: 'a ' },
    { type: 'response.output_text.delta', output_index: 0, content_index: 0, delta: 'b' },
    { type: 'response.completed', response },
  ]
  const sse = events.map((e) => `event: ${e.type}\ndata: ${JSON.stringify(e)}\n\n`).join('')
  assert.deepEqual(read('responses-stream', http(sse, 200, 'text/event-stream')), [
    true,
    'a b',
    50,
    32,
  ])
  // A stream that ends without its completion event, or with an error event, is no answer.
  const cut = events
    .slice(0, 3)
    .map((e) => `data: ${JSON.stringify(e)}\n\n`)
    .join('')
  assert.equal(
    parseEntrypointAnswer('responses-stream', http(cut, 200, 'text/event-stream')).isAnswered,
    false,
  )
  const failed = `data: ${JSON.stringify({ type: 'error', message: 'boom' })}\n\n`
  assert.equal(
    parseEntrypointAnswer('responses-stream', http(failed, 200, 'text/event-stream')).isAnswered,
    false,
  )
})

test('not answers: a 404, a 2xx of another shape, a body cut at its cap', () => {
  assert.equal(
    parseEntrypointAnswer('messages', http({ detail: 'Not Found' }, 404)).isAnswered,
    false,
  )
  assert.equal(parseEntrypointAnswer('generate', http({ choices: [] })).isAnswered, false)
  const truncated = { ...http({ text: 'x', meta_info: {} }), failure: 'truncated' as const }
  assert.equal(parseEntrypointAnswer('generate', truncated).isAnswered, false)
})

test('planTrials (property): a same-path trial on every served entrypoint, then one from the first served to each other; 3 requests each', () => {
  fc.assert(
    fc.property(fc.subarray([...entrypointNames]), (served) => {
      const trials = planTrials(served)
      assert.deepEqual(trials, [
        ...served.map((e) => [e, e]),
        ...served.slice(1).map((e) => [served[0], e]),
      ])
      assert.equal(trials.length, served.length === 0 ? 0 : 2 * served.length - 1)
    }),
  )
})
