/** `makeDir`, the `mkdir -p` that always ends (Node 20's recursive mkdirSync spins forever under
 *  /proc), and `kvfence demo --out` on a folder that cannot be made. */
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { mkdtempSync, rmSync, statSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { after, describe, it } from 'node:test'
import { promisify } from 'node:util'
import { makeDir } from '../src/common/make-dir.js'
import { cliPath } from './helpers/paths.js'

const dir = mkdtempSync(join(tmpdir(), 'kvfence-make-dir-'))

describe('makeDir', () => {
  after(() => rmSync(dir, { recursive: true, force: true }))

  it('makes missing parents, and accepts a folder that exists', () => {
    const deep = join(dir, 'a', 'b', 'c')
    makeDir(deep)
    assert.ok(statSync(deep).isDirectory())
    makeDir(deep)
    makeDir(dir)
  })

  it('throws the error of the level that cannot be made', () => {
    const file = join(dir, 'file')
    writeFileSync(file, '')
    assert.throws(() => makeDir(join(file, 'x', 'y')), { code: 'ENOTDIR', path: join(file, 'x') })
    assert.throws(() => makeDir('/proc/kvfence-nope/x'), {
      code: 'ENOENT',
      path: '/proc/kvfence-nope',
    })
  })

  it('kvfence demo --out under /proc: one line and exit 2, not a spin (Node 20 bug)', async () => {
    await assert.rejects(
      promisify(execFile)(process.execPath, [cliPath, 'demo', '--out', '/proc/kvfence-nope/x'], {
        timeout: 60_000,
      }),
      (err: { code: number; stderr: string; killed: boolean }) => {
        assert.equal(err.killed, false, 'still running after 60 s')
        assert.equal(err.code, 2)
        assert.equal(
          err.stderr,
          "kvfence: ENOENT: no such file or directory, mkdir '/proc/kvfence-nope'\n",
        )
        return true
      },
    )
  })
})
