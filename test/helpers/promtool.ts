/** Runs Debian's `promtool` on the alerting rules in deploy/: `promtool check rules FILE` and
 *  `promtool test rules FILE.test.yml`, one test per rules file. Skips, saying why, only when
 *  promtool is not installed (`.ci/run` installs it). */
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { existsSync } from 'node:fs'
import { join } from 'node:path'
import { test } from 'node:test'
import { repoRoot } from './paths.js'

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

/** Declares a test named `name` that checks `deploy/RULES.yml` holds exactly `numRules` rules
 *  and passes its unit tests in `deploy/RULES.test.yml`. */
export function testRulesFile(name: string, rules: string, numRules: number): void {
  test(
    name,
    {
      skip:
        promtool === undefined
          ? 'promtool is not installed (Debian: apt-get install prometheus)'
          : false,
    },
    async () => {
      const check = await run(['check', 'rules', `${rules}.yml`])
      assert.equal(check.code, 0, check.output)
      assert.match(check.output, new RegExp(`SUCCESS: ${numRules} rules found`))
      const tested = await run(['test', 'rules', `${rules}.test.yml`])
      assert.equal(tested.code, 0, tested.output)
      assert.match(tested.output, /SUCCESS/)
    },
  )
}
