/** The response sentinel in gateway mode: the router (real HTTP, the `openai` client) in front of
 *  the stand-in vLLM of test/helpers/engines.ts, whose every answer is the fixed text `w0 w1 …`.
 *  When tenant alpha's recent prompt is that text, tenant beta's answers carry a run of alpha's
 *  prompt: suspected (alpha's own answers are not); in block mode beta's stream ends with the
 *  sentinel's error event before any of the run, and a whole answer is a 500. */
import assert from 'node:assert/strict'
import { after, before, describe, it } from 'node:test'
import OpenAI from 'openai'
import { startRouter, type RunningRouter } from '../../../src/router/start.js'
import type { SentinelMode } from '../../../src/router/sentinel/sentinel.js'
import { apiKeyDigest } from '../../../src/router/tenants/tenants.js'
import { type Engine, engineReplyText, startEngine } from '../../helpers/engines.js'
import { openaiClient } from '../../helpers/cluster.js'
import { loadTokenizer } from '../../../src/model/tokenizer.js'
import { qwen3TokenizerDir } from '../../helpers/qwen3.js'
import { captureLogs, keys } from '../helpers.js'

/** 20 words, 70 characters: `w0 w1 … w19 `. */
const reply = engineReplyText(20)

async function routerFor(engine: Engine, mode: SentinelMode, tokenizerDir?: string) {
  const logs = captureLogs()
  const router = await startRouter({
    gateway: { kind: engine.kind, url: engine.url, discoveryIntervalMs: 0, tokenizerDir },
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

const ask = (router: RunningRouter, key: string, prompt: string, stream: boolean) =>
  openaiClient(router.url, key).completions.create({
    model: 'served',
    prompt,
    max_tokens: 20,
    stream,
  } as OpenAI.CompletionCreateParamsNonStreaming)

for (const mode of ['observe', 'block'] as const) {
  describe(`gateway, ${mode} mode`, () => {
    let engine: Engine
    let router: RunningRouter
    let logs: ReturnType<typeof captureLogs>
    before(async () => {
      engine = await startEngine('vllm', { poolTokens: 4096, maxModelLen: 4096, numTokens: 20 })
      ;({ router, logs } = await routerFor(engine, mode))
    })
    after(async () => {
      await router?.close()
      await engine?.close()
    })
    const events = () =>
      logs.records().filter((r) => String(r.msg).startsWith('sentinel:')) as unknown as {
        rid: string
        tenant: string
        sourceTenant: string
        runTokens: number
      }[]

    it("alpha's own answers, echoing its prompt, raise nothing", async () => {
      const res = (await ask(router, keys.alpha, reply, false)) as OpenAI.Completion
      assert.equal(res.choices[0].text, reply)
      assert.deepEqual(events(), [])
      // The counters are there at 0 before any event (an alert's increase() needs that sample),
      // beside the cap (64 MiB by default).
      const metrics = await (await fetch(`${router.url}/metrics`)).text()
      const action = mode === 'block' ? 'blocked' : 'observed'
      for (const line of [
        `kvfence_sentinel_suspected_total{action="${action}"} 0`,
        `kvfence_sentinel_confirmed_total{action="${action}"} 0`,
        'kvfence_sentinel_fingerprint_max_bytes 67108864',
        'kvfence_sentinel_window_seconds 600',
      ])
        assert.ok(metrics.split('\n').includes(line), line)
    })

    if (mode === 'observe') {
      it("beta's answers carrying alpha's prompt are suspected, streamed or whole", async () => {
        const whole = (await ask(router, keys.beta, 'hello', false)) as OpenAI.Completion
        assert.equal(whole.choices[0].text, reply)
        let streamed = ''
        const stream = (await ask(
          router,
          keys.beta,
          'hello',
          true,
        )) as unknown as AsyncIterable<OpenAI.Completion>
        for await (const chunk of stream) streamed += chunk.choices[0]?.text ?? ''
        assert.equal(streamed, reply)
        assert.deepEqual(
          events().map((e) => [e.tenant, e.sourceTenant, e.runTokens]),
          [
            ['beta', 'alpha', 16],
            ['beta', 'alpha', 16],
          ],
        )
      })
    } else {
      it("beta's stream ends with the sentinel's error event before any 16 characters of the run", async () => {
        let received = ''
        const stream = (await ask(
          router,
          keys.beta,
          'hello',
          true,
        )) as unknown as AsyncIterable<OpenAI.Completion>
        await assert.rejects(
          async () => {
            for await (const chunk of stream) received += chunk.choices[0]?.text ?? ''
          },
          (err: unknown) => err instanceof OpenAI.APIError && /sentinel withheld/.test(err.message),
        )
        // The run is the whole reply from its first character: none of it went out.
        assert.equal(received, '')
        const whole = await ask(router, keys.beta, 'hello', false).then(
          () => null,
          (e: unknown) => e,
        )
        assert.ok(whole instanceof OpenAI.InternalServerError, String(whole))
        assert.equal(whole.code, 'answer_withheld')
        assert.equal(events().length, 2)
      })
    }
  })
}

describe('gateway with a local tokenizer (Qwen3), a prompt given as token ids', () => {
  const qwen3 = qwen3TokenizerDir()
  let engine: Engine
  let router: RunningRouter
  let logs: ReturnType<typeof captureLogs>
  before(async () => {
    engine = await startEngine('vllm', { poolTokens: 4096, maxModelLen: 4096, numTokens: 20 })
    ;({ router, logs } = await routerFor(engine, 'observe', qwen3.dir))
  })
  after(async () => {
    await router?.close()
    await engine?.close()
    qwen3.remove()
  })

  it("is decoded and fingerprinted: beta's answer carrying its text is suspected at 16 tokens' characters", async () => {
    // Alpha's prompt: the reply's 70 characters as Qwen3's 51 token ids (`w`, a digit or two,
    // a space: no merges across them). 16 tokens of it are ⌈16 × 70 ÷ 51⌉ = 22 characters.
    const ids = loadTokenizer(qwen3.dir).encode(reply)
    assert.equal(ids.length, 51)
    await openaiClient(router.url, keys.alpha).completions.create({
      model: 'served',
      prompt: ids,
      max_tokens: 20,
    })
    const res = (await ask(router, keys.beta, 'hello', false)) as OpenAI.Completion
    assert.equal(res.choices[0].text, reply)
    const events = logs.records().filter((r) => String(r.msg).startsWith('sentinel:'))
    assert.deepEqual(
      events.map((e) => [e.tenant, e.sourceTenant, e.runTokens, e.runCharacters]),
      [['beta', 'alpha', 16, 22]], // ⌊22 × 51 ÷ 70⌋ = 16
    )
  })
})
