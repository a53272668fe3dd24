/** Each probe's share of the budget (plan.ts `shareBudget`): the shares `--plan` prints are the
 *  max-min fair split its docstring states, recomputed here by another route (the largest equal
 *  level the budget affords); a probe that would take all that is left no longer starves the
 *  probes after it; and a default audit of an engine reporting a 64k-token pool ends every probe
 *  with a verdict inside the default budget. */
import assert from 'node:assert/strict'
import { describe, test } from 'node:test'
import { auditDefaults, formatPlan, planAudit, runAudit } from '../../src/audit/index.js'
import type { AuditPlan, BudgetShare } from '../../src/audit/plan.js'
import { standInTenants, startStandIn, type StandInOptions } from './standins.js'

/** The shares by the stated rule, computed as "the largest level L such that every probe given
 *  min(need, L) fits", the leftover one request each to the probes cut, in the probes' order. */
function expectedShares(plan: AuditPlan): BudgetShare[] {
  const own = plan.probes.find((p) => p.probe === 'audit')?.numRequests ?? 0
  const probes = plan.probes.filter((p) => p.probe !== 'audit')
  const available = Math.max(0, plan.limits.maxRequests - own)
  const given = (level: number) => probes.reduce((s, p) => s + Math.min(p.numRequests, level), 0)
  let level = 0
  while (given(level + 1) <= available && level < Math.max(0, ...probes.map((p) => p.numRequests)))
    level++
  let leftover = available - given(level)
  const requests = probes.map((p) => {
    if (p.numRequests <= level) return p.numRequests
    return level + (leftover-- > 0 ? 1 : 0)
  })
  const tokens = probes.map((p, i) =>
    requests[i] >= p.numRequests
      ? p.numTokens
      : Math.floor((p.numTokens * requests[i]) / p.numRequests),
  )
  // Time follows requests and prefilled tokens: 256 tokens weigh as one request.
  const weights = requests.map((n, i) => n + 1 + tokens[i] / 256)
  const weight = weights.reduce((s, w) => s + w, 0)
  return probes.map((p, i) => ({
    probe: p.probe as BudgetShare['probe'],
    numRequests: requests[i],
    numTokens: tokens[i],
    seconds: Math.floor((plan.limits.maxSeconds * 1000 * weights[i]) / weight) / 1000,
  }))
}

async function planOf(options: StandInOptions): Promise<AuditPlan> {
  const standIn = await startStandIn('safe', options)
  try {
    return await planAudit({ target: standIn.url, tenants: standInTenants, seed: 1 })
  } finally {
    await standIn.close()
  }
}

describe('--plan: each probe its share of the default budget', () => {
  const pools: [string, StandInOptions][] = [
    ['4k', { poolTokens: 4096, contextTokens: 4096 }],
    ['64k', { poolTokens: 65_536, contextTokens: 65_536 }],
    // The incident's scale: a 1,048,576-token context over a 681,280-token pool.
    ['681k', { poolTokens: 681_280, contextTokens: 1_048_576 }],
  ]
  for (const [name, options] of pools) {
    test(`a ${name}-token pool: the shares follow the stated rule and fit the budget`, async () => {
      const plan = await planOf(options)
      const shares = plan.shares ?? []
      assert.deepEqual(shares, expectedShares(plan))
      const own = plan.probes.find((p) => p.probe === 'audit')!.numRequests
      const sharedRequests = shares.reduce((s, p) => s + p.numRequests, 0)
      assert.ok(own + sharedRequests <= auditDefaults.maxRequests)
      assert.equal(
        plan.numRequestsCapped,
        Math.min(plan.numRequests, auditDefaults.maxRequests, own + sharedRequests),
      )
      // No probe is given more than it asks, and every probe that asks for some gets some.
      for (const share of shares) {
        const need = plan.probes.find((p) => p.probe === share.probe)!
        assert.ok(share.numRequests <= need.numRequests, share.probe)
        assert.equal(share.numRequests > 0, need.numRequests > 0, share.probe)
      }
      // What falls short is said before any request, probe by probe.
      const text = formatPlan(plan)
      for (const share of shares) {
        const need = plan.probes.find((p) => p.probe === share.probe)!
        const says = text.includes(`${share.probe} needs up to ${need.numRequests} requests`)
        assert.equal(says, share.numRequests < need.numRequests, share.probe)
      }
    })
  }

  test("at the incident's scale prefix-timing's 5,000-odd requests are cut to a share, not the audit", async () => {
    const plan = await planOf({ poolTokens: 681_280, contextTokens: 1_048_576 })
    const need = plan.probes.find((p) => p.probe === 'prefix-timing')!
    const share = plan.shares!.find((s) => s.probe === 'prefix-timing')!
    assert.ok(need.numRequests > 5000, `${need.numRequests}`)
    assert.ok(share.numRequests < need.numRequests)
    // The probes after it keep theirs whole.
    for (const later of ['cache-fields', 'warm-equals-cold', 'error-handling'] as const) {
      const p = plan.probes.find((x) => x.probe === later)!
      assert.equal(plan.shares!.find((s) => s.probe === later)!.numRequests, p.numRequests, later)
    }
  })
})

describe('the audit holds each later probe its share', () => {
  test('prefix-timing, which takes as many samples as the budget leaves, no longer starves error-handling', async () => {
    // 5 own requests (3 discovery reads, 2 key checks) and 2 calibrations: 60 left for the
    // probes. Spent in order, prefix-timing took 10 samples × 6 and error-handling got none
    // ("not run: request budget exhausted").
    const standIn = await startStandIn('safe', {
      prefixCache: 'per-tenant',
      poolTokens: 65_536,
      contextTokens: 8192,
    })
    try {
      const report = await runAudit({
        target: standIn.url,
        tenants: standInTenants,
        seed: 5,
        probes: ['prefix-timing', 'error-handling'],
        maxRequests: 67,
      })
      const errorHandling = report.findings.filter((f) => f.probe === 'error-handling')
      assert.deepEqual(
        errorHandling.map((f) => f.verdict),
        ['clean'],
      )
      assert.notEqual(report.findings.find((f) => f.probe === 'prefix-timing')?.verdict, undefined)
      assert.deepEqual(report.pendingProbes, [])
      assert.ok(report.requestsSent <= 67)
    } finally {
      await standIn.close()
    }
  })

  test('a default audit of a 64k-token pool: every probe ends with a verdict of its own, none for want of budget', async () => {
    const standIn = await startStandIn('safe', {
      prefixCache: 'per-tenant',
      poolTokens: 65_536,
      contextTokens: 8192,
    })
    try {
      const report = await runAudit({ target: standIn.url, tenants: standInTenants, seed: 5 })
      assert.equal(report.state, 'finished')
      assert.deepEqual(report.pendingProbes, [])
      assert.ok(report.requestsSent <= auditDefaults.maxRequests)
      for (const run of report.probeRuns) {
        const findings = report.findings.filter((f) => f.probe === run.probe)
        assert.ok(findings.length > 0, run.probe)
        for (const f of findings)
          assert.doesNotMatch(
            f.title,
            /budget|requests left|not run/,
            `${run.probe}: ${f.verdict}: ${f.title}`,
          )
      }
      // The probes after prefix-timing, which the budget used to starve, tell.
      for (const probe of ['warm-equals-cold', 'evict-then-return', 'error-handling'] as const)
        assert.equal(report.findings.find((f) => f.probe === probe)?.verdict, 'clean', probe)
    } finally {
      await standIn.close()
    }
  })
})
