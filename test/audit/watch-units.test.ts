/** The watch's parts without a network: the hourly budget and the pacing bucket under a fake
 *  clock, the alert state across cycles, cycle plans against their allowance, and the webhook
 *  bodies. */
import assert from 'node:assert/strict'
import { readFileSync } from 'node:fs'
import { join } from 'node:path'
import { describe, test } from 'node:test'
import { parse } from 'yaml'
import { createRng } from '../../src/audit/rng.js'
import { createSizer } from '../../src/audit/sizer.js'
import { AlertTracker } from '../../src/audit/watch/alerts.js'
import { findFragment } from '../../src/audit/canaries.js'
import {
  availabilityFindings,
  planCycle,
  planFollowUp,
  plantCharacters,
  promptTokenBound,
  type WatchFinding,
} from '../../src/audit/watch/cycle.js'
import { HourlyBudget, PacingBucket } from '../../src/audit/watch/hourly.js'
import { cycleCostBound } from '../../src/audit/watch/loop.js'
import { validateWatchOptions } from '../../src/audit/watch/options.js'
import { alertNameOf, webhookBody } from '../../src/audit/watch/webhook.js'
import type { CompletionResult } from '../../src/audit/target.js'
import type { Finding, FindingSource } from '../../src/audit/types.js'
import { completionResult } from './completion-result.js'
import { repoRoot } from '../helpers/paths.js'

const tenants = [
  { name: 'watch-a', key: 'sk-watch-a-0123456789' },
  { name: 'watch-b', key: 'sk-watch-b-9876543210' },
]

/** A calibrated sizer of one token per word plus one, and the incident's shape. */
const sizer = createSizer('usage', [
  { words: 16, tokens: 17 },
  { words: 64, tokens: 65 },
])
const discovery = { poolTokens: 384, contextTokens: 1024 }

describe('HourlyBudget', () => {
  test('never lets more than the limits into any sliding hour; settling frees the difference', () => {
    let now = 0
    const budget = new HourlyBudget(1000, 10, () => now)
    const first = budget.reserve({ tokens: 600, requests: 6 })!
    assert.equal(budget.reserve({ tokens: 500, requests: 1 }), null, '600 + 500 > 1000 tokens')
    assert.equal(budget.reserve({ tokens: 100, requests: 5 }), null, '6 + 5 > 10 requests')
    first.settle({ tokens: 250, requests: 4 })
    assert.deepEqual(budget.remaining(), { tokens: 750, requests: 6 })
    now = 30 * 60_000
    assert.ok(budget.reserve({ tokens: 750, requests: 6 }))
    assert.deepEqual(budget.remaining(), { tokens: 0, requests: 0 })
    budget.check()
    now = 60 * 60_000 // the first reservation leaves the window
    assert.deepEqual(budget.remaining(), { tokens: 250, requests: 4 })
    now = 90 * 60_000
    assert.deepEqual(budget.remaining(), { tokens: 1000, requests: 10 })
  })

  test('a settlement never raises what a reservation holds', () => {
    const budget = new HourlyBudget(100, 10, () => 0)
    budget.reserve({ tokens: 50, requests: 2 })!.settle({ tokens: 80, requests: 9 })
    assert.deepEqual(budget.remaining(), { tokens: 50, requests: 8 })
  })
})

test('PacingBucket refills at the hourly rate up to its capacity', () => {
  let now = 0
  const bucket = new PacingBucket(
    { tokens: 3600, requests: 360 },
    { tokens: 100, requests: 10 },
    () => now,
  )
  assert.deepEqual(bucket.available(), { tokens: 100, requests: 10 })
  bucket.take({ tokens: 100, requests: 10 })
  now = 10_000 // 10 s at 1 token and 0.1 request per second
  assert.deepEqual(bucket.available(), { tokens: 10, requests: 1 })
  now = 3_600_000
  assert.deepEqual(bucket.available(), { tokens: 100, requests: 10 })
})

describe('AlertTracker', () => {
  const finding: Finding = {
    probe: 'canary',
    verdict: 'leak',
    severity: 'critical',
    title: 'leak',
    evidence: {},
    remediation: '',
  }
  const leak: WatchFinding = { key: 'leak:canary:watch-a->watch-b', finding }

  test('fires once per new finding and resolves after N cycles without it', () => {
    const alerts = new AlertTracker(3)
    assert.deepEqual(
      alerts.observe(1, [leak], 1000).fired.map((a) => a.key),
      [leak.key],
    )
    assert.deepEqual(alerts.observe(2, [leak]), { fired: [], resolved: [] })
    assert.deepEqual(alerts.observe(3, []), { fired: [], resolved: [] })
    assert.deepEqual(alerts.observe(4, []), { fired: [], resolved: [] })
    const { resolved } = alerts.observe(5, [])
    assert.deepEqual(
      resolved.map((a) => [a.key, a.firstCycle, a.lastCycle, a.numSightings]),
      [[leak.key, 1, 2, 2]],
    )
    assert.deepEqual(alerts.list(), [])
    assert.deepEqual(
      alerts.observe(6, [leak]).fired.map((a) => a.firstCycle),
      [6],
      'a new incident fires again',
    )
  })
})

describe('planCycle', () => {
  test("a plan costs the sum of its requests' bounds, and never more than its allowance", () => {
    for (let seed = 0; seed < 200; seed++) {
      const allowance = { tokens: 300 + ((seed * 97) % 2500), requests: 2 + (seed % 8) }
      const plan = planCycle(createRng(seed, 'plan'), tenants, discovery, sizer, allowance)
      const steps = plan.groups.flat()
      assert.equal(plan.cost.requests, steps.length)
      assert.equal(
        plan.cost.tokens,
        steps.reduce((n, s) => n + s.tokenBound, 0),
      )
      assert.ok(plan.cost.tokens <= allowance.tokens && plan.cost.requests <= allowance.requests)
      if (steps.length === 0) assert.match(plan.skipped[0], /^cycle skipped/)
      else {
        assert.equal(steps[0].label, 'plant')
        const look = steps[steps.length - 1]
        assert.equal(look.label, 'normal after the plant')
        assert.notEqual(look.planted.tenant.name, steps[0].planted.tenant.name)
        // One rejection-path trigger at most, right after the plant; the others after it.
        const kinds = plan.triggers.slice(1)
        const rejections = kinds.filter((k) => k === 'over-capacity' || k === 'boundary')
        assert.ok(rejections.length <= 1, kinds.join(','))
        if (rejections.length === 1) assert.equal(kinds[0], rejections[0], kinds.join(','))
      }
    }
  })

  test('the plant is made only of canaries; one rejection-path prompt a cycle, just over the pool', () => {
    const sizes = new Set<number>()
    const drawn = { 'over-capacity': 0, boundary: 0, 'stream-cut': 0, burst: 0 }
    for (let seed = 0; seed < 100; seed++) {
      const plan = planCycle(createRng(seed, 'plan'), tenants, discovery, sizer, {
        tokens: 1e6,
        requests: 100,
      })
      const plant = plan.groups[0][0]
      assert.equal(plant.planted.prompt, plant.planted.canaries.join(' '))
      assert.equal(plant.tokenBound, promptTokenBound(plant.planted.prompt) + 16)
      for (const step of plan.groups.flat()) {
        if (step.trigger === 'boundary') assert.equal(step.aimedTokens, 385)
        if (step.trigger === 'over-capacity') sizes.add(step.aimedTokens!)
      }
      // With room for everything, every cycle tries the rejection path once.
      assert.ok(['over-capacity', 'boundary'].includes(plan.triggers[1]), plan.triggers.join(','))
      for (const trigger of plan.triggers.slice(1)) drawn[trigger as keyof typeof drawn]++
    }
    // 386..416: over the 384-token pool by 2 to 32, inside the advertised 1024.
    assert.ok(sizes.size > 10)
    for (const n of sizes) assert.ok(n >= 386 && n <= 416, `size ${n}`)
    assert.equal(drawn['over-capacity'] + drawn.boundary, 100)
    // The cut and the burst are drawn with probability ¼ each: 25 of 100 expected, σ ≈ 4.3.
    for (const n of [drawn['stream-cut'], drawn.burst]) assert.ok(n >= 8 && n <= 45, `drawn ${n}`)
  })

  test('the plant is as large as surely fits the limit: 364 characters at most for a 384-token pool', () => {
    // 384 tokens − 16 (its max_tokens) − 4 (special tokens over the bytes): a byte-level
    // tokenizer cannot make the prompt larger than the pool. No limit known: 200; the cap: 400.
    assert.deepEqual(
      [plantCharacters(384), plantCharacters(null), plantCharacters(1_000_000)],
      [364, 200, 400],
    )
    for (const [known, most] of [
      [discovery, 364],
      [{ poolTokens: null, contextTokens: null }, 200],
      [{ poolTokens: 100_000, contextTokens: 128_000 }, 400],
    ] as const) {
      for (let seed = 0; seed < 50; seed++) {
        const plan = planCycle(createRng(seed, 'plant'), tenants, known, sizer, {
          tokens: 1e6,
          requests: 100,
        })
        const { prompt, canaries } = plan.groups[0][0].planted
        assert.equal(prompt, canaries.join(' '))
        // Whole canaries (16–24 characters each) while the next would not fit.
        assert.ok(prompt.length <= most && prompt.length > most - 25, `${prompt.length}`)
        for (const c of canaries) assert.match(c, /^[A-Za-z0-9]{16,24}$/)
      }
    }
  })

  test('a prompt that must be refused asks for 32 tokens (it costs nothing where it is refused)', () => {
    for (let seed = 0; seed < 30; seed++) {
      const plan = planCycle(createRng(seed, 'plan'), tenants, discovery, sizer, {
        tokens: 1e6,
        requests: 100,
      })
      const read = plan.groups[1][0]
      assert.ok(read.mustReject)
      assert.equal(read.maxTokens, 32)
      assert.equal(read.tokenBound, Math.ceil(read.aimedTokens! * 1.05) + 8 + 32)
    }
  })
})

test("at the default budget a cycle may spend what its own triggers and all 20 follow-up rounds cost at most against the incident's shape", () => {
  const config = validateWatchOptions({ target: 'http://127.0.0.1:8000', tenants }, 1)
  const cost = cycleCostBound(config)
  // 24 shares of 100,000 tokens and 1,440 requests an hour at 120 cycles an hour.
  assert.deepEqual(cost.allowance, { tokens: 20_000, requests: 288 })
  // Reads 7; plant, cut, fresh, burst of 3, look, rejection-path prompt 8; 20 rounds of 2.
  assert.equal(cost.maxRequests, 7 + 8 + 20 * 2)
  // 21 plants of ≤ 400 bytes (+ 4, + 16 answer tokens), the cut (200 + 4 + 16), 5 observers
  // (49 + 4 + 16).
  assert.equal(cost.maxCanaryTokens, 21 * 420 + 220 + 5 * 69)
  // The cycle's rejection-path prompt and each round's read: over the 384-token pool by at most
  // 32, bound at ⌈416 × 1.05⌉ + 8 tokens plus 32 answer tokens.
  const readBound = Math.ceil(416 * 1.05) + 8 + 32
  assert.equal(readBound, 477)
  assert.ok(cost.maxCanaryTokens + 21 * readBound <= cost.allowance.tokens)
  assert.ok(cost.maxRequests <= cost.allowance.requests)
})

describe('planFollowUp', () => {
  test('a plant by one tenant, then an over-capacity prompt by the other, sharing no canary fragment with the cycle', () => {
    for (let seed = 0; seed < 50; seed++) {
      const rng = createRng(seed, 'follow-up')
      const taken = planCycle(rng, tenants, discovery, sizer, { tokens: 1e6, requests: 100 })
        .groups.flat()
        .flatMap((s) => s.planted.canaries)
      const groups = planFollowUp(rng, tenants, discovery, sizer, 2, taken)!
      assert.deepEqual(
        groups.map((g) => g.length),
        [1, 1],
      )
      const [[plant], [read]] = groups
      assert.equal(plant.label, 'plant (follow-up 2)')
      assert.equal(plant.trigger, 'plant')
      assert.equal(plant.mustReject, false)
      assert.equal(plant.maxTokens, 16)
      assert.equal(plant.planted.prompt, plant.planted.canaries.join(' '))
      assert.ok(plant.planted.prompt.length <= 364 && plant.planted.prompt.length > 339)
      assert.equal(plant.tokenBound, plant.planted.prompt.length + 4 + 16)
      for (const c of plant.planted.canaries)
        for (const t of taken) assert.equal(findFragment(t, c), null)
      assert.equal(read.trigger, 'over-capacity')
      assert.equal(read.label, `over-capacity ${read.aimedTokens} tokens (follow-up 2)`)
      assert.ok(read.aimedTokens! >= 386 && read.aimedTokens! <= 416, `${read.aimedTokens}`)
      assert.equal(read.mustReject, true)
      assert.equal(read.maxTokens, 32)
      assert.notEqual(read.planted.tenant.name, plant.planted.tenant.name)
    }
  })

  test('none without a limit to go over or a sizer', () => {
    const rng = createRng(1, 'follow-up')
    const unknown = { poolTokens: null, contextTokens: null }
    assert.equal(planFollowUp(rng, tenants, unknown, sizer, 1, []), null)
    assert.equal(planFollowUp(rng, tenants, discovery, null, 1, []), null)
  })
})

describe('availabilityFindings', () => {
  const answer = (status: number | null, failure: CompletionResult['failure'] = null) =>
    completionResult({
      status,
      failure,
      errorCode:
        status === 500 ? 'internal_error' : status === 400 ? 'context_length_exceeded' : null,
    })
  const observe = (mustReject: boolean, result: CompletionResult) => ({
    planted: { id: 'x', tenant: tenants[0], canaries: [], prompt: '' },
    label: 'x',
    stream: false,
    result,
    step: { mustReject },
  })
  const refused = observe(true, answer(400))

  test('valid requests timing out while the endpoint refuses the over-capacity prompt at once: a warning', () => {
    // The bench's early-release cycles: the plant and the look time out, or one times out and
    // one fails with 500, while the over-capacity prompt is refused with 400.
    for (const [results, failedBy] of [
      [[answer(null, 'timeout'), answer(null, 'timeout')], { 'no answer within the timeout': 2 }],
      [
        [answer(null, 'timeout'), answer(500)],
        { 'no answer within the timeout': 1, 'HTTP 500 internal_error': 1 },
      ],
    ] as const) {
      const [finding] = availabilityFindings([refused, ...results.map((r) => observe(false, r))])
      assert.equal(finding.key, 'warning:availability')
      assert.deepEqual(finding.finding.evidence, { numValidSent: 2, numFailed: 2, failedBy })
    }
  })

  test('no warning for timeouts when nothing of the cycle was answered, for 503s, or for one failure', () => {
    const timeouts = [answer(null, 'timeout'), answer(null, 'timeout')]
    assert.deepEqual(availabilityFindings(timeouts.map((r) => observe(false, r))), [])
    const shed = [answer(503), answer(503)].map((r) => observe(false, r))
    assert.deepEqual(availabilityFindings([refused, ...shed]), [])
    const one = [answer(500), answer(200), answer(200)].map((r) => observe(false, r))
    assert.deepEqual(availabilityFindings([refused, ...one]), [])
  })
})

test('webhook bodies: Alertmanager webhook v4 and Slack, with no key', () => {
  const alert = {
    key: 'warning:capacity',
    finding: {
      probe: 'capacity',
      verdict: 'warning',
      severity: 'high',
      title: 'advertised context 1024 tokens > effective KV pool 384 tokens',
      evidence: { advertisedContextTokens: 1024, effectivePoolTokens: 384, other: 'dropped' },
      remediation: 'Lower it.',
    } satisfies Finding,
    startedAt: Date.UTC(2026, 0, 2, 3, 4, 5),
    firstCycle: 1,
    lastCycle: 1,
    numSightings: 1,
  }
  const am = webhookBody(
    'alertmanager',
    'resolved',
    alert,
    'http://llm:8000',
    Date.UTC(2026, 0, 2, 4, 0, 0),
  )
  assert.equal(am.version, '4')
  assert.equal(am.status, 'resolved')
  const [one] = am.alerts as Record<string, unknown>[]
  assert.deepEqual(one.labels, {
    alertname: 'KvfenceCapacityGap',
    severity: 'warning',
    verdict: 'warning',
    class: 'misconfiguration',
    probe: 'capacity',
    finding: 'warning:capacity',
    target: 'http://llm:8000',
  })
  assert.equal(one.startsAt, '2026-01-02T03:04:05.000Z')
  assert.equal(one.endsAt, '2026-01-02T04:00:00.000Z')
  assert.deepEqual(JSON.parse((one.annotations as Record<string, string>).evidence), {
    advertisedContextTokens: 1024,
    effectivePoolTokens: 384,
  })
  const slack = webhookBody('slack', 'firing', alert, 'http://llm:8000')
  assert.equal(
    slack.text,
    ':rotating_light: FIRING kvfence watch warning (capacity) on http://llm:8000: advertised context 1024 tokens > effective KV pool 384 tokens',
  )
  for (const body of [am, slack]) {
    for (const t of tenants) assert.ok(!JSON.stringify(body).includes(t.key))
  }
})

test('webhook alertname: the shipped rule that fires for the same finding (Alertmanager groups them)', () => {
  // A trial's capacity warning came as KvfenceWatchWarning by webhook while Prometheus fired
  // KvfenceCapacityGap, whose rule KvfenceWatchWarning's leaves out: two alerts for one finding.
  const file = parse(readFileSync(join(repoRoot, 'deploy', 'kvfence-watch-rules.yml'), 'utf8')) as {
    groups: { rules: { alert: string; expr: string }[] }[]
  }
  const exprOf = new Map(file.groups.flatMap((g) => g.rules).map((r) => [r.alert, r.expr]))
  const nameOf = (verdict: 'leak' | 'warning', probe: FindingSource) =>
    alertNameOf({ verdict, probe })
  assert.match(exprOf.get(nameOf('warning', 'capacity')) ?? '', /kvfence_watch_capacity_gap_tokens/)
  for (const probe of ['boundary', 'page-leak', 'availability'] as const)
    assert.match(exprOf.get(nameOf('warning', probe)) ?? '', /verdict="warning", probe!="capacity"/)
  for (const probe of ['canary', 'boundary', 'abort-race', 'concurrency'] as const)
    assert.match(exprOf.get(nameOf('leak', probe)) ?? '', /verdict="leak"/)
})

test('options: fewer than two tenants, a bad URL or a zero budget are refused with one line', () => {
  const ok = { target: 'http://127.0.0.1:8000/v1/', tenants }
  assert.equal(validateWatchOptions(ok, 1).baseUrl, 'http://127.0.0.1:8000')
  assert.throws(() => validateWatchOptions({ ...ok, tenants: tenants.slice(1) }, 1), /at least two/)
  assert.throws(() => validateWatchOptions({ ...ok, target: 'ftp://x' }, 1), /http\(s\) URL/)
  assert.throws(
    () => validateWatchOptions({ ...ok, maxTokensPerHour: 0 }, 1),
    /^AuditError: max tokens per hour must be an integer from 1/,
  )
})
