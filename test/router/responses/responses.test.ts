/** The Responses API on kvfence's own workers (the router in process, real HTTP, stand-in prefill
 *  and decode workers whose reply is "Hello, tenant!" then EOS), driven by the official `openai`
 *  client (`responses.create`, streamed and not, `.retrieve`, `.delete`); every body and event
 *  checked against OpenAI's OpenAPI description (`Response`, `ResponseStreamEvent`,
 *  `ErrorResponse`). The prompt the workers receive is compared with the test template's own
 *  rendering of the conversation; stored responses belong to their tenant. */
import assert from 'node:assert/strict'
import { after, before, describe, it } from 'node:test'
import OpenAI from 'openai'
import { loadValidators, specSkip, violations } from '../../helpers/openapi.js'
import { type Harness, bosId, charIds, defaultReplyText, keys, startHarness } from '../helpers.js'

const model = 'echo-test'

/** The prompt ids the test template gives `messages` ([role, content] pairs): BOS, then
 *  `<role>content\n` each, then `<assistant>`. */
function promptIds(messages: [string, string][]): number[] {
  const text = messages.map(([role, content]) => `<${role}>${content}\n`).join('') + '<assistant>'
  return [bosId, ...charIds(text)]
}

/** A response as the spec has it: the SDK adds `output_text` (a convenience, not the wire). */
function wire(response: OpenAI.Responses.Response): Record<string, unknown> {
  const { output_text: _, ...rest } = response as unknown as Record<string, unknown>
  return rest
}

/** The status and JSON body of an SDK call that must fail. */
async function failure(call: Promise<unknown>): Promise<{ status: number; error: unknown }> {
  const err = await call.then(
    () => null,
    (e: unknown) => e,
  )
  assert.ok(err instanceof OpenAI.APIError, String(err))
  return { status: err.status ?? 0, error: err.error }
}

describe('the Responses API on kvfence workers', { skip: specSkip }, () => {
  let h: Harness
  let validator: ReturnType<typeof loadValidators>
  const check = (schema: string, value: unknown) =>
    assert.deepEqual(
      violations(validator(schema), value),
      [],
      `${schema}: ${JSON.stringify(value)}`,
    )
  before(async () => {
    validator = loadValidators()
    h = await startHarness()
  })
  after(() => h.close())

  it("answers a string input with the workers' text, exact usage, stored by default", async () => {
    const response = await h.client().responses.create({ model, input: 'Hi there' })
    check('Response', wire(response))
    assert.match(response.id, /^resp_[0-9a-f]{32}$/)
    assert.equal(response.status, 'completed')
    assert.equal(response.output_text, defaultReplyText)
    assert.deepEqual(response.output, [
      {
        id: `msg_${response.id.slice(5)}`,
        type: 'message',
        status: 'completed',
        role: 'assistant',
        content: [{ type: 'output_text', text: defaultReplyText, annotations: [], logprobs: [] }],
      },
    ])
    const numInput = promptIds([['user', 'Hi there']]).length
    const numOutput = defaultReplyText.length + 1 // + EOS
    assert.deepEqual(response.usage, {
      input_tokens: numInput,
      input_tokens_details: { cached_tokens: 0, cache_write_tokens: 0 },
      output_tokens: numOutput,
      output_tokens_details: { reasoning_tokens: 0 },
      total_tokens: numInput + numOutput,
    })
    assert.equal(wire(response).store, true)
    assert.deepEqual(wire(await h.client().responses.retrieve(response.id)), wire(response))
  })

  it('renders instructions and message items (text and input_text parts) through the chat template', async () => {
    const before = h.workers.generateRequests.length
    await h.client().responses.create({
      model,
      instructions: 'Be brief',
      input: [
        { role: 'developer', content: 'Rules' },
        {
          role: 'user',
          content: [
            { type: 'input_text', text: 'Hello ' },
            { type: 'input_text', text: 'you' },
          ],
        },
        { type: 'message', role: 'assistant', content: 'Yes?' },
        { role: 'user', content: 'Go' },
      ],
      max_output_tokens: 64,
      temperature: 0.5,
      top_p: 0.9,
    })
    const sent = h.workers.generateRequests.slice(before)
    assert.equal(sent.length, 1)
    assert.deepEqual(
      sent[0].promptTokenIds,
      promptIds([
        ['system', 'Be brief'],
        ['developer', 'Rules'],
        ['user', 'Hello you'],
        ['assistant', 'Yes?'],
        ['user', 'Go'],
      ]),
    )
    assert.equal(sent[0].maxTokens, 64)
    assert.equal(sent[0].sampling.temperature, 0.5)
    assert.equal(sent[0].sampling.topP, 0.9)
    assert.equal(sent[0].tenant, 'alpha')
  })

  it("streams the events of OpenAI's stream, in order, numbered, each valid", async () => {
    const stream = await h.client().responses.create({ model, input: 'Hi', stream: true })
    const events: OpenAI.Responses.ResponseStreamEvent[] = []
    for await (const event of stream) events.push(event)
    for (const event of events) check('ResponseStreamEvent', event)
    const types = events.map((e) => e.type)
    const numDeltas = types.filter((t) => t === 'response.output_text.delta').length
    assert.ok(numDeltas >= 1)
    assert.deepEqual(types, [
      'response.created',
      'response.in_progress',
      'response.output_item.added',
      'response.content_part.added',
      ...Array<string>(numDeltas).fill('response.output_text.delta'),
      'response.output_text.done',
      'response.content_part.done',
      'response.output_item.done',
      'response.completed',
    ])
    assert.deepEqual(
      events.map((e) => e.sequence_number),
      events.map((_, i) => i),
    )
    const text = events
      .filter((e) => e.type === 'response.output_text.delta')
      .map((e) => e.delta)
      .join('')
    assert.equal(text, defaultReplyText)
    const last = events.at(-1)
    assert.ok(last?.type === 'response.completed')
    assert.equal(last.response.output_text ?? defaultReplyText, defaultReplyText)
    // The streamed response is stored as it ended.
    const stored = await h.client().responses.retrieve(last.response.id)
    assert.deepEqual(stored.output, last.response.output)
  })

  it('continues a stored response: the workers get the stored conversation, not its instructions', async () => {
    const first = await h.client().responses.create({ model, instructions: 'Old', input: 'One' })
    const before = h.workers.generateRequests.length
    const second = await h.client().responses.create({
      model,
      input: 'Two',
      previous_response_id: first.id,
    })
    assert.equal(second.previous_response_id, first.id)
    const third = await h.client().responses.create({
      model,
      input: 'Three',
      previous_response_id: second.id,
      stream: false,
    })
    const sent = h.workers.generateRequests.slice(before).map((r) => r.promptTokenIds)
    assert.deepEqual(sent, [
      promptIds([
        ['user', 'One'],
        ['assistant', defaultReplyText],
        ['user', 'Two'],
      ]),
      promptIds([
        ['user', 'One'],
        ['assistant', defaultReplyText],
        ['user', 'Two'],
        ['assistant', defaultReplyText],
        ['user', 'Three'],
      ]),
    ])
    assert.equal(third.output_text, defaultReplyText)
  })

  it('max_output_tokens ends the response incomplete, with its reason', async () => {
    const response = await h.client().responses.create({ model, input: 'Hi', max_output_tokens: 3 })
    check('Response', wire(response))
    assert.equal(response.status, 'incomplete')
    assert.deepEqual(response.incomplete_details, { reason: 'max_output_tokens' })
    assert.equal(response.output_text, defaultReplyText.slice(0, 3))
  })

  it('an input_image part: 400 naming the part and its kind, nothing generated', async () => {
    const before = h.workers.generateRequests.length
    const image = await failure(
      h.client().responses.create({
        model,
        input: [
          { role: 'user', content: 'Hi' },
          {
            role: 'user',
            content: [
              { type: 'input_text', text: 'What is this?' },
              { type: 'input_image', image_url: 'https://example.com/a.png', detail: 'auto' },
            ],
          },
        ],
      }),
    )
    assert.deepEqual(image, {
      status: 400,
      error: {
        message:
          'input[1].content[1] is an "input_image" part: this server\'s model takes text only (input_text parts)',
        type: 'invalid_request_error',
        param: 'input[1].content[1].type',
        code: 'invalid_request',
      },
    })
    check('ErrorResponse', { error: image.error })
    assert.equal(h.workers.generateRequests.length, before)
  })

  it("another tenant's id, an unknown id and a deleted id get the same 404; a malformed id a 400", async () => {
    const mine = await h.client(keys.alpha).responses.create({ model, input: 'Secret' })
    const unknown = `resp_${'0'.repeat(32)}`
    const notFound = (id: string, param: string | null) => ({
      status: 404,
      error: {
        message: `No response found with id '${id}'.`,
        type: 'invalid_request_error',
        param,
        code: 'not_found',
      },
    })
    const beta = h.client(keys.beta)
    assert.deepEqual(await failure(beta.responses.retrieve(mine.id)), notFound(mine.id, null))
    assert.deepEqual(await failure(beta.responses.retrieve(unknown)), notFound(unknown, null))
    assert.deepEqual(await failure(beta.responses.delete(mine.id)), notFound(mine.id, null))
    // Continuing another tenant's response: the same 404 as an unknown id, nothing generated.
    const before = h.workers.generateRequests.length
    const foreign = beta.responses.create({ model, input: 'x', previous_response_id: mine.id })
    assert.deepEqual(await failure(foreign), notFound(mine.id, 'previous_response_id'))
    const unknownPrevious = beta.responses.create({
      model,
      input: 'x',
      previous_response_id: unknown,
    })
    assert.deepEqual(await failure(unknownPrevious), notFound(unknown, 'previous_response_id'))
    const malformed = await failure(
      beta.responses.create({ model, input: 'x', previous_response_id: 'resp_nope' }),
    )
    assert.equal(malformed.status, 400)
    assert.deepEqual(malformed.error, {
      message:
        "Invalid 'previous_response_id': expected an ID that begins with 'resp_' followed by 32 hexadecimal digits.",
      type: 'invalid_request_error',
      param: 'previous_response_id',
      code: 'invalid_request',
    })
    const malformedGet = await failure(beta.responses.retrieve('resp_nope'))
    assert.equal(malformedGet.status, 400)
    assert.equal(h.workers.generateRequests.length, before)
    check('ErrorResponse', { error: malformed.error })
    check('ErrorResponse', { error: notFound(mine.id, null).error })
    // Still alpha's, whole; alpha deletes it, and then it is gone for alpha too.
    assert.equal(
      (await h.client(keys.alpha).responses.retrieve(mine.id)).output_text,
      defaultReplyText,
    )
    const deleted = await fetch(`${h.router.url}/v1/responses/${mine.id}`, {
      method: 'DELETE',
      headers: { authorization: `Bearer ${keys.alpha}` },
    })
    assert.equal(deleted.status, 200)
    assert.deepEqual(await deleted.json(), { id: mine.id, object: 'response', deleted: true })
    assert.deepEqual(
      await failure(h.client(keys.alpha).responses.retrieve(mine.id)),
      notFound(mine.id, null),
    )
  })

  it('store: false responses cannot be fetched or continued', async () => {
    const response = await h.client().responses.create({ model, input: 'Hi', store: false })
    assert.equal(wire(response).store, false)
    assert.equal((await failure(h.client().responses.retrieve(response.id))).status, 404)
    const continued = h.client().responses.create({
      model,
      input: 'x',
      previous_response_id: response.id,
    })
    assert.equal((await failure(continued)).status, 404)
  })

  it('refuses what it does not implement, and internal fields, naming the field', async () => {
    const refused = async (body: Record<string, unknown>) => {
      const res = await h.post('/v1/responses', { model, input: 'Hi', ...body })
      assert.equal(res.status, 400)
      const json = (await res.json()) as { error: { param: string } }
      check('ErrorResponse', json)
      return json.error.param
    }
    assert.equal(await refused({ tools: [{ type: 'web_search' }] }), 'tools')
    assert.equal(await refused({ cache_salt: 'mine' }), 'cache_salt')
    assert.equal(await refused({ input: [{ role: 'tool', content: 'x' }] }), 'input')
    assert.equal(await refused({ input: [] }), 'input')
    assert.equal(await refused({ max_output_tokens: 0 }), 'max_output_tokens')
    assert.equal(await refused({ frequency_penalty: 1 }), 'frequency_penalty')
  })

  it("lists a response's input items (order, after, limit), to its own tenant only", async () => {
    const input = [
      { role: 'system' as const, content: 'Be brief.' },
      { role: 'user' as const, content: [{ type: 'input_text' as const, text: 'one' }] },
      { role: 'assistant' as const, content: 'two' },
      {
        role: 'user' as const,
        content: [
          { type: 'input_text' as const, text: 'three' },
          { type: 'input_text' as const, text: ' four' },
        ],
      },
    ]
    const response = await h.client().responses.create({ model, input, instructions: 'Hi' })
    const expected = [
      { role: 'system', content: [{ type: 'input_text', text: 'Be brief.' }] },
      { role: 'user', content: [{ type: 'input_text', text: 'one' }] },
      {
        role: 'assistant',
        content: [{ type: 'output_text', text: 'two', annotations: [], logprobs: [] }],
      },
      {
        role: 'user',
        content: [
          { type: 'input_text', text: 'three' },
          { type: 'input_text', text: ' four' },
        ],
      },
    ].map((item) => ({ type: 'message', status: 'completed', ...item }))
    const items = h.client().responses.inputItems
    const page = await items.list(response.id, { order: 'asc' })
    const body = (await items
      .list(response.id, { order: 'asc' })
      .asResponse()
      .then((r) => r.json())) as Record<string, unknown>
    check('ResponseItemList', body)
    assert.deepEqual(body.data, page.data)
    const withoutIds = page.data.map(({ id: _, ...rest }) => rest)
    assert.deepEqual(withoutIds, expected)
    const ids = page.data.map((item) => item.id!)
    assert.equal(new Set(ids).size, 4)
    for (const id of ids) assert.match(id, /^msg_[0-9a-f]{32}$/)
    assert.deepEqual(body.first_id, ids[0])
    assert.deepEqual(body.last_id, ids[3])
    assert.equal(body.has_more, false)
    // The default order is desc: the last input item first.
    assert.deepEqual(
      (await items.list(response.id)).data.map((item) => item.id),
      [...ids].reverse(),
    )
    const second = await items.list(response.id, { order: 'asc', after: ids[0], limit: 2 })
    assert.deepEqual(
      second.data.map((item) => item.id),
      ids.slice(1, 3),
    )
    assert.equal(second.has_more, true)
    // The SDK's own paging follows `after` to the end.
    const paged: string[] = []
    for await (const item of items.list(response.id, { order: 'asc', limit: 1 }))
      paged.push(item.id!)
    assert.deepEqual(paged, ids)
    // Another tenant's id is the unknown id's 404, body for body but the id.
    const foreign = await failure(h.client(keys.beta).responses.inputItems.list(response.id))
    const unknownId = `resp_${'0'.repeat(32)}`
    const unknown = await failure(h.client(keys.beta).responses.inputItems.list(unknownId))
    assert.equal(foreign.status, 404)
    assert.deepEqual(
      JSON.parse(JSON.stringify(foreign.error).replaceAll(response.id, unknownId)),
      unknown.error,
    )
    // Bad queries name their parameter.
    for (const [query, param] of [
      ['limit=0', 'limit'],
      ['limit=101', 'limit'],
      ['order=up', 'order'],
      [`after=msg_${'f'.repeat(32)}`, 'after'],
      ['before=x', 'before'],
    ]) {
      const res = await fetch(`${h.router.url}/v1/responses/${response.id}/input_items?${query}`, {
        headers: { authorization: `Bearer ${keys.alpha}` },
      })
      assert.equal(res.status, 400, query)
      const json = (await res.json()) as { error: { param: string } }
      check('ErrorResponse', json)
      assert.equal(json.error.param, param, query)
    }
  })

  it("refuses a request over the window (G2) naming Responses' fields, never chat's", async () => {
    const refusal = async (body: Record<string, unknown>) => {
      const res = await h.post('/v1/responses', { model, ...body })
      assert.equal(res.status, 400)
      const json = (await res.json()) as { error: { message: string; param: string; code: string } }
      check('ErrorResponse', json)
      assert.equal(json.error.code, 'context_length_exceeded')
      return json.error
    }
    const window = 64 * 16 // the harness's pool: 64 pages of 16 tokens
    const numHi = promptIds([['user', 'Hi']]).length
    assert.deepEqual(await refusal({ input: 'Hi', max_output_tokens: window }), {
      code: 'context_length_exceeded',
      type: 'invalid_request_error',
      param: 'max_output_tokens',
      message:
        `This model's maximum context length is ${window} tokens. However, you requested ` +
        `${numHi + window} tokens (${numHi} in the input, ${window} in the output). ` +
        'Please reduce the length of the input or max_output_tokens.',
    })
    const long = 'a'.repeat(window)
    const numLong = promptIds([
      ['system', 'Be brief.'],
      ['user', long],
    ]).length
    const tooLong = await refusal({ instructions: 'Be brief.', input: long })
    assert.equal(tooLong.param, 'input')
    assert.equal(
      tooLong.message,
      `This model's maximum context length is ${window} tokens. However, you requested ` +
        `${numLong + 1} tokens (${numLong} in the input, at least 1 in the output). ` +
        'Please reduce the length of the input or max_output_tokens.',
    )
    assert.doesNotMatch(tooLong.message, /messages|max_tokens/)
  })

  it('counts the requests under endpoint "responses" in the metrics', async () => {
    await h.client(keys.beta).responses.create({ model, input: 'Hi' })
    const metrics = await (await fetch(`${h.router.url}/metrics`)).text()
    const line = metrics
      .split('\n')
      .find((l) =>
        l.startsWith(
          'kvfence_router_requests_total{endpoint="responses",tenant="beta",status="200"}',
        ),
      )
    assert.ok(line, 'no responses line for beta')
    assert.ok(!metrics.includes('Secret'), 'a prompt in the metrics')
  })
})

describe('a Responses stream whose worker fails after the first text', { skip: specSkip }, () => {
  let h: Harness
  before(async () => {
    h = await startHarness({ decodeErrorAfterTokens: 3 })
  })
  after(() => h.close())

  it('ends with an error event after the text so far, never a completed response; nothing stored', async () => {
    const validator = loadValidators()
    const res = await h.post('/v1/responses', { model, input: 'Hi', stream: true })
    assert.equal(res.status, 200)
    const events = (await res.text())
      .split('\n\n')
      .filter((e) => e !== '')
      .map((e) => {
        const [eventLine, dataLine] = e.split('\n')
        const value = JSON.parse(dataLine.slice('data: '.length)) as { type: string }
        assert.equal(eventLine, `event: ${value.type}`)
        return value as Record<string, unknown> & { type: string }
      })
    for (const event of events) {
      assert.deepEqual(violations(validator('ResponseStreamEvent'), event), [], event.type)
    }
    const types = events.map((e) => e.type)
    assert.ok(!types.includes('response.completed'))
    const last = events.at(-1)!
    assert.equal(last.type, 'error')
    assert.equal(last.param, null)
    assert.equal(typeof last.code, 'string')
    const text = events
      .filter((e) => e.type === 'response.output_text.delta')
      .map((e) => e.delta)
      .join('')
    assert.equal(text, defaultReplyText.slice(0, 3))
    const id = (events[0].response as { id: string }).id
    assert.equal((await failure(h.client().responses.retrieve(id))).status, 404)
  })
})
