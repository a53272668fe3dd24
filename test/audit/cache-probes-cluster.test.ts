/** `warm-equals-cold` and `evict-then-return` against the real kvfence cluster as shipped (router,
 *  prefill and decode workers as OS processes, KV pages over TCP, the bundled model), its prefix
 *  cache given a host-memory offload tier: both are clean, and evict-then-return's return really
 *  was loaded back from the offload tier (the prefill worker's own counter says so). */
import assert from 'node:assert/strict'
import { rmSync } from 'node:fs'
import { join } from 'node:path'
import { after, before, test } from 'node:test'
import { runAudit, type AuditReport } from '../../src/audit/index.js'
import { startCluster } from '../../src/config/launch.js'
import { incidentShape, twoTenants } from '../helpers/cluster.js'
import { echoModelDir } from '../helpers/paths.js'

const { dir, tenants, tenantsFile } = twoTenants('kvfence-audit-cache-probes-')
let report: AuditReport
let prefillMetrics: string
/** Seeds whose canaries once put warm-equals-cold one token over every even edge (2522790461,
 *  an even-length canary) beside ones that never did; per seed, [verdict, missedEdges]. */
const seeds = [2522790461, 3068662099, 11, 12]
const bySeed = new Map<number, [string, unknown]>()

before(async () => {
  const cluster = await startCluster({
    modelDir: echoModelDir,
    ...incidentShape,
    contextWindow: 1024,
    clampContext: true,
    tenantsFile,
    logDir: join(dir, 'logs'),
    logLevel: 'warn',
    // 8 MiB of offload tier: many times the prefill pool, so an evicted page stays there.
    prefillArgs: ['--prefix-cache-offload-bytes', String(8 * 1024 * 1024)],
  })
  try {
    report = await runAudit({
      target: cluster.routerUrl,
      tenants,
      seed: 3,
      probes: ['warm-equals-cold', 'evict-then-return'],
    })
    prefillMetrics = await (await fetch(`${cluster.prefillUrl}/metrics`)).text()
    for (const seed of seeds) {
      const { findings } = await runAudit({
        target: cluster.routerUrl,
        tenants,
        seed,
        probes: ['warm-equals-cold'],
      })
      bySeed.set(seed, [findings[0].verdict, findings[0].evidence.missedEdges])
    }
  } finally {
    await cluster.stop()
  }
})
after(() => rmSync(dir, { recursive: true, force: true }))

test('kvfence as shipped, with an offload tier: warm-equals-cold and evict-then-return clean', () => {
  assert.deepEqual(
    report.findings.map((f) => [f.probe, f.verdict]),
    [
      ['warm-equals-cold', 'clean'],
      ['evict-then-return', 'clean'],
    ],
    JSON.stringify(report.findings.map((f) => [f.title, f.evidence])).slice(0, 4000),
  )
})

test('warm-equals-cold landed on every edge it aimed at (16, 32, 64, 128: page 16; 256: the prefill chunk; both read from /server_info)', () => {
  const e = report.findings[0].evidence as {
    edges: { tokens: number; why: string }[]
    missedEdges: number[]
    numCompared: number
  }
  assert.deepEqual(
    e.edges.map((x) => x.why),
    ['1 × page 16', '2 × page 16', '4 × page 16', '8 × page 16', 'chunk 256'],
  )
  assert.deepEqual(e.missedEdges, [])
  assert.equal(e.numCompared, 15)
})

test('warm-equals-cold lands on every edge whatever the seed (2522790461 once missed 32, 64, 128 and 256 by one)', () => {
  assert.deepEqual(
    [...bySeed],
    seeds.map((seed) => [seed, ['clean', []]]),
  )
})

test("evict-then-return's churn covered 4 × the largest pool, another tenant was served none of the evicted prefixes, the returns were loaded back from the offload tier", () => {
  const e = report.findings[1].evidence as {
    churn: { poolTokens: number }
    churnTokensAnswered: number
    returns: { cachedTokens: number; isEqual: boolean }[]
    crossTenantChecks: { factor: number; cachedTokens: number; isEqual: boolean }[]
  }
  // The decode worker's pool: 64 pages × 16 tokens.
  assert.equal(e.churn.poolTokens, 1024)
  assert.ok(e.churnTokensAnswered >= 4096)
  assert.deepEqual(
    e.crossTenantChecks.map((c) => [c.factor, c.cachedTokens, c.isEqual]),
    [
      [1, 0, true],
      [2, 0, true],
      [4, 0, true],
    ],
  )
  assert.ok(e.returns.every((r) => r.isEqual))
  assert.ok(e.returns.some((r) => r.cachedTokens > 0))
  const hits = /^kvfence_prefix_cache_offload_loads_total\{[^}]*outcome="hit"[^}]*\} (\d+)/m.exec(
    prefillMetrics,
  )
  assert.ok(hits !== null && Number(hits[1]) >= 1, prefillMetrics.slice(0, 2000))
})
