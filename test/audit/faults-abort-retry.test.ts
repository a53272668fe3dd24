/** abort-retry against kvfence's own clusters (router, prefill and decode workers as OS processes,
 *  the bundled echo model): clean as shipped, and finding the `publish-partial` fault with the
 *  guards off. Beside test/audit/faults.test.ts (the other faults), in a file of its own so that
 *  neither file runs for minutes on a loaded machine. One cluster at a time. */
import assert from 'node:assert/strict'
import { rmSync } from 'node:fs'
import { join } from 'node:path'
import { after, test } from 'node:test'
import { runAudit, type AuditOptions, type Finding } from '../../src/audit/index.js'
import { startCluster, type ClusterOptions } from '../../src/config/launch.js'
import { twoTenants } from '../helpers/cluster.js'
import { echoModelDir } from '../helpers/paths.js'
import { faultyClusterRunner } from './fault-cluster.js'

const { dir, tenants, tenantsFile } = twoTenants('kvfence-audit-faults-abort-retry-')
after(() => rmSync(dir, { recursive: true, force: true }))

const options = (url: string, extra: Partial<AuditOptions> = {}): AuditOptions => ({
  target: url,
  tenants,
  seed: 1,
  ...extra,
})

const withFaultyCluster = faultyClusterRunner(dir, tenantsFile)

// abort-retry against kvfence: publish-partial (an aborted prefill's pages published) needs a
// prefix cache that holds a prompt past one prefill chunk while its own pages are leased (the
// demo's 24-page pool caches 6 pages, all written by the first chunk): bench/audit.ts's shape.
const publishPartialShape: Partial<ClusterOptions> = {
  prefillPages: 256,
  decodePages: 128,
  prefixCachePages: 128,
  contextWindow: 2048,
}

test('abort-retry, kvfence as shipped (guards on, the demo shape): no difference after cuts during prefill; clean only with a cache hit seen, else inconclusive', async () => {
  const cluster = await startCluster({
    modelDir: echoModelDir,
    pageSize: 16,
    prefillPages: 24,
    decodePages: 64,
    contextWindow: 1024,
    clampContext: true,
    tenantsFile,
    logDir: join(dir, 'abort-retry-shipped'),
    logLevel: 'warn',
  })
  try {
    const report = await runAudit(options(cluster.routerUrl, { probes: ['abort-retry'] }))
    const [finding] = report.findings
    // This shape's small prefix cache (6 pages) mostly serves nothing, not even the control (a
    // prompt answered whole, sent again by its tenant), and then equal retries prove nothing
    // about reuse: inconclusive. Whether a page of the tenant's own prompt survives to its retry
    // depends on the machine's timing (seen: 16 cached tokens at load 10): then the retries'
    // equality stands on a cache hit, and the verdict is clean, naming it. Never a leak or warning.
    const why = `${finding.title} ${JSON.stringify(finding.evidence).slice(0, 600)}`
    assert.equal(report.findings.length, 1)
    assert.equal(finding.probe, 'abort-retry')
    assert.ok(['clean', 'inconclusive'].includes(finding.verdict), why)
    assert.match(
      finding.title,
      finding.verdict === 'clean'
        ? /^\d+ prompts cut during prefill; \d+ retries by the same and another tenant answered exactly the cold answer \(positive control: the prefix cache served [1-9]\d* cached tokens\)$/
        : /prompts cut during prefill and \d+ retries answered the cold answer, but no request was seen served from a prefix cache \(cached_tokens always 0/,
      why,
    )
    // The chunk kvfence's prefill worker reports in /server_info (prefillChunkTokens).
    assert.equal(finding.evidence.chunkTokens, 256)
    assert.equal(finding.evidence.isChunkReported, true)
  } finally {
    await cluster.stop()
  }
})

test('publish-partial, guards off: abort-retry finds the published half-written pages', async () => {
  // Whether a cut lands while P is prefilling depends on timing on a shared machine (seen: one
  // run in two or three finds it within its six attempts): a run that found nothing is retried
  // on a fresh cluster, at most three runs in all. A run that found nothing is never a leak
  // elsewhere, and the finding, when there is one, is a leak or a warning.
  let finding: Finding | undefined
  for (let run = 0; run < 3; run++) {
    const report = await withFaultyCluster(
      `publish-partial-${run}`,
      { ...publishPartialShape, prefillFaults: ['publish-partial'] },
      (url) => runAudit(options(url, { probes: ['abort-retry'] })),
    )
    finding = report.findings[0]
    if (finding.verdict === 'leak' || finding.verdict === 'warning') break
  }
  assert.ok(finding !== undefined)
  assert.ok(
    finding.verdict === 'leak' || finding.verdict === 'warning',
    `${finding.verdict}: ${finding.title} ${JSON.stringify(finding.evidence).slice(0, 600)}`,
  )
  assert.equal(finding.probe, 'abort-retry')
  // The same tenant's retry read the published pages: the prompt was cached whole.
  assert.match(finding.title, /tenant-a's retry \(same tenant, right after the cut\)/)
})
