/** Runs the compiled test suite with `node --test`, one tier or both (tiers.ts says which file is
 *  in which):
 *
 *    node dist/scripts/tests.js all       every test file (`npm test`)
 *    node dist/scripts/tests.js unit      the in-process tier (`npm run test:unit`)
 *    node dist/scripts/tests.js process   the tier that starts processes
 *
 *  Arguments after the tier go to `node --test` before the files (e.g. `--test-reporter=spec`). */
import { spawnSync } from 'node:child_process'
import { availableParallelism } from 'node:os'
import { dirname, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'
import { tiers } from './tiers.js'

const [tier, ...nodeArgs] = process.argv.slice(2)
const root = resolve(dirname(fileURLToPath(import.meta.url)), '..', '..')
const split = tiers(root)
// The process tier first: its files run longest, and starting them first leaves the short unit
// files to fill the slots at the end.
const files =
  tier === 'all'
    ? [...split.process, ...split.unit]
    : tier === 'unit'
      ? split.unit
      : tier === 'process'
        ? split.process
        : undefined
if (files === undefined) {
  process.stderr.write(`tests: give a tier: all, unit or process (got ${String(tier)})\n`)
  process.exit(2)
}
// Unit files only compute: one per core. Process files mostly wait on their clusters: three at a
// time on two cores, as before the tiers.
const unitConcurrency = availableParallelism()
const run = spawnSync(
  process.execPath,
  [
    '--test',
    `--test-concurrency=${tier === 'unit' ? unitConcurrency : 3}`,
    '--test-timeout=300000',
    ...nodeArgs,
    ...files,
  ],
  { cwd: root, stdio: 'inherit' },
)
process.exit(run.status ?? 1)
