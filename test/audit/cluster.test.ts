/** The default audit against the real kvfence cluster as shipped (router, prefill and decode
 *  workers as OS processes, KV pages over TCP, the bundled model): no probe reports a leak or a
 *  warning, and the probes that can tell on this engine say clean, reading the real
 *  `/server_info` (pool usage per worker) and the router's real error answers.
 *
 *  One seed (11) in `npm test`: a whole default audit is ~25 s of both cores. `KVFENCE_AUDIT_SEEDS`
 *  (comma-separated seeds) runs it once per seed, each on a fresh cluster (`npm run test:seeds`:
 *  three seeds); each run's figures (verdicts, requests, tokens, wall) are printed as a test
 *  diagnostic. */
import assert from 'node:assert/strict'
import { rmSync } from 'node:fs'
import { join } from 'node:path'
import { after, before, describe, test } from 'node:test'
import { auditDefaults, probeNames, runAudit, type AuditReport } from '../../src/audit/index.js'
import { startCluster, type Cluster } from '../../src/config/launch.js'
import { incidentShape, twoTenants } from '../helpers/cluster.js'
import { echoModelDir } from '../helpers/paths.js'
import { reportValidator } from './schema-validator.js'

/** The seeds to audit with: `KVFENCE_AUDIT_SEEDS` (e.g. `11,12,13`), else 11. */
function auditSeeds(value: string | undefined): number[] {
  if (value === undefined || value.trim() === '') return [11]
  const seeds = value.split(',').map((s) => Number(s.trim()))
  if (!seeds.every((s) => Number.isSafeInteger(s) && s >= 0)) {
    throw new Error(`KVFENCE_AUDIT_SEEDS must be comma-separated whole numbers, got "${value}"`)
  }
  return seeds
}

/** A counter's value from a Prometheus text body (0 when absent). */
function counter(body: string, name: string): number {
  const line = body.split('\n').find((l) => l.startsWith(`${name} `))
  return line === undefined ? 0 : Number(line.slice(name.length + 1))
}

for (const seed of auditSeeds(process.env.KVFENCE_AUDIT_SEEDS)) {
  describe(`the default audit of kvfence as shipped, seed ${seed}`, () => {
    const { dir, tenants, tenantsFile } = twoTenants('kvfence-audit-cluster-')
    let cluster: Cluster
    let report: AuditReport

    before(async () => {
      cluster = await startCluster({
        modelDir: echoModelDir,
        ...incidentShape,
        contextWindow: 1024,
        clampContext: true,
        tenantsFile,
        logDir: join(dir, 'logs'),
      })
      report = await runAudit({ target: cluster.routerUrl, tenants, seed })
    })
    after(async () => {
      await cluster?.stop()
      rmSync(dir, { recursive: true, force: true })
    })

    test('the run’s figures', async (t) => {
      const metrics = await (await fetch(`${cluster.routerUrl}/metrics`)).text()
      const verdicts: Record<string, number> = {}
      for (const f of report.findings) verdicts[f.verdict] = (verdicts[f.verdict] ?? 0) + 1
      const prompt = counter(metrics, 'kvfence_router_prompt_tokens_total')
      const generated = counter(metrics, 'kvfence_router_completion_tokens_total')
      const unsure = report.findings.filter((f) => f.verdict === 'inconclusive')
      t.diagnostic(
        `seed ${seed}: ${JSON.stringify(verdicts)}` +
          `${unsure.map((f) => ` [${f.probe}: ${f.title}]`).join('')}; ${report.requestsSent} requests; ` +
          `${prompt} prompt + ${generated} generated tokens admitted; ${(report.durationMs / 1000).toFixed(1)} s`,
      )
      assert.equal(report.seed, seed)
    })

    test('the shipped engine: no leak and no warning from any probe', () => {
      const alarming = report.findings.filter(
        (f) => f.verdict === 'leak' || f.verdict === 'warning',
      )
      assert.deepEqual(
        alarming.map((f) => `${f.probe}: ${f.title}`),
        [],
      )
    })

    test('capacity, boundary, canary, page-leak and error-handling are clean on the shipped engine', () => {
      const verdictOf = (probe: string) => report.findings.find((f) => f.probe === probe)?.verdict
      for (const probe of ['capacity', 'boundary', 'canary', 'page-leak', 'error-handling']) {
        const finding = report.findings.find((f) => f.probe === probe)
        assert.equal(
          verdictOf(probe),
          'clean',
          `${probe}: ${JSON.stringify(finding).slice(0, 2000)}`,
        )
      }
      const pageLeak = report.findings.find((f) => f.probe === 'page-leak')!.evidence
      assert.deepEqual(pageLeak.source, {
        endpoint: '/server_info',
        field: 'workers[].numPagesUsed',
        unit: 'pages',
      })
      assert.equal(pageLeak.baseline, 0)
      assert.ok((pageLeak.peak as number) > 0, 'pages were seen in use during the workload')
    })

    test('the budget held: at most the default 800 requests, and every one accounted for', () => {
      assert.ok(report.requestsSent <= auditDefaults.maxRequests)
      assert.equal(auditDefaults.maxRequests, 800)
      assert.equal(report.probeRuns.length, probeNames.length)
      // Discovery reads /v1/models, /server_info (kvfence answers it) and /metrics: 3 requests;
      // then each of the 2 tenants' keys is checked with one GET /v1/models; /health is read
      // before the probes and after them (a health check that turned bad is an availability
      // finding).
      const numProbeRequests = report.probeRuns.reduce((n, r) => n + r.requestsSent, 0)
      assert.equal(report.requestsSent - numProbeRequests, 3 + 2 + 2)
    })

    test('the report validates against docs/report-schema.json; no valid request failed', () => {
      const { validate, errorsOf } = reportValidator()
      assert.ok(validate(JSON.parse(JSON.stringify(report))), errorsOf())
      assert.deepEqual(
        report.findings.filter((f) => f.probe === 'availability').map((f) => f.title),
        [],
      )
      const numCompletions = report.probeRuns.reduce((n, r) => n + r.completions.sent, 0)
      assert.equal(numCompletions, report.completions.length)
    })
  })
}
