/** Sampling parameters and log-probabilities end to end: a real cluster (router, prefill and decode
 *  workers as OS processes, KV over TCP) answers the official `openai` client with OpenAI's
 *  logprobs shapes, chat and completions, whole and streamed. The values are checked against the
 *  single-process engine (`generateLocal`, one pool, unbatched `forward`) and against properties
 *  that hold whatever the model: at temperature 0 the chosen token is the most likely one, the
 *  alternatives come most likely first, and their probabilities sum to at most 1. Responses with
 *  logprobs validate against OpenAI's OpenAPI description (skipped without it). */
import assert from 'node:assert/strict'
import { join } from 'node:path'
import { after, before, describe, it } from 'node:test'
import type { ValidateFunction } from 'ajv/dist/2020.js'
import { startCluster, type Cluster } from '../../src/config/launch.js'
import type { Sampling } from '../../src/control/messages.js'
import { buildFaultConfig } from '../../src/engine/faults.js'
import { generateLocal, type LocalResult } from '../../src/engine/local-engine.js'
import { createWorkerCore } from '../../src/engine/worker-core.js'
import { loadTokenizer } from '../../src/model/tokenizer.js'
import { loadModel } from '../../src/model/weights.js'
import { openaiClient, twoTenants } from '../helpers/cluster.js'
import { loadValidators, sseEvents, specSkip, violations } from '../helpers/openapi.js'
import { echoModelDir } from '../helpers/paths.js'

const { dir, tenants, tenantsFile } = twoTenants('kvfence-sampling-')
const model = 'echo-tiny'
const tokenizer = loadTokenizer(echoModelDir)
const eos = tokenizer.eosTokenId!
const local = createWorkerCore({
  model: loadModel(echoModelDir),
  numPages: 64,
  pageSize: 16,
  faults: buildFaultConfig([], false, {}),
})

/** Batched (cluster) and unbatched (local) forward passes may round differently in float32. */
const logprobTolerance = 1e-4

const greedy: Sampling = {
  temperature: 0,
  topP: 1,
  topK: null,
  minP: 0,
  presencePenalty: 0,
  frequencyPenalty: 0,
  seed: null,
  numLogprobs: null,
}

/** What the single-process engine generates for a completion prompt. */
function localRun(prompt: string, maxTokens: number, sampling: Partial<Sampling>): LocalResult {
  return generateLocal(local, tokenizer.encode(prompt), {
    maxTokens,
    sampling: { ...greedy, ...sampling },
    stopTokenIds: [eos],
  })
}

/** A token's text as the router reports it: decoded alone, special tokens kept. */
const tokenText = (id: number) => tokenizer.decode([id], { skipSpecialTokens: false })

function assertNear(got: number, want: number, what: string): void {
  assert.ok(Math.abs(got - want) <= logprobTolerance, `${what}: got ${got}, want ${want}`)
}

interface ChatEntry {
  token: string
  logprob: number
  bytes: number[] | null
  top_logprobs: { token: string; logprob: number; bytes: number[] | null }[]
}

/** The properties every chat entry has at temperature 0 with `numTop` alternatives. */
function checkGreedyChatEntry(e: ChatEntry, numTop: number, what: string): void {
  assert.equal(e.top_logprobs.length, numTop, what)
  assert.deepEqual(e.bytes, [...Buffer.from(e.token, 'utf8')], what)
  assert.equal(e.top_logprobs[0].token, e.token, `${what}: greedy picks the most likely token`)
  assert.equal(e.top_logprobs[0].logprob, e.logprob, what)
  for (let i = 1; i < numTop; i++)
    assert.ok(e.top_logprobs[i].logprob <= e.top_logprobs[i - 1].logprob, `${what}: order`)
  const mass = e.top_logprobs.reduce((s, t) => s + Math.exp(t.logprob), 0)
  assert.ok(mass <= 1 + 1e-9, `${what}: top probabilities sum to ${mass}`)
  for (const t of e.top_logprobs) assert.deepEqual(t.bytes, [...Buffer.from(t.token, 'utf8')])
}

describe('sampling parameters and log-probabilities, end to end', () => {
  let cluster: Cluster
  let schema: ((name: string) => ValidateFunction) | null = null
  const api = () => openaiClient(cluster.routerUrl, tenants[0].key)
  const post = (path: string, body: object) =>
    fetch(`${cluster.routerUrl}${path}`, {
      method: 'POST',
      headers: { authorization: `Bearer ${tenants[0].key}`, 'content-type': 'application/json' },
      body: JSON.stringify(body),
    })
  const check = (name: string, value: unknown) =>
    assert.deepEqual(violations(schema!(name), value), [], name)

  before(async () => {
    if (specSkip === false) schema = loadValidators()
    cluster = await startCluster({
      modelDir: echoModelDir,
      pageSize: 16,
      prefillPages: 64,
      decodePages: 64,
      tenantsFile,
      logDir: join(dir, 'logs'),
    })
  })
  after(async () => cluster?.stop())

  const prompt = 'the river walks near the stone garden and Qx7vR2mK9pLt4Wz8 holds the light'

  it('chat: one entry per completion token, the first from prefill; greedy picks the top-1', async () => {
    const res = await api().chat.completions.create({
      model,
      messages: [{ role: 'user', content: prompt }],
      max_tokens: 10,
      temperature: 0,
      logprobs: true,
      top_logprobs: 4,
    })
    const choice = res.choices[0]
    const content = choice.logprobs!.content!
    assert.equal(choice.logprobs!.refusal, null)
    assert.equal(content.length, res.usage!.completion_tokens)
    content.forEach((e, i) => checkGreedyChatEntry(e, 4, `token ${i}`))
    const visible = content.filter((e) => e.token !== tokenizer.eosToken)
    assert.equal(visible.map((e) => e.token).join(''), choice.message.content)
    // The same values as the single-process engine (its prompt: the chat template's text).
    const want = generateLocal(
      local,
      tokenizer.encode(tokenizer.applyChatTemplate([{ role: 'user', content: prompt }])),
      { maxTokens: 10, sampling: { ...greedy, numLogprobs: 4 }, stopTokenIds: [eos] },
    )
    assert.deepEqual(
      content.map((e) => e.token),
      want.tokenIds.map(tokenText),
    )
    content.forEach((e, i) => {
      assertNear(e.logprob, want.logprobs![i].logprob, `token ${i}`)
      e.top_logprobs.forEach((t, j) => {
        assert.equal(t.token, tokenText(want.logprobs![i].top[j].tokenId))
        assertNear(t.logprob, want.logprobs![i].top[j].logprob, `token ${i} top ${j}`)
      })
    })
  })

  it('chat streamed: the chunks carry, in order, the entries of the whole response', async () => {
    const body = {
      model,
      messages: [{ role: 'user' as const, content: prompt }],
      max_tokens: 12,
      temperature: 0,
      logprobs: true,
      top_logprobs: 2,
    }
    const whole = await api().chat.completions.create(body)
    const stream = await api().chat.completions.create({ ...body, stream: true })
    const entries: ChatEntry[] = []
    let text = ''
    for await (const chunk of stream) {
      for (const c of chunk.choices) {
        text += c.delta.content ?? ''
        entries.push(...(c.logprobs?.content ?? []))
      }
    }
    assert.equal(text, whole.choices[0].message.content)
    assert.deepEqual(
      entries.map((e) => e.token),
      whole.choices[0].logprobs!.content!.map((e) => e.token),
    )
    entries.forEach((e, i) => {
      checkGreedyChatEntry(e, 2, `streamed token ${i}`)
      assertNear(e.logprob, whole.choices[0].logprobs!.content![i].logprob, `token ${i}`)
    })
  })

  it('chat: logprobs without top_logprobs gives the token’s own logprob and no alternatives', async () => {
    const res = await api().chat.completions.create({
      model,
      messages: [{ role: 'user', content: 'hello there' }],
      max_tokens: 3,
      temperature: 0,
      logprobs: true,
    })
    const content = res.choices[0].logprobs!.content!
    assert.equal(content.length, res.usage!.completion_tokens)
    for (const e of content) assert.deepEqual(e.top_logprobs, [])
    const plain = await api().chat.completions.create({
      model,
      messages: [{ role: 'user', content: 'hello there' }],
      max_tokens: 3,
      temperature: 0,
    })
    assert.equal(plain.choices[0].logprobs, null)
  })

  it('completions: tokens, token_logprobs, top_logprobs (N + the chosen one), text_offset', async () => {
    const res = await api().completions.create({
      model,
      prompt,
      max_tokens: 10,
      temperature: 0,
      logprobs: 3,
    })
    const lp = res.choices[0].logprobs!
    const n = res.usage!.completion_tokens
    assert.equal(lp.tokens!.length, n)
    assert.equal(lp.token_logprobs!.length, n)
    assert.equal(lp.top_logprobs!.length, n)
    const want = localRun(prompt, 10, { numLogprobs: 3 })
    assert.deepEqual(lp.tokens, want.tokenIds.map(tokenText))
    let offset = 0
    lp.tokens!.forEach((token, i) => {
      const top = lp.top_logprobs![i]
      // Greedy: the chosen token is among the top 3 (and first), so exactly 3 keys.
      assert.equal(Object.keys(top).length, 3, `token ${i}`)
      assert.equal(top[token], lp.token_logprobs![i])
      assert.equal(Math.max(...Object.values(top)), lp.token_logprobs![i])
      assertNear(lp.token_logprobs![i], want.logprobs![i].logprob, `token ${i}`)
      assert.equal(lp.text_offset![i], offset)
      offset += [...token].length
    })
    assert.equal(lp.tokens!.join(''), res.choices[0].text)
  })

  it('completions with logprobs 0: the chosen token alone, also when sampled at random', async () => {
    const res = await api().completions.create({
      model,
      prompt,
      max_tokens: 8,
      temperature: 1.5,
      seed: 5,
      logprobs: 0,
    })
    const lp = res.choices[0].logprobs!
    const want = localRun(prompt, 8, { temperature: 1.5, seed: 5, numLogprobs: 0 })
    assert.deepEqual(lp.tokens, want.tokenIds.map(tokenText))
    lp.tokens!.forEach((token, i) => {
      assert.deepEqual(Object.keys(lp.top_logprobs![i]), [token])
      assertNear(lp.token_logprobs![i], want.logprobs![i].logprob, `token ${i}`)
    })
  })

  it('completions streamed: text_offset runs on across chunks', async () => {
    const body = { model, prompt, max_tokens: 9, temperature: 0, logprobs: 1 }
    const whole = (await api().completions.create(body)).choices[0].logprobs!
    const stream = await api().completions.create({ ...body, stream: true })
    const tokens: string[] = []
    const offsets: number[] = []
    for await (const chunk of stream) {
      for (const c of chunk.choices) {
        tokens.push(...(c.logprobs?.tokens ?? []))
        offsets.push(...(c.logprobs?.text_offset ?? []))
      }
    }
    assert.deepEqual(tokens, whole.tokens)
    assert.deepEqual(offsets, whole.text_offset)
  })

  it('stop_token_ids ends the output after that token with finish_reason stop', async () => {
    const free = localRun(prompt, 12, {})
    // The first token that does not occur earlier in the output: generation must end right there.
    const at = free.tokenIds.findIndex((id, i) => i >= 2 && !free.tokenIds.slice(0, i).includes(id))
    assert.ok(at > 0, 'the model repeats one token only')
    const stopId = free.tokenIds[at]
    const res = await api().completions.create({
      model,
      prompt,
      max_tokens: 12,
      temperature: 0,
      stop_token_ids: [stopId],
    } as unknown as { model: string; prompt: string })
    assert.equal(res.choices[0].finish_reason, 'stop')
    assert.equal(res.usage!.completion_tokens, at + 1)
    assert.equal(res.choices[0].text, tokenizer.decode(free.tokenIds.slice(0, at + 1)))
  })

  it('the same seed twice gives the same text with top_k, min_p and penalties', async () => {
    const body = {
      model,
      prompt: 'a market opens before the morning bread; the baker sings 7Yt2mW0q, the baker sings',
      max_tokens: 24,
      temperature: 1.2,
      seed: 77,
      top_k: 8,
      min_p: 0.02,
      presence_penalty: 0.4,
      frequency_penalty: 0.3,
    }
    const first = await api().completions.create(body)
    const second = await api().completions.create(body)
    assert.equal(second.choices[0].text, first.choices[0].text)
    const want = localRun(body.prompt, 24, {
      temperature: 1.2,
      seed: 77,
      topK: 8,
      minP: 0.02,
      presencePenalty: 0.4,
      frequencyPenalty: 0.3,
    })
    assert.equal(first.choices[0].text, tokenizer.decode(want.tokenIds))
  })

  it(
    'responses with logprobs validate against the OpenAI OpenAPI description',
    { skip: specSkip },
    async () => {
      const chat = {
        model,
        messages: [{ role: 'user', content: 'hello there' }],
        max_tokens: 5,
        temperature: 0,
        logprobs: true,
        top_logprobs: 2,
      }
      check('CreateChatCompletionResponse', await (await post('/v1/chat/completions', chat)).json())
      const chatChunks = await sseEvents(
        await post('/v1/chat/completions', {
          ...chat,
          stream: true,
          stream_options: { include_usage: true },
        }),
      )
      assert.ok(chatChunks.length > 3)
      for (const chunk of chatChunks) check('CreateChatCompletionStreamResponse', chunk)

      const completion = {
        model,
        prompt: 'hello there',
        max_tokens: 5,
        temperature: 0,
        logprobs: 2,
      }
      check('CreateCompletionResponse', await (await post('/v1/completions', completion)).json())
      const chunks = await sseEvents(await post('/v1/completions', { ...completion, stream: true }))
      assert.ok(chunks.length > 2)
      for (const chunk of chunks) {
        // The spec's completion schema is shared by streamed chunks but has no null finish_reason
        // (OpenAI and vLLM send null mid-stream): checked with the final reason filled in.
        const filled = structuredClone(chunk) as { choices: { finish_reason: unknown }[] }
        for (const c of filled.choices) c.finish_reason ??= 'length'
        check('CreateCompletionResponse', filled)
      }
    },
  )
})
