/** `kvfence audit --resume`: the real CLI against a stand-in on loopback (in child processes where
 *  a signal or a kill ends it, in this process for runs to their end). An
 *  audit interrupted (SIGINT, SIGTERM) or killed outright after its first probe leaves a JSON
 *  report of what it had established; `--resume` keeps those probes as they were, runs only the
 *  others, and its report says which were resumed. A report of another audit is refused with one
 *  line. */
import assert from 'node:assert/strict'
import { spawn } from 'node:child_process'
import { mkdtemp, readFile, rm, writeFile } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { fileURLToPath } from 'node:url'
import { after, before, describe, test } from 'node:test'
import type { AuditReport } from '../../src/audit/index.js'
import { reportValidator } from './schema-validator.js'
import { startStandIn, tenantKeys, type StandIn } from './standins.js'
import { kvfenceWithEnv } from '../helpers/cli.js'

const mainJs = fileURLToPath(new URL('../../src/cli/main.js', import.meta.url))
const tenantArgs = ['--tenant', `alice=${tenantKeys.alice}`, '--tenant', `bob=${tenantKeys.bob}`]
const probeArgs = ['--probes', 'boundary,canary,determinism']

interface Run {
  code: number | null
  signal: NodeJS.Signals | null
  stdout: string
  stderr: string
}

/** Runs `kvfence audit` to its end, in this process (test/helpers/cli.ts); never signalled. */
async function audit(args: string[]): Promise<Run> {
  return { ...(await kvfenceWithEnv({}, 'audit', ...args)), signal: null }
}

/** Runs `kvfence audit` and sends `signal` once a stdout line matches `at`. */
function auditUntil(args: string[], at: RegExp, signal: NodeJS.Signals): Promise<Run> {
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, [mainJs, 'audit', ...args])
    let stdout = ''
    let stderr = ''
    let isSent = false
    const timer = setTimeout(() => child.kill('SIGKILL'), 120_000)
    child.stdout.on('data', (chunk: Buffer) => {
      stdout += chunk.toString('utf8')
      if (!isSent && stdout.split('\n').some((line) => at.test(line))) {
        isSent = true
        child.kill(signal)
      }
    })
    child.stderr.on('data', (chunk: Buffer) => (stderr += chunk.toString('utf8')))
    child.on('error', reject)
    child.on('close', (code, sig) => {
      clearTimeout(timer)
      if (!isSent) reject(new Error(`no line matched ${at}:\n${stdout}\n${stderr}`))
      else resolve({ code, signal: sig, stdout, stderr })
    })
  })
}

const readReport = async (file: string): Promise<AuditReport> =>
  JSON.parse(await readFile(file, 'utf8')) as AuditReport

/** What a probe's kept parts are: its run, its findings and its completions. */
function partsOf(report: AuditReport, probe: string): unknown {
  return {
    run: report.probeRuns.find((r) => r.probe === probe),
    findings: report.findings.filter((f) => f.probe === probe),
    completions: report.completions.filter((c) => c.probe === probe),
  }
}

describe('--resume', () => {
  let standIn: StandIn
  let dir = ''
  const { validate, errorsOf } = reportValidator()
  before(async () => {
    // Slow tokens keep canary running for a while after boundary has ended.
    standIn = await startStandIn('safe', { tokenDelayMs: 5 })
    dir = await mkdtemp(join(tmpdir(), 'kvfence-resume-'))
  })
  after(async () => {
    await standIn.close()
    await rm(dir, { recursive: true, force: true })
  })

  test('SIGINT after the first probe: exit 130, the report keeps it; --resume runs only the others', async () => {
    const json = join(dir, 'sigint.json')
    const args = ['--target', standIn.url, ...tenantArgs, ...probeArgs, '--seed', '11']
    // `[canary] running` is printed after boundary's report was written.
    const stopped = await auditUntil([...args, '--json', json], /^\[canary\] running$/, 'SIGINT')
    assert.equal(stopped.code, 130, stopped.stderr)
    assert.equal(
      stopped.stderr,
      `kvfence audit: interrupted by SIGINT: 1 of 3 probes ran to their end; ${json} holds them: continue with --resume ${json}\n`,
    )
    const interrupted = await readReport(json)
    assert.ok(validate(interrupted), errorsOf())
    assert.equal(interrupted.state, 'interrupted')
    assert.equal(interrupted.interruptedBy, 'SIGINT')
    assert.deepEqual(interrupted.tenants, ['alice', 'bob'])
    assert.deepEqual(interrupted.probes, ['boundary', 'canary', 'determinism'])
    assert.deepEqual(interrupted.pendingProbes, ['canary', 'determinism'])
    assert.deepEqual(
      interrupted.findings.filter((f) => f.probe !== 'boundary').map((f) => [f.probe, f.verdict]),
      [
        ['canary', 'inconclusive'],
        ['determinism', 'inconclusive'],
      ],
    )

    // No --probes/--seed change, no --json: the seed comes from the report, which is rewritten.
    const resumed = await audit([
      '--target',
      standIn.url,
      ...tenantArgs,
      ...probeArgs,
      '--resume',
      json,
    ])
    assert.equal(resumed.code, 0, resumed.stderr)
    assert.doesNotMatch(resumed.stdout, /\[boundary\] running/, 'boundary was run again')
    assert.match(resumed.stdout, /\[canary\] running/)
    const final = await readReport(json)
    assert.ok(validate(final), errorsOf())
    assert.equal(final.state, 'finished')
    assert.deepEqual(final.pendingProbes, [])
    assert.equal(final.seed, 11)
    assert.equal(final.startedAt, interrupted.startedAt)
    assert.deepEqual(final.resumed?.probes, ['boundary'])
    assert.equal(final.resumed?.previousRequestsSent, interrupted.requestsSent)
    assert.equal(final.resumed?.previousDurationMs, interrupted.durationMs)
    // boundary as the interrupted run established it, to the byte.
    assert.deepEqual(partsOf(final, 'boundary'), partsOf(interrupted, 'boundary'))
    // Request numbers run on from the interrupted run's: every one unique, the resumed run's
    // after the earlier one's.
    const numbers = final.completions.map((c) => c.requestNumber)
    assert.equal(new Set(numbers).size, numbers.length)
    for (const c of final.completions.filter((c) => c.probe !== 'boundary' && c.probe !== null))
      assert.ok(c.requestNumber > interrupted.requestsSent, `${c.probe} #${c.requestNumber}`)
    assert.ok(final.requestsSent > interrupted.requestsSent)

    // The same audit never interrupted reaches the same verdicts.
    const whole = join(dir, 'whole.json')
    const straight = await audit([...args, '--json', whole])
    assert.equal(straight.code, 0, straight.stderr)
    const verdicts = (r: AuditReport) => r.findings.map((f) => [f.probe, f.verdict, f.severity])
    assert.deepEqual(verdicts(final), verdicts(await readReport(whole)))
  })

  test('killed outright (SIGKILL) after the first probe: the report written after it resumes with only the keys given again (target, model, probes, seed and tenant order from the report)', async () => {
    const json = join(dir, 'killed.json')
    const args = ['--target', standIn.url, ...tenantArgs, ...probeArgs, '--seed', '12']
    const killed = await auditUntil([...args, '--json', json], /^\[canary\] running$/, 'SIGKILL')
    assert.equal(killed.signal, 'SIGKILL')
    const left = await readReport(json)
    assert.ok(validate(left), errorsOf())
    assert.equal(left.state, 'running')
    assert.deepEqual(left.pendingProbes, ['canary', 'determinism'])
    assert.deepEqual(
      left.probeRuns.map((r) => r.probe),
      ['boundary'],
    )
    // No --target, --probes or --seed; the tenants' keys in the other order.
    const reversed = ['--tenant', `bob=${tenantKeys.bob}`, '--tenant', `alice=${tenantKeys.alice}`]
    const resumed = await audit([...reversed, '--resume', json])
    assert.equal(resumed.code, 0, resumed.stderr)
    const final = await readReport(json)
    assert.equal(final.state, 'finished')
    assert.equal(final.target, left.target)
    assert.equal(final.model, left.model)
    assert.equal(final.seed, 12)
    assert.deepEqual(final.tenants, ['alice', 'bob'])
    assert.deepEqual(final.probes, ['boundary', 'canary', 'determinism'])
    assert.deepEqual(final.resumed?.probes, ['boundary'])
    assert.deepEqual(partsOf(final, 'boundary'), partsOf(left, 'boundary'))
  })

  test('SIGTERM: exit 143, the report says so', async () => {
    const json = join(dir, 'sigterm.json')
    const args = ['--target', standIn.url, ...tenantArgs, ...probeArgs, '--seed', '13']
    const stopped = await auditUntil([...args, '--json', json], /^\[canary\] running$/, 'SIGTERM')
    assert.equal(stopped.code, 143, stopped.stderr)
    const report = await readReport(json)
    assert.equal(report.state, 'interrupted')
    assert.equal(report.interruptedBy, 'SIGTERM')
  })

  test('a report of another audit, or one with nothing left, is refused with one line (exit 2)', async () => {
    const json = join(dir, 'done.json')
    const args = ['--target', standIn.url, ...tenantArgs, '--probes', 'capacity', '--seed', '14']
    assert.equal((await audit([...args, '--json', json])).code, 0)
    const partial = join(dir, 'partial.json')
    const report = await readReport(json)
    await writeFile(partial, JSON.stringify({ ...report, pendingProbes: ['capacity'] }))
    const notJson = join(dir, 'not.json')
    await writeFile(notJson, 'not json\n')
    const cases: [string[], string][] = [
      [
        [...args, '--resume', json],
        `cannot resume ${json}: nothing to resume: every probe in it ran to its end`,
      ],
      [
        [
          '--target',
          standIn.url,
          '--tenant',
          `carol=${tenantKeys.alice}`,
          '--tenant',
          `bob=${tenantKeys.bob}`,
          '--probes',
          'capacity',
          '--resume',
          partial,
        ],
        `cannot resume ${partial}: its tenants are alice, bob, this audit's carol, bob: give a key for each of its tenants`,
      ],
      [
        ['--resume', partial],
        `--resume ${partial}: give the keys of its tenants alice, bob (--tenant NAME=KEY or NAME=env:VAR each, or --config with keyEnv); the report holds no key`,
      ],
      [
        ['--target', `${standIn.url}/other`, ...tenantArgs, '--resume', partial],
        `cannot resume ${partial}: it audited ${standIn.url}, not ${standIn.url}/other`,
      ],
      [
        [...args, '--probes', 'capacity,boundary', '--resume', partial],
        `cannot resume ${partial}: its probes are capacity, this audit's capacity, boundary: give the same --probes`,
      ],
      [
        [
          '--target',
          `${standIn.url}/other`,
          ...tenantArgs,
          '--probes',
          'capacity',
          '--resume',
          partial,
        ],
        `cannot resume ${partial}: it audited ${standIn.url}, not ${standIn.url}/other`,
      ],
      [
        [...args, '--seed', '15', '--resume', partial],
        `cannot resume ${partial}: its seed is 14, not 15: leave --seed out, or give 14`,
      ],
      [
        [...args, '--model', 'other', '--resume', partial],
        `cannot resume ${partial}: its model is "tiny-echo", not "other"`,
      ],
      [[...args, '--resume', notJson], `cannot resume ${notJson}: it is not JSON`],
      [
        [...args, '--resume', join(dir, 'missing.json')],
        `cannot resume ${join(dir, 'missing.json')}: ENOENT`,
      ],
    ]
    for (const [caseArgs, line] of cases) {
      const run = await audit(caseArgs)
      assert.equal(run.code, 2, run.stderr)
      assert.equal(run.stderr, `kvfence audit: ${line}\n`)
    }
    // Refused before anything was written: the report given is as it was.
    assert.deepEqual(await readReport(partial), { ...report, pendingProbes: ['capacity'] })
  })
})
