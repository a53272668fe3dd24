/** `kvfence --version` prints the package's version (package.json), exit 0. */
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { readFileSync } from 'node:fs'
import { join } from 'node:path'
import { it } from 'node:test'
import { promisify } from 'node:util'
import { cliEntry, packageRoot } from '../../src/common/paths.js'

it('kvfence --version and -V print package.json’s version and exit 0', async () => {
  const { version } = JSON.parse(readFileSync(join(packageRoot, 'package.json'), 'utf8')) as {
    version: string
  }
  assert.equal(version, '0.1.0')
  for (const flag of ['--version', '-V']) {
    const { stdout, stderr } = await promisify(execFile)(process.execPath, [cliEntry, flag])
    assert.equal(stdout, '0.1.0\n')
    assert.equal(stderr, '')
  }
})
