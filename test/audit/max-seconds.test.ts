/** `--max-seconds` (and `budget.maxSeconds` in the config file) is bounded by what a Node.js timer
 *  can wait: a fresh-user trial gave `--max-seconds 9999999` against a leaking endpoint, the
 *  deadline timer overflowed and fired after 1 ms, every probe ended inconclusive and the audit
 *  exited 0. Too short a budget ended in an "internal error". Both are refused before any request:
 *  one line, exit 2. */
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { mkdtemp, rm, writeFile } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { fileURLToPath } from 'node:url'
import { after, before, describe, test } from 'node:test'
import { runAudit } from '../../src/audit/index.js'
import { startStandIn, tenantKeys, type StandIn } from './standins.js'

const mainJs = fileURLToPath(new URL('../../src/cli/main.js', import.meta.url))
/** floor((2^31 − 1) ms / 1000): Node's longest timer, in whole seconds. */
const longest = 2147483

function kvfence(args: string[]): Promise<{ code: number | null; stderr: string }> {
  return new Promise((resolve) => {
    execFile(process.execPath, [mainJs, ...args], { timeout: 60_000 }, (err, _stdout, stderr) => {
      resolve({ code: err && typeof err.code === 'number' ? err.code : err ? null : 0, stderr })
    })
  })
}

describe('audit time budget bounds', () => {
  let standIn: StandIn
  let dir: string
  before(async () => {
    standIn = await startStandIn('safe')
    dir = await mkdtemp(join(tmpdir(), 'kvfence-max-seconds-'))
  })
  after(async () => {
    await standIn.close()
    await rm(dir, { recursive: true, force: true })
  })

  const tenants = ['--tenant', `alice=${tenantKeys.alice}`, '--tenant', `bob=${tenantKeys.bob}`]
  const audit = (...args: string[]) =>
    kvfence(['audit', '--target', standIn.url, ...tenants, ...args])

  for (const value of ['9999999', String(longest + 1), '0.0001', '0.5']) {
    test(`--max-seconds ${value} is refused in one line, exit 2, before any request`, async () => {
      const before = standIn.stats.numRequests
      const run = await audit('--max-seconds', value)
      assert.equal(run.code, 2, run.stderr)
      assert.equal(
        run.stderr,
        `kvfence audit: --max-seconds must be a number from 1 to ${longest}, got "${value}"\n`,
      )
      assert.equal(standIn.stats.numRequests, before, 'nothing was sent')
    })
  }

  test('budget.maxSeconds past the longest timer in the config file is refused, naming the key', async () => {
    const config = join(dir, 'audit.yaml')
    await writeFile(config, `budget: { maxSeconds: 3000000 }\n`)
    const run = await audit('--config', config)
    assert.equal(run.code, 2, run.stderr)
    assert.equal(run.stderr.trimEnd().split('\n').length, 1, run.stderr)
    assert.match(run.stderr, /budget\.maxSeconds/)
    assert.match(run.stderr, new RegExp(String(longest)))
  })

  test('runAudit refuses the same bounds', async () => {
    for (const maxSeconds of [3_000_000, 0.5]) {
      await assert.rejects(
        runAudit({
          target: standIn.url,
          tenants: [
            { name: 'alice', key: tenantKeys.alice },
            { name: 'bob', key: tenantKeys.bob },
          ],
          maxSeconds,
        }),
        new RegExp(`max seconds must be a number from 1 to ${longest}, got ${maxSeconds}`),
      )
    }
  })

  test(`--max-seconds ${longest} is accepted`, async () => {
    const run = await audit('--max-seconds', String(longest), '--plan')
    assert.equal(run.code, 0, run.stderr)
  })
})
