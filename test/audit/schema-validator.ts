/** docs/report-schema.json compiled with Ajv (JSON Schema 2020-12, formats checked), for the tests
 *  that hold real reports against it. */
import { readFileSync } from 'node:fs'
import { join } from 'node:path'
import { Ajv2020, type ValidateFunction } from 'ajv/dist/2020.js'
import addFormatsModule from 'ajv-formats'
import { repoRoot } from '../helpers/paths.js'

const addFormats = addFormatsModule as unknown as typeof addFormatsModule.default

/** The schema as the docs hold it (parsed JSON). */
export function readReportSchema(): Record<string, unknown> {
  return JSON.parse(readFileSync(join(repoRoot, 'docs', 'report-schema.json'), 'utf8')) as Record<
    string,
    unknown
  >
}

/** A validator of reports; `errorsOf` gives its errors as one line each. */
export function reportValidator(): { validate: ValidateFunction; errorsOf(): string } {
  const ajv = new Ajv2020({ allErrors: true, strict: true })
  addFormats(ajv)
  const validate = ajv.compile(readReportSchema())
  const errorsOf = () =>
    (validate.errors ?? []).map((e) => `${e.instancePath || '/'} ${e.message}`).join('\n')
  return { validate, errorsOf }
}
