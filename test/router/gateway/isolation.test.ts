/** Gateway mode's isolation self-check and the engines that report no capacity: the gateway
 *  refuses a path whose engine ignores or refuses the tenant's salt before any tenant meets it,
 *  serves it only when the operator names it in `allowUnsalted`, and ends its streams as OpenAI's
 *  do even when the engine omits `[DONE]`. Against the stand-ins of test/helpers/engines.ts: the
 *  plain one (`openai`) behaves as Hugging Face `transformers serve` 5.17 did when tried here. */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import OpenAI from 'openai'
import { KvfenceError } from '../../../src/common/errors.js'
import { BackendSection } from '../../../src/config/cluster.js'
import { repoRoot } from '../../helpers/paths.js'
import { join } from 'node:path'
import type { RunningRouter } from '../../../src/router/start.js'
import { engineReplyText, startEngine } from '../../helpers/engines.js'
import { startGatewayRouter } from './engines.js'
import { captureLogs, keys, waitFor, writeTestTokenizer } from '../helpers.js'

const client = (router: RunningRouter) =>
  new OpenAI({ baseURL: `${router.url}/v1`, apiKey: keys.alpha, maxRetries: 0 })

/** The raw SSE text of a streamed chat request. */
async function rawStream(router: RunningRouter): Promise<string> {
  const res = await fetch(`${router.url}/v1/chat/completions`, {
    method: 'POST',
    headers: { authorization: `Bearer ${keys.alpha}`, 'content-type': 'application/json' },
    body: JSON.stringify({
      model: 'served',
      messages: [{ role: 'user', content: 'hi' }],
      stream: true,
    }),
  })
  assert.equal(res.status, 200)
  return res.text()
}

/** The router's `/server_info` isolation results, by endpoint. */
async function isolationResults(router: RunningRouter): Promise<Record<string, string>> {
  const info = (await (await fetch(`${router.url}/server_info`)).json()) as {
    isolationSelfCheck: { paths: { endpoint: string; result: string }[] } | null
  }
  return Object.fromEntries(info.isolationSelfCheck!.paths.map((p) => [p.endpoint, p.result]))
}

describe('gateway isolation self-check', () => {
  it('a plain server that reports no capacity: refused without kvPoolTokens, and without backend.model when /v1/models fails', async () => {
    const engine = await startEngine('openai', { poolTokens: 512, maxModelLen: 512 })
    try {
      const tokenizerDir = writeTestTokenizer()
      await assert.rejects(startGatewayRouter(engine, { tokenizerDir }), (err: unknown) => {
        assert.ok(err instanceof KvfenceError)
        assert.equal(err.code, 'worker_unavailable')
        assert.match(err.message, /GET \/v1\/models answered HTTP 500: .*set backend\.model/)
        return true
      })
      await assert.rejects(
        startGatewayRouter(engine, { backendModel: 'tiny-engine', kvPoolTokens: 512 }),
        (err: unknown) => {
          assert.ok(err instanceof KvfenceError)
          assert.equal(err.code, 'config_invalid')
          assert.match(
            err.message,
            /openai backend: the engine cannot count prompts \(no \/tokenize\); set backend\.tokenizerDir/,
          )
          return true
        },
      )
      await assert.rejects(
        startGatewayRouter(engine, { backendModel: 'tiny-engine', tokenizerDir }),
        (err: unknown) => {
          assert.ok(err instanceof KvfenceError)
          assert.match(
            err.message,
            /cannot read its KV capacity .*declare it with backend\.kvPoolTokens/,
          )
          return true
        },
      )
      assert.equal(engine.completions.length + engine.selfChecks.length, 0)
    } finally {
      await engine.close()
    }
  })

  it('an engine that refuses cache_salt is refused at start, before any tenant meets its 422', async () => {
    const engine = await startEngine('openai', { poolTokens: 512, maxModelLen: 512 })
    try {
      await assert.rejects(
        startGatewayRouter(engine, {
          backendModel: 'tiny-engine',
          kvPoolTokens: 512,
          tokenizerDir: writeTestTokenizer(),
        }),
        (err: unknown) => {
          assert.ok(err instanceof KvfenceError)
          assert.equal(err.code, 'guard_violation')
          assert.match(
            err.message,
            /openai backend \/v1\/chat\/completions: the engine refuses cache_salt \(HTTP 422: .*Unexpected fields in the request: \{'cache_salt'\}/,
          )
          assert.match(
            err.message,
            /openai backend \/v1\/completions: the engine refuses cache_salt/,
          )
          assert.match(err.message, /name it in backend\.allowUnsalted/)
          return true
        },
      )
      // Per path: the salted request, then the same without the salt to tell a refused field
      // from an engine that refuses everything.
      assert.equal(engine.selfChecks.length, 4)
      assert.equal(typeof engine.selfChecks[0].cache_salt, 'string')
      assert.equal(engine.selfChecks[1].cache_salt, undefined)
      assert.equal(engine.completions.length, 0)
    } finally {
      await engine.close()
    }
  })

  it('allowUnsalted serves such a path without the salt, and its streams end with [DONE] though the engine omits it', async () => {
    const engine = await startEngine('openai', { poolTokens: 512, maxModelLen: 512 })
    const logs = captureLogs()
    const router = await startGatewayRouter(engine, {
      backendModel: 'tiny-engine',
      kvPoolTokens: 512,
      tokenizerDir: writeTestTokenizer(),
      allowUnsalted: ['chat', 'completion'],
      log: logs.log,
    })
    try {
      assert.deepEqual(await isolationResults(router), {
        chat: 'salt-refused',
        completion: 'salt-refused',
      })
      assert.match(
        logs.text(),
        /reports no KV capacity: G1 rests on the declared backend\.kvPoolTokens \(512 tokens\)/,
      )
      assert.match(logs.text(), /served anyway \(allowUnsalted\)/)

      const completion = await client(router).completions.create({
        model: 'served',
        prompt: 'one two',
      })
      assert.equal(completion.choices[0].text, engineReplyText())
      assert.equal(engine.completions[0].cache_salt, undefined)

      const raw = await rawStream(router)
      assert.ok(raw.endsWith('data: [DONE]\n\n'), `the stream ends with [DONE]: ${raw.slice(-80)}`)
      assert.equal(raw.split('data: [DONE]').length, 2, 'one [DONE]')

      const stream = await client(router).chat.completions.create({
        model: 'served',
        messages: [{ role: 'user', content: 'hello' }],
        stream: true,
      })
      let text = ''
      for await (const chunk of stream) text += chunk.choices[0]?.delta.content ?? ''
      assert.equal(text, engineReplyText())
      assert.equal(router.config.contextWindow, 512)
    } finally {
      await router.close()
      await engine.close()
    }
  })

  it('an engine that keys its prefix cache by the salt is isolated on both paths; tenants keep their salts', async () => {
    const engine = await startEngine('vllm', {
      poolTokens: 1024,
      maxModelLen: 1024,
      prefixCache: 'salted',
    })
    const router = await startGatewayRouter(engine)
    try {
      assert.deepEqual(await isolationResults(router), { chat: 'isolated', completion: 'isolated' })
      // Three requests a path: A, A again (the positive control), B.
      assert.equal(engine.selfChecks.length, 6)
      const metrics = await (await fetch(`${router.url}/metrics`)).text()
      assert.match(metrics, /kvfence_gateway_path_isolation\{endpoint="chat",result="isolated"\} 1/)
      assert.match(
        metrics,
        /kvfence_gateway_path_isolation\{endpoint="completion",result="isolated"\} 1/,
      )
      await client(router).completions.create({ model: 'served', prompt: 'one two' })
      assert.equal(typeof engine.completions[0].cache_salt, 'string')
    } finally {
      await router.close()
      await engine.close()
    }
  })

  it('an engine that ignores the salt is refused at start; allowUnsalted must name every such path', async () => {
    const engine = await startEngine('vllm', {
      poolTokens: 1024,
      maxModelLen: 1024,
      prefixCache: 'shared',
    })
    try {
      await assert.rejects(
        startGatewayRouter(engine, { allowUnsalted: ['completion'] }),
        (err: unknown) => {
          assert.ok(err instanceof KvfenceError)
          assert.equal(err.code, 'guard_violation')
          assert.match(
            err.message,
            /vllm backend \/v1\/chat\/completions: another salt reused \d+ cached tokens .*ignores cache_salt/,
          )
          assert.doesNotMatch(err.message, /\/v1\/completions:/)
          return true
        },
      )
    } finally {
      await engine.close()
    }
  })

  it('an engine without a visible prefix cache cannot be told apart: served, and said so', async () => {
    const engine = await startEngine('sglang', { poolTokens: 1024, maxModelLen: 1024 })
    const logs = captureLogs()
    const router = await startGatewayRouter(engine, { log: logs.log })
    try {
      assert.deepEqual(await isolationResults(router), {
        chat: 'cannot-tell',
        completion: 'cannot-tell',
      })
      assert.match(logs.text(), /cannot tell: the same tenant's repeat reports no cached_tokens/)
    } finally {
      await router.close()
      await engine.close()
    }
  })

  it('a later self-check that finds the salt ignored refuses the path with 503 path_refused', async () => {
    const engine = await startEngine('vllm', {
      poolTokens: 1024,
      maxModelLen: 1024,
      prefixCache: 'salted',
    })
    const router = await startGatewayRouter(engine, { selfCheckIntervalMs: 100 })
    try {
      await client(router).completions.create({ model: 'served', prompt: 'one two' })
      engine.prefixCache = 'shared' // a redeploy that dropped the salt
      let results: Record<string, string> = {}
      await waitFor(() => {
        void isolationResults(router)
          .then((r) => (results = r))
          .catch(() => undefined)
        return results.completion === 'shared'
      }, 10_000)
      await assert.rejects(
        client(router).completions.create({ model: 'served', prompt: 'one two' }),
        (err: unknown) => {
          assert.ok(err instanceof OpenAI.APIError)
          assert.equal(err.status, 503)
          assert.equal(err.code, 'path_refused')
          return true
        },
      )
    } finally {
      await router.close()
      await engine.close()
    }
  })

  it("llama.cpp's server: one slot's n_ctx from /props is the window", async () => {
    const engine = await startEngine('llamacpp', { poolTokens: 2048, maxModelLen: 8192 })
    const router = await startGatewayRouter(engine)
    try {
      assert.equal(router.config.contextWindow, 2048)
      const completion = await client(router).completions.create({
        model: 'served',
        prompt: 'one two',
      })
      assert.equal(completion.choices[0].text, engineReplyText())
    } finally {
      await router.close()
      await engine.close()
    }
  })
})

describe('gateway self-check: what the trial found', () => {
  it('an engine that does not answer at all is refused at start, not served as "cannot tell"', async () => {
    const engine = await startEngine('openai', { poolTokens: 512, maxModelLen: 512 })
    const url = engine.url
    await engine.close() // nothing listens there now
    await assert.rejects(
      startGatewayRouter(
        { ...engine, url },
        { backendModel: 'tiny-engine', kvPoolTokens: 512, tokenizerDir: writeTestTokenizer() },
      ),
      (err: unknown) => {
        assert.ok(err instanceof KvfenceError)
        assert.equal(err.code, 'worker_unavailable')
        assert.match(
          err.message,
          /^openai backend did not answer the isolation self-check: the engine did not answer \([^)]*ECONNREFUSED[^)]*\)$/,
        )
        return true
      },
    )
  })

  it("the router's /health follows the engine's: 503 with the reason once the engine is gone", async () => {
    const engine = await startEngine('vllm', { poolTokens: 1024, maxModelLen: 1024 })
    const router = await startGatewayRouter(engine)
    try {
      assert.equal((await fetch(`${router.url}/health`)).status, 200)
      await engine.close()
      const res = await fetch(`${router.url}/health`)
      assert.equal(res.status, 503)
      assert.match(await res.text(), /the engine at http:\/\/127\.0\.0\.1:\d+ does not answer/)
    } finally {
      await router.close()
    }
  })

  it("the self-check's requests are named as tenants' are (SGLang's rid), so it sends what they will", async () => {
    const engine = await startEngine('sglang', { poolTokens: 1024, maxModelLen: 1024 })
    const router = await startGatewayRouter(engine, { tokenizerDir: writeTestTokenizer() })
    try {
      assert.equal(engine.selfChecks.length, 6)
      for (const body of engine.selfChecks) assert.match(String(body.rid), /^[0-9a-f]{32}$/)
    } finally {
      await router.close()
      await engine.close()
    }
  })

  it("a plain server's window is the model's length from tokenizerDir's config.json, not the declared pool", async () => {
    const engine = await startEngine('openai', { poolTokens: 32_768, maxModelLen: 32_768 })
    const logs = captureLogs()
    const router = await startGatewayRouter(engine, {
      backendModel: 'tiny-engine',
      kvPoolTokens: 32_768,
      tokenizerDir: join(repoRoot, 'models', 'echo-tiny'), // max_position_embeddings 1024
      allowUnsalted: ['chat', 'completion'],
      log: logs.log,
    })
    try {
      assert.equal(router.config.contextWindow, 1024)
      assert.doesNotMatch(logs.text(), /reports no model length/)
    } finally {
      await router.close()
      await engine.close()
    }
    // Without a config.json beside the tokenizer, the start-up says the length is unknown.
    const engine2 = await startEngine('openai', { poolTokens: 512, maxModelLen: 512 })
    const logs2 = captureLogs()
    const router2 = await startGatewayRouter(engine2, {
      backendModel: 'tiny-engine',
      kvPoolTokens: 512,
      tokenizerDir: writeTestTokenizer(),
      allowUnsalted: ['chat', 'completion'],
      log: logs2.log,
    })
    try {
      assert.match(logs2.text(), /reports no model length and tokenizerDir has no config\.json/)
    } finally {
      await router2.close()
      await engine2.close()
    }
  })

  it('selfCheckIntervalMs is 0 or at least 10 s in the cluster file', () => {
    const parsed = BackendSection.safeParse({
      kind: 'vllm',
      url: 'http://127.0.0.1:8000',
      selfCheckIntervalMs: 5,
    })
    assert.equal(parsed.success, false)
    assert.match(
      parsed.error!.issues[0].message,
      /must be 0 \(at start only\) or at least 10000 ms/,
    )
    for (const ms of [0, 10_000]) {
      const ok = BackendSection.safeParse({
        kind: 'vllm',
        url: 'http://127.0.0.1:8000',
        selfCheckIntervalMs: ms,
      })
      assert.equal(ok.success, true)
    }
  })
})
