/** Probe `entrypoints` against stand-ins serving every generation entrypoint (entrypoint-standins.ts):
 *  one that drops the tenant's cache salt on `/v1/messages` alone, one that drops it on Responses
 *  tool-call continuations alone, one whose `/v1/messages` answers from a cache keyed by the prompt
 *  alone (another tenant's text), and their correct twin. Real sockets on loopback, in-process
 *  audits. Each case asserts the finding (class, verdict, endpoint named) for each entrypoint. */
import assert from 'node:assert/strict'
import { test } from 'node:test'
import { runAudit, type AuditReport } from '../../src/audit/index.js'
import { entrypointNames } from '../../src/audit/probes/entrypoint-shapes.js'
import { startEntrypointStandIn, type EntrypointStandInOptions } from './entrypoint-standins.js'
import { reportValidator } from './schema-validator.js'
import { standInTenants } from './standins.js'

async function audit(options: EntrypointStandInOptions, seed = 1): Promise<AuditReport> {
  const standIn = await startEntrypointStandIn(options)
  try {
    return await runAudit({
      target: standIn.url,
      tenants: standInTenants,
      seed,
      probes: ['entrypoints'],
    })
  } finally {
    await standIn.close()
  }
}

/** [endpoint, verdict, class] per finding. */
function rows(report: AuditReport): [string, string, string][] {
  return report.findings
    .filter((f) => f.probe === 'entrypoints')
    .map((f) => [String(f.evidence.endpoint), f.verdict, String(f.class)])
}

const all = [...entrypointNames]
const cleanRow = (endpoint: string): [string, string, string] => [endpoint, 'clean', 'content-leak']
const endpoints = [
  'POST /v1/completions',
  'POST /v1/chat/completions',
  'POST /v1/responses',
  'POST /v1/responses (stream)',
  'POST /v1/messages',
  'POST /v1/messages (stream)',
  'POST /generate',
  'POST /generate (stream)',
  'POST /completion',
]
const toolEndpoint = 'POST /v1/responses (tool-call continuation)'

test('the correct twin (the salt kept on every entrypoint): every entrypoint served and clean, with its positive control', async () => {
  for (const seed of [1, 2]) {
    const report = await audit({ serves: all }, seed)
    assert.deepEqual(
      rows(report),
      [...endpoints, toolEndpoint].map(cleanRow),
      JSON.stringify(report.findings.map((f) => f.title)),
    )
    const served = report.findings[0].evidence.entrypoints as {
      entrypoint: string
      isServed: boolean
    }[]
    assert.deepEqual(
      served.map((r) => [r.entrypoint, r.isServed]),
      all.map((n) => [n, true]),
    )
  }
})

test('the salt dropped on /v1/messages alone: a side channel on POST /v1/messages, the others clean', async () => {
  const report = await audit({ serves: all, saltless: ['messages'] })
  assert.deepEqual(
    rows(report),
    [...endpoints, toolEndpoint].map((e) =>
      e === 'POST /v1/messages' ? [e, 'warning', 'side-channel'] : cleanRow(e),
    ),
    JSON.stringify(report.findings.map((f) => f.title)),
  )
  const side = report.findings.find((f) => f.verdict === 'warning')!
  assert.match(side.title, /tenant bob was served cached tokens of a prefix only tenant alice sent/)
  const trials = side.evidence.trials as { primedOn: string; testCachedTokens: number }[]
  // Primed on messages itself (the same path); from completions (salted) nothing is shared.
  assert.deepEqual(
    trials.map((t) => t.primedOn),
    ['messages'],
  )
  assert.ok(trials[0].testCachedTokens >= 16)
})

test('the salt dropped on Responses tool-call continuations alone: a side channel on the continuation, the others clean', async () => {
  const report = await audit({ serves: all, saltless: ['responses-tools'] })
  assert.deepEqual(
    rows(report),
    [...endpoints, toolEndpoint].map((e) =>
      e === toolEndpoint ? [e, 'warning', 'side-channel'] : cleanRow(e),
    ),
    JSON.stringify(report.findings.map((f) => f.title)),
  )
})

test('/v1/messages answering from a cache keyed by the prompt alone: a content leak on POST /v1/messages naming the canary', async () => {
  const report = await audit({ serves: all, saltless: ['messages'], answerCache: true })
  const leaks = report.findings.filter((f) => f.verdict === 'leak')
  assert.ok(leaks.length >= 1)
  for (const f of leaks) {
    assert.equal(f.class, 'content-leak')
    assert.equal(f.evidence.endpoint, 'POST /v1/messages')
    assert.ok((f.evidence.fragments as string[]).length >= 1)
  }
})

test('only completions and chat served, tools refused: the others listed as not served (404), no finding for them', async () => {
  const report = await audit({ serves: ['chat'], acceptsTools: false })
  assert.deepEqual(
    rows(report),
    ['POST /v1/completions', 'POST /v1/chat/completions'].map(cleanRow),
  )
  const served = report.findings[0].evidence.entrypoints as {
    entrypoint: string
    status: number
    isServed: boolean
  }[]
  assert.deepEqual(
    served.filter((r) => !r.isServed).map((r) => [r.entrypoint, r.status]),
    [
      ['responses', 404],
      ['responses-stream', 404],
      ['messages', 404],
      ['messages-stream', 404],
      ['generate', 404],
      ['generate-stream', 404],
      ['completion', 404],
    ],
  )
})

test('a tool request that fails (500) is not "not served": the round trip is inconclusive, naming the status', async () => {
  const report = await audit({ serves: ['responses'], acceptsTools: 'fails' })
  assert.deepEqual(rows(report), [
    cleanRow('POST /v1/completions'),
    cleanRow('POST /v1/responses'),
    cleanRow('POST /v1/responses (stream)'),
    [toolEndpoint, 'inconclusive', 'side-channel'],
  ])
  assert.match(report.findings[3].title, /the first request with a tool failed \(500\)/)
})

test("every generation request of the probe is in the report's completions, with its endpoint: per path, the stand-in's count; the probe run counts them all", async () => {
  const standIn = await startEntrypointStandIn({ serves: all })
  let report: AuditReport
  try {
    report = await runAudit({
      target: standIn.url,
      tenants: standInTenants,
      seed: 1,
      probes: ['entrypoints'],
    })
  } finally {
    await standIn.close()
  }
  const { validate, errorsOf } = reportValidator()
  assert.ok(validate(JSON.parse(JSON.stringify(report))), errorsOf())
  // What the stand-in received, per POST path, is what the report lists per endpoint.
  const tally = (list: readonly string[]) => {
    const out: Record<string, number> = {}
    for (const key of list) out[key] = (out[key] ?? 0) + 1
    return out
  }
  const received = tally(standIn.routes.filter((r) => r.startsWith('POST ')))
  assert.deepEqual(tally(report.completions.map((c) => String(c.endpoint))), received)
  // Every entrypoint was sent to (Responses streamed or not on one path).
  assert.deepEqual(
    Object.keys(received).sort(),
    [...new Set(endpoints.map((e) => e.split(' (')[0]))].sort(),
  )
  const run = report.probeRuns.find((r) => r.probe === 'entrypoints')!
  const ofProbe = report.completions.filter((c) => c.probe === 'entrypoints')
  assert.equal(run.completions.sent, ofProbe.length)
  assert.equal(run.completions.sent, run.requestsSent)
  assert.equal(run.completions.answered, ofProbe.length)
})
