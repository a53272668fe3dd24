/** `kvfence router --config` reads the backend's API key from the variable the file names; an unset
 *  variable stops it with one line (sending no key would be a silent substitution). */
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { mkdtempSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { it } from 'node:test'
import { promisify } from 'node:util'
import { stringify } from 'yaml'
import { apiKeyDigest } from '../../src/router/tenants.js'
import { cliEntry } from '../../src/paths.js'

it('router --config refuses a backend.apiKeyEnv that is not set (exit 2, one line)', async () => {
  const dir = mkdtempSync(join(tmpdir(), 'kvfence-router-config-'))
  const file = join(dir, 'cluster.yaml')
  writeFileSync(
    file,
    stringify({
      backend: { kind: 'vllm', url: 'http://127.0.0.1:9', apiKeyEnv: 'KVFENCE_TEST_UNSET_KEY' },
      tenants: [{ name: 'alice', keySha256: apiKeyDigest('k') }],
    }),
  )
  const env = { ...process.env }
  delete env.KVFENCE_TEST_UNSET_KEY
  const err = await promisify(execFile)(process.execPath, [cliEntry, 'router', '--config', file], {
    env,
    timeout: 60_000,
  }).then(
    () => null,
    (e: { code: number; stderr: string }) => e,
  )
  assert.ok(err, 'the router started without its backend key')
  assert.equal(err.code, 2)
  assert.equal(err.stderr.trim(), 'kvfence: backend.apiKeyEnv: KVFENCE_TEST_UNSET_KEY is not set')
})
