/** Gateway mode answers in OpenAI's published shapes whatever the engine behind it sends: every
 *  body the router returns in front of the SGLang and vLLM stand-ins (test/helpers/engines.ts, in
 *  the engines' own shapes, extra fields and nulls included) validates against OpenAI's OpenAPI
 *  description (test/helpers/openapi.ts): completions and chat completions, plain and streamed,
 *  the model list, and the error bodies of an over-capacity prompt, bad input (refused by the
 *  router or by the engine) and a failing engine. Skipped when the spec file is not present. */
import assert from 'node:assert/strict'
import { rmSync } from 'node:fs'
import { after, before, describe, it } from 'node:test'
import type { ValidateFunction } from 'ajv/dist/2020.js'
import type { RunningRouter } from '../../../src/router/start.js'
import { hasSpec, loadValidators, specSkip, sseEvents, violations } from '../../helpers/openapi.js'
import { type Engine, engineReplyText, startEngine } from '../../helpers/engines.js'
import { startGatewayRouter } from './engines.js'
import { keys, writeTestTokenizer } from '../helpers.js'

const skip = specSkip
const replyText = engineReplyText() // 'w0 w1 w2 '

// One spec load (~3 MB of YAML) for the whole file.
let schema: (name: string) => ValidateFunction
const check = (name: string, value: unknown, what = name) =>
  assert.deepEqual(violations(schema(name), value), [], `${what}: ${JSON.stringify(value)}`)

/** A legacy completion chunk checked as a completion: the spec shares one schema between the two,
 *  yet OpenAI itself sends `finish_reason: null` on every chunk but a choice's last. */
function checkCompletionChunk(chunk: unknown): void {
  const withReason = structuredClone(chunk) as { choices: { finish_reason: unknown }[] }
  for (const choice of withReason.choices) choice.finish_reason ??= 'length'
  check('CreateCompletionResponse', withReason, 'a completion chunk')
}

before(() => {
  if (hasSpec) schema = loadValidators()
})

for (const kind of ['sglang', 'vllm'] as const) {
  describe(`gateway in front of ${kind}: bodies match the OpenAI OpenAPI description`, () => {
    let engine: Engine
    let router: RunningRouter
    // SGLang's stand-in has no /tokenize: the router counts with the engine's tokenizer.json.
    const tokenizerDir = kind === 'sglang' ? writeTestTokenizer() : undefined
    const post = (path: string, body: unknown) =>
      fetch(`${router.url}${path}`, {
        method: 'POST',
        headers: { authorization: `Bearer ${keys.alpha}`, 'content-type': 'application/json' },
        body: typeof body === 'string' ? body : JSON.stringify(body),
      })

    before(async () => {
      if (!hasSpec) return
      engine = await startEngine(kind, { poolTokens: 128, maxModelLen: 4096 })
      router = await startGatewayRouter(engine, { tokenizerDir })
    })
    after(async () => {
      await router?.close()
      await engine?.close()
      if (tokenizerDir !== undefined) rmSync(tokenizerDir, { recursive: true, force: true })
    })

    it(
      'text_completion: exactly the OpenAI fields, none of the engine’s own',
      { skip },
      async () => {
        const res = await post('/v1/completions', {
          model: 'served',
          prompt: 'one two',
          max_tokens: 3,
        })
        assert.equal(res.status, 200)
        const body = (await res.json()) as { id: string }
        check('CreateCompletionResponse', body)
        assert.match(body.id, /^cmpl-[0-9a-f]{32}$/)
        assert.deepEqual(body, {
          id: body.id,
          object: 'text_completion',
          created: 1_767_000_000,
          model: 'served',
          choices: [{ index: 0, text: replyText, logprobs: null, finish_reason: 'length' }],
          usage: { prompt_tokens: 4, completion_tokens: 3, total_tokens: 7 },
        })
      },
    )

    it('chat.completion', { skip }, async () => {
      const res = await post('/v1/chat/completions', {
        model: 'served',
        messages: [{ role: 'user', content: 'hello there' }],
        max_tokens: 3,
      })
      assert.equal(res.status, 200)
      const body = (await res.json()) as { choices: { message: unknown }[] }
      check('CreateChatCompletionResponse', body)
      assert.deepEqual(body.choices[0].message, {
        role: 'assistant',
        content: replyText,
        refusal: null,
      })
    })

    it('chat.completion.chunk, usage included', { skip }, async () => {
      const chunks = (await sseEvents(
        await post('/v1/chat/completions', {
          model: 'served',
          messages: [{ role: 'user', content: 'hello there' }],
          stream: true,
          stream_options: { include_usage: true },
        }),
      )) as { choices: { delta: { content?: string }; finish_reason: string | null }[] }[]
      for (const chunk of chunks) check('CreateChatCompletionStreamResponse', chunk, 'a chat chunk')
      const choices = chunks.flatMap((c) => c.choices)
      assert.equal(choices.map((c) => c.delta.content ?? '').join(''), replyText)
      assert.equal(choices.at(-1)!.finish_reason, 'length')
      assert.deepEqual(chunks.at(-1), {
        ...chunks.at(-1),
        choices: [],
        usage: { prompt_tokens: 4, completion_tokens: 3, total_tokens: 7 },
      })
    })

    it('text_completion chunks, usage included', { skip }, async () => {
      const chunks = (await sseEvents(
        await post('/v1/completions', {
          model: 'served',
          prompt: 'one two',
          stream: true,
          stream_options: { include_usage: true },
        }),
      )) as { choices: { text: string; finish_reason: string | null }[] }[]
      assert.ok(chunks.length >= 4, `${chunks.length} chunks`)
      for (const chunk of chunks) checkCompletionChunk(chunk)
      const choices = chunks.flatMap((c) => c.choices)
      assert.equal(choices.map((c) => c.text).join(''), replyText)
      assert.equal(choices.at(-1)!.finish_reason, 'length')
    })

    it('the model list', { skip }, async () => {
      const res = await fetch(`${router.url}/v1/models`, {
        headers: { authorization: `Bearer ${keys.alpha}` },
      })
      check('ListModelsResponse', await res.json())
    })

    it('error bodies: over capacity, bad input, a failing engine', { skip }, async () => {
      const refusal = async (res: Response, status: number, code: string | null) => {
        const body = (await res.json()) as { error: { code: unknown } }
        check('ErrorResponse', body, `HTTP ${res.status}`)
        assert.equal(res.status, status, JSON.stringify(body))
        assert.equal(body.error.code, code)
      }
      // Over capacity, refused by the router before the engine (vLLM: words are tokens; SGLang:
      // characters are, and it accepts at most 128 − 5 prompt tokens).
      const longPrompt = kind === 'vllm' ? 'w '.repeat(130) : 'x'.repeat(130)
      await refusal(
        await post('/v1/completions', { model: 'served', prompt: longPrompt, max_tokens: 1 }),
        400,
        'context_length_exceeded',
      )
      // Bad input, refused by the router.
      await refusal(await post('/v1/completions', '{"model":'), 400, 'invalid_request')
      await refusal(
        await post('/v1/chat/completions', { model: 'served', messages: [] }),
        400,
        'invalid_request',
      )
      const numSent = engine.completions.length
      // Bad input, refused by the engine in its own error shape (code: its HTTP status).
      engine.failure = 'bad-request'
      try {
        await refusal(
          await post('/v1/completions', { model: 'served', prompt: 'one', temperature: 1.5 }),
          400,
          null,
        )
        // The engine fails: 500 in its own shape, then a stream that breaks mid-way.
        engine.failure = 'server-error'
        await refusal(
          await post('/v1/chat/completions', {
            model: 'served',
            messages: [{ role: 'user', content: 'hi' }],
          }),
          503,
          'worker_unavailable',
        )
        engine.failure = 'stream-error'
        const events = (await sseEvents(
          await post('/v1/completions', { model: 'served', prompt: 'one', stream: true }),
        )) as Record<string, unknown>[]
        const last = events.at(-1)!
        check('ErrorResponse', last, 'the in-stream error event')
        assert.equal((last as { error: { code: unknown } }).error.code, 'worker_unavailable')
        for (const chunk of events.slice(0, -1)) checkCompletionChunk(chunk)
        // Before any output the same failure is a plain HTTP error.
        engine.failure = 'stream-error-at-start'
        await refusal(
          await post('/v1/completions', { model: 'served', prompt: 'one', stream: true }),
          503,
          'worker_unavailable',
        )
      } finally {
        engine.failure = null
      }
      assert.equal(engine.completions.length, numSent + 4, 'the engine saw only the last four')
    })
  })
}
