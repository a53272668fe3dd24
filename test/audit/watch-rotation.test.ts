/** The watch's rotation: one cheap arm a cycle, in order; the race arm finds answers crossed
 *  under overlapping load and passes the correct twin (the other arms: watch-arms.test.ts). */
import assert from 'node:assert/strict'
import { describe, test } from 'node:test'
import { createRng } from '../../src/audit/rng.js'
import { runCycle } from '../../src/audit/watch/cycle.js'
import { watchOutage } from '../../src/audit/watch/loop.js'
import { armOf, raceArm, rotation } from '../../src/audit/watch/rotation.js'
import { startLoadStandIn, type LoadStandInOptions } from './load-standins.js'
import { standInTenants } from './standins.js'

async function cycleAgainst(options: LoadStandInOptions, seed: number) {
  const standIn = await startLoadStandIn(options)
  try {
    const report = await runCycle({
      baseUrl: standIn.url,
      tenants: standInTenants,
      model: null,
      rng: createRng(seed, 'rotation test'),
      sizer: null,
      usageEndpoint: undefined,
      allowance: { tokens: 20_000, requests: 288 },
      requestTimeoutMs: 10_000,
      concurrency: 4,
      maxSeconds: 30,
      arm: raceArm,
    })
    return { report, stats: { ...standIn.stats } }
  } finally {
    await standIn.close()
  }
}

// The arm's long prompt is 400 characters of canaries (about 20 words, a short one 100, about 6); every answer waits 200 ms, so that the arrivals (10 ms apart on average) overlap.
const engine = { contextTokens: 4096, poolTokens: 4096, delayMs: 200 }

// Every test here audits a stand-in of its own, mostly waiting on its delays: two groups run at
// once. Not more: the audits share this process's event loop, and with many at once their
// timers and reads ran late enough to change verdicts (a discovery read timing out, a cut not
// seen before the slot was given back).
describe('watch-rotation', { concurrency: 2 }, () => {
  describe('the rotation', () => {
    test('cycles take the arms in order, from the first', () => {
      assert.equal(armOf(1), rotation[0])
      assert.equal(armOf(rotation.length + 1), rotation[0])
      assert.equal(armOf(2), rotation[1 % rotation.length])
    })

    test("the race arm's bound: one long prompt of 400 characters and three of 100", () => {
      // Each + 4 special tokens + 16 answer tokens.
      const limits = { poolTokens: Infinity, contextTokens: Infinity, inputLimitTokens: Infinity }
      assert.deepEqual(raceArm.cost(limits), { requests: 4, tokens: 420 + 3 * 120 })
    })

    for (const seed of [1, 2, 3]) {
      test(`the race arm: answers crossed with 2 in flight and a long prompt: a race-load leak alert (seed ${seed})`, async () => {
        const { report, stats } = await cycleAgainst(
          { ...engine, race: { minInFlight: 2, longWords: 12, mode: 'cross' } },
          seed,
        )
        assert.ok(stats.numRaced > 0)
        assert.equal(report.arm, 'race')
        assert.equal(report.outcome, 'finding')
        assert.ok(report.findings.some((f) => f.key.startsWith('leak:race-load:')))
        assert.ok(report.findings.every((f) => f.finding.verdict === 'leak'))
      })

      test(`the race arm against the correct twin: a clean cycle (seed ${seed})`, async () => {
        const { report, stats } = await cycleAgainst(engine, seed)
        assert.ok(stats.maxInFlight > 1)
        assert.equal(report.arm, 'race')
        assert.equal(report.outcome, 'clean', report.reason ?? '')
        assert.deepEqual(report.findings, [])
      })
    }

    test('an arm the allowance cannot hold is skipped and named', async () => {
      const standIn = await startLoadStandIn(engine)
      try {
        const report = await runCycle({
          baseUrl: standIn.url,
          tenants: standInTenants,
          model: null,
          rng: createRng(9, 'rotation test'),
          sizer: null,
          usageEndpoint: undefined,
          allowance: { tokens: 20_000, requests: 12 },
          requestTimeoutMs: 10_000,
          concurrency: 4,
          maxSeconds: 30,
          arm: raceArm,
        })
        assert.equal(report.arm, null)
        assert.ok(report.skipped.some((line) => line.startsWith('race arm skipped: it needs ~')))
      } finally {
        await standIn.close()
      }
    })
  })

  describe("the watch's outage check (the audit's, across cycles)", () => {
    const request = {
      tenant: standInTenants[0],
      prompt: 'a b c',
      maxTokens: 16,
      stream: false,
    }
    const result = (status: number | null, n: number) => ({
      status,
      failure: status === null ? ('network' as const) : null,
      text: status === 200 ? 'a b c' : '',
      promptTokens: status === 200 ? 4 : null,
      cachedTokens: null,
      ttftMs: null,
      requestNumber: n,
      atMs: 0,
      errorCode: null,
      errorMessage: null,
    })

    test('six valid requests failing in a row after an answer: an availability alert; an answer ends it', () => {
      const outage = watchOutage()
      outage.onCompletion(request, result(200, 1))
      for (let n = 1; n <= 5; n++) outage.onCompletion(request, result(500, n))
      assert.deepEqual(outage.findings(), [])
      outage.onCompletion(request, result(null, 6))
      const [alert] = outage.findings()
      assert.equal(alert.key, 'warning:outage')
      assert.equal(alert.finding.probe, 'availability')
      assert.match(
        alert.finding.title,
        /at request #2 .*the 6 valid requests from then on failed \(HTTP 500 ×5, network ×1\)/,
      )
      outage.onCompletion(request, result(200, 7))
      assert.deepEqual(outage.findings(), [])
    })

    test('prompts sent to be refused (isValid false) failing count for nothing', () => {
      const outage = watchOutage()
      outage.onCompletion(request, result(200, 1))
      for (let n = 1; n <= 8; n++)
        outage.onCompletion({ ...request, isValid: false }, result(500, n))
      assert.deepEqual(outage.findings(), [])
    })
  })
})
