/** What the e2e prefix-cache tests (test/e2e/prefix-cache*.test.ts) share: the single-process
 *  engine's answer as their oracle, the prompts whose pages they cache and flood, the size of a
 *  page of echo-tiny's KV, a directory for the disk tier, and summing a metric's samples.
 *  Not a test file itself. */
import { mkdtempSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { buildFaultConfig } from '../../src/engine/faults.js'
import { generateLocal } from '../../src/engine/local-engine.js'
import { createWorkerCore } from '../../src/engine/worker-core.js'
import { loadTokenizer } from '../../src/model/tokenizer.js'
import { loadModel } from '../../src/model/weights.js'
import { echoModelDir } from './paths.js'

/** The system line the tenants' prompts begin with (84 characters). */
export const stoneGardenSystem =
  'system: you answer in the voice of the stone garden, Lm4Nb8Vc1Xz0 is the gate code. '

/** BOS + 110 characters: 111 tokens, 6 full pages of 16. */
export const stoneGardenPrompt = `${stoneGardenSystem}user: what opens the gate?`

/** A flood of `count` prompts of 6 full pages each (BOS + 97 characters: 98 tokens), no two sharing a
 *  first page. */
export function floodPrompts(count: number): string[] {
  return Array.from(
    { length: count },
    (_, i) =>
      `${i}${i}${i} flood: the river carries salt past the mill at dawn, again and again, while the wheel turns. `,
  )
}

/** echo-tiny's page, bytes: 2 layers × K and V × 16 tokens × 2 KV heads × 32 floats × 4 bytes. */
export const echoPageBytes = 2 * 2 * 16 * 2 * 32 * 4

/** A fresh directory (0700, as mkdtemp makes it) for a disk tier, named after `name`. */
export function offloadDiskDir(name: string): string {
  return mkdtempSync(join(tmpdir(), `kvfence-offload-${name}-`))
}

/** The single-process engine on echo-tiny (`numPages` pages of 16, no cache, no fault): its
 *  greedy text for a prompt, the oracle a cluster's answers are compared with. `stopAtEos` false
 *  generates all `maxTokens` even past an end of sequence. */
export function echoOracle(
  numPages = 64,
): (prompt: string, maxTokens: number, options?: { stopAtEos?: boolean }) => string {
  const tokenizer = loadTokenizer(echoModelDir)
  const local = createWorkerCore({
    model: loadModel(echoModelDir),
    numPages,
    pageSize: 16,
    faults: buildFaultConfig([], false, {}),
  })
  return (prompt, maxTokens, { stopAtEos = true } = {}) => {
    const out = generateLocal(local, tokenizer.encode(prompt), {
      maxTokens,
      sampling: { temperature: 0, topP: 1, seed: null },
      stopTokenIds: stopAtEos && tokenizer.eosTokenId !== null ? [tokenizer.eosTokenId] : [],
    })
    return tokenizer.decode(out.tokenIds)
  }
}

/** Sum of the samples of `name` in `text` (Prometheus exposition) whose labels include every
 *  one of `labels` (`key="value"` strings). */
export function metricSum(text: string, name: string, labels: string[] = []): number {
  return text
    .split('\n')
    .filter((l) => l.startsWith(`${name}{`) || l.startsWith(`${name} `))
    .filter((l) => labels.every((x) => l.includes(x)))
    .reduce((sum, l) => sum + Number(l.slice(l.lastIndexOf(' ') + 1)), 0)
}
