/** The Responses API end to end on kvfence's own workers: a real cluster (router, prefill and
 *  decode workers as OS processes, the bundled model, KV over TCP) driven by the official `openai`
 *  client. At temperature 0 a response's text is the chat completion of the same messages (the
 *  chat endpoint is the independent reference: the same template, the same workers), whole and
 *  streamed, and a response continued with `previous_response_id` is the chat completion of the
 *  whole conversation; another tenant cannot fetch or continue it. */
import assert from 'node:assert/strict'
import { rmSync } from 'node:fs'
import { after, before, describe, it } from 'node:test'
import OpenAI from 'openai'
import { type Cluster, startCluster } from '../../src/config/launch.js'
import { openaiClient, twoTenants } from '../helpers/cluster.js'
import { echoModelDir } from '../helpers/paths.js'

const { dir, tenants, tenantsFile } = twoTenants('kvfence-responses-')
const model = 'echo-tiny'

describe('the Responses API on a real cluster', () => {
  let cluster: Cluster
  let alpha: OpenAI
  let beta: OpenAI
  before(async () => {
    cluster = await startCluster({
      modelDir: echoModelDir,
      pageSize: 16,
      prefillPages: 32,
      decodePages: 64,
      tenantsFile,
      logLevel: 'warn',
    })
    alpha = openaiClient(cluster.routerUrl, tenants[0].key)
    beta = openaiClient(cluster.routerUrl, tenants[1].key)
  })
  after(async () => {
    await cluster?.stop()
    rmSync(dir, { recursive: true, force: true })
  })

  /** The chat completion's text of `messages` at temperature 0. */
  const chatText = async (messages: OpenAI.ChatCompletionMessageParam[]) =>
    (await alpha.chat.completions.create({ model, messages, max_tokens: 12, temperature: 0 }))
      .choices[0].message.content

  it('answers as chat does, whole and streamed, and continues a stored conversation', async () => {
    const first = await alpha.responses.create({
      model,
      instructions: 'Answer.',
      input: 'hello world',
      max_output_tokens: 12,
      temperature: 0,
    })
    const expected = await chatText([
      { role: 'system', content: 'Answer.' },
      { role: 'user', content: 'hello world' },
    ])
    assert.ok(expected !== null && expected.length > 0, 'the model answered nothing: no comparison')
    assert.equal(first.output_text, expected)

    const stream = await alpha.responses.create({
      model,
      instructions: 'Answer.',
      input: 'hello world',
      max_output_tokens: 12,
      temperature: 0,
      stream: true,
    })
    let streamed = ''
    for await (const event of stream) {
      if (event.type === 'response.output_text.delta') streamed += event.delta
    }
    assert.equal(streamed, expected)

    const second = await alpha.responses.create({
      model,
      input: 'and again',
      previous_response_id: first.id,
      max_output_tokens: 12,
      temperature: 0,
    })
    assert.equal(
      second.output_text,
      await chatText([
        { role: 'user', content: 'hello world' },
        { role: 'assistant', content: first.output_text },
        { role: 'user', content: 'and again' },
      ]),
    )
    assert.equal((await alpha.responses.retrieve(second.id)).output_text, second.output_text)
    const foreign = await beta.responses
      .create({ model, input: 'x', previous_response_id: second.id })
      .then(
        () => null,
        (e: unknown) => e,
      )
    assert.ok(foreign instanceof OpenAI.NotFoundError, String(foreign))
  })
})
