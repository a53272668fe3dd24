/** Probe `concurrency`: bursts of simultaneous requests from every tenant (as many as the
 *  budget's concurrency allows), each with canaries of its own, streamed and not; every answer,
 *  first tokens included, must carry only its own request's material. Catches batch slots,
 *  metadata or first tokens mixed up under load (sglang#17259, #22716). */
import { materialPromptTokens } from '../plan.js'
import { BudgetExhaustedError } from '../budget.js'
import type { Probe } from '../probe.js'
import { inconclusiveRemediation } from '../probe.js'
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

const numBursts = 3
const maxTokens = 32

export const concurrencyProbe: Probe = {
  name: 'concurrency',
  description:
    'bursts of simultaneous requests from every tenant (up to --concurrency); each answer, first tokens included, must carry only its own material',
  plan: ({ limits }) => [
    {
      what: `${numBursts} bursts of ${limits.concurrency}`,
      numRequests: limits.concurrency < 2 ? 0 : numBursts * limits.concurrency,
      tokensEach: materialPromptTokens + maxTokens,
    },
  ],
  async run(target, budget, context): Promise<Finding[]> {
    const burstSize = budget.limits.concurrency
    const inconclusive = (title: string, evidence: Record<string, unknown>): Finding[] => [
      {
        probe: 'concurrency',
        verdict: 'inconclusive',
        severity: 'medium',
        title,
        evidence,
        remediation: `Re-run with --concurrency 4 or more. ${inconclusiveRemediation}`,
      },
    ]
    if (burstSize < 2) {
      return inconclusive('--concurrency 1 allows no simultaneous requests', { burstSize })
    }
    const rng = createRng(context.seed, 'concurrency')
    const ids = Array.from(
      { length: numBursts * burstSize },
      (_, i) => `b${Math.floor(i / burstSize)}r${i % burstSize}`,
    )
    const planted = plantMaterial(rng, target.tenants, ids)
    const observed: Observed[] = []
    let stoppedBy: string | null = null
    const acceptedPerBurst: number[] = []
    for (let b = 0; b < numBursts && stoppedBy === null; b++) {
      const burst = planted.slice(b * burstSize, (b + 1) * burstSize)
      const settled = await Promise.allSettled(
        burst.map(async (p, i) => {
          const stream = (i + b) % 2 === 0
          const result = await target.complete({
            tenant: p.tenant,
            prompt: p.prompt,
            maxTokens,
            stream,
          })
          const o: Observed = { planted: p, label: `burst ${b + 1}`, stream, result }
          observed.push(o)
          return o
        }),
      )
      for (const s of settled) {
        if (s.status === 'rejected') {
          if (!(s.reason instanceof BudgetExhaustedError)) throw s.reason
          stoppedBy = s.reason.message
        }
      }
      acceptedPerBurst.push(
        settled.filter((s) => s.status === 'fulfilled' && isAnsweredWhole(s.value.result)).length,
      )
    }
    const crossings = findCrossings(observed, planted)
    const summary = { burstSize, acceptedPerBurst, stoppedBy, requests: requestLog(observed) }
    context.log(`accepted per burst of ${burstSize}: ${acceptedPerBurst.join(' ')}`)
    if (crossings.length > 0) {
      return leakFindings('concurrency', crossings, planted, summary, crossingRemediation)
    }
    if (!acceptedPerBurst.some((n) => n >= 2)) {
      return inconclusive('no burst had two simultaneous requests answered', summary)
    }
    const numAccepted = acceptedPerBurst.reduce((a, b) => a + b, 0)
    return [
      {
        probe: 'concurrency',
        verdict: 'clean',
        severity: 'info',
        title: `${numAccepted} answers in ${acceptedPerBurst.length} bursts of ${burstSize} each carried only their own material`,
        evidence: summary,
        remediation: 'None needed.',
      },
    ]
  },
}
