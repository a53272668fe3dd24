/** The watch's request-ids arm, the entrypoint arm on streamed `/v1/messages` and `/generate`,
 *  the operational arm reading while A's request is in flight, requests on every entrypoint in
 *  the outage watch, and what arms are charged: each against a stand-in with the flaw (the arm's
 *  alert, keyed as docs/monitoring.md names it) and its correct twin (a clean cycle). Real
 *  sockets on loopback, in-process cycles and audits. */
import assert from 'node:assert/strict'
import { describe, test } from 'node:test'
import { runAudit } from '../../src/audit/index.js'
import { parseEntrypointAnswer } from '../../src/audit/probes/entrypoint-shapes.js'
import { createRng } from '../../src/audit/rng.js'
import { createEntrypointArm } from '../../src/audit/watch/arms/entrypoint.js'
import { operationalArm } from '../../src/audit/watch/arms/operational.js'
import { createRequestIdsArm } from '../../src/audit/watch/arms/request-ids.js'
import { runCycle, tokensCharged } from '../../src/audit/watch/cycle.js'
import { watchOutage } from '../../src/audit/watch/loop.js'
import { validateWatchOptions } from '../../src/audit/watch/options.js'
import { armRunsPerHour } from '../../src/audit/watch/plan.js'
import type { RotationArm } from '../../src/audit/watch/rotation.js'
import type { CompletionResult } from '../../src/audit/target.js'
import { completionResult } from './completion-result.js'
import { startEntrypointStandIn, type EntrypointStandInOptions } from './entrypoint-standins.js'
import { startLayerStandIn, type LayerOptions } from './layer-standins.js'
import { standInTenants } from './standins.js'

function cycle(url: string, arm: RotationArm, seed: number, requestTimeoutMs = 10_000) {
  return runCycle({
    baseUrl: url,
    tenants: standInTenants,
    model: null,
    rng: createRng(seed, 'more arms test'),
    sizer: null,
    usageEndpoint: undefined,
    allowance: { tokens: 20_000, requests: 288 },
    requestTimeoutMs,
    concurrency: 4,
    maxSeconds: 30,
    arm,
  })
}

async function layerCycles(
  options: LayerOptions,
  arm: RotationArm,
  numCycles = 1,
  requestTimeoutMs = 10_000,
) {
  const standIn = await startLayerStandIn(options)
  try {
    const reports = []
    for (let i = 1; i <= numCycles; i++)
      reports.push(await cycle(standIn.url, arm, i, requestTimeoutMs))
    return { reports, requests: [...standIn.requests] }
  } finally {
    await standIn.close()
  }
}

async function entrypointCycles(options: EntrypointStandInOptions, numCycles: number) {
  const standIn = await startEntrypointStandIn(options)
  const arm = createEntrypointArm()
  try {
    const reports = []
    for (let i = 1; i <= numCycles; i++) reports.push(await cycle(standIn.url, arm, i))
    return reports
  } finally {
    await standIn.close()
  }
}

describe('the request-ids arm', () => {
  test("a gateway joining streams by client id across tenants: a leak alert, A's canary in B's events", async () => {
    const { reports } = await layerCycles({ requestIds: 'shared' }, createRequestIdsArm())
    const [report] = reports
    assert.equal(report.arm, 'request-ids')
    assert.equal(report.outcome, 'finding')
    const keys = report.findings.map((f) => f.key)
    assert.ok(keys.includes('leak:request-ids:alice->bob'), keys.join(', '))
    const leak = report.findings.find((f) => f.key === 'leak:request-ids:alice->bob')!.finding
    assert.equal(leak.probe, 'request-ids')
    assert.equal(leak.evidence.arm, 'colliding')
    assert.equal(leak.evidence.sourceTenant, 'alice')
    assert.equal(leak.evidence.streamTenant, 'bob')
  })

  test("a server merging same-id requests (B's tokens in A's stream, B hung): an integrity alert naming A's over-long stream; the twin is clean", async () => {
    const { reports } = await layerCycles(
      { requestIds: 'merged', isOpaque: true },
      createRequestIdsArm(),
      1,
      2_000,
    )
    const [report] = reports
    assert.equal(report.outcome, 'finding')
    assert.deepEqual(
      report.findings.map((f) => f.key),
      ['warning:request-ids:integrity:alice'],
    )
    const { finding } = report.findings[0]
    assert.equal(finding.evidence.otherTenant, 'bob')
    assert.equal(finding.evidence.otherFailure, 'timeout')
    assert.ok((finding.evidence.numTextEvents as number) > 48)
    const twin = await layerCycles(
      { requestIds: 'per-tenant', isOpaque: true },
      createRequestIdsArm(),
      1,
      2_000,
    )
    assert.equal(twin.reports[0].outcome, 'clean', twin.reports[0].reason ?? '')
  })

  test('the twin (ids joined per tenant): two clean cycles; the id fields checked once', async () => {
    const arm = createRequestIdsArm()
    assert.deepEqual(arm.cost({ poolTokens: null, contextTokens: null, inputLimitTokens: null }), {
      requests: 4 + 2,
      tokens: 4 * 8 + 2 * (104 + 48),
    })
    const { reports, requests } = await layerCycles({ requestIds: 'per-tenant' }, arm, 2)
    for (const report of reports) {
      assert.equal(report.arm, 'request-ids')
      assert.equal(report.outcome, 'clean', report.reason ?? '')
      assert.deepEqual(report.findings, [])
      assert.ok(!report.skipped.some((s) => s.includes('could not tell')), report.skipped.join())
    }
    // The stand-in takes every field: one check request with all of them, in the first cycle.
    const checks = requests.filter((r) => r.includes('/v1/completions'))
    assert.ok(checks.length > 0)
    assert.deepEqual(arm.cost({ poolTokens: null, contextTokens: null, inputLimitTokens: null }), {
      requests: 2,
      tokens: 2 * (104 + 48),
    })
  })
})

describe('the entrypoint arm on streamed entrypoints', () => {
  test('the salt dropped on streamed /v1/messages only: cycles 1-2 (completions, messages) clean, cycle 3 (messages streamed) a leak alert', async () => {
    const reports = await entrypointCycles(
      { serves: ['messages'], saltless: ['messages-stream'], answerCache: true },
      3,
    )
    assert.deepEqual(
      reports.map((r) => r.outcome),
      ['clean', 'clean', 'finding'],
    )
    assert.deepEqual(
      reports[2].findings.map((f) => f.key),
      // The answer cache hands B A's answer (a leak); the prefix cache is shared there too.
      ['leak:entrypoints:messages-stream', 'warning:entrypoints:messages-stream'],
    )
    assert.equal(reports[2].findings[0].finding.evidence.endpoint, 'POST /v1/messages (stream)')
  })

  test("the salt dropped on SGLang's streamed /generate only: cycle 3 (generate streamed) a leak alert", async () => {
    const reports = await entrypointCycles(
      { serves: ['generate'], saltless: ['generate-stream'], answerCache: true },
      3,
    )
    assert.deepEqual(
      reports.map((r) => r.outcome),
      ['clean', 'clean', 'finding'],
    )
    assert.deepEqual(
      reports[2].findings.map((f) => f.key),
      // The answer cache hands B A's answer (a leak); the prefix cache is shared there too.
      ['leak:entrypoints:generate-stream', 'warning:entrypoints:generate-stream'],
    )
  })

  test('the twin (salt kept on every path, streamed or not): five clean cycles, each control showing reuse', async () => {
    const reports = await entrypointCycles({ serves: ['messages', 'generate'] }, 5)
    for (const report of reports) {
      assert.equal(report.outcome, 'clean', report.reason ?? '')
      assert.deepEqual(report.findings, [])
      assert.ok(!report.skipped.some((s) => s.includes('could not tell')), report.skipped.join())
    }
  })
})

describe('the audit on streamed entrypoints', () => {
  test('the salt dropped on streamed /v1/messages only: a side channel there, plain /v1/messages clean', async () => {
    const standIn = await startEntrypointStandIn({
      serves: ['messages', 'generate'],
      saltless: ['messages-stream'],
    })
    try {
      const report = await runAudit({
        target: standIn.url,
        tenants: standInTenants,
        seed: 1,
        probes: ['entrypoints'],
      })
      const rows = report.findings.map((f) => [String(f.evidence.endpoint), f.verdict])
      assert.deepEqual(rows, [
        ['POST /v1/completions', 'clean'],
        ['POST /v1/messages', 'clean'],
        ['POST /v1/messages (stream)', 'warning'],
        ['POST /generate', 'clean'],
        ['POST /generate (stream)', 'clean'],
      ])
    } finally {
      await standIn.close()
    }
  })
})

describe('the operational arm', () => {
  test('/slots shows a prompt only while its request is in flight: a leak alert, read in flight', async () => {
    const { reports } = await layerCycles({ slots: 'in-flight', chunkDelayMs: 20 }, operationalArm)
    const [report] = reports
    assert.equal(report.arm, 'operational')
    const leak = report.findings.find((f) => f.key === 'leak:operational-endpoints:/slots')
    assert.ok(leak, report.findings.map((f) => f.key).join(', '))
    assert.equal(leak.finding.evidence.phase, 'in-flight')
  })

  test('the twin (slots without prompts): a clean cycle', async () => {
    const { reports } = await layerCycles({ slots: 'hidden', chunkDelayMs: 20 }, operationalArm)
    assert.equal(reports[0].outcome, 'clean', reports[0].reason ?? '')
    assert.deepEqual(reports[0].findings, [])
  })
})

test('an engine that dies on a large prompt on /v1/messages only: the audit reports the outage, at the messages request', async () => {
  const standIn = await startEntrypointStandIn({
    serves: ['chat', 'messages', 'generate'],
    messagesDiesOverWords: 10,
  })
  try {
    const report = await runAudit({
      target: standIn.url,
      tenants: standInTenants,
      seed: 1,
      probes: ['entrypoints'],
    })
    const outage = report.findings.find(
      (f) => f.probe === 'availability' && /went down during the audit/.test(f.title),
    )
    assert.ok(outage, report.findings.map((f) => f.title).join('\n'))
    const evidence = outage.evidence.outage as { firstFailure: { promptChars: number } }
    // The first failure is the first trial's prime on /v1/messages: a prefix and two canaries.
    assert.ok(evidence.firstFailure.promptChars > 50)
  } finally {
    await standIn.close()
  }
})

test("the watch's outage alert says it happened during the watch", () => {
  const outage = watchOutage()
  const request = { tenant: standInTenants[0], prompt: 'a b c', maxTokens: 4, stream: false }
  const result = (status: number, n: number): CompletionResult =>
    completionResult({ status, requestNumber: n, atMs: n })
  outage.onCompletion(request, result(200, 1))
  for (let n = 2; n <= 7; n++) outage.onCompletion(request, result(500, n))
  const [finding] = outage.findings()
  assert.match(finding.finding.title, /^the endpoint went down during the watch at request #2 /)
  assert.doesNotMatch(finding.finding.title, /audit/)
})

describe('what an arm is charged', () => {
  const request = {
    tenant: standInTenants[0],
    prompt: 'x'.repeat(100),
    maxTokens: 16,
    stream: true,
  }
  const base = completionResult({ status: 200, promptTokens: 30 })
  test('the prompt tokens reported plus max_tokens; the bound (bytes + 4 + max_tokens) when none; a refusal nothing', () => {
    assert.equal(tokensCharged(request, base), 30 + 16)
    assert.equal(tokensCharged(request, { ...base, promptTokens: null }), 104 + 16)
    assert.equal(tokensCharged(request, { ...base, promptTokens: 500 }), 104 + 16)
    assert.equal(
      tokensCharged(request, { ...base, status: 400, errorCode: 'context_length_exceeded' }),
      0,
    )
  })

  test('under the default budget every arm runs at least once an hour, charged its whole bound', () => {
    const config = validateWatchOptions(
      { target: 'http://127.0.0.1:8000', tenants: standInTenants },
      1,
    )
    const runs = armRunsPerHour(config)
    assert.deepEqual(
      runs.map((r) => r.name),
      ['race', 'entrypoint', 'operational', 'near-duplicate', 'request-ids'],
    )
    for (const r of runs) assert.ok(r.runs >= 1 && r.runs <= 24, `${r.name}: ${r.runs}`)
  })
})

describe('streamed /v1/messages and /generate read event by event', () => {
  const sse = (body: string) => ({
    status: 200,
    failure: null,
    failureDetail: null,
    contentType: 'text/event-stream',
    body,
    firstByteMs: 1,
    requestNumber: 1,
    atMs: 1,
  })
  const data = (values: unknown[]) => values.map((v) => `data: ${JSON.stringify(v)}\n\n`).join('')

  test("SGLang's events, each the answer so far: the last one's text; its meta_info's counts", () => {
    const meta = { prompt_tokens: 40, cached_tokens: 32 }
    const body = `${data([
      { text: 'the', meta_info: meta },
      { text: 'the river', meta_info: meta },
      { text: 'the river runs', meta_info: meta },
    ])}data: [DONE]\n\n`
    const answer = parseEntrypointAnswer('generate-stream', sse(body))
    assert.deepEqual(
      [answer.isAnswered, answer.text, answer.promptTokens, answer.cachedTokens],
      [true, 'the river runs', 40, 32],
    )
  })

  test('events carrying only the new part (--incremental-streaming-output): joined', () => {
    const meta = { prompt_tokens: 9, cached_tokens: 0 }
    const body = `${data([
      { text: 'the', meta_info: meta },
      { text: ' river', meta_info: meta },
    ])}data: [DONE]\n\n`
    assert.equal(parseEntrypointAnswer('generate-stream', sse(body)).text, 'the river')
  })

  test('no [DONE]: not an answer', () => {
    const body = data([{ text: 'the', meta_info: { prompt_tokens: 3 } }])
    assert.equal(parseEntrypointAnswer('generate-stream', sse(body)).isAnswered, false)
  })

  test("Anthropic's stream: text deltas joined, prompt tokens = input + cache reads + writes", () => {
    const usage = { input_tokens: 5, cache_read_input_tokens: 32, cache_creation_input_tokens: 3 }
    const body = data([
      { type: 'message_start', message: { id: 'msg_1', content: [], usage } },
      { type: 'content_block_delta', index: 0, delta: { type: 'text_delta', text: 'the ' } },
      { type: 'content_block_delta', index: 0, delta: { type: 'text_delta', text: 'river' } },
      { type: 'message_stop' },
    ])
    const answer = parseEntrypointAnswer('messages-stream', sse(body))
    assert.deepEqual(
      [answer.isAnswered, answer.text, answer.promptTokens, answer.cachedTokens],
      [true, 'the river', 40, 32],
    )
  })
})
