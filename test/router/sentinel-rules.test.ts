/** The response sentinel's Prometheus alerting rules (deploy/kvfence-sentinel-rules.yml) through
 *  `promtool test rules` with deploy/kvfence-sentinel-rules.test.yml: a confirmed leak pages at
 *  once, suspected answers warn at a sustained rate (one alone does not), fingerprints near
 *  their cap warn. Skips, saying why, only when promtool is not installed. */
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { existsSync } from 'node:fs'
import { join } from 'node:path'
import { test } from 'node:test'
import { repoRoot } from '../helpers/paths.js'

const promtool = ['/usr/bin/promtool', '/usr/local/bin/promtool'].find((p) => existsSync(p))
const deployDir = join(repoRoot, 'deploy')

function run(args: string[]): Promise<{ code: number | null; output: string }> {
  return new Promise((resolve) => {
    execFile(promtool!, args, { cwd: deployDir, timeout: 60_000 }, (err, stdout, stderr) => {
      const code = err && typeof err.code === 'number' ? err.code : err ? null : 0
      resolve({ code, output: stdout + stderr })
    })
  })
}

test(
  'promtool: the sentinel rules file is valid and its unit tests pass',
  {
    skip:
      promtool === undefined
        ? 'promtool is not installed (Debian: apt-get install prometheus)'
        : false,
  },
  async () => {
    const check = await run(['check', 'rules', 'kvfence-sentinel-rules.yml'])
    assert.equal(check.code, 0, check.output)
    assert.match(check.output, /SUCCESS: 3 rules found/)
    const tested = await run(['test', 'rules', 'kvfence-sentinel-rules.test.yml'])
    assert.equal(tested.code, 0, tested.output)
    assert.match(tested.output, /SUCCESS/)
  },
)
