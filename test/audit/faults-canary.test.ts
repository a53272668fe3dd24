/** The canary probe against kvfence's incident fault (`placeholder-forward`, guards off) on a
 *  freshly started cluster (router, prefill and decode workers as OS processes, the bundled echo
 *  model, the demo's pools: prefill 384 tokens, decode 1,024, context 1,024 advertised). With
 *  seed 2 it used to miss the leak: the pages an over-capacity request read stale held
 *  `boundary`'s filler prompts or nothing, not the victim's canaries (a warning only, and the
 *  default `--fail-on leak` exited 0). The probe now covers the decode pool with canary-dense
 *  plants sent together before its over-capacity prompts. One cluster. */
import assert from 'node:assert/strict'
import { rmSync } from 'node:fs'
import { after, test } from 'node:test'
import { runAudit, type Finding } from '../../src/audit/index.js'
import { twoTenants } from '../helpers/cluster.js'
import { faultyClusterRunner } from './fault-cluster.js'

const { dir, tenants, tenantsFile } = twoTenants('kvfence-audit-faults-canary-')
after(() => rmSync(dir, { recursive: true, force: true }))

const withFaultyCluster = faultyClusterRunner(dir, tenantsFile)

test('placeholder-forward, guards off, fresh cluster, seed 2: the first over-capacity prompt carries a canary (a leak)', async () => {
  const report = await withFaultyCluster(
    'placeholder-forward',
    {
      prefillFaults: ['placeholder-forward'],
      decodeFaults: ['placeholder-forward'],
      clampContext: false,
    },
    // boundary first, as in a default audit: its prompts (up to 1,023 tokens of filler) are what
    // the stale pages held when the probe missed.
    (url) => runAudit({ target: url, tenants, seed: 2, probes: ['boundary', 'canary'] }),
  )
  const canary = report.findings.filter((f) => f.probe === 'canary')
  assert.ok(
    canary.length > 0 && canary.every((f) => f.verdict === 'leak'),
    canary.map((f) => `${f.verdict}: ${f.title}`).join('\n'),
  )
  const first = canary.reduce((a: Finding, f) =>
    (f.evidence.requestNumber as number) < (a.evidence.requestNumber as number) ? f : a,
  )
  const e = first.evidence as {
    victimTenant: string
    observerTenant: string
    request: { kind: string; status: number; promptTokens: number }
    poolCover: Record<string, unknown>
  }
  assert.equal(e.victimTenant, 'tenant-a')
  assert.equal(e.observerTenant, 'tenant-b')
  // The first over-capacity prompt is one token over the 384-token prefill pool.
  assert.deepEqual(e.request, {
    kind: 'over-capacity',
    promptTokens: 385,
    stream: true,
    status: 200,
  })
  // Worked by hand: the plants' leases (prompt + 32) must fit the 384-token pool, so ⌈1,024 /
  // 384⌉ = 3 of them share the 1,024-token decode pool: ⌊1,024 / 3⌋ = 341, down to a page: 336,
  // less 32: 304 prompt tokens each (21 of the 64 pages each). The echo model's tokenizer spends
  // a token a character plus one at the start.
  const { sent, poolTokens, numNeeded, numPlants, promptTokensEach } = e.poolCover
  assert.deepEqual(
    { sent, poolTokens, numNeeded, numPlants, promptTokensEach },
    { sent: true, poolTokens: 1024, numNeeded: 3, numPlants: 3, promptTokensEach: 304 },
  )
  // Within the incident's target (bench/audit.ts: incident_detect_requests ≤ 30).
  assert.ok((first.evidence.requestNumber as number) <= 30, String(first.evidence.requestNumber))
})
