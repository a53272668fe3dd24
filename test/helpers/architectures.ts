/** Every architecture the engine loads, as the architecture-coverage test enumerates them: the
 *  folders of models/test/, the bundled echo model, and the model types `src/model/config.ts`
 *  accepts (one without a checkpoint of its own is built from another's weights under its name).
 *  Also renders the coverage table of docs/faults.md and compares it with the doc.
 *  Knows model directories and config fields; knows nothing of faults or pools. */
import { readFileSync, readdirSync } from 'node:fs'
import { join } from 'node:path'
import { parseModelConfig, type ModelConfig } from '../../src/model/config.js'
import { parseSafetensorsRaw } from '../../src/model/safetensors.js'
import { loadModel, modelFromTensors, type Model } from '../../src/model/weights.js'
import { echoModelDir, repoRoot } from './paths.js'

/** models/test/: one tiny random-weight checkpoint per architecture variant. */
export const testModelsDir = join(repoRoot, 'models', 'test')

/** The folder names under models/test/, sorted. */
export function testModelFolders(): string[] {
  return readdirSync(testModelsDir, { withFileTypes: true })
    .filter((e) => e.isDirectory())
    .map((e) => e.name)
    .sort()
}

/** The `model_type`s config.ts accepts. config.ts keeps its list private; its refusal of an
 *  unknown type names every accepted one ("… is not supported (llama, qwen2 are)"), so the list is
 *  read from that message: a type added there appears here without anyone editing this file.
 *  Throws when the message no longer has that form (the enumeration would otherwise go blind). */
export function supportedModelTypes(): string[] {
  const raw = JSON.parse(readFileSync(join(echoModelDir, 'config.json'), 'utf8')) as object
  try {
    parseModelConfig({ ...raw, model_type: 'no-such-architecture' })
  } catch (err) {
    const match = /is not supported \((.+) are\)$/.exec((err as Error).message)
    if (match) return match[1].split(', ').sort()
    throw new Error(`cannot read the supported model types from: ${(err as Error).message}`)
  }
  throw new Error('config.ts accepted model_type "no-such-architecture"')
}

/** One architecture of the matrix: how to load it and what it stands for. */
export interface Architecture {
  /** Row name: the models/test folder, `echo-tiny`, or `<model_type> (<folder> weights)`. */
  name: string
  /** The models/test folder it covers, or null (echo-tiny, or a model type built from another
   *  folder's weights). */
  folder: string | null
  load(): Model
}

/** What one row stands for, from its config: model type, heads:kv-heads, and its variant's
 *  distinguishing features (biases, tied embeddings, RoPE scaling). */
export function describeConfig(c: ModelConfig): string {
  const features = [
    `${c.modelType}`,
    `GQA ${c.numHeads}:${c.numKvHeads}`,
    c.attentionBias ? (c.outputBias ? 'q/k/v/o biases' : 'q/k/v biases') : null,
    c.tieWordEmbeddings ? 'tied embeddings' : null,
    c.ropeScaling ? `${c.ropeScaling.ropeType} RoPE scaling` : null,
  ]
  return features.filter((f) => f !== null).join(', ')
}

/** Load `folder` of models/test/ with its config's `model_type` replaced by `modelType`: how a
 *  supported type without a checkpoint of its own (Mistral, which config.ts reads as Llama without
 *  a sliding window) is run through the engine's loader under its own name. */
export function loadAs(folder: string, modelType: string): Model {
  const dir = join(testModelsDir, folder)
  const raw = JSON.parse(readFileSync(join(dir, 'config.json'), 'utf8')) as object
  const config = parseModelConfig({ ...raw, model_type: modelType }, `${folder}/config.json`)
  const file = join(dir, 'model.safetensors')
  return modelFromTensors(`${modelType}-${folder}`, config, parseSafetensorsRaw(readFileSync(file)))
}

/** The matrix's rows: every models/test folder that exists now, the echo model, and one row per
 *  supported model type that none of those has (built by {@link loadAs} over `donor`'s weights).
 *  The test compares this with {@link testModelFolders} and {@link supportedModelTypes}. */
export function architectures(
  folders: readonly string[],
  modelTypes: readonly string[],
  borrowed: Readonly<Record<string, string>>,
): Architecture[] {
  const rows: Architecture[] = folders.map((folder) => ({
    name: folder,
    folder,
    load: () => loadModel(join(testModelsDir, folder)),
  }))
  rows.push({
    name: 'echo-tiny',
    folder: null,
    load: () => loadModel(echoModelDir),
  })
  for (const modelType of modelTypes) {
    const donor = borrowed[modelType]
    if (donor === undefined) continue
    rows.push({
      name: `${modelType} (${donor} weights)`,
      folder: null,
      load: () => loadAs(donor, modelType),
    })
  }
  return rows
}

// ---------------------------------------------------------------------------------------------
// The generated section of docs/faults.md

/** docs/faults.md, whose section between {@link sectionBegin} and {@link sectionEnd} the
 *  coverage test generates. */
export const faultsDoc = join(repoRoot, 'docs', 'faults.md')
/** The line that opens the generated section (an HTML comment: invisible once rendered). */
export const sectionBegin =
  '<!-- architecture-coverage: generated by test/e2e/architecture-coverage.test.ts; do not edit by hand -->'
/** The line that closes the generated section. */
export const sectionEnd = '<!-- architecture-coverage: end -->'

/** The text between {@link sectionBegin} and {@link sectionEnd} in `doc` (without the marker
 *  lines), or null when either marker is missing. */
export function generatedSection(doc: string): string | null {
  const begin = doc.indexOf(sectionBegin)
  const end = doc.indexOf(sectionEnd)
  if (begin < 0 || end < begin) return null
  return doc.slice(begin + sectionBegin.length, end).replace(/^\n/, '')
}

/** One measured row of the table: per guard id, the matrix cells (fault names, with the guards
 *  a cell switched off) in which that guard refused; and the cells that ended in exactly the
 *  single-process tokens with the fault injected. */
export interface CoverageRow {
  architecture: string
  describes: string
  refusedBy: Readonly<Record<string, readonly string[]>>
  exactTokens: readonly string[]
}

/** The markdown table of `rows`: one column per guard in `guards`, a cell listing the matrix
 *  cells in which that guard refused (— when none did). */
export function renderCoverageTable(
  rows: readonly CoverageRow[],
  guards: readonly string[],
): string {
  const cell = (names: readonly string[] | undefined) =>
    names === undefined || names.length === 0 ? '—' : names.map((n) => `\`${n}\``).join(', ')
  const header = ['architecture', 'model', ...guards, 'exact single-process tokens under']
  const lines = [
    `| ${header.join(' | ')} |`,
    `| ${header.map(() => '---').join(' | ')} |`,
    ...rows.map(
      (r) =>
        `| ${[r.architecture, r.describes, ...guards.map((g) => cell(r.refusedBy[g])), cell(r.exactTokens)].join(' | ')} |`,
    ),
  ]
  return lines.join('\n') + '\n'
}
