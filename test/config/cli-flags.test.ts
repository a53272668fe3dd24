/** Out-of-range ports and unknown log levels are refused by the CLI before any part starts: one
 *  line naming the flag, exit 2 (they used to surface from Node or pino after workers started). */
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { mkdirSync, rmSync } from 'node:fs'
import { createServer } from 'node:net'
import { join } from 'node:path'
import { after, describe, it } from 'node:test'
import { twoTenants } from '../helpers/cluster.js'
import { cliPath } from '../helpers/paths.js'

function run(args: string[]): Promise<{ code: number | null; stdout: string; stderr: string }> {
  return new Promise((resolve) =>
    execFile(process.execPath, [cliPath, ...args], { timeout: 60_000 }, (err, stdout, stderr) =>
      resolve({ code: err ? ((err as { code?: number }).code ?? null) : 0, stdout, stderr }),
    ),
  )
}

const levels = 'Allowed choices are fatal, error, warn, info, debug, trace, silent.'
const cases: [string[], string][] = [
  [['serve', '--port', '70000'], `error: option '--port <port>' argument '70000' is invalid. expected a port from 0 to 65535, got "70000"`],
  [['decode', '--transfer-port', '99999'], `error: option '--transfer-port <port>' argument '99999' is invalid. expected a port from 0 to 65535, got "99999"`],
  [['prefill', '--port', '-1'], `error: option '--port <port>' argument '-1' is invalid. expected a port from 0 to 65535, got "-1"`],
  [['router', '--port', '65536'], `error: option '--port <port>' argument '65536' is invalid. expected a port from 0 to 65535, got "65536"`],
  [['serve', '--log-level', 'chatty'], `error: option '--log-level <level>' argument 'chatty' is invalid. ${levels}`],
  [['decode', '--log-level', 'chatty'], `error: option '--log-level <level>' argument 'chatty' is invalid. ${levels}`],
  [['serve', '--page-size', '0'], `error: option '--page-size <n>' argument '0' is invalid. expected a positive integer, got "0"`],
  [['serve', '--prefill-pages', '0'], `error: option '--prefill-pages <n>' argument '0' is invalid. expected a positive integer, got "0"`],
  [['serve', '--prefix-cache-pages', '-1'], `error: option '--prefix-cache-pages <n>' argument '-1' is invalid. expected a non-negative integer, got "-1"`],
  // Checked before any part starts: one line, and no part's log lines before it.
  [['serve', '--tenants', '/nonexistent-kvfence/tenants.yaml'], `kvfence: cannot read tenants file /nonexistent-kvfence/tenants.yaml: ENOENT: no such file or directory, open '/nonexistent-kvfence/tenants.yaml'`],
  // A policy for a store that is not configured would be silently ignored.
  [['router', '--limits-on-unavailable', 'local'], 'kvfence: --limits-on-unavailable needs --limits-redis (it is the policy while Redis is unreachable)'],
] // prettier-ignore

describe('CLI flag ranges', () => {
  for (const [args, message] of cases) {
    it(`kvfence ${args.join(' ')}`, async () => {
      const res = await run(args)
      assert.equal(res.code, 2)
      assert.equal(res.stderr.trim(), message)
      assert.equal(res.stdout, '')
    })
  }
})

describe('serve checks the model folder and its port before any part starts', () => {
  const { dir, tenantsFile } = twoTenants('kvfence-cli-flags-')
  after(() => rmSync(dir, { recursive: true, force: true }))

  it('a model folder without config.json: one line, exit 2 (was the worker line plus "exited")', async () => {
    const empty = join(dir, 'empty-model')
    mkdirSync(empty)
    const res = await run(['serve', '--tenants', tenantsFile, '--model', empty])
    assert.equal(res.code, 2)
    assert.equal(res.stderr.trim(), `kvfence: no config.json in model directory ${empty}`)
  })

  it('--prefix-cache-pages over --prefill-pages: one line, exit 2', async () => {
    const res = await run(['serve', '--tenants', tenantsFile, '--prefix-cache-pages', '65'])
    assert.equal(res.code, 2)
    assert.equal(res.stderr.trim(), 'kvfence: --prefix-cache-pages 65 exceeds --prefill-pages 64')
  })

  it('a port in use: one line naming it, exit 2, before any worker logs', async () => {
    const taken = createServer()
    await new Promise<void>((resolve) => taken.listen(0, '127.0.0.1', resolve))
    const { port } = taken.address() as { port: number }
    try {
      const res = await run(['serve', '--tenants', tenantsFile, '--port', String(port)])
      assert.equal(res.code, 2)
      assert.equal(
        res.stderr.trim(),
        `kvfence: 127.0.0.1:${port} is already in use: give another --port`,
      )
    } finally {
      taken.close()
    }
  })
})
