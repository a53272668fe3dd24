/** The router's response bodies match OpenAI's published OpenAPI description (the schemas named
 *  below), checked by Ajv (JSON Schema 2020-12, the dialect of OpenAPI 3.1) with `ajv-formats`;
 *  `$ref`s resolve into the spec's own component schemas. Skipped when the spec file is not present
 *  (set KVFENCE_OPENAI_SPEC to its path). */
import assert from 'node:assert/strict'
import { existsSync, readFileSync } from 'node:fs'
import { join } from 'node:path'
import { after, before, describe, it } from 'node:test'
import { Ajv2020, type ErrorObject, type ValidateFunction } from 'ajv/dist/2020.js'
import addFormatsModule from 'ajv-formats'
import { parse as parseYaml } from 'yaml'
import { repoRoot } from '../helpers/paths.js'
import { type Harness, keys, startHarness } from './helpers.js'

// The project's shared/ folder sits beside the repository (also in CI).
const specPath =
  process.env.KVFENCE_OPENAI_SPEC ?? join(repoRoot, '..', 'shared', 'specs', 'openai-openapi.yaml')
const hasSpec = existsSync(specPath)
const specId = 'https://kvfence.test/openai-openapi.json'
// ajv-formats is CommonJS with a default export; under NodeNext its default is the module.
const addFormats = addFormatsModule as unknown as typeof addFormatsModule.default

/** OpenAPI 3.0's `nullable: true`, which OpenAI's 3.1 description still carries beside `type`,
 *  `$ref` and `allOf`, as 3.1 spells it: the schema or null. (3.1 dropped the keyword, so no
 *  2020-12 validator knows it; Ajv's own `nullable` needs a sibling `type`, and
 *  @openapi-contrib/openapi-schema-to-json-schema@5.1.0 drops the null beside `$ref`/`allOf` and
 *  refuses 3.1 type arrays.) */
function upgradeNullable(node: unknown): unknown {
  if (Array.isArray(node)) return node.map(upgradeNullable)
  if (node === null || typeof node !== 'object') return node
  const { nullable, ...rest } = node as Record<string, unknown>
  const upgraded = Object.fromEntries(
    Object.entries(rest).map(([key, value]) => [key, upgradeNullable(value)]),
  )
  return nullable === true ? { anyOf: [upgraded, { type: 'null' }] } : upgraded
}

/** Validators of the spec's component schemas, by name. */
function loadValidators(path: string): (name: string) => ValidateFunction {
  const spec = parseYaml(readFileSync(path, 'utf8')) as { components: { schemas: unknown } }
  // strict off: the spec carries OpenAPI-only keywords (discriminator, x-oaiMeta, example).
  const ajv = new Ajv2020({ strict: false, allErrors: true })
  addFormats(ajv)
  // OpenAI's own formats on numbers and maps; only `unixtime` occurs in the schemas checked here.
  ajv.addFormat('unixtime', { type: 'number', validate: (n) => Number.isSafeInteger(n) && n >= 0 })
  for (const format of ['map', 'double', 'float', 'int64', 'binary', 'file', 'png']) {
    ajv.addFormat(format, true)
  }
  ajv.addSchema({ $id: specId, components: { schemas: upgradeNullable(spec.components.schemas) } })
  return (name) => {
    const validate = ajv.getSchema(`${specId}#/components/schemas/${name}`)
    assert.ok(validate, `the spec has no schema ${name}`)
    return validate
  }
}

/** `instancePath message` of each of Ajv's errors (empty when `value` is valid). */
function violations(validate: ValidateFunction, value: unknown): string[] {
  if (validate(value)) return []
  return (validate.errors ?? []).map((e: ErrorObject) => `${e.instancePath} ${e.message ?? ''}`)
}

// Each test is skipped (and counted as skipped, never as passed) when the spec is not there.
const skip = hasSpec ? false : `no OpenAPI description at ${specPath} (set KVFENCE_OPENAI_SPEC)`

describe('responses match the OpenAI OpenAPI description', () => {
  let h: Harness
  let schema: (name: string) => ValidateFunction
  const check = (name: string, value: unknown) =>
    assert.deepEqual(violations(schema(name), value), [], name)
  const sseEvents = async (res: Response) =>
    (await res.text())
      .split('\n\n')
      .filter((e) => e !== '' && e !== 'data: [DONE]')
      .map((e) => JSON.parse(e.slice('data: '.length)) as unknown)

  before(async () => {
    if (!hasSpec) return
    schema = loadValidators(specPath)
    h = await startHarness({ decodeErrorAfterTokens: undefined })
  })
  after(() => h?.close())

  it('validates a known-bad body as bad (the validator works)', { skip }, () => {
    const errors = violations(schema('CreateCompletionResponse'), {
      id: 'x',
      object: 'chat.completion',
      created: 1.5,
      choices: [{ index: 0, text: 'a', finish_reason: 'done' }],
    })
    assert.ok(errors.includes(" must have required property 'model'"), errors.join('; '))
    assert.ok(errors.includes('/object must be equal to one of the allowed values'))
    assert.ok(errors.includes('/created must be integer'))
    assert.ok(
      errors.includes('/choices/0/finish_reason must be equal to one of the allowed values'),
    )
    assert.ok(errors.includes("/choices/0 must have required property 'logprobs'"))
    // nullable beside a type: null passes where the spec allows it, and only there.
    const chat = schema('CreateChatCompletionStreamResponse')
    const chunk = (finishReason: unknown) => ({
      id: 'c',
      object: 'chat.completion.chunk',
      created: 1,
      model: 'm',
      choices: [{ index: 0, delta: {}, finish_reason: finishReason }],
    })
    assert.deepEqual(violations(chat, chunk(null)), [])
    assert.notDeepEqual(violations(chat, { ...chunk(null), created: null }), [])
  })

  it('chat.completion and chat.completion.chunk', { skip }, async () => {
    const body = { model: 'echo-test', messages: [{ role: 'user', content: 'Hi' }], max_tokens: 4 }
    check('CreateChatCompletionResponse', await (await h.post('/v1/chat/completions', body)).json())
    const chunks = await sseEvents(
      await h.post('/v1/chat/completions', {
        ...body,
        stream: true,
        stream_options: { include_usage: true },
      }),
    )
    assert.ok(chunks.length > 3)
    for (const chunk of chunks) check('CreateChatCompletionStreamResponse', chunk)
  })

  it('text_completion, plain and streamed', { skip }, async () => {
    const body = { model: 'echo-test', prompt: 'Hi', max_tokens: 4 }
    check('CreateCompletionResponse', await (await h.post('/v1/completions', body)).json())
    const chunks = await sseEvents(
      await h.post('/v1/completions', {
        ...body,
        stream: true,
        stream_options: { include_usage: true },
      }),
    )
    // Known gap in the spec: its legacy completion schema is shared by streamed chunks, yet OpenAI
    // (and vLLM) send `finish_reason: null` on every chunk but the last one of a choice.
    const completion = schema('CreateCompletionResponse')
    for (const chunk of chunks) {
      const isLast = (chunk as { choices: { finish_reason: unknown }[] }).choices.every(
        (c) => c.finish_reason !== null,
      )
      if (isLast) check('CreateCompletionResponse', chunk)
      else {
        const withReason = structuredClone(chunk) as { choices: { finish_reason: unknown }[] }
        for (const choice of withReason.choices) choice.finish_reason = 'length'
        assert.deepEqual(violations(completion, withReason), [], 'a mid-stream chunk')
      }
    }
    const finishes = chunks.flatMap((c) => (c as { choices: { finish_reason: unknown }[] }).choices)
    assert.equal(finishes.at(-1)!.finish_reason, 'length')
  })

  it('the model list and error bodies', { skip }, async () => {
    const models = await fetch(`${h.router.url}/v1/models`, {
      headers: { authorization: `Bearer ${keys.alpha}` },
    })
    check('ListModelsResponse', await models.json())
    check(
      'ErrorResponse',
      await (await h.post('/v1/completions', { model: 'echo-test', prompt: '' })).json(),
    )
    check(
      'ErrorResponse',
      await (await h.post('/v1/completions', {}, { authorization: 'Bearer nope' })).json(),
    )
  })
})
