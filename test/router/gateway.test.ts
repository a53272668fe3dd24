/** Gateway mode in front of SGLang and vLLM, against stand-ins that reproduce those engines'
 *  documented response shapes: SGLang `/get_server_info` (`max_total_num_tokens`,
 *  `max_req_input_len`, `context_length`) and `/abort_request {rid}`; vLLM `/metrics`
 *  `vllm:cache_config_info{block_size, num_gpu_blocks}`, `/v1/models` `max_model_len` and
 *  `/tokenize` `{count, max_model_len, tokens}`. */
import assert from 'node:assert/strict'
import http from 'node:http'
import type { AddressInfo } from 'node:net'
import { rmSync } from 'node:fs'
import { describe, it } from 'node:test'
import OpenAI from 'openai'
import { startRouter, type RunningRouter } from '../../src/router/start.js'
import { apiKeyDigest } from '../../src/router/tenants.js'
import { captureLogs, keys, waitFor, writeTestTokenizer } from './helpers.js'

interface Engine {
  url: string
  kind: 'sglang' | 'vllm'
  /** KV pool in tokens; may be changed while running. */
  poolTokens: number
  completions: Record<string, unknown>[]
  aborted: string[]
  tokenizeCalls: number
  close(): Promise<void>
}

/** A stand-in engine: words are tokens (vLLM `/tokenize`), replies are fixed words. */
async function startEngine(
  kind: 'sglang' | 'vllm',
  options: { poolTokens: number; maxModelLen: number; tokenDelayMs?: number; numTokens?: number },
): Promise<Engine> {
  const engine: Engine = {
    url: '',
    kind,
    poolTokens: options.poolTokens,
    completions: [],
    aborted: [],
    tokenizeCalls: 0,
    close: async () => undefined,
  }
  const send = (res: http.ServerResponse, status: number, body: unknown) => {
    res.writeHead(status, { 'content-type': 'application/json' })
    res.end(JSON.stringify(body))
  }
  const server = http.createServer(async (req, res) => {
    const chunks: Buffer[] = []
    for await (const c of req as AsyncIterable<Buffer>) chunks.push(c)
    const body = chunks.length > 0 ? JSON.parse(Buffer.concat(chunks).toString('utf8')) : null
    const route = `${req.method} ${req.url}`
    if (route === 'GET /v1/models') {
      return send(res, 200, {
        object: 'list',
        data: [
          {
            id: 'tiny-engine',
            object: 'model',
            created: 0,
            owned_by: kind,
            max_model_len: options.maxModelLen,
          },
        ],
      })
    }
    if (kind === 'sglang' && route === 'GET /get_server_info') {
      return send(res, 200, {
        model_path: 'tiny-engine',
        context_length: options.maxModelLen,
        chunked_prefill_size: 8192,
        max_total_num_tokens: engine.poolTokens,
        max_req_input_len: engine.poolTokens - 5,
      })
    }
    if (kind === 'sglang' && route === 'POST /abort_request') {
      engine.aborted.push(body.rid)
      return send(res, 200, {})
    }
    if (kind === 'vllm' && route === 'GET /metrics') {
      res.writeHead(200, { 'content-type': 'text/plain; version=0.0.4' })
      return res.end(
        '# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n' +
          '# TYPE vllm:cache_config_info gauge\n' +
          `vllm:cache_config_info{block_size="16",cache_dtype="auto",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="${engine.poolTokens / 16}"} 1.0\n`,
      )
    }
    if (kind === 'vllm' && route === 'POST /tokenize') {
      engine.tokenizeCalls++
      const text: string =
        body.prompt ?? body.messages.map((m: { content: string }) => m.content).join(' ')
      const tokens = text
        .trim()
        .split(/\s+/)
        .map((_w, i) => i + 10)
      return send(res, 200, { count: tokens.length, max_model_len: options.maxModelLen, tokens })
    }
    const isChat = route === 'POST /v1/chat/completions'
    if (!isChat && route !== 'POST /v1/completions') return send(res, 404, { detail: 'Not Found' })
    engine.completions.push(body)
    const words = Array.from({ length: options.numTokens ?? 3 }, (_, i) => `w${i} `)
    const base = { id: 'engine-id', created: 1, model: 'tiny-engine' }
    if (!body.stream) {
      const text = words.join('')
      return send(res, 200, {
        ...base,
        object: isChat ? 'chat.completion' : 'text_completion',
        choices: [
          isChat
            ? {
                index: 0,
                message: { role: 'assistant', content: text },
                logprobs: null,
                finish_reason: 'length',
              }
            : { index: 0, text, logprobs: null, finish_reason: 'length' },
        ],
        usage: {
          prompt_tokens: 4,
          completion_tokens: words.length,
          total_tokens: 4 + words.length,
        },
      })
    }
    res.writeHead(200, { 'content-type': 'text/event-stream' })
    let isClosed = false
    res.on('close', () => (isClosed = true))
    for (const [i, word] of words.entries()) {
      if (isClosed) return
      const finish = i === words.length - 1 ? 'length' : null
      res.write(
        `data: ${JSON.stringify({
          ...base,
          object: isChat ? 'chat.completion.chunk' : 'text_completion',
          choices: [
            isChat
              ? { index: 0, delta: { content: word }, finish_reason: finish }
              : { index: 0, text: word, finish_reason: finish },
          ],
        })}\n\n`,
      )
      await new Promise((r) => setTimeout(r, options.tokenDelayMs ?? 0))
    }
    res.end('data: [DONE]\n\n')
  })
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r))
  engine.url = `http://127.0.0.1:${(server.address() as AddressInfo).port}`
  engine.close = async () => {
    server.closeAllConnections()
    await new Promise((r) => server.close(r))
  }
  return engine
}

async function startGatewayRouter(
  engine: Engine,
  extra: { tokenizerDir?: string; contextWindow?: number; discoveryIntervalMs?: number } = {},
): Promise<RunningRouter> {
  return startRouter({
    gateway: {
      kind: engine.kind,
      url: engine.url,
      tokenizerDir: extra.tokenizerDir,
      discoveryIntervalMs: extra.discoveryIntervalMs ?? 0,
    },
    modelName: 'served',
    contextWindow: extra.contextWindow,
    tenants: [{ name: 'alpha', keySha256: apiKeyDigest(keys.alpha) }],
    port: 0,
    log: captureLogs().log,
  })
}

const client = (router: RunningRouter) =>
  new OpenAI({ baseURL: `${router.url}/v1`, apiKey: keys.alpha, maxRetries: 0 })

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
      })
      assert.equal(completion.choices[0].text, 'w0 w1 w2 ')
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
