/** The CLI's one-line errors for tenants and cluster config files: a YAML fault names the line and
 *  column but never the file's content (a key digest, or a key pasted by mistake); a directory or
 *  a device (`/dev/zero`: it used to grow `serve` to gigabytes, or hang `keys list`) is refused
 *  unread; `keys add` into a missing folder names the file, not write-file-atomic's temporary
 *  one. Real CLI as a child process: exit 2, stderr exactly one line, stdout empty. */
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { mkdirSync, mkdtempSync, rmSync, truncateSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { after, describe, it } from 'node:test'
import { loadClusterConfig } from '../../src/config/cluster.js'
import { apiKeyDigest } from '../../src/router/tenants/tenants.js'
import { cliPath } from '../helpers/paths.js'

const dir = mkdtempSync(join(tmpdir(), 'kvfence-file-reads-'))
const digest = apiKeyDigest('sk-kvf-file-reads-test-key')

function run(args: string[]): Promise<{ code: number | null; stdout: string; stderr: string }> {
  return new Promise((resolve) =>
    execFile(process.execPath, [cliPath, ...args], { timeout: 60_000 }, (err, stdout, stderr) =>
      resolve({ code: err ? ((err as { code?: number }).code ?? null) : 0, stdout, stderr }),
    ),
  )
}

/** Writes `text` to `name` in the test folder. */
function write(name: string, text: string): string {
  const path = join(dir, name)
  writeFileSync(path, text)
  return path
}

describe('tenants and config file errors on the CLI', () => {
  after(() => rmSync(dir, { recursive: true, force: true }))

  // The user trial's file: the key line indented by 3 spaces instead of 4.
  const badTenants = write(
    'bad-tenants.yaml',
    `tenants:\n  - name: alice\n   keySha256: ${digest}\n`,
  )
  const badConfig = write(
    'bad-config.yaml',
    `workers: { prefill: [{ pages: 8 }], decode: [{ pages: 8 }] }\ntenants:\n  - name: alice\n   keySha256: ${digest}\n`,
  )
  const folder = join(dir, 'a-folder')
  mkdirSync(folder)
  const fault = 'Sequence item without - indicator'
  const cases: [string[], string][] = [
    [['keys', 'list', '--tenants', badTenants], `tenants file ${badTenants} is not valid YAML: line 3, column 1: ${fault}`],
    [['keys', 'remove', 'alice', '--tenants', badTenants], `tenants file ${badTenants} is not valid YAML: line 3, column 1: ${fault}`],
    [['serve', '--tenants', badTenants], `tenants file ${badTenants} is not valid YAML: line 3, column 1: ${fault}`],
    [['serve', '--config', badConfig], `config file ${badConfig} is not valid YAML: line 4, column 1: ${fault}`],
    [['keys', 'list', '--tenants', '/dev/zero'], 'tenants file /dev/zero is not a regular file'],
    [['keys', 'add', 'bob', '--tenants', '/dev/zero'], 'tenants file /dev/zero is not a regular file'],
    [['serve', '--tenants', '/dev/zero'], 'tenants file /dev/zero is not a regular file'],
    [['serve', '--config', '/dev/zero'], 'config file /dev/zero is not a regular file'],
    [['keys', 'list', '--tenants', folder], `tenants file ${folder} is a directory, not a file`],
    [['serve', '--tenants', folder], `tenants file ${folder} is a directory, not a file`],
    [['serve', '--config', folder], `config file ${folder} is a directory, not a file`],
    [['keys', 'add', 'bob', '--tenants', '/nonexistent-kvfence/dir/t.yaml'], 'cannot write tenants file /nonexistent-kvfence/dir/t.yaml: ENOENT: no such file or directory'],
    // At once: the lock used to retry ENOENT for 20 s first (a trial).
    [['keys', 'remove', 'bob', '--tenants', '/nonexistent-kvfence/dir/t.yaml'], 'cannot write tenants file /nonexistent-kvfence/dir/t.yaml: ENOENT: no such file or directory'],
  ] // prettier-ignore
  for (const [args, message] of cases) {
    it(`kvfence ${args.join(' ')}`, async () => {
      const res = await run(args)
      assert.equal(res.code, 2)
      assert.equal(res.stderr, `kvfence: ${message}\n`)
      assert.equal(res.stdout, '')
      assert.ok(!res.stderr.includes(digest.slice(0, 8)), 'no digest on stderr')
    })
  }

  it('loadClusterConfig refuses a file over 16 MiB unread', () => {
    const huge = write('huge.yaml', '')
    truncateSync(huge, 16 * 1024 * 1024 + 1) // sparse: nothing written
    assert.throws(() => loadClusterConfig(huge), {
      name: 'KvfenceError',
      message: `config file ${huge} is larger than 16 MiB`,
    })
  })
})
