/** The second edition's probes and rules, against stand-ins over real HTTP: capacity rules per
 *  engine (each engine's own derivation of the largest input it accepts), the concurrency ramp,
 *  fields that steer the cache, and the controls every finding names. */
import assert from 'node:assert/strict'
import { describe, test } from 'node:test'
import {
  formatHtmlReport,
  formatJunitReport,
  formatSummary,
  runAudit,
  type AuditReport,
} from '../../src/audit/index.js'
import { reportValidator } from './schema-validator.js'
import { standInTenants, startStandIn, type StandInOptions } from './standins.js'

async function audit(options: StandInOptions): Promise<AuditReport> {
  const standIn = await startStandIn('safe', options)
  try {
    return await runAudit({
      target: standIn.url,
      tenants: standInTenants,
      seed: 5,
      probes: ['capacity', 'boundary'],
    })
  } finally {
    await standIn.close()
  }
}

const rows = (report: AuditReport): string[][] =>
  report.findings.map((f) => [f.probe, f.verdict, f.title])

// Every test here audits a stand-in of its own, mostly waiting on its delays: two groups run at
// once. Not more: the audits share this process's event loop, and with many at once their
// timers and reads ran late enough to change verdicts (a discovery read timing out, a cut not
// seen before the slot was given back).
describe('engines', { concurrency: 2 }, () => {
  describe('SGLang: max_req_input_len = min(context − 1, pool − 1) − 5', () => {
    test('context = pool, the 6-token reserve under it: no warning; boundary clean with the input limit accepted', async () => {
      // Pool 384, context 384: SGLang reports max_req_input_len 378 and refuses 378 or more.
      const report = await audit({ flavour: 'sglang' })
      assert.deepEqual(rows(report), [
        [
          'capacity',
          'clean',
          "advertised context 384 tokens fits the KV pool of 384 tokens (SGLang's input limit 378 keeps its normal 6-token reserve)",
        ],
        ['boundary', 'clean', 'rejected every prompt larger than 384 tokens with a 4xx'],
      ])
      const capacity = report.findings[0].evidence
      assert.equal(capacity.effectivePoolTokens, 384)
      assert.deepEqual(capacity.inputRule, {
        engine: 'sglang',
        rule: 'max_req_input_len = min(context − 1, max_total_num_tokens − 1) − 5',
        reportedInputLimitTokens: 378,
        expectedInputLimitTokens: 378,
        inputLimitSources: [
          {
            endpoint: '/get_server_info',
            field: 'internal_states[0].max_req_input_len',
            tokens: 378,
          },
        ],
      })
      const sizes = report.findings[1].evidence.sizes as { labels: string; status: number }[]
      assert.deepEqual(
        sizes.map((s) => [s.labels, s.status]),
        [
          ['input-limit', 200],
          ['pool-1/context-1', 400],
          ['pool/context', 400],
          ['pool+1/context+1', 400],
        ],
      )
    })

    test('a pool smaller than the advertised context: warning, with both numbers', async () => {
      const report = await audit({ flavour: 'sglang', contextTokens: 512 })
      assert.deepEqual(rows(report), [
        ['capacity', 'warning', 'advertised context 512 tokens > effective KV pool 384 tokens'],
        ['boundary', 'clean', 'rejected every prompt larger than 384 tokens with a 4xx'],
      ])
      assert.equal(report.findings[0].severity, 'high')
    })
  })

  describe('concurrency ramp 1 → 2 → 4 → 8 → 16', () => {
    const rampAudit = async (options: StandInOptions): Promise<AuditReport> => {
      const standIn = await startStandIn('safe', options)
      try {
        return await runAudit({
          target: standIn.url,
          tenants: standInTenants,
          seed: 8,
          probes: ['concurrency'],
        })
      } finally {
        await standIn.close()
      }
    }

    test('slots that cross only with 8 or more running: caught by the default ramp (leak, critical)', async () => {
      const report = await rampAudit({ isCrossTalk: true, crossTalkMinRunning: 8, tokenDelayMs: 3 })
      assert.deepEqual(
        [...new Set(report.findings.map((f) => `${f.probe} ${f.verdict}`))],
        ['concurrency leak'],
      )
      assert.equal(report.findings[0].severity, 'critical')
      assert.equal(report.budget.maxConcurrency, 16)
    })

    test('its correct twin: clean, having reached 16 in flight (probeRuns.concurrencyReached)', async () => {
      const report = await rampAudit({ tokenDelayMs: 3 })
      assert.deepEqual(rows(report), [
        [
          'concurrency',
          'clean',
          '31 answers in bursts of 1, 2, 4, 8, 16 in flight carried only their own material',
        ],
      ])
      assert.equal(report.probeRuns[0].concurrencyReached, 16)
    })

    test("the endpoint's own limit (503 capacity_exhausted above 4 at once) stops the ramp there", async () => {
      // Answers last long enough (30 ms a token) that a burst of 8 is all in flight before the
      // first ends: at 3 ms, under load, one ended before the 8th arrived and a 5th got in.
      const report = await rampAudit({ maxBatch: 4, maxQueued: 0, tokenDelayMs: 30 })
      assert.deepEqual(rows(report), [
        [
          'concurrency',
          'clean',
          '11 answers in bursts of 1, 2, 4, 8 in flight carried only their own material (the endpoint shed load above 4 at once)',
        ],
      ])
      const ramp = report.findings[0].evidence.ramp as { level: number; numShed: number }[]
      assert.deepEqual(
        ramp.map((s) => [s.level, s.numShed]),
        [
          [1, 0],
          [2, 0],
          [4, 0],
          [8, 4],
        ],
      )
    })
  })

  describe('cache-fields: fields that steer the cache must be refused or ignored', () => {
    const fieldsAudit = async (
      options: StandInOptions,
      isAggressive = false,
    ): Promise<AuditReport> => {
      const standIn = await startStandIn('safe', options)
      try {
        return await runAudit({
          target: standIn.url,
          tenants: standInTenants,
          seed: 11,
          probes: ['cache-fields'],
          isAggressive,
        })
      } finally {
        await standIn.close()
      }
    }

    test("a client's cache_salt honoured (another tenant's salt opens its prefix): a side channel per field, not a leak", async () => {
      const report = await fieldsAudit({ prefixCache: 'per-tenant', clientSalt: 'honoured' })
      assert.deepEqual(rows(report), [
        [
          'cache-fields',
          'warning',
          "cache_salt is honoured from clients: bob's request with alice's cache_salt value reported 32 cached tokens of a prefix only alice sent",
        ],
        [
          'cache-fields',
          'warning',
          "extra_key is honoured from clients: bob's request with alice's extra_key value reported 32 cached tokens of a prefix only alice sent",
        ],
      ])
      assert.deepEqual(
        report.findings.map((f) => f.class),
        ['side-channel', 'side-channel'],
      )
    })

    test('its twin that ignores the fields (cache keyed by tenant), and one that refuses them: clean', async () => {
      assert.deepEqual(rows(await fieldsAudit({ prefixCache: 'per-tenant' })), [
        [
          'cache-fields',
          'clean',
          'cache-steering fields refused or ignored: cache_salt ignored, extra_key ignored',
        ],
      ])
      assert.deepEqual(
        rows(await fieldsAudit({ prefixCache: 'per-tenant', clientSalt: 'refused' }, true)),
        [
          [
            'cache-fields',
            'clean',
            'cache-steering fields refused or ignored: cache_salt refused, extra_key refused, kv_transfer_params refused, bootstrap_host refused, positional_embed_overrides refused',
          ],
        ],
      )
    })

    test('a cache shared whatever the field: a side-channel warning saying so; no prefix cache at all: inconclusive (no positive control)', async () => {
      const shared = await fieldsAudit({ prefixCache: 'shared' })
      assert.deepEqual(
        [shared.findings[0].verdict, shared.findings[0].class, shared.findings[0].severity],
        ['warning', 'side-channel', 'high'],
      )
      assert.match(
        shared.findings[0].title,
        /it did without the field too: the prefix cache is shared across tenants$/,
      )
      assert.deepEqual(rows(await fieldsAudit({})), [
        [
          'cache-fields',
          'inconclusive',
          "could not tell whether another tenant's salt is honoured: cache_salt (the same tenant and salt reported no cached tokens), extra_key (the same tenant and salt reported no cached tokens)",
        ],
      ])
    })
  })

  describe('controls: each finding names OWASP AISVS 5.5.5 where it applies and the guards that would have stopped it', () => {
    test('in the JSON (valid against the schema), the console table, JUnit and HTML', async () => {
      const standIn = await startStandIn('leaky')
      let report: AuditReport
      try {
        report = await runAudit({
          target: standIn.url,
          tenants: standInTenants,
          seed: 3,
          probes: ['capacity', 'canary'],
        })
      } finally {
        await standIn.close()
      }
      const capacity = report.findings.find((f) => f.probe === 'capacity')
      const leak = report.findings.find((f) => f.probe === 'canary' && f.verdict === 'leak')
      // docs/threat-model.md: the incident's path is closed by G1–G4, stale pages by G5 and G6.
      assert.deepEqual(capacity?.controls, { aisvs: [], guards: ['G1'] })
      assert.deepEqual(leak?.controls, {
        aisvs: ['5.5.5'],
        guards: ['G1', 'G2', 'G3', 'G4', 'G5', 'G6'],
      })
      const { validate, errorsOf } = reportValidator()
      assert.ok(validate(JSON.parse(JSON.stringify(report))), errorsOf())
      const line = 'AISVS 5.5.5; G1, G2, G3, G4, G5, G6'
      // Wide enough for the controls on one line (at 100 columns they wrap in their column).
      assert.match(
        formatSummary(report, 200),
        new RegExp(`canary\\s+leak\\s+critical\\s+${line}\\s+\\[content-leak\\]`),
      )
      assert.ok(formatJunitReport(report).includes(`controls: ${line}`))
      assert.ok(formatHtmlReport(report, '').includes(`<td>${line}</td>`))
    })
  })

  describe('abort-race: waves of mid-stream cuts after the pairs', () => {
    const abortAudit = async (options: StandInOptions): Promise<AuditReport> => {
      const standIn = await startStandIn('safe', options)
      try {
        return await runAudit({
          target: standIn.url,
          tenants: standInTenants,
          seed: 9,
          probes: ['abort-race'],
        })
      } finally {
        await standIn.close()
      }
    }

    test('an abort that leaks only with 8 or more running: caught by the waves (leak)', async () => {
      const report = await abortAudit({
        isAbortLeak: true,
        abortLeakMinRunning: 8,
        tokenDelayMs: 3,
      })
      assert.equal(report.findings[0].verdict, 'leak')
      assert.deepEqual(report.findings[0].evidence.waveWidths, [2, 4, 8])
    })

    test('its correct twin: clean, 16 in flight reached', async () => {
      const report = await abortAudit({ tokenDelayMs: 3 })
      assert.deepEqual(
        report.findings.map((f) => f.verdict),
        ['clean'],
      )
      assert.equal(report.probeRuns[0].concurrencyReached, 16)
    })
  })
})
