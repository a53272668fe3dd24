/** The probes of the layers beside and in front of an engine (`operational-endpoints`,
 *  `near-duplicates`, `request-ids`) against the stand-ins of layer-standins.ts, each modelled on
 *  a public report, and their correct twins: the audit finds each (class, endpoint or field
 *  named, secret redacted in every report format) and passes each twin. Real sockets on
 *  loopback, the real auditor end to end. */
import assert from 'node:assert/strict'
import { describe, test } from 'node:test'
import { planAudit, runAudit, type AuditReport } from '../../src/audit/index.js'
import { formatSummary } from '../../src/audit/reporters/console.js'
import { formatHtmlReport } from '../../src/audit/reporters/html.js'
import { formatJsonReport } from '../../src/audit/reporters/json.js'
import { formatJunitReport } from '../../src/audit/reporters/junit.js'
import { operationalPaths } from '../../src/audit/probes/operational-endpoints.js'
import type { ProbeName } from '../../src/audit/types.js'
import { startLayerStandIn, standInAdminKey, type LayerOptions } from './layer-standins.js'
import { standInTenants, tenantKeys } from './standins.js'

async function audit(options: LayerOptions, probe: ProbeName, seed = 1): Promise<AuditReport> {
  const standIn = await startLayerStandIn(options)
  try {
    return await runAudit({ target: standIn.url, tenants: standInTenants, seed, probes: [probe] })
  } finally {
    await standIn.close()
  }
}

function verdicts(report: AuditReport, probe: ProbeName): string[] {
  return report.findings.filter((f) => f.probe === probe).map((f) => `${f.verdict} ${f.class}`)
}

// Every test here audits a stand-in of its own, mostly waiting on its delays: two groups run at
// once. Not more: the audits share this process's event loop, and with many at once their
// timers and reads ran late enough to change verdicts (a discovery read timing out, a cut not
// seen before the slot was given back).
describe('layers', { concurrency: 2 }, () => {
  describe('operational-endpoints', () => {
    test('a llama.cpp-like /slots showing prompts: content-leak naming /slots; the twin without prompts is clean and lists /slots as read', async () => {
      const leaky = await audit({ slots: 'prompts' }, 'operational-endpoints')
      const leaks = leaky.findings.filter((f) => f.verdict === 'leak')
      assert.deepEqual(
        leaks.map((f) => [f.class, f.evidence.endpoint, f.evidence.victimTenant]),
        [['content-leak', '/slots', 'alice']],
      )
      const twin = await audit({ slots: 'hidden' }, 'operational-endpoints')
      assert.deepEqual(verdicts(twin, 'operational-endpoints'), ['clean content-leak'])
      assert.deepEqual(twin.findings[0].evidence.endpointsRead, [
        '/slots',
        '/metrics',
        '/health',
        '/v1/models',
      ])
      assert.ok(
        (twin.findings[0].evidence.endpointsNotExercised as string[]).includes('/server_info'),
      )
    })

    test('an SGLang-like /server_info serializing api_key: credential-exposure per endpoint and field, the secrets redacted in JSON, console, HTML and JUnit; the twin is clean', async () => {
      const leaky = await audit({ serverInfo: 'api-key' }, 'operational-endpoints')
      const exposed = leaky.findings
        .filter((f) => f.class === 'credential-exposure')
        .map((f) => `${f.evidence.endpoint} ${f.evidence.field} ${f.evidence.kind} ${f.severity}`)
        .sort()
      assert.deepEqual(exposed, [
        '/get_server_info admin_api_key credential-field critical',
        '/get_server_info anywhere in the body tenant-key critical',
        '/get_server_info api_key credential-field critical',
        '/server_info admin_api_key credential-field critical',
        '/server_info anywhere in the body tenant-key critical',
        '/server_info api_key credential-field critical',
      ])
      for (const f of leaky.findings)
        if (f.class === 'credential-exposure') assert.deepEqual(f.cwe, ['CWE-522', 'CWE-200'])
      const formats = [
        formatJsonReport(leaky),
        formatSummary(leaky),
        formatHtmlReport(leaky, ''),
        formatJunitReport(leaky),
      ]
      for (const text of formats) {
        assert.ok(!text.includes(standInAdminKey), 'the admin key is never printed')
        assert.ok(!text.includes(tenantKeys.alice), "alice's key is never printed")
      }
      assert.ok(
        leaky.findings.some(
          (f) =>
            f.title ===
            "GET /server_info with bob's key served a credential in field admin_api_key (redacted, 25 characters)",
        ),
      )
      const twin = await audit({ serverInfo: 'clean' }, 'operational-endpoints')
      assert.deepEqual(verdicts(twin, 'operational-endpoints'), ['clean content-leak'])
    })
  })

  describe('near-duplicates', () => {
    test("a response cache keyed by the normalised prompt without the tenant: the recased near-duplicates carry alice's canary", async () => {
      const report = await audit({ responseCache: 'shared-exact' }, 'near-duplicates')
      assert.deepEqual(
        report.findings.map((f) => [f.verdict, f.class, f.evidence.nearDuplicate]),
        [
          ['leak', 'content-leak', 'recased'],
          ['leak', 'content-leak', 'recased, whitespace changed'],
          ['leak', 'content-leak', 'sentences reordered, recased'],
        ],
      )
    })

    test("a semantic cache without the tenant: every near-duplicate, own canary too, carries alice's canary", async () => {
      const report = await audit({ responseCache: 'shared-semantic' }, 'near-duplicates')
      assert.equal(report.findings.length, 6)
      assert.ok(
        report.findings.every((f) => f.verdict === 'leak' && f.evidence.canary !== undefined),
      )
    })

    test("the twin keyed by tenant is clean (alice's repeat hit it); with no cache at all the probe says it could not tell", async () => {
      const twin = await audit({ responseCache: 'per-tenant' }, 'near-duplicates')
      assert.deepEqual(verdicts(twin, 'near-duplicates'), ['clean content-leak'])
      assert.equal(twin.findings[0].evidence.controlCacheHit, true)
      const none = await audit({}, 'near-duplicates')
      assert.deepEqual(verdicts(none, 'near-duplicates'), ['inconclusive content-leak'])
      assert.match(none.findings[0].title, /showed no cache hit/)
    })
  })

  describe('request-ids', () => {
    test('a gateway joining requests with the same client id across tenants: content-leak under collision only', async () => {
      const report = await audit({ requestIds: 'shared' }, 'request-ids')
      const leaks = report.findings.filter((f) => f.verdict === 'leak')
      assert.ok(leaks.length > 0)
      assert.ok(
        leaks.every(
          (f) =>
            f.evidence.arm !== 'distinct' && /request ids collide across tenants/.test(f.title),
        ),
      )
      assert.ok(
        leaks.some((f) => f.evidence.streamTenant === 'bob' && f.evidence.sourceTenant === 'alice'),
      )
      assert.ok(leaks.every((f) => typeof f.evidence.requestNumber === 'number'))
    })

    test("a relay writing one stream's event to another client: content-leak with distinct ids, naming the event", async () => {
      const report = await audit({ relay: 'crossing' }, 'request-ids')
      const distinct = report.findings.filter(
        (f) => f.verdict === 'leak' && f.evidence.arm === 'distinct',
      )
      assert.ok(distinct.length > 0)
      assert.ok(distinct.every((f) => /streams crossed between clients/.test(f.title)))
      assert.ok(
        distinct.some((f) => f.evidence.kind === 'canary') &&
          distinct.some((f) => f.evidence.kind === 'foreign-id'),
      )
    })

    test('a gateway refusing an id another tenant has in flight: availability under collision only', async () => {
      const report = await audit({ requestIds: 'reject' }, 'request-ids')
      assert.deepEqual(
        report.findings.map((f) => [f.verdict, f.class, f.title]),
        [
          [
            'warning',
            'availability',
            "with the same client request id as another tenant's request in flight, bob's request got HTTP 409; with distinct ids both were answered",
          ],
        ],
      )
    })

    test("a gateway whose abort ends every stream with the id: integrity, bob's answer cut", async () => {
      const report = await audit({ requestIds: 'cancel' }, 'request-ids')
      const found = report.findings.map((f) => [
        f.verdict,
        f.class,
        f.evidence.charsWithDistinctIds,
      ])
      assert.equal(found.length, 1)
      assert.deepEqual(found[0].slice(0, 2), ['warning', 'integrity'])
      assert.match(
        report.findings[0].title,
        /^aborting alice's request cut bob's request with the same client request id/,
      )
      assert.ok((report.findings[0].evidence.charsAfterAbort as number) < (found[0][2] as number))
    })

    test("one request hanging past the client's timeout, once, under collision: request-ids could not tell; one availability finding names the request, and none for /health", async () => {
      const standIn = await startLayerStandIn({ requestIds: 'per-tenant', hangsOnce: 4 })
      let report: AuditReport
      try {
        report = await runAudit({
          target: standIn.url,
          tenants: standInTenants,
          seed: 1,
          probes: ['request-ids'],
          requestTimeoutMs: 2_000,
        })
      } finally {
        await standIn.close()
      }
      // The 4th streamed request is the colliding arm's second (bob's): distinct answered both.
      const timedOut = report.completions.filter((c) => c.failure === 'timeout')
      assert.equal(timedOut.length, 1)
      assert.deepEqual(
        report.findings.map((f) => [f.probe, f.verdict]),
        [
          ['request-ids', 'inconclusive'],
          ['availability', 'warning'],
        ],
        JSON.stringify(report.findings.map((f) => f.title)),
      )
      assert.match(report.findings[0].title, /colliding: HTTP 200\/timeout/)
      const numValid = report.completions.filter(
        (c) => c.isValid !== false && c.fate !== 'cut',
      ).length
      assert.equal(
        report.findings[1].title,
        `1 of ${numValid} valid requests failed (timeout ×1: request #${timedOut[0].requestNumber}, request-ids, POST /v1/completions)`,
      )
    })

    test('the twins (ids scoped by tenant; a clean relay) are clean, with both requests of every arm in flight at once', async () => {
      for (const options of [{ requestIds: 'per-tenant' }, { relay: 'clean' }] as const) {
        const report = await audit({ ...options, chunkDelayMs: 15 }, 'request-ids')
        assert.deepEqual(
          verdicts(report, 'request-ids'),
          ['clean content-leak'],
          JSON.stringify(report.findings[0].title),
        )
      }
    })
  })

  test('--plan counts the new probes: 3 reads per operational path and 2 plants; 8 near-duplicate requests; 4 id-field checks and 6 streamed requests', async () => {
    const standIn = await startLayerStandIn({})
    try {
      const plan = await planAudit({
        target: standIn.url,
        tenants: standInTenants,
        probes: ['operational-endpoints', 'near-duplicates', 'request-ids'],
      })
      const counts = Object.fromEntries(plan.probes.map((p) => [p.probe, p.numRequests]))
      assert.equal(counts['operational-endpoints'], operationalPaths.length * 3 + 2)
      assert.equal(counts['near-duplicates'], 8)
      assert.equal(counts['request-ids'], 10)
      assert.deepEqual(
        plan.shares?.map((s) => [s.probe, s.numRequests]),
        [
          ['operational-endpoints', 44],
          ['near-duplicates', 8],
          ['request-ids', 10],
        ],
      )
      assert.ok(
        standIn.requests.every((r) => !r.startsWith('POST')),
        'a plan sends no completion',
      )
    } finally {
      await standIn.close()
    }
  })
})
