/** Checking response bodies against OpenAI's published OpenAPI description: its component schemas
 *  (e.g. `CreateChatCompletionResponse`, `ErrorResponse`) compiled by Ajv (JSON Schema 2020-12, the
 *  dialect of OpenAPI 3.1) with `ajv-formats`, `$ref`s resolving into the spec's own components.
 *  The spec is the copy in test/fixtures/openai-openapi/ (see its README: source commit and
 *  licence), or the file KVFENCE_OPENAI_SPEC names; tests that need it are skipped (and counted
 *  as skipped, with {@link specSkip} as the reason) only when that variable names a missing file.
 *  Not a test file itself. */
import assert from 'node:assert/strict'
import { createHash } from 'node:crypto'
import { existsSync, mkdirSync, readFileSync, renameSync, writeFileSync } from 'node:fs'
import { join } from 'node:path'
import { Ajv2020, type ErrorObject, type ValidateFunction } from 'ajv/dist/2020.js'
import addFormatsModule from 'ajv-formats'
import { parse as parseYaml } from 'yaml'
import { repoRoot } from './paths.js'

/** Where the spec is read: KVFENCE_OPENAI_SPEC, or the copy kept with the tests. */
export const specPath =
  process.env.KVFENCE_OPENAI_SPEC ??
  join(repoRoot, 'test', 'fixtures', 'openai-openapi', 'openai-openapi.yaml')
/** Whether the spec file is there. */
export const hasSpec = existsSync(specPath)
/** The `skip` option of a test that needs the spec: false when it is there, else the reason. */
export const specSkip: false | string = hasSpec
  ? false
  : `no OpenAPI description at ${specPath} (set KVFENCE_OPENAI_SPEC)`

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

/** Where parsed specs are kept as JSON, by the SHA-256 of their YAML: parsing the ~3 MB YAML
 *  took ~2.5 s of CPU per test file, reading its JSON ~0.1 s. */
const specCacheDir = join(repoRoot, 'node_modules', '.cache', 'kvfence-openapi')

/** The spec at `path`, parsed: from the JSON cache when it holds this exact YAML's (by hash), else
 *  parsed from the YAML and cached (written to a file of its own and renamed, so that test files
 *  running side by side never read a half-written one). */
function readSpec(path: string): { components: { schemas: unknown } } {
  const yaml = readFileSync(path, 'utf8')
  const cached = join(specCacheDir, `${createHash('sha256').update(yaml).digest('hex')}.json`)
  if (existsSync(cached)) {
    return JSON.parse(readFileSync(cached, 'utf8')) as { components: { schemas: unknown } }
  }
  const spec = parseYaml(yaml) as { components: { schemas: unknown } }
  mkdirSync(specCacheDir, { recursive: true })
  const partial = `${cached}.${process.pid}.tmp`
  writeFileSync(partial, JSON.stringify(spec))
  renameSync(partial, cached)
  return spec
}

/** Each spec's lookup, compiled once per process (Ajv keeps the validators it compiled). */
const lookups = new Map<string, (name: string) => ValidateFunction>()

/** Compiles the spec at `path` (default {@link specPath}; once per process and path) and returns
 *  a lookup of validators of its component schemas by name; the lookup fails an assertion for a
 *  name the spec does not have. */
export function loadValidators(path: string = specPath): (name: string) => ValidateFunction {
  const known = lookups.get(path)
  if (known !== undefined) return known
  const spec = readSpec(path)
  // strict off: the spec carries OpenAPI-only keywords (discriminator, x-oaiMeta, example).
  const ajv = new Ajv2020({ strict: false, allErrors: true })
  addFormats(ajv)
  // OpenAI's own formats on numbers and maps; only `unixtime` occurs in the schemas checked here.
  ajv.addFormat('unixtime', { type: 'number', validate: (n) => Number.isSafeInteger(n) && n >= 0 })
  for (const format of ['map', 'double', 'float', 'int64', 'binary', 'file', 'png']) {
    ajv.addFormat(format, true)
  }
  ajv.addSchema({ $id: specId, components: { schemas: upgradeNullable(spec.components.schemas) } })
  const lookup = (name: string) => {
    const validate = ajv.getSchema(`${specId}#/components/schemas/${name}`)
    assert.ok(validate, `the spec has no schema ${name}`)
    return validate
  }
  lookups.set(path, lookup)
  return lookup
}

/** `instancePath message` of each of Ajv's errors (empty when `value` is valid). */
export function violations(validate: ValidateFunction, value: unknown): string[] {
  if (validate(value)) return []
  return (validate.errors ?? []).map((e: ErrorObject) => `${e.instancePath} ${e.message ?? ''}`)
}

/** The JSON events of an SSE body (`data: {...}` events; `data: [DONE]` left out). */
export async function sseEvents(res: Response): Promise<unknown[]> {
  return (await res.text())
    .split('\n\n')
    .filter((e) => e !== '' && e !== 'data: [DONE]')
    .map((e) => JSON.parse(e.slice('data: '.length)) as unknown)
}
