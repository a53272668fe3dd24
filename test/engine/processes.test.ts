/** Which node flags a forked part inherits. */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import { partExecArgv } from '../../src/engine/processes.js'

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
})
