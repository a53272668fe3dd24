/** The probe registry (src/audit/probes/index.ts), the one place a probe is registered: every
 *  list of probes, every table about them and every budget share derives from it, and each of its
 *  modules loads on its own, whichever a program imports first. "First" is checked in a worker
 *  thread per module: each has its own module graph, as a fresh process has, at a fraction of a
 *  process's start (a control below shows a worker catching an import cycle that one process
 *  importing the modules in turn would not). */
import assert from 'node:assert/strict'
import { mkdtempSync, readdirSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { pathToFileURL } from 'node:url'
import { Worker } from 'node:worker_threads'
import { describe, test } from 'node:test'
import { probeClass } from '../../src/audit/classes.js'
import { parseAuditConfig } from '../../src/audit/config.js'
import { controlsOf } from '../../src/audit/controls.js'
import { probeNames, probes } from '../../src/audit/index.js'
import { shareBudget, probePlan } from '../../src/audit/plan.js'
import { probeNames as namesOfTypes } from '../../src/audit/types.js'
import { repoRoot } from '../helpers/paths.js'

/** Imports the module at `file` first in a fresh worker thread (its own module graph). Resolves
 *  with null once the worker exited 0, or with the error's first line. */
function importFirst(file: string): Promise<string | null> {
  const worker = new Worker(`import(${JSON.stringify(pathToFileURL(file).href)})`, { eval: true })
  return new Promise((resolve) => {
    let error: string | null = null
    worker.once('error', (e) => (error = String(e).split('\n')[0]))
    worker.once('exit', (code) => resolve(error ?? (code === 0 ? null : `exit ${code}`)))
  })
}

describe('the probe registry', () => {
  test('each key is its probe’s name, and the names are the keys in the registry’s order', () => {
    for (const [key, probe] of Object.entries(probes)) assert.equal(probe.name, key)
    assert.deepEqual(probeNames, Object.keys(probes))
    assert.equal(namesOfTypes, probeNames)
    assert.equal(probeNames[0], 'capacity')
    // stall last: a request that never answers may leave pages held; no probe runs after it.
    assert.equal(probeNames.at(-1), 'stall')
  })

  test('a finding’s class and controls are its probe’s, read from the registry', () => {
    for (const name of probeNames) {
      assert.equal(probeClass(name), probes[name].class)
      assert.deepEqual(controlsOf(name), probes[name].controls)
    }
    assert.equal(probeClass('availability'), 'availability')
    assert.deepEqual(controlsOf('availability'), { aisvs: [], guards: [] })
    // Spot values from docs/threat-model.md's guard table and the class table of docs/auditing.md.
    assert.deepEqual(controlsOf('page-leak'), { aisvs: [], guards: ['G7', 'G8'] })
    assert.equal(probeClass('prefix-timing'), 'side-channel')
  })

  test('a budget share for every registered probe, from its own plan', () => {
    const input = {
      limits: { maxRequests: 500, maxSeconds: 120, concurrency: 4 },
      numTenants: 2,
      overCapacityAttempts: 4,
      poolTokens: 4096,
      contextTokens: 4096,
      inputLimitTokens: null,
      largestPoolTokens: 4096,
      isAggressive: false,
    }
    const plans = probeNames.map((name) => probePlan(name, probes[name].plan(input)))
    assert.deepEqual(
      shareBudget(plans, input.limits, 0).map((s) => s.probe),
      probeNames,
    )
  })

  test('the config file accepts every registered name and refuses any other', () => {
    const text = (probes: string): string => `target: http://127.0.0.1:1\nprobes: [${probes}]\n`
    assert.deepEqual(parseAuditConfig(text(probeNames.join(', ')), 'a.yaml', {}).probes, probeNames)
    assert.throws(
      () => parseAuditConfig(text('capacity, no-such-probe'), 'a.yaml', {}),
      (e: Error) => e.message.startsWith('config a.yaml: probes.1: '),
    )
  })

  test('a worker importing a module first catches what one process importing in turn would not', async () => {
    // The control: a registry and a probe reading it at load (a cycle). Imported first, either
    // module meets the other's binding uninitialised; a process that had already loaded one
    // would load the other from its cache without a word.
    const dir = mkdtempSync(join(tmpdir(), 'kvfence-registry-cycle-'))
    try {
      writeFileSync(join(dir, 'index.js'), "import { p } from './p.js'\nexport const registry = { p }\n")
      writeFileSync(join(dir, 'p.js'), "import { registry } from './index.js'\nexport const p = 1\nexport const n = Object.keys(registry).length\n")
      writeFileSync(join(dir, 'package.json'), '{ "type": "module" }\n')
      assert.equal(await importFirst(join(dir, 'p.js')), "ReferenceError: Cannot access 'p' before initialization")
      assert.equal(await importFirst(join(dir, 'index.js')), "ReferenceError: Cannot access 'registry' before initialization")
    } finally {
      rmSync(dir, { recursive: true, force: true })
    }
  }) // prettier-ignore

  test('every audit module loads first in a fresh module graph (no probe read before its module ran)', async () => {
    const dir = join(repoRoot, 'dist', 'src', 'audit')
    const modules = [
      ...readdirSync(join(dir, 'probes')).map((f) => join(dir, 'probes', f)),
      ...readdirSync(dir).map((f) => join(dir, f)),
    ].filter((f) => f.endsWith('.js'))
    assert.ok(modules.length > 30)
    const failed: string[] = []
    for (const file of modules) {
      const error = await importFirst(file)
      if (error !== null) failed.push(`${file}: ${error}`)
    }
    assert.deepEqual(failed, [])
  })
})
