/** What the fault tests (test/engine/faults-cluster.test.ts, test/e2e/faults.test.ts) read from a
 *  cluster, in process or forked alike: completions through the official `openai` client with the
 *  error they ended with, a worker's `/metrics` samples, both pools back to idle, and the
 *  single-process engine's text to compare with. Not a test file itself. */
import assert from 'node:assert/strict'
import OpenAI from 'openai'
import { buildFaultConfig } from '../../src/engine/faults.js'
import { generateLocal } from '../../src/engine/local-engine.js'
import { createWorkerCore } from '../../src/engine/worker-core.js'
import { loadTokenizer } from '../../src/model/tokenizer.js'
import { loadModel } from '../../src/model/weights.js'
import { pagesUsed } from './cluster.js'
import { echoModelDir } from './paths.js'

/** Wait until both pools are back to 0 used pages (the workers free asynchronously after an error
 *  reached the client), at most 5 s. */
export async function assertIdle(cluster: {
  prefillUrl: string
  decodeUrl: string
}): Promise<void> {
  const deadline = Date.now() + 5_000
  let used = await pagesUsed(cluster)
  while (used.some((n) => n !== 0) && Date.now() < deadline) {
    await new Promise((r) => setTimeout(r, 20))
    used = await pagesUsed(cluster)
  }
  assert.deepEqual(used, [0, 0], 'pages used on [prefill, decode]')
}

/** A sample of a worker's `/metrics` (0 when the labelled series is absent). */
export async function metric(url: string, name: string, labels = ''): Promise<number> {
  const text = await (await fetch(`${url}/metrics`)).text()
  const line = text
    .split('\n')
    .find(
      (l) =>
        (l.startsWith(`${name}{`) && l.includes(labels)) ||
        (labels === '' && l.startsWith(`${name} `)),
    )
  return line === undefined ? 0 : Number(line.slice(line.lastIndexOf(' ') + 1))
}

/** How one completion ended. */
export interface Answer {
  text: string
  /** The OpenAI error the request ended with (thrown, or an in-stream error event), or null. */
  error: InstanceType<typeof OpenAI.APIError> | null
}

/** One completion, streamed or not; collects the text and the error it ended with. */
export async function ask(
  c: OpenAI,
  prompt: string,
  opts: { stream?: boolean; maxTokens?: number } = {},
): Promise<Answer> {
  let text = ''
  try {
    const base = { model: 'echo-tiny', prompt, max_tokens: opts.maxTokens ?? 16, temperature: 0 }
    if (opts.stream) {
      const stream = await c.completions.create({ ...base, stream: true })
      for await (const chunk of stream) text += chunk.choices[0]?.text ?? ''
    } else {
      text = (await c.completions.create(base)).choices[0].text
    }
    return { text, error: null }
  } catch (err) {
    if (err instanceof OpenAI.APIError) return { text, error: err }
    throw err
  }
}

let tokenizer: ReturnType<typeof loadTokenizer> | null = null
/** The single-process engine's text for `prompt` at temperature 0, `maxTokens` tokens (the echo
 *  model, one 64-page pool of 16-token pages, no faults); asserts it is not empty. */
export function oracleText(prompt: string, maxTokens: number): string {
  tokenizer ??= loadTokenizer(echoModelDir)
  const core = createWorkerCore({
    model: loadModel(echoModelDir),
    numPages: 64,
    pageSize: 16,
    faults: buildFaultConfig([], false, {}),
  })
  const local = generateLocal(core, tokenizer.encode(prompt), {
    maxTokens,
    sampling: { temperature: 0, topP: 1, seed: null },
    stopTokenIds: [],
  })
  const text = tokenizer.decode(local.tokenIds)
  // An empty oracle would make every comparison below pass on a broken model.
  assert.ok(
    text.trim().length > 0,
    `the single-process engine gave no text for ${maxTokens} tokens`,
  )
  return text
}
