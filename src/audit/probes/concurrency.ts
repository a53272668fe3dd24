/** Probe `concurrency`: bursts of simultaneous requests from every tenant, ramped 1 → 2 → 4 →
 *  8 → 16 in flight (up to `--max-concurrency`, and no further than the endpoint's own limit once
 *  a 429 or 503 shows it), each with canaries of its own, streamed and not; every answer, first
 *  tokens included, must carry only its own request's material. Catches batch slots, metadata or
 *  first tokens mixed up under load (sglang#17259, #22716), including races that only open at
 *  a batch size the default `--concurrency` never reaches. */
import { materialPromptTokens } from '../plan.js'
import { BudgetExhaustedError } from '../budget.js'
import type { Probe } from '../probe.js'
import { aisvsKvPartitioning, inconclusiveRemediation } from '../probe.js'
import { createRng } from '../rng.js'
import { isAnsweredWhole } from '../target.js'
import type { Finding } from '../types.js'
import {
  crossingRemediation,
  findCrossings,
  leakFindings,
  plantMaterial,
  requestLog,
  type Observed,
} from './material.js'

const maxTokens = 32
/** The ramp's levels (requests in flight), before the ceiling. */
const rampSteps = [1, 2, 4, 8, 16] as const

/** The levels the ramp sends at, each one burst: the steps up to `ceiling`, and the ceiling
 *  itself when it falls between two steps. */
export function rampLevels(ceiling: number): number[] {
  const levels: number[] = rampSteps.filter((n) => n <= ceiling)
  if (levels[levels.length - 1] !== ceiling) levels.push(ceiling)
  return levels
}

/** One burst of the ramp: how many were sent together, answered whole, refused for load. */
interface RampStep {
  readonly level: number
  readonly numAnswered: number
  readonly numShed: number
}

export const concurrencyProbe: Probe = {
  name: 'concurrency',
  description:
    'bursts of simultaneous requests from every tenant (up to --concurrency); each answer, first tokens included, must carry only its own material',
  class: 'content-leak',
  controls: { aisvs: [aisvsKvPartitioning], guards: ['G4'] },
  plan: ({ limits }) => {
    const levels = rampLevels(Math.max(limits.concurrency, limits.maxConcurrency ?? 0))
    return [
      {
        what: `bursts of ${levels.join(', ')} in flight`,
        numRequests: levels.length < 2 ? 0 : levels.reduce((a, b) => a + b, 0),
        tokensEach: materialPromptTokens + maxTokens,
      },
    ]
  },
  async run(target, budget, context): Promise<Finding[]> {
    const ceiling = budget.maxInFlightLimit
    const inconclusive = (title: string, evidence: Record<string, unknown>): Finding[] => [
      {
        probe: 'concurrency',
        verdict: 'inconclusive',
        severity: 'medium',
        title,
        evidence,
        remediation: `Re-run with --max-concurrency 8 or more. ${inconclusiveRemediation}`,
      },
    ]
    if (ceiling < 2) {
      return inconclusive('--concurrency 1 allows no simultaneous requests', { ceiling })
    }
    const levels = rampLevels(ceiling)
    const rng = createRng(context.seed, 'concurrency')
    const ids = levels.flatMap((level) => Array.from({ length: level }, (_, i) => `c${level}r${i}`))
    const planted = plantMaterial(rng, target.tenants, ids)
    const observed: Observed[] = []
    let stoppedBy: string | null = null
    const ramp: RampStep[] = []
    let endpointLimit: number | null = null
    let offset = 0
    for (const level of levels) {
      if (stoppedBy !== null || endpointLimit !== null) break
      const burst = planted.slice(offset, offset + level)
      offset += level
      const settled = await budget.withInFlightLimit(level, () =>
        Promise.allSettled(
          burst.map(async (p, i) => {
            const stream = (i + level) % 2 === 0
            const result = await target.complete({
              tenant: p.tenant,
              prompt: p.prompt,
              maxTokens,
              stream,
            })
            const o: Observed = { planted: p, label: `${level} in flight`, stream, result }
            observed.push(o)
            return o
          }),
        ),
      )
      const results = settled.flatMap((s) => (s.status === 'fulfilled' ? [s.value.result] : []))
      for (const s of settled) {
        if (s.status === 'rejected') {
          if (!(s.reason instanceof BudgetExhaustedError)) throw s.reason
          stoppedBy = s.reason.message
        }
      }
      const step: RampStep = {
        level,
        numAnswered: results.filter(isAnsweredWhole).length,
        numShed: results.filter((r) => r.status === 429 || r.status === 503).length,
      }
      ramp.push(step)
      // The endpoint said how many it takes at once: going higher only adds refusals.
      if (step.numShed > 0) endpointLimit = step.numAnswered
    }
    const acceptedPerBurst = ramp.map((s) => s.numAnswered)
    const highestLevel = Math.max(0, ...ramp.filter((s) => s.numAnswered >= 2).map((s) => s.level))
    const crossings = findCrossings(observed, planted)
    const summary = {
      ceiling,
      ramp,
      highestLevel,
      endpointLimit,
      acceptedPerBurst,
      stoppedBy,
      requests: requestLog(observed),
    }
    context.log(`ramp: ${ramp.map((s) => `${s.numAnswered}/${s.level}`).join(' ')}`)
    if (crossings.length > 0) {
      return leakFindings('concurrency', crossings, planted, summary, crossingRemediation)
    }
    if (!acceptedPerBurst.some((n) => n >= 2)) {
      return inconclusive('no burst had two simultaneous requests answered', summary)
    }
    const numAccepted = acceptedPerBurst.reduce((a, b) => a + b, 0)
    // Clean says only what was exercised: a burst with fewer than two answers (timeouts on a slow
    // engine) proved nothing at its level.
    const isExercised = (s: RampStep) => s.numAnswered >= Math.min(2, s.level)
    const exercised = ramp.filter(isExercised).map((s) => s.level)
    const unexercised = ramp.filter((s) => !isExercised(s)).map((s) => s.level)
    return [
      {
        probe: 'concurrency',
        verdict: 'clean',
        severity: 'info',
        title:
          `${numAccepted} answers in bursts of ${exercised.join(', ')} in flight carried only their own material` +
          (unexercised.length > 0
            ? `; not exercised: bursts of ${unexercised.join(', ')} (fewer than two answered)`
            : '') +
          (endpointLimit !== null
            ? ` (the endpoint shed load above ${endpointLimit} at once)`
            : ''),
        evidence: summary,
        remediation: 'None needed.',
      },
    ]
  },
}
