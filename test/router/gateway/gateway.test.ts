/** Gateway mode in front of SGLang and vLLM, against stand-ins that reproduce those engines'
 *  documented discovery endpoints and response shapes (test/helpers/engines.ts). */
import assert from 'node:assert/strict'
import { rmSync } from 'node:fs'
import { describe, it } from 'node:test'
import OpenAI from 'openai'
import type { RunningRouter } from '../../../src/router/start.js'
import { startEngine } from '../../helpers/engines.js'
import { startGatewayRouter } from './engines.js'
import { keys, waitFor, writeTestTokenizer } from '../helpers.js'

const client = (router: RunningRouter, apiKey = keys.alpha) =>
  new OpenAI({ baseURL: `${router.url}/v1`, apiKey, maxRetries: 0 })

describe('gateway mode', () => {
  it('vLLM: advertises num_gpu_blocks × block_size, counts with /tokenize, refuses over-capacity prompts before the engine', async () => {
    // 8 blocks × 16 = 128 tokens of KV, though the model allows 4096.
    const engine = await startEngine('vllm', { poolTokens: 128, maxModelLen: 4096 })
    const router = await startGatewayRouter(engine)
    try {
      const models = await client(router).models.list()
      assert.equal((models.data[0] as unknown as { max_model_len: number }).max_model_len, 128)

      const longPrompt = Array.from({ length: 120 }, (_, i) => `w${i}`).join(' ') // 120 tokens
      await assert.rejects(
        client(router).completions.create({ model: 'served', prompt: longPrompt, max_tokens: 10 }),
        (err: unknown) => {
          assert.ok(err instanceof OpenAI.BadRequestError)
          assert.equal(err.code, 'context_length_exceeded')
          assert.match(err.message, /maximum context length is 128 tokens.*130 tokens/)
          return true
        },
      )
      assert.equal(engine.completions.length, 0, 'nothing reached the engine')

      const completion = await client(router).completions.create({
        model: 'served',
        prompt: 'one two three',
        // @ts-expect-error vLLM's extension (its serving benchmark sends it): passed on as sent
        ignore_eos: true,
      })
      assert.equal(completion.choices[0].text, 'w0 w1 w2 ')
      assert.equal(engine.completions[0].ignore_eos, true)
      assert.equal(completion.model, 'served')
      assert.match(completion.id, /^cmpl-[0-9a-f]{32}$/)
      // The engine may generate only what admission counted: 128 − 3 prompt tokens.
      assert.equal(engine.completions[0].max_tokens, 125)
      assert.equal(engine.completions[0].model, 'tiny-engine')
      assert.equal(engine.tokenizeCalls, 2)

      const stream = await client(router).chat.completions.create({
        model: 'served',
        messages: [{ role: 'user', content: 'hello there' }],
        stream: true,
      })
      let text = ''
      let finish: string | null = null
      for await (const chunk of stream) {
        assert.match(chunk.id, /^chatcmpl-[0-9a-f]{32}$/)
        text += chunk.choices[0]?.delta.content ?? ''
        finish = chunk.choices[0]?.finish_reason ?? finish
      }
      assert.equal(text, 'w0 w1 w2 ')
      assert.equal(finish, 'length')
    } finally {
      await router.close()
      await engine.close()
    }
  })

  it('SGLang: capacity from /get_server_info, tokens by its tokenizer.json, a disconnect aborts by rid', async () => {
    const engine = await startEngine('sglang', {
      poolTokens: 256,
      maxModelLen: 8192,
      numTokens: 200,
      tokenDelayMs: 5,
    })
    const tokenizerDir = writeTestTokenizer()
    const router = await startGatewayRouter(engine, { tokenizerDir })
    try {
      const info = (await (await fetch(`${router.url}/server_info`)).json()) as Record<
        string,
        unknown
      >
      assert.equal(info.contextWindow, 256)
      assert.deepEqual(info.backend, {
        kind: 'sglang',
        url: engine.url,
        contextWindow: 256,
        capacityTokens: 256,
        reportedCapacityTokens: 256,
        maxModelLen: 8192,
        maxInputTokens: 251,
      })
      // Char-level tokenizer: BOS + 251 chars = 252 prompt tokens > max_req_input_len 251.
      await assert.rejects(
        client(router).completions.create({
          model: 'served',
          prompt: 'x'.repeat(251),
          max_tokens: 1,
        }),
        (err: unknown) =>
          err instanceof OpenAI.BadRequestError &&
          /at most 251 prompt tokens; your prompt has 252/.test(err.message),
      )
      assert.equal(engine.completions.length, 0)

      const abort = new AbortController()
      const stream = await client(router).completions.create(
        { model: 'served', prompt: 'Hi', max_tokens: 200, stream: true },
        { signal: abort.signal },
      )
      let rid = ''
      try {
        for await (const chunk of stream) {
          rid = chunk.id.slice('cmpl-'.length)
          abort.abort()
        }
      } catch (err) {
        assert.ok(err instanceof OpenAI.APIUserAbortError)
      }
      assert.equal(engine.completions[0].rid, rid, 'the router sent its own id as rid')
      await waitFor(() => engine.aborted.includes(rid))
    } finally {
      await router.close()
      await engine.close()
      rmSync(tokenizerDir, { recursive: true, force: true })
    }
  })

  for (const kind of ['vllm', 'sglang'] as const) {
    it(`${kind}: every request carries its tenant's cache_salt, so tenants never share the engine's prefix cache`, async () => {
      const engine = await startEngine(kind, { poolTokens: 4096, maxModelLen: 4096 })
      // The SGLang stand-in has no /tokenize: the gateway counts with a tokenizer.json.
      const tokenizerDir = kind === 'sglang' ? writeTestTokenizer() : undefined
      const router = await startGatewayRouter(engine, { tokenizerDir })
      try {
        const send = (key: string) =>
          client(router, key).completions.create({
            model: 'served',
            prompt: 'one two three',
            max_tokens: 2,
          })
        await send(keys.alpha)
        await send(keys.alpha)
        await send(keys.beta)
        const salts = engine.completions.map((b) => b.cache_salt)
        // HMAC-SHA-256 in base64url: 43 characters, nothing of the tenant's name in it.
        for (const salt of salts) assert.match(String(salt), /^[A-Za-z0-9_-]{43}$/)
        assert.equal(salts[0], salts[1], "one tenant's requests share a salt (and its cache hits)")
        assert.notEqual(salts[0], salts[2], 'two tenants never do')
      } finally {
        await router.close()
        await engine.close()
        if (tokenizerDir) rmSync(tokenizerDir, { recursive: true, force: true })
      }
    })
  }

  it("serves the engine's own model id when no modelName is configured", async () => {
    const engine = await startEngine('vllm', { poolTokens: 4096, maxModelLen: 4096 })
    const router = await startGatewayRouter(engine, { modelName: null })
    try {
      const models = await client(router).models.list()
      assert.deepEqual(
        models.data.map((m) => m.id),
        ['tiny-engine'],
      )
      const completion = await client(router).completions.create({
        model: 'tiny-engine',
        prompt: 'one two',
        max_tokens: 2,
      })
      assert.equal(completion.model, 'tiny-engine')
    } finally {
      await router.close()
      await engine.close()
    }
  })

  it('refuses to start when asked to advertise more than the engine holds (G1)', async () => {
    const engine = await startEngine('vllm', { poolTokens: 128, maxModelLen: 4096 })
    try {
      await assert.rejects(
        startGatewayRouter(engine, { contextWindow: 4096 }),
        /G1: context window 4096 exceeds what vllm backend .* holds: 128 tokens/,
      )
    } finally {
      await engine.close()
    }
  })

  it('follows the engine down when its capacity shrinks (periodic discovery)', async () => {
    const engine = await startEngine('vllm', { poolTokens: 256, maxModelLen: 4096 })
    const router = await startGatewayRouter(engine, { discoveryIntervalMs: 10 })
    try {
      engine.poolTokens = 64
      const window = async () =>
        ((await client(router).models.list()).data[0] as unknown as { max_model_len: number })
          .max_model_len
      for (let i = 0; i < 200 && (await window()) !== 64; i++)
        await new Promise((r) => setTimeout(r, 10))
      assert.equal(await window(), 64)
    } finally {
      await router.close()
      await engine.close()
    }
  })
})
