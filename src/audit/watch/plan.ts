/** `kvfence watch --plan`: what the watch would send, before it sends anything: the key check
 *  at start, a cycle's requests and tokens at most (loop.ts `cycleCostBound`), the rotation of
 *  arms (rotation.ts) and how often each runs in an hour, the allowance the pacing gives one
 *  cycle, the least a cycle needs to start, and what an hour holds at most. No request is sent:
 *  the watch's over-capacity or boundary prompt follows the pool and context discovery reads
 *  when it starts, and is paid from the same hourly budget.
 *  Knows the watch's config and its cost bound; knows nothing of HTTP. */
import { cycleCostBound, pacing } from './loop.js'
import { HourlyBudget, type Spend } from './hourly.js'
import type { WatchConfig } from './options.js'
import { createRotation, rotation } from './rotation.js'

/** What a healthy endpoint's cycle spends on average besides its arm (docs/monitoring.md §3:
 *  2,000 drawn plans, 572 tokens and 3.24 completions plus 4 reads; rounded up). */
export const typicalCycle: Spend = { tokens: 572, requests: 8 }

/** How many times each arm of the rotation runs in an hour under `config`: cycles exactly
 *  `cycleSeconds` apart, each spending {@link typicalCycle}, then its arm when what is left of
 *  its allowance holds the arm's bound, charged the whole bound (the most it can be charged:
 *  an endpoint that reports no usage, a tokenizer of one token a byte). Counted over the second
 *  hour, once the pacing bucket's start-up fill is spent. Arithmetic, nothing is sent. */
export function armRunsPerHour(config: WatchConfig): { name: string; runs: number }[] {
  let nowMs = 0
  const clock = () => nowMs
  const hourly = new HourlyBudget(config.maxTokensPerHour, config.maxRequestsPerHour, clock)
  const bucket = pacing(config, clock)
  const arms = createRotation()
  const runs = new Map(arms.map((a) => [a.name, 0]))
  const cycles = Math.floor((2 * 3600) / config.cycleSeconds)
  const { minCycle } = cycleCostBound(config)
  const none = { poolTokens: null, contextTokens: null, inputLimitTokens: null }
  for (let cycle = 1; cycle <= cycles; cycle++, nowMs += config.cycleSeconds * 1000) {
    const left = hourly.remaining()
    const inBucket = bucket.available()
    const allowance = {
      tokens: Math.min(left.tokens, inBucket.tokens),
      requests: Math.min(left.requests, inBucket.requests),
    }
    if (allowance.tokens < minCycle.tokens || allowance.requests < minCycle.requests) continue
    const arm = arms[(cycle - 1) % arms.length]
    const cost = arm.cost(none)
    const isArmRun =
      allowance.tokens - typicalCycle.tokens >= cost.tokens &&
      allowance.requests - typicalCycle.requests >= cost.requests
    const spent = {
      tokens: Math.min(allowance.tokens, typicalCycle.tokens + (isArmRun ? cost.tokens : 0)),
      requests: Math.min(
        allowance.requests,
        typicalCycle.requests + (isArmRun ? cost.requests : 0),
      ),
    }
    hourly.reserve(spent)
    bucket.take(spent)
    if (isArmRun && nowMs >= 3_600_000) runs.set(arm.name, runs.get(arm.name)! + 1)
  }
  return arms.map((a) => ({ name: a.name, runs: runs.get(a.name)! }))
}

/** The plan as the console prints it, one fact a line. */
export function formatWatchPlan(config: WatchConfig): string {
  const cost = cycleCostBound(config)
  const cyclesPerHour = 3600 / config.cycleSeconds
  const turns = cyclesPerHour / rotation.length
  const runs = armRunsPerHour(config)
  return [
    `watch plan for ${config.baseUrl}: upper estimates; nothing was sent`,
    `at start: each tenant's key checked with one GET of /v1/models (${config.tenants.length} requests, no tokens), as the audit checks them`,
    `a cycle every ${config.cycleSeconds} s on average (±20 %): ${cyclesPerHour.toFixed(1)} cycles an hour`,
    `a cycle sends at most ${cost.maxRequests} requests and ${cost.maxCanaryTokens} tokens of canary prompts (reads, a plant, a cut stream, five observer prompts, follow-up rounds), plus one over-capacity or boundary prompt sized from discovery`,
    `and one rotating arm a cycle, when what the cycle has left holds it (at most ${cost.rotationArm.requests} requests and ${cost.rotationArm.tokens} tokens), charged what it spent: ${rotation.map((arm, i) => `${i + 1}. ${arm.name} (${arm.description})`).join('; ')}`,
    `arm runs an hour (${turns.toFixed(0)} turns each; cycles at ${typicalCycle.tokens} tokens and ${typicalCycle.requests} requests, each arm charged its whole bound): ${runs.map((r) => `${r.name} ${r.runs}`).join(', ')}`,
    `a cycle may spend at most ${cost.allowance.requests} requests and ${cost.allowance.tokens} tokens (its pacing allowance); it starts only with ${cost.minCycle.requests} requests and ${cost.minCycle.tokens} tokens available (reads, a plant and one look)`,
    `an hour: at most ${config.maxRequestsPerHour} requests (--max-requests-per-hour) and ${config.maxTokensPerHour} tokens (--max-tokens-per-hour); a cycle that cannot be paid for is skipped and logged`,
  ].join('\n')
}
