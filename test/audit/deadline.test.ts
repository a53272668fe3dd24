/** The time budget holds against an endpoint whose answers never end: the real CLI, in a child
 *  process, against a stand-in whose every completion streams token events forever. The audit
 *  must exit within `--max-seconds` plus the documented grace (probes conclude, reports are
 *  written), must not call `clean` what it never saw whole, and must print no `-Infinity`.
 *  Since no valid answer ever ends, nothing was audited: the exit is 2 (a tool error, one line
 *  saying why), never 0, and the JSON report says `tool-error` with no verdict drawn from it.
 *  The wall-time bound is a hang check with a wide margin, not a performance claim: before the
 *  fix a 3-second abort-race ran for minutes of CPU past its deadline (scanning 8 MiB answers). */
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { mkdtemp, readFile, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { fileURLToPath } from 'node:url'
import { after, before, describe, test } from 'node:test'
import { probeGraceMs } from '../../src/audit/run.js'
import type { AuditReport } from '../../src/audit/index.js'
import { Budget } from '../../src/audit/budget.js'
import { createTarget, isAnsweredWhole, outcomeOf } from '../../src/audit/target.js'
import { standInTenants, startStandIn, tenantKeys, type StandIn } from './standins.js'

const mainJs = fileURLToPath(new URL('../../src/cli/main.js', import.meta.url))

/** Node's start and the report writing, outside the audit's own clock: a hang bound only (a shared
 *  machine at load average 15 took 13 s for a 4 s budget). The deadline itself is checked on the
 *  report's `durationMs`, which the audit measures from its first request. */
const marginMs = 30_000

interface Run {
  code: number | null
  stdout: string
  stderr: string
  wallMs: number
}

function audit(url: string, args: string[]): Promise<Run> {
  const startedAt = performance.now()
  return new Promise((resolve) => {
    execFile(
      process.execPath,
      [mainJs, 'audit', '--target', url, ...tenantArgs, '--seed', '5', ...args],
      { timeout: 60_000 },
      (err, stdout, stderr) => {
        const code = err && typeof err.code === 'number' ? err.code : err ? null : 0
        resolve({ code, stdout, stderr, wallMs: performance.now() - startedAt })
      },
    )
  })
}

const tenantArgs = ['--tenant', `alice=${tenantKeys.alice}`, '--tenant', `bob=${tenantKeys.bob}`]

describe('an endpoint whose answers never end', () => {
  let fast: StandIn
  let slow: StandIn
  let dir = ''
  before(async () => {
    fast = await startStandIn('safe', { isEndless: true })
    slow = await startStandIn('safe', { isEndless: true, tokenDelayMs: 20 })
    dir = await mkdtemp(join(tmpdir(), 'kvfence-deadline-'))
  })
  after(async () => {
    await fast.close()
    await slow.close()
    await rm(dir, { recursive: true, force: true })
  })

  const readReport = async (file: string): Promise<AuditReport> =>
    JSON.parse(await readFile(file, 'utf8')) as AuditReport

  test('abort-race, events as fast as they are read, --max-seconds 3: ends in time, exit 2 (no answer ended, and the line says how), inconclusive (never clean)', async () => {
    const json = join(dir, 'abort-race.json')
    const run = await audit(fast.url, [
      '--probes',
      'abort-race',
      '--max-seconds',
      '3',
      '--json',
      json,
    ])
    // No valid answer ended: each went on past its size cap, or was in flight at the deadline and
    // cut there (how many of each depends on how fast this machine reads). Not one was answered,
    // so nothing was audited, and the line names the cause these counts show.
    assert.equal(run.code, 2, run.stderr)
    const report = await readReport(json)
    const numNotAnsweredBy = new Map<string, number>()
    for (const c of report.completions) {
      if (c.isValid === false || c.failure === 'aborted') continue // abort-race's own cuts
      const isTruncated = c.status === 200 && c.failure === 'truncated' && c.fate === 'failed'
      const isAtDeadline = c.status === null && c.failure === 'timeout' && c.fate === 'cut'
      assert.ok(isTruncated || isAtDeadline, `completion ${JSON.stringify(c)}`)
      const cause = isTruncated ? 'HTTP 200 truncated' : 'cut at the deadline'
      numNotAnsweredBy.set(cause, (numNotAnsweredBy.get(cause) ?? 0) + 1)
    }
    const numSent = [...numNotAnsweredBy.values()].reduce((a, b) => a + b, 0)
    const byCause = [...numNotAnsweredBy]
      .sort(([, a], [, b]) => b - a)
      .map(([cause, n]) => `${cause} ×${n}`)
      .join(', ')
    // /health is read once a valid completion failed (a truncation), unless the budget was spent.
    const health = report.findings.find((f) => f.probe === 'availability')?.evidence.health as
      { status: number | string } | null | undefined
    const healthNote =
      health == null || health.status === 'budget' ? '' : `; /health answered ${health.status}`
    const hint = !numNotAnsweredBy.has('HTTP 200 truncated')
      ? "none ended before the time budget's deadline: raise --max-seconds, or check that the endpoint ends its answers at max_tokens"
      : numNotAnsweredBy.has('cut at the deadline')
        ? 'every answer not cut at the deadline went on past max_tokens until it was cut at its size cap: the endpoint does not end its answers'
        : 'every answer went on past max_tokens until it was cut at its size cap: the endpoint does not end its answers'
    assert.equal(
      run.stderr,
      `kvfence audit: the target answered none of the ${numSent} valid completions sent to ${fast.url}/v1/completions (${byCause})${healthNote}: ${hint}. Nothing was audited\n`,
    )
    assert.ok(run.wallMs < 3_000 + probeGraceMs + marginMs, `took ${Math.round(run.wallMs)} ms`)
    assert.equal(report.state, 'tool-error')
    assert.equal(report.toolError?.code, 'no_completion_answered')
    assert.deepEqual(report.pendingProbes, ['abort-race'])
    assert.ok(report.durationMs <= 3_000 + probeGraceMs, `report says ${report.durationMs} ms`)
    assert.deepEqual(
      report.findings.filter((f) => f.probe !== 'availability').map((f) => [f.probe, f.verdict]),
      [['abort-race', 'inconclusive']],
    )
    assert.match(report.findings[0].title, /answers to other tenants never ended/)
    assert.doesNotMatch(run.stdout + run.stderr, /Infinity/)
  })

  test('every probe, one event every 20 ms, --max-seconds 4: ends in time, exit 2 (no answer ended), abort-race not clean, no -Infinity', async () => {
    const json = join(dir, 'all.json')
    const run = await audit(slow.url, ['--max-seconds', '4', '--json', json])
    // No valid answer ended before the deadline: a tool error naming the deadline, not exit 0.
    assert.equal(run.code, 2, run.stderr)
    assert.match(
      run.stderr,
      /^kvfence audit: the target answered none of the \d+ valid completions sent to \S+ \(cut at the deadline ×\d+\)(; \/health answered 200)?: none ended before the time budget's deadline: raise --max-seconds, or check that the endpoint ends its answers at max_tokens\. Nothing was audited\n$/,
    )
    assert.ok(run.wallMs < 4_000 + probeGraceMs + marginMs, `took ${Math.round(run.wallMs)} ms`)
    const report = await readReport(json)
    assert.equal(report.state, 'tool-error')
    assert.ok(report.durationMs <= 4_000 + probeGraceMs, `report says ${report.durationMs} ms`)
    const verdictOf = (probe: string) => report.findings.find((f) => f.probe === probe)?.verdict
    assert.equal(verdictOf('abort-race'), 'inconclusive')
    // The budget ran out before page-leak read the pool once: it says so, with no number.
    assert.equal(verdictOf('page-leak'), 'inconclusive')
    assert.doesNotMatch(run.stdout + run.stderr, /Infinity/)
  })

  test('one completion: cut at its size cap, failure "truncated", never an answer read whole', async () => {
    const target = createTarget({
      baseUrl: fast.url,
      model: null,
      tenants: standInTenants,
      budget: new Budget({ maxRequests: 2, maxSeconds: 20, concurrency: 1 }),
      requestTimeoutMs: 10_000,
    })
    const result = await target.complete({
      tenant: standInTenants[1],
      prompt: 'hello there',
      maxTokens: 4,
      stream: true,
    })
    assert.equal(result.status, 200)
    assert.equal(result.failure, 'truncated')
    assert.equal(outcomeOf(result), 'accepted') // the server took it...
    assert.equal(isAnsweredWhole(result), false) // ...but the answer was never read whole
    // The cap for max_tokens 4 is 64 KiB + 4 × 4 KiB, filled with the stand-in's 96-byte events
    // (`data: {…" more"…}` and a blank line); the one cut in two is not parsed.
    assert.equal(result.text, ' more'.repeat(Math.floor((64 * 1024 + 4 * 4096) / 96)))
  })
})
