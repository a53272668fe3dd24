/** The Responses API through the gateway: the router (in process, real HTTP, the `openai` client)
 *  in front of the stand-in engines of test/helpers/engines.ts, whose every answer is `w0 w1 …`
 *  with finish reason `length`. Each Responses request reaches the engine as a streamed chat
 *  completion carrying the tenant's `cache_salt` and the router's id; the answer is rebuilt in the
 *  Responses shape (checked against OpenAI's OpenAPI description); a continued response sends
 *  the stored conversation; its input items are listed to their tenant alone; and the response sentinel checks the Responses path as it does chat:
 *  in block mode an answer carrying another tenant's recent prompt is withheld. */
import assert from 'node:assert/strict'
import { after, before, describe, it } from 'node:test'
import OpenAI from 'openai'
import { startRouter, type RunningRouter } from '../../../src/router/start.js'
import type { SentinelMode } from '../../../src/router/sentinel/sentinel.js'
import { apiKeyDigest } from '../../../src/router/tenants/tenants.js'
import {
  type Engine,
  type EngineKind,
  engineReplyText,
  startEngine,
} from '../../helpers/engines.js'
import { openaiClient } from '../../helpers/cluster.js'
import { loadValidators, specSkip, violations } from '../../helpers/openapi.js'
import { captureLogs, keys } from '../helpers.js'

/** 20 words, 70 characters: `w0 w1 … w19 `. */
const reply = engineReplyText(20)

async function routerFor(engine: Engine, mode: SentinelMode) {
  const logs = captureLogs()
  const router = await startRouter({
    gateway: { kind: engine.kind, url: engine.url, discoveryIntervalMs: 0 },
    modelName: 'served',
    tenants: [
      { name: 'alpha', keySha256: apiKeyDigest(keys.alpha) },
      { name: 'beta', keySha256: apiKeyDigest(keys.beta) },
    ],
    sentinel: { mode },
    port: 0,
    log: logs.log,
  })
  return { router, logs }
}

// SGLang counts a chat prompt only with a local tokenizer (tokenizerDir); vLLM and llama.cpp
// count it themselves.
for (const kind of ['vllm', 'llamacpp'] as EngineKind[]) {
  describe(`Responses through the gateway (${kind})`, { skip: specSkip }, () => {
    let engine: Engine
    let router: RunningRouter
    let validator: ReturnType<typeof loadValidators>
    const check = (schema: string, value: unknown) =>
      assert.deepEqual(violations(validator(schema), value), [], schema)
    before(async () => {
      validator = loadValidators()
      engine = await startEngine(kind, { poolTokens: 4096, maxModelLen: 4096, numTokens: 20 })
      ;({ router } = await routerFor(engine, 'observe'))
    })
    after(async () => {
      await router?.close()
      await engine?.close()
    })

    it("sends the engine chat with the tenant's salt, and rebuilds the Response", async () => {
      const client = openaiClient(router.url, keys.alpha)
      const first = engine.completions.length
      const response = await client.responses.create({
        model: 'served',
        instructions: 'Be brief',
        input: 'Hello there',
        max_output_tokens: 20,
      })
      const { output_text: _, ...body } = response as unknown as Record<string, unknown>
      check('Response', body)
      assert.equal(response.output_text, reply)
      // The engine finished with `length`: the response is incomplete, as OpenAI's would be.
      assert.equal(response.status, 'incomplete')
      const sent = engine.completions.slice(first)
      assert.equal(sent.length, 1)
      assert.deepEqual(sent[0].messages, [
        { role: 'system', content: 'Be brief' },
        { role: 'user', content: 'Hello there' },
      ])
      assert.equal(sent[0].max_tokens, 20)
      assert.equal(sent[0].stream, true)
      const saltAlpha = sent[0].cache_salt
      assert.equal(typeof saltAlpha, 'string')
      await openaiClient(router.url, keys.beta).responses.create({ model: 'served', input: 'Hi' })
      assert.notEqual(engine.completions.at(-1)?.cache_salt, saltAlpha)

      // Continued: the stored conversation goes to the engine; streamed events are valid.
      const stream = await client.responses.create({
        model: 'served',
        input: 'More',
        previous_response_id: response.id,
        stream: true,
      })
      let text = ''
      for await (const event of stream) {
        check('ResponseStreamEvent', event)
        if (event.type === 'response.output_text.delta') text += event.delta
      }
      assert.equal(text, reply)
      assert.deepEqual(engine.completions.at(-1)?.messages, [
        { role: 'user', content: 'Hello there' },
        { role: 'assistant', content: reply },
        { role: 'user', content: 'More' },
      ])
      // Beta cannot fetch or continue alpha's.
      const beta = openaiClient(router.url, keys.beta)
      const err = await beta.responses.retrieve(response.id).then(
        () => null,
        (e: unknown) => e,
      )
      assert.ok(err instanceof OpenAI.NotFoundError)
      // Its input items: the request's own input (instructions are no item), to alpha alone.
      const listed = await client.responses.inputItems.list(response.id)
      assert.deepEqual(
        listed.data.map(({ id: _, ...item }) => item),
        [
          {
            type: 'message',
            status: 'completed',
            role: 'user',
            content: [{ type: 'input_text', text: 'Hello there' }],
          },
        ],
      )
      const foreign = await beta.responses.inputItems.list(response.id).then(
        () => null,
        (e: unknown) => e,
      )
      assert.ok(foreign instanceof OpenAI.NotFoundError)
    })
  })
}

describe('the response sentinel on the Responses path (gateway, block mode)', () => {
  let engine: Engine
  let router: RunningRouter
  let logs: ReturnType<typeof captureLogs>
  before(async () => {
    engine = await startEngine('vllm', { poolTokens: 4096, maxModelLen: 4096, numTokens: 20 })
    ;({ router, logs } = await routerFor(engine, 'block'))
  })
  after(async () => {
    await router?.close()
    await engine?.close()
  })

  it("withholds beta's answer carrying alpha's prompt, streamed or whole: a 500 before any of it", async () => {
    // Alpha's recent prompt is the engine's reply text; beta's answer (that text) carries it.
    await openaiClient(router.url, keys.alpha).responses.create({ model: 'served', input: reply })
    const beta = openaiClient(router.url, keys.beta)
    // The run starts at the answer's first character: nothing is released, so the refusal comes
    // before the stream's headers, as a plain HTTP 500 (as on chat).
    const streamed = await beta.responses
      .create({ model: 'served', input: 'hello', stream: true })
      .then(
        () => null,
        (e: unknown) => e,
      )
    assert.ok(streamed instanceof OpenAI.InternalServerError, String(streamed))
    assert.equal(streamed.code, 'answer_withheld')
    const whole = await beta.responses.create({ model: 'served', input: 'hello' }).then(
      () => null,
      (e: unknown) => e,
    )
    assert.ok(whole instanceof OpenAI.InternalServerError, String(whole))
    assert.equal(whole.code, 'answer_withheld')
    const events = logs.records().filter((r) => String(r.msg).startsWith('sentinel:'))
    assert.equal(events.length, 2)
  })
})
