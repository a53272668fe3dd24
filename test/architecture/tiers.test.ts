/** The two tiers of the suite (scripts/tiers.ts): a file's tier follows from what its imports
 *  reach, helper modules are never run as test files, and known files land where they belong. */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import { importSpecifiers, tiers } from '../../scripts/tiers.js'
import { repoRoot } from '../helpers/paths.js'

describe('test tiers', () => {
  it('reads static imports, re-exports and import() of a literal from compiled JS', () => {
    const js = [
      "import { a } from './a.js'",
      // Split so that this file's own text imports no process module.
      "import b from 'node:" + "child_process'",
      "export { c } from '../c.js'",
      "import './side-effect.js'",
      "const d = await import('./d.js')",
      'const e = await import(name)',
    ].join('\n')
    assert.deepEqual(importSpecifiers(js), [
      './a.js',
      'node:child_process',
      '../c.js',
      './side-effect.js',
      './d.js',
    ])
  })

  it('puts each test file in exactly one tier and never runs a helper module', () => {
    const { unit, process } = tiers(repoRoot)
    const all = [...unit, ...process]
    assert.equal(new Set(all).size, all.length)
    for (const f of all) assert.match(f, /^dist\/test\/.+\.test\.js$/)
    // Files that start clusters or the CLI, and files that compute in-process.
    for (const f of ['e2e/demo', 'e2e/faults', 'config/cli-flags', 'reliability/soak'])
      assert.ok(process.includes(`dist/test/${f}.test.js`), f)
    for (const f of ['kv/pool', 'transfer/frames', 'architecture/tiers', 'model/forward'])
      assert.ok(unit.includes(`dist/test/${f}.test.js`), f)
  })
})
