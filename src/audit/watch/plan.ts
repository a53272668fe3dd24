/** `kvfence watch --plan`: what the watch would send, before it sends anything: a cycle's
 *  requests and tokens at most (loop.ts `cycleCostBound`), the rotation of arms (rotation.ts), the allowance the pacing gives one
 *  cycle, the least a cycle needs to start, and what an hour holds at most. No request is sent:
 *  the watch's over-capacity or boundary prompt follows the pool and context discovery reads
 *  when it starts, and is paid from the same hourly budget.
 *  Knows the watch's config and its cost bound; knows nothing of HTTP. */
import { cycleCostBound } from './loop.js'
import type { WatchConfig } from './options.js'
import { rotation } from './rotation.js'

/** The plan as the console prints it, one fact a line. */
export function formatWatchPlan(config: WatchConfig): string {
  const cost = cycleCostBound(config)
  const cyclesPerHour = 3600 / config.cycleSeconds
  return [
    `watch plan for ${config.baseUrl}: upper estimates; nothing was sent`,
    `a cycle every ${config.cycleSeconds} s on average (±20 %): ${cyclesPerHour.toFixed(1)} cycles an hour`,
    `a cycle sends at most ${cost.maxRequests} requests and ${cost.maxCanaryTokens} tokens of canary prompts (reads, a plant, a cut stream, five observer prompts, follow-up rounds), plus one over-capacity or boundary prompt sized from discovery`,
    `and one rotating arm a cycle, when what the cycle has left holds it (at most ${cost.rotationArm.requests} requests and ${cost.rotationArm.tokens} tokens): ${rotation.map((arm, i) => `${i + 1}. ${arm.name} (${arm.description})`).join('; ')}`,
    `a cycle may spend at most ${cost.allowance.requests} requests and ${cost.allowance.tokens} tokens (its pacing allowance); it starts only with ${cost.minCycle.requests} requests and ${cost.minCycle.tokens} tokens available (reads, a plant and one look)`,
    `an hour: at most ${config.maxRequestsPerHour} requests (--max-requests-per-hour) and ${config.maxTokensPerHour} tokens (--max-tokens-per-hour); a cycle that cannot be paid for is skipped and logged`,
  ].join('\n')
}
