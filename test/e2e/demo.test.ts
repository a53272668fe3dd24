/** `kvfence demo` (what `npm start` runs), as a user runs it: a child process that starts two real
 *  clusters, audits both, prints the outcomes side by side and writes both reports (JSON and HTML).
 *  One run of the demo (minutes on a small machine) is shared by the tests of this file. */
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { mkdtempSync, readFileSync, readdirSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { after, it } from 'node:test'
import { promisify } from 'node:util'
import { cliPath } from '../helpers/paths.js'

interface Report {
  findings: {
    probe: string
    verdict: string
    severity: string
    evidence: Record<string, unknown>
  }[]
}

const out = mkdtempSync(join(tmpdir(), 'kvfence-demo-'))
after(() => rmSync(out, { recursive: true, force: true }))
let demo: Promise<{ out: string; stdout: string }> | undefined
/** The demo, run once (by the first test that asks) into `out`. */
function demoRun(): Promise<{ out: string; stdout: string }> {
  demo ??= promisify(execFile)(process.execPath, [cliPath, 'demo', '--out', out], {
    timeout: 240_000,
    env: { ...process.env, KVFENCE_ALLOW_FAULTS: '' },
  }).then(({ stdout }) => ({ out, stdout }))
  return demo
}

it('kvfence demo shows the leak with the fault and none as shipped, writes both reports, and catches the fault switched on in production', async () => {
  const { out, stdout } = await demoRun()
  const unsafe = JSON.parse(readFileSync(join(out, 'unsafe.json'), 'utf8')) as Report
  const safe = JSON.parse(readFileSync(join(out, 'safe.json'), 'utf8')) as Report

  const leak = unsafe.findings.find((f) => f.verdict === 'leak')
  assert.ok(leak, 'unsafe.json has no leak finding')
  assert.equal(leak.probe, 'canary')
  assert.equal(leak.severity, 'critical')
  const canary = String(leak.evidence.canary)
  assert.match(canary, /^[A-Za-z0-9]{16,24}$/)
  assert.ok(String(leak.evidence.excerpt).includes(String(leak.evidence.matchedFragment)))
  assert.equal(safe.findings.filter((f) => f.verdict === 'leak').length, 0)
  assert.equal(
    safe.findings.find((f) => f.probe === 'canary')?.verdict,
    'clean',
    `safe canary finding: ${JSON.stringify(safe.findings.find((f) => f.probe === 'canary'))}; ` +
      `last lines of the as-shipped parts' logs: ${logTails(join(out, 'logs', 'safe'))}`,
  )

  // The console shows both outcomes side by side, the canary only redacted.
  assert.match(stdout, /B's over-capacity prompts │ \d+× HTTP 200/)
  assert.match(stdout, /HTTP 400 context_length_exceeded/)
  assert.match(stdout, /G1 refused to start/)
  assert.ok(!stdout.includes(canary), 'the console shows the canary unredacted')

  // Third act: the fault switched on while the watch and the sentinel run; both catch it.
  assert.match(stdout, /── 3\/3 {2}in production/)
  assert.match(stdout, /the watch ran [1-9]\d* cycles, 0 findings/)
  assert.match(stdout, /sentinel: first (confirmed|suspected) cross-tenant answer +\+\d+\.\d s/)
  assert.match(stdout, /watch: first alert \((leak|warning):[\w-]+\) +\+\d+\.\d s/)
  // The leak finding needs the watch's over-capacity prompt to land on its own plant's stale
  // pages before the demo's traffic overwrites them: shown when seen, said when not.
  assert.match(
    stdout,
    /watch: leak alert (\(\w+ probe\) +\+\d+\.\d s, -?\d+\.\d s after (tenant-b|the sentinel)| +not seen)/,
  )
  const tooWide = stdout.split('\n').filter((l) => l.length > 80)
  assert.deepEqual(tooWide, [])
  assert.match(stdout, /^reports:\n {2}\S+unsafe\.json\n/m)
  const watchLog = readFileSync(join(out, 'logs', 'watch.log'), 'utf8')
  assert.match(watchLog, /"msg":"finding"/)
  assert.ok(stdout.includes(canary.slice(0, 4)), 'the console does not show the redacted canary')
})

it('kvfence demo writes unsafe.html and safe.html; the incident matrix counts its leaks', async () => {
  const { out, stdout } = await demoRun()
  assert.match(stdout, /^ {2}\S*unsafe\.html\n {2}\S*safe\.json\n {2}\S*safe\.html$/m)
  const unsafe = JSON.parse(readFileSync(join(out, 'unsafe.json'), 'utf8')) as Report
  const leak = unsafe.findings.find((f) => f.probe === 'canary' && f.verdict === 'leak')
  assert.ok(leak, 'the incident run leaked')
  const { observerTenant, victimTenant, numLeakingRequests } = leak.evidence as {
    observerTenant: string
    victimTenant: string
    numLeakingRequests: number
  }
  for (const name of ['unsafe.html', 'safe.html']) {
    const html = readFileSync(join(out, name), 'utf8')
    assert.match(html, /^<!doctype html>/, name)
    assert.ok(html.includes('id="tenant-matrix"'), `${name} has the tenant matrix`)
    assert.ok(html.includes('<canvas id="timeline-chart"'), `${name} has the timeline`)
  }
  const cell = new RegExp(
    `data-observer="${observerTenant}" data-source="${victimTenant}">(\\d+)</td>`,
  ).exec(readFileSync(join(out, 'unsafe.html'), 'utf8'))
  assert.equal(Number(cell?.[1]), numLeakingRequests)
})

/** The last 3 lines of each log file in `dir`, for a failure message. */
function logTails(dir: string): string {
  return readdirSync(dir)
    .map((name) => {
      const lines = readFileSync(join(dir, name), 'utf8').trim().split('\n')
      return `${name}: ${lines.slice(-3).join(' | ')}`
    })
    .join('; ')
}
