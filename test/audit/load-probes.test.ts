/** `race-load` and `stall` against the stand-ins of load-standins.ts over real HTTP: each finds
 *  its engine's bug with its class, and passes the correct twin. */
import assert from 'node:assert/strict'
import { describe, test } from 'node:test'
import { runAudit, type AuditReport, type ProbeName } from '../../src/audit/index.js'
import { stallSizes, testedTop } from '../../src/audit/probes/stall.js'
import { startLoadStandIn, type LoadStandInOptions } from './load-standins.js'
import { standInTenants } from './standins.js'

async function audit(
  probe: ProbeName,
  options: LoadStandInOptions,
  seed = 7,
): Promise<{
  report: AuditReport
  stats: {
    numRaced: number
    numStalled: number
    maxInFlight: number
    numPagesUsed: number
  }
}> {
  const standIn = await startLoadStandIn(options)
  try {
    const report = await runAudit({
      target: standIn.url,
      tenants: standInTenants,
      seed,
      probes: [probe],
      maxSeconds: 120,
      maxConcurrency: 8,
    })
    return { report, stats: { ...standIn.stats } }
  } finally {
    await standIn.close()
  }
}

const rows = (report: AuditReport): string[][] =>
  report.findings.map((f) => [f.probe, f.verdict, f.class ?? '', f.severity])

// Long prompts are 2,044 characters of canaries (about 150 words); short ones 160 (about 12).
const big = { contextTokens: 65_536, poolTokens: 65_536, delayMs: 20, msPerWord: 0.2 }
const race = { minInFlight: 4, longWords: 64 }

describe('race-load', () => {
  test('answers crossed only with 4 or more in flight and a long prompt: content-leak', async () => {
    const { report, stats } = await audit('race-load', { ...big, race: { ...race, mode: 'cross' } })
    assert.ok(stats.numRaced > 0)
    assert.deepEqual(rows(report)[0].slice(0, 3), ['race-load', 'leak', 'content-leak'])
    assert.ok(report.findings.every((f) => f.verdict === 'leak'))
  })

  test('answers changed (a word lost, JSON broken) only under load: integrity warning', async () => {
    const { report, stats } = await audit('race-load', { ...big, race: { ...race, mode: 'break' } })
    assert.ok(stats.numRaced > 0)
    assert.equal(report.findings.length, 1)
    assert.deepEqual(rows(report)[0].slice(0, 3), ['race-load', 'warning', 'integrity'])
  })

  for (const seed of [1, 2, 3]) {
    test(`the correct twin: clean, with the load measured at 8 in flight (seed ${seed})`, async () => {
      const { report, stats } = await audit('race-load', big, seed)
      const [finding] = report.findings
      assert.deepEqual(
        rows(report),
        [['race-load', 'clean', 'content-leak', 'info']],
        finding.title,
      )
      assert.equal(finding.evidence.maxInFlight, 8)
      // The server saw the load, and never more than the cap.
      assert.ok(stats.maxInFlight > 1 && stats.maxInFlight <= 8)
    })
  }

  test("the endpoint's own limit (max_running_requests 4) bounds the ramp", async () => {
    const { report, stats } = await audit('race-load', { ...big, maxRunning: 4 })
    assert.deepEqual(rows(report), [['race-load', 'clean', 'content-leak', 'info']])
    assert.equal(report.findings[0].evidence.endpointLimit, 4)
    const levels = report.findings[0].evidence.levels as { level: number }[]
    assert.deepEqual(
      levels.map((l) => l.level),
      [2, 4],
    )
    assert.ok(stats.maxInFlight <= 4)
  })
})

describe('stall', () => {
  const sizes = { contextTokens: 4096, poolTokens: 8192 }

  test('the ladder: doubling from 512 to the advertised limit, capped at 32,768 by default', () => {
    assert.deepEqual(stallSizes(4088), [512, 1024, 2048, 4088])
    assert.deepEqual(
      stallSizes(testedTop(681_272, false)),
      [512, 1024, 2048, 4096, 8192, 16384, 32768],
    )
    assert.equal(testedTop(681_272, true), 681_272)
    // A small top is never the first size: its bound comes from a measured answer.
    assert.deepEqual(stallSizes(376), [94, 188, 376])
  })

  test('prefill limit 900 under an advertised 4,096: availability naming 1,024, and the pages kept: resource-leak', async () => {
    const { report, stats } = await audit('stall', { ...sizes, prefillLimitTokens: 900 })
    assert.equal(stats.numStalled, 1)
    assert.deepEqual(rows(report), [
      ['stall', 'warning', 'availability', 'high'],
      ['stall', 'warning', 'resource-leak', 'high'],
    ])
    assert.match(report.findings[0].title, /^a 1024-token prompt, within the 4088 tokens/)
    const after = report.findings[1].evidence.after as { usage: { used: number } }
    assert.equal(after.usage.used, stats.numPagesUsed)
    assert.match(
      report.findings[1].title,
      new RegExp(`stayed at ${stats.numPagesUsed} pages \\(0 before\\)`),
    )
  })

  test('the correct twin (prefill and decode limits equal): clean up to 4,088 tokens', async () => {
    const { report, stats } = await audit('stall', { ...sizes, prefillLimitTokens: 4096 })
    assert.equal(stats.numStalled, 0)
    assert.deepEqual(rows(report), [['stall', 'clean', 'availability', 'info']])
    assert.match(
      report.findings[0].title,
      /^prompts of 512, 1024, 2048, 4088 tokens were each answered within their bound \(the 4088 advertised\)$/,
    )
  })
})
