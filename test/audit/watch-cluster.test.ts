/** `kvfence watch` against the real kvfence cluster (router, prefill and decode workers as OS
 *  processes, KV pages over TCP, the bundled model): with the incident's fault injected and guards
 *  off it alerts (a leak finding in the log, the metric, the webhook body); as shipped it stays
 *  quiet through several cycles of every trigger and every arm of the rotation. */
import assert from 'node:assert/strict'
import { rmSync } from 'node:fs'
import { join } from 'node:path'
import { describe, test } from 'node:test'
import { startCluster, type ClusterOptions } from '../../src/config/launch.js'
import { twoTenants } from '../helpers/cluster.js'
import { echoModelDir } from '../helpers/paths.js'
import { metricValue, scrape, startReceiver, startWatch, type LogLine } from './watch-process.js'
import { rotation } from '../../src/audit/watch/rotation.js'

/** The incident's shape scaled down: a 384-token prefill pool, a 1024-token context. */
const shape = {
  modelDir: echoModelDir,
  pageSize: 16,
  prefillPages: 24,
  decodePages: 64,
  contextWindow: 1024,
}
const watchArgs = (url: string) => [
  '--target',
  url,
  '--tenant',
  'tenant-a=env:KVFENCE_WATCH_A',
  '--tenant',
  'tenant-b=env:KVFENCE_WATCH_B',
  '--cycle-seconds',
  '0.5',
  '--metrics-port',
  '0',
  '--seed',
  '21',
  '--max-tokens-per-hour',
  '100000000',
  '--max-requests-per-hour',
  '1000000',
]

async function withCluster(
  prefix: string,
  options: Partial<ClusterOptions>,
  body: (url: string, env: Record<string, string>) => Promise<void>,
): Promise<void> {
  const { dir, tenants, tenantsFile } = twoTenants(prefix)
  const cluster = await startCluster({
    ...shape,
    tenantsFile,
    logDir: join(dir, 'logs'),
    ...options,
  })
  try {
    await body(cluster.routerUrl, {
      KVFENCE_WATCH_A: tenants[0].key,
      KVFENCE_WATCH_B: tenants[1].key,
    })
  } finally {
    await cluster.stop()
    rmSync(dir, { recursive: true, force: true })
  }
}

/** A leak from one tenant to another (a same-tenant crossing, requests crossed, is a leak too). */
const isCrossTenantLeak = (l: LogLine): boolean => {
  const e = l.evidence as Record<string, unknown> | undefined
  return l.msg === 'finding' && l.verdict === 'leak' && e?.victimTenant !== e?.observerTenant
}

describe('kvfence watch against the real cluster', () => {
  test('placeholder-forward injected, guards off: a leak alert (log line, metric, webhook)', async () => {
    const receiver = await startReceiver()
    try {
      await withCluster(
        'kvfence-watch-incident-',
        {
          prefillFaults: ['placeholder-forward'],
          disableGuards: true,
          env: { ...process.env, KVFENCE_ALLOW_FAULTS: '1' },
        },
        async (url, env) => {
          const watch = startWatch([...watchArgs(url), '--webhook', receiver.url], env)
          try {
            const leak = await watch.waitFor(
              (l) => l.msg === 'finding' && isCrossTenantLeak(l),
              150_000,
              'with a cross-tenant leak finding',
            )
            const evidence = leak.evidence as Record<string, string>
            assert.deepEqual([evidence.victimTenant, evidence.observerTenant].sort(), [
              'tenant-a',
              'tenant-b',
            ])
            assert.ok(evidence.canary.includes(evidence.matchedFragment))
            const capacity = watch.lines.find(
              (l) => l.msg === 'finding' && l.probe === 'capacity',
            ) as LogLine
            assert.deepEqual(capacity.evidence, {
              advertisedContextTokens: 1024,
              effectivePoolTokens: 24 * 16,
            })
            const metrics = await scrape(await watch.metricsUrl())
            const labels = { verdict: 'leak', probe: String(leak.probe) }
            assert.ok(metricValue(metrics, 'kvfence_watch_findings_total', labels)! >= 1)
            assert.ok(metricValue(metrics, 'kvfence_watch_active_findings', labels)! >= 1)
            assert.equal(metricValue(metrics, 'kvfence_watch_capacity_gap_tokens'), 1024 - 384)
            // The webhook is posted after the log line: give it a moment.
            const until = Date.now() + 10_000
            const isLeakBody = (b: unknown) =>
              (b as { alerts: { labels: { finding: string } }[] }).alerts[0].labels.finding ===
              leak.finding
            while (!receiver.bodies.some(isLeakBody) && Date.now() < until)
              await new Promise((r) => setTimeout(r, 100))
            const body = receiver.bodies.find(isLeakBody) as {
              status: string
              alerts: { labels: Record<string, string> }[]
            }
            assert.equal(body.status, 'firing')
            assert.equal(body.alerts[0].labels.severity, 'critical')
            assert.equal(body.alerts[0].labels.target, url)
          } finally {
            watch.child.kill('SIGTERM')
            assert.equal((await watch.exited).code, 0)
          }
        },
      )
    } finally {
      await receiver.close()
    }
  })

  test('as shipped: no finding through several cycles, every trigger run', async () => {
    await withCluster('kvfence-watch-shipped-', { clampContext: true }, async (url, env) => {
      const watch = startWatch(watchArgs(url), env)
      try {
        const isDone = () => {
          const cycles = watch.lines.filter((l) => l.msg === 'cycle' && l.outcome === 'clean')
          const triggers = new Set(cycles.flatMap((l) => l.triggers as string[]))
          const arms = new Set(cycles.map((l) => l.arm))
          return cycles.length >= 6 && triggers.size === 5 && arms.size === rotation.length
        }
        await watch.waitFor(
          () => isDone(),
          150_000,
          'of six clean cycles running every trigger and every arm of the rotation',
        )
        const metrics = await scrape(await watch.metricsUrl())
        assert.deepEqual(
          watch.lines.filter((l) => l.msg === 'finding' || l.outcome === 'finding'),
          [],
        )
        // Each arm exercised what it checks: its positive control showed (none could not tell).
        assert.deepEqual(
          watch.lines.flatMap((l) =>
            ((l.skipped as string[] | undefined) ?? []).filter((s) => s.includes('arm ')),
          ),
          [],
        )
        // Every prompt over the limit was refused: no follow-up round ran.
        assert.deepEqual(
          watch.lines.filter((l) => l.msg === 'cycle' && l.followUps !== undefined),
          [],
        )
        assert.equal(metricValue(metrics, 'kvfence_watch_capacity_gap_tokens'), 0)
        assert.equal(
          metricValue(metrics, 'kvfence_watch_cycles_total', { outcome: 'finding' }),
          null,
        )
        assert.equal(metricValue(metrics, 'kvfence_watch_idle_pool_usage'), 0)
      } finally {
        watch.child.kill('SIGTERM')
        assert.equal((await watch.exited).code, 0)
      }
    })
  })
})
