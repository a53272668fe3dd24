/** The watch's rotation arms of the entrypoints, operational-endpoints and near-duplicates
 *  probes: each raises its alert, keyed as docs/monitoring.md names it, in a watch cycle against
 *  a stand-in with the flaw, and the cycle is clean against its correct twin; the entrypoint arm
 *  discovers the served entrypoints once and takes one a cycle; `watch --plan` lists every arm
 *  and the costliest bound; the near-duplicate arm's prompt bound holds. */
import assert from 'node:assert/strict'
import { describe, test } from 'node:test'
import fc from 'fast-check'
import { makeCanaries } from '../../src/audit/canaries.js'
import { nearDuplicates, victimPrompt } from '../../src/audit/probes/near-duplicates.js'
import { createRng } from '../../src/audit/rng.js'
import { createEntrypointArm } from '../../src/audit/watch/arms/entrypoint.js'
import {
  createNearDuplicateArm,
  nearArmPromptChars,
} from '../../src/audit/watch/arms/near-duplicate.js'
import { operationalArm } from '../../src/audit/watch/arms/operational.js'
import { runCycle } from '../../src/audit/watch/cycle.js'
import { cycleCostBound } from '../../src/audit/watch/loop.js'
import { validateWatchOptions } from '../../src/audit/watch/options.js'
import { formatWatchPlan } from '../../src/audit/watch/plan.js'
import type { RotationArm } from '../../src/audit/watch/rotation.js'
import { startEntrypointStandIn, type EntrypointStandInOptions } from './entrypoint-standins.js'
import { startLayerStandIn, standInAdminKey, type LayerOptions } from './layer-standins.js'
import { standInTenants, tenantKeys } from './standins.js'

function cycle(url: string, arm: RotationArm, seed: number) {
  return runCycle({
    baseUrl: url,
    tenants: standInTenants,
    model: null,
    rng: createRng(seed, 'arms test'),
    sizer: null,
    usageEndpoint: undefined,
    allowance: { tokens: 20_000, requests: 288 },
    requestTimeoutMs: 10_000,
    concurrency: 4,
    maxSeconds: 30,
    arm,
  })
}

/** Runs `numCycles` cycles with one arm against an entrypoint stand-in. */
async function entrypointCycles(options: EntrypointStandInOptions, numCycles: number) {
  const standIn = await startEntrypointStandIn(options)
  const arm = createEntrypointArm()
  try {
    const reports = []
    for (let i = 1; i <= numCycles; i++) reports.push(await cycle(standIn.url, arm, i))
    return { reports, routes: [...standIn.routes] }
  } finally {
    await standIn.close()
  }
}

async function layerCycle(options: LayerOptions, arm: RotationArm, seed: number) {
  const standIn = await startLayerStandIn(options)
  try {
    return await cycle(standIn.url, arm, seed)
  } finally {
    await standIn.close()
  }
}

describe('the entrypoint arm', () => {
  test('chat drops the tenant from its cache key and answers from it: cycle 1 takes completions (clean), cycle 2 chat (a leak alert)', async () => {
    const { reports, routes } = await entrypointCycles(
      { serves: ['chat'], saltless: ['chat'], answerCache: true },
      2,
    )
    const [first, second] = reports
    assert.equal(first.arm, 'entrypoint')
    assert.equal(first.outcome, 'clean', first.reason ?? '')
    assert.deepEqual(first.findings, [])
    assert.equal(second.arm, 'entrypoint')
    assert.equal(second.outcome, 'finding')
    assert.ok(second.findings.some((f) => f.key === 'leak:entrypoints:chat'))
    // Discovered once: two requests to /v1/messages (plain and streamed; not served) in two cycles.
    assert.equal(routes.filter((r) => r === 'POST /v1/messages').length, 2)
  })

  test('chat shares its prefix cache across tenants: a side-channel warning on chat', async () => {
    const { reports } = await entrypointCycles({ serves: ['chat'], saltless: ['chat'] }, 2)
    const keys = reports[1].findings.map((f) => f.key)
    assert.deepEqual(keys, ['warning:entrypoints:chat'])
    assert.equal(reports[1].findings[0].finding.class, 'side-channel')
  })

  test('the correct twin: every cycle clean, its control showing reuse', async () => {
    const { reports } = await entrypointCycles({ serves: ['chat', 'messages'] }, 3)
    for (const report of reports) {
      assert.equal(report.arm, 'entrypoint')
      assert.equal(report.outcome, 'clean', report.reason ?? '')
      assert.deepEqual(report.findings, [])
      assert.deepEqual(
        report.skipped.filter((line) => line.startsWith('entrypoint arm')),
        [],
      )
    }
  })
})

describe('the operational arm', () => {
  test("/slots shows A's prompt to B's key: a leak alert naming the path", async () => {
    const report = await layerCycle({ slots: 'prompts' }, operationalArm, 1)
    assert.equal(report.arm, 'operational')
    assert.equal(report.outcome, 'finding')
    assert.ok(report.findings.some((f) => f.key === 'leak:operational-endpoints:/slots'))
  })

  test('/server_info serializes the admin key: a credential warning, the value redacted', async () => {
    const report = await layerCycle({ serverInfo: 'api-key' }, operationalArm, 2)
    const secrets = report.findings.filter((f) =>
      f.key.startsWith('warning:operational-endpoints:/server_info:'),
    )
    assert.ok(secrets.length > 0)
    const text = JSON.stringify(report)
    assert.ok(!text.includes(standInAdminKey))
    assert.ok(!text.includes(tenantKeys.alice) && !text.includes(tenantKeys.bob))
  })

  test('the twin (slots without prompts, keys nulled): a clean cycle', async () => {
    const report = await layerCycle({ slots: 'hidden', serverInfo: 'clean' }, operationalArm, 3)
    assert.equal(report.arm, 'operational')
    assert.equal(report.outcome, 'clean', report.reason ?? '')
    assert.deepEqual(report.findings, [])
    assert.deepEqual(
      report.skipped.filter((line) => line.startsWith('operational arm')),
      [],
    )
  })
})

describe('the near-duplicate arm', () => {
  for (const seed of [1, 2]) {
    test(`a gateway cache keyed by the normalised prompt without the tenant: a leak alert (seed ${seed})`, async () => {
      const report = await layerCycle(
        { responseCache: 'shared-exact' },
        createNearDuplicateArm(),
        seed,
      )
      assert.equal(report.arm, 'near-duplicate')
      assert.equal(report.outcome, 'finding')
      assert.ok(report.findings.some((f) => f.key === 'leak:near-duplicates:alice->bob'))
    })

    test(`the twin, keyed by tenant: a clean cycle, A's repeat hit (seed ${seed})`, async () => {
      const report = await layerCycle(
        { responseCache: 'per-tenant' },
        createNearDuplicateArm(),
        seed,
      )
      assert.equal(report.arm, 'near-duplicate')
      assert.equal(report.outcome, 'clean', report.reason ?? '')
      assert.deepEqual(report.findings, [])
      assert.deepEqual(
        report.skipped.filter((line) => line.startsWith('near-duplicate arm')),
        [],
      )
    })
  }

  test('no cache at all: no alert, and the cycle says the arm could not tell', async () => {
    const report = await layerCycle({}, createNearDuplicateArm(), 4)
    assert.deepEqual(report.findings, [])
    assert.ok(
      report.skipped.some((line) =>
        line.startsWith(
          "near-duplicate arm could not tell: alice's exact repeat showed no cache hit",
        ),
      ),
    )
  })

  test('no prompt it sends is longer than its bound', () => {
    fc.assert(
      fc.property(fc.integer({ min: 0, max: 2 ** 32 - 1 }), (seed) => {
        const rng = createRng(seed, 'bound')
        const [canary, own] = makeCanaries(rng, 2)
        const prompt = victimPrompt(rng, canary)
        const all = [prompt, ...nearDuplicates(prompt, canary, own).map((d) => d.prompt)]
        return all.every((p) => p.length <= nearArmPromptChars)
      }),
      { numRuns: 2000 },
    )
  })
})

test('watch --plan lists the five arms; the bound is the costliest (operational reads, entrypoint discovery)', () => {
  const config = validateWatchOptions(
    { target: 'http://127.0.0.1:8000', tenants: standInTenants },
    1,
  )
  const cost = cycleCostBound(config)
  // operational: a streamed plant and 14 paths read twice; entrypoint: 9 discovery requests of
  // 18 + 100 + 1 tokens, then a trial of 3 × (300 + 100 + 8).
  assert.deepEqual(cost.rotationArm, { requests: 29, tokens: 9 * 119 + 3 * 408 })
  const plan = formatWatchPlan(config)
  assert.match(plan, /at most 29 requests and 2295 tokens\), charged what it spent: 1\. race \(/)
  assert.match(
    plan,
    /; 2\. entrypoint \(.*; 3\. operational \(.*; 4\. near-duplicate \(.*; 5\. request-ids \(/,
  )
  assert.match(
    plan,
    /^at start: each tenant's key checked with one GET of \/v1\/models \(2 requests, no tokens\)/m,
  )
})
