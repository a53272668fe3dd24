/** The watch's follow-up rounds against the real cluster under a busy workload: with the
 *  incident's fault injected (guards off) and four benign tenants sending their next request as
 *  soon as their last is answered (test/helpers/workload.ts, the bench's), an over-pool read wins
 *  the plant's freed pages only now and then, and a cycle at the default budget tries again in
 *  its follow-up rounds until one carries the plant's canary. One cycle misses about once in 100
 *  (docs/monitoring.md, section 1): two cycles are allowed. */
import assert from 'node:assert/strict'
import { rmSync, writeFileSync } from 'node:fs'
import { join } from 'node:path'
import { test } from 'node:test'
import { createRng } from '../../src/audit/rng.js'
import { runCycle, type CycleReport } from '../../src/audit/watch/cycle.js'
import { cycleCostBound } from '../../src/audit/watch/loop.js'
import { validateWatchOptions, watchDefaults } from '../../src/audit/watch/options.js'
import { startCluster } from '../../src/config/launch.js'
import { newApiKey } from '../../src/router/tenants/tenant-keys.js'
import { apiKeyDigest } from '../../src/router/tenants/tenants.js'
import { incidentShape, twoTenants } from '../helpers/cluster.js'
import { echoModelDir } from '../helpers/paths.js'
import { startWorkload } from '../helpers/workload.js'

test('placeholder-forward under a busy workload: a cycle at the default budget raises the leak within its follow-up rounds', async (t) => {
  const { dir, tenants, tenantsFile } = twoTenants('kvfence-watch-follow-up-')
  const workloadKeys = Array.from({ length: 4 }, () => newApiKey())
  writeFileSync(
    tenantsFile,
    'tenants:\n' +
      [...tenants.map((t) => t.key), ...workloadKeys]
        .map((key, i) => `  - { name: tenant-${i + 1}, keySha256: ${apiKeyDigest(key)} }\n`)
        .join(''),
  )
  const cluster = await startCluster({
    modelDir: echoModelDir,
    ...incidentShape,
    contextWindow: 1024,
    tenantsFile,
    prefillFaults: ['placeholder-forward'],
    disableGuards: true,
    logDir: join(dir, 'logs'),
    logLevel: 'warn',
    env: { ...process.env, KVFENCE_ALLOW_FAULTS: '1' },
  })
  const workload = startWorkload(cluster.routerUrl, workloadKeys)
  try {
    const watchTenants = tenants.map((t, i) => ({ name: `tenant-${i + 1}`, key: t.key }))
    const config = validateWatchOptions({ target: cluster.routerUrl, tenants: watchTenants }, 1)
    // Let the workload fill the pools first.
    await new Promise((r) => setTimeout(r, 3000))
    const reports: CycleReport[] = []
    let sizer = null
    for (let cycle = 1; cycle <= 2; cycle++) {
      const report = await runCycle({
        baseUrl: config.baseUrl,
        tenants: config.tenants,
        model: null,
        rng: createRng(cycle, 'follow-up test'),
        sizer,
        usageEndpoint: undefined,
        allowance: cycleCostBound(config).allowance,
        requestTimeoutMs: watchDefaults.requestTimeoutSeconds * 1000,
        concurrency: watchDefaults.concurrency,
        maxSeconds: watchDefaults.cycleSeconds,
      })
      reports.push(report)
      sizer = report.sizer
      if (report.findings.some((f) => f.finding.verdict === 'leak')) break
    }
    t.diagnostic(`follow-up rounds per cycle: ${reports.map((r) => r.followUps).join(', ')}`)
    const last = reports.at(-1)!
    const kinds = last.findings.map((f) => `${f.finding.verdict}:${f.finding.probe}`)
    assert.deepEqual([...new Set(kinds)].sort(), [
      'leak:canary',
      'warning:boundary',
      'warning:capacity',
    ])
    // The leak is in an answer to a prompt over the pool: the cycle's own, or a round's.
    const carriers = last.steps.filter((s) => s.carriesCanary)
    assert.ok(carriers.length >= 1)
    assert.ok(carriers.every((s) => s.trigger === 'over-capacity' || s.trigger === 'boundary'))
    assert.ok(last.followUps <= 12)
    // A round is a plant and a read, sent only while the allowance lasted.
    assert.ok(last.spent.tokens <= cycleCostBound(config).allowance.tokens)
  } finally {
    await workload.stop()
    await cluster.stop()
    rmSync(dir, { recursive: true, force: true })
  }
})
