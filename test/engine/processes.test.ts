/** Which node flags a forked part inherits, and what its log file says when it dies. */
import assert from 'node:assert/strict'
import type { ChildProcess } from 'node:child_process'
import { mkdtempSync, readFileSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { once } from 'node:events'
import { describe, it } from 'node:test'
import { forkPart, partExecArgv } from '../../src/engine/processes.js'
import { echoModelDir } from '../helpers/paths.js'

describe('partExecArgv', () => {
  it('drops the debugger and test-runner flags, keeps the rest in order', () => {
    assert.deepEqual(
      partExecArgv([
        '--inspect=9229',
        '--max-old-space-size=512',
        '--test-timeout=300000',
        '--enable-source-maps',
        '--inspect-brk',
        '--test',
        '--debug-port=1',
      ]),
      ['--max-old-space-size=512', '--enable-source-maps'],
    )
  })

  it('drops code given on the command line with its script, as node itself records it', () => {
    // The arrays are process.execArgv as node 20 gives them for `node -e S`, `node -p -e S`,
    // `node -pe S`, `node -p S`, `node --eval=S` and `node --input-type=module -e S`.
    const script = 'import("./dist/bench/main.js")'
    for (const argv of [
      ['-e', script],
      ['-p', '-e', script],
      ['-pe', script],
      ['-p', script],
      [`--eval=${script}`],
      ['--input-type=module', '--eval', script],
      ['--input-type', 'module', '-e', script],
    ]) {
      assert.deepEqual(partExecArgv(['--enable-source-maps', ...argv, '--no-warnings']), [
        '--enable-source-maps',
        '--no-warnings',
      ])
    }
  })
})

describe('forkPart', () => {
  it("ends a part's log file with how the process ended, even when it was killed (SIGKILL)", async () => {
    const dir = mkdtempSync(join(tmpdir(), 'kvfence-part-'))
    const logFile = join(dir, 'decode.log')
    const started: ChildProcess[] = []
    try {
      const { child } = await forkPart(
        ['decode', '--model', echoModelDir, '--port', '0', '--pages', '8', '--page-size', '16'],
        {
          env: process.env,
          logFile,
          timeoutMs: 30_000,
          failure: (why, last) => new Error(`decode did not start (${why.kind}): ${last}`),
        },
        started,
      )
      const closed = once(child, 'close')
      child.kill('SIGKILL') // writes nothing itself, as after a native crash
      await closed
      await new Promise((resolve) => setTimeout(resolve, 50)) // the log stream's last write
      const lines = readFileSync(logFile, 'utf8').trim().split('\n')
      assert.match(lines[0], /"name":"kvfence-decode"/) // the part's own output comes first
      assert.equal(lines.at(-1), `kvfence: process ${child.pid} ended (signal SIGKILL)`)
    } finally {
      for (const c of started) c.kill('SIGKILL')
      rmSync(dir, { recursive: true, force: true })
    }
  })
})
