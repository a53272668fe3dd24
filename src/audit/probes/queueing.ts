/** Probe `queueing`: fills the endpoint with long generations from the victim (every slot but
 *  one the budget allows), then sends short requests from the other tenants that must wait behind
 *  them. A request counts as queued when its time to first byte is over 3× the unloaded one
 *  (+ 20 ms). Queued answers are checked like `concurrency`'s: only their own material. Catches
 *  queue, lease and timeout paths that hand a waiting request pages or results that expired or
 *  belonged to another request (vllm#52234). A 429/503 is a bounded queue doing its job. */
import { runUntilExhausted } from '../budget.js'
import type { Probe } from '../probe.js'
import { inconclusiveRemediation } from '../probe.js'
import { createRng } from '../rng.js'
import { outcomeOf } from '../target.js'
import { median } from '../stats.js'
import type { Finding } from '../types.js'
import {
  crossingRemediation,
  findCrossings,
  leakFindings,
  plantMaterial,
  requestLog,
  type Observed,
} from './material.js'

const holderMaxTokens = 256
const waiterMaxTokens = 16
const numBaseline = 2
const numWaiters = 4

export const queueingProbe: Probe = {
  name: 'queueing',
  description:
    'long generations fill the batch, short requests of other tenants wait behind them; queued answers must carry only their own material',
  async run(target, budget, context): Promise<Finding[]> {
    const [victim, ...others] = target.tenants
    const numHolders = Math.max(1, budget.limits.concurrency - 1)
    const rng = createRng(context.seed, 'queueing')
    const baseline = plantMaterial(rng, others, ['base0', 'base1'].slice(0, numBaseline))
    const holders = plantMaterial(
      rng,
      [victim],
      Array.from({ length: numHolders }, (_, i) => `hold${i}`),
    )
    const waiters = plantMaterial(
      rng,
      others,
      Array.from({ length: numWaiters }, (_, i) => `wait${i}`),
    )
    const planted = [...baseline, ...holders, ...waiters]
    const observed: Observed[] = []
    const send = async (i: number, label: string, maxTokens: number, stream: boolean) => {
      const p = planted[i]
      const result = await target.complete({
        tenant: p.tenant,
        prompt: p.prompt,
        maxTokens,
        stream,
      })
      observed.push({ planted: p, label, stream, result })
    }
    const stoppedBy = await runUntilExhausted(async () => {
      for (let i = 0; i < baseline.length; i++) await send(i, 'unloaded', waiterMaxTokens, true)
      const holding = holders.map((_, i) =>
        send(baseline.length + i, 'holding the batch', holderMaxTokens, true),
      )
      // Let the holders reach the server before the waiters queue up behind them.
      await new Promise((r) => setTimeout(r, 20))
      const waiting = waiters.map((_, i) =>
        send(baseline.length + holders.length + i, 'queued', waiterMaxTokens, i % 2 === 0),
      )
      await Promise.all([...holding, ...waiting])
    })
    const ttft = (label: string) =>
      observed
        .filter(
          (o) =>
            o.label === label && o.result.ttftMs !== null && outcomeOf(o.result) === 'accepted',
        )
        .map((o) => o.result.ttftMs as number)
    const unloadedMs = median(ttft('unloaded'))
    const waited = unloadedMs === null ? [] : ttft('queued').filter((t) => t > 3 * unloadedMs + 20)
    const numShed = observed.filter(
      (o) => o.label === 'queued' && (o.result.status === 429 || o.result.status === 503),
    ).length
    const summary = {
      holders: numHolders,
      unloadedTtftMs: unloadedMs,
      queuedTtftMs: ttft('queued'),
      numQueued: waited.length,
      numShed,
      stoppedBy,
      requests: requestLog(observed),
    }
    context.log(`unloaded TTFT ${unloadedMs} ms; queued ${summary.queuedTtftMs.join(', ')} ms`)
    const crossings = findCrossings(observed, planted)
    if (crossings.length > 0) {
      return leakFindings('queueing', crossings, planted, summary, crossingRemediation)
    }
    const numWaitersAnswered = observed.filter(
      (o) => o.label === 'queued' && outcomeOf(o.result) === 'accepted',
    ).length
    if (waited.length === 0 && numShed > 0 && numShed + numWaitersAnswered === waiters.length) {
      // A full endpoint that refuses instead of queueing has no queue path to get wrong.
      return [
        {
          probe: 'queueing',
          verdict: 'clean',
          severity: 'info',
          title: `the full endpoint refused ${numShed} requests with 429/503 instead of queueing them; the ${numWaitersAnswered} it answered carried only their own material`,
          evidence: summary,
          remediation: 'None needed.',
        },
      ]
    }
    if (waited.length === 0) {
      return [
        {
          probe: 'queueing',
          verdict: 'inconclusive',
          severity: 'low',
          title: `no request was seen waiting (time to first byte never over 3× the unloaded ${unloadedMs ?? '?'} ms)`,
          evidence: summary,
          remediation: `The endpoint's batch is larger than --concurrency ${budget.limits.concurrency}: re-run with a higher --concurrency to exercise its queue. ${inconclusiveRemediation}`,
        },
      ]
    }
    return [
      {
        probe: 'queueing',
        verdict: 'clean',
        severity: 'info',
        title: `${waited.length} requests waited behind a full batch and were answered with only their own material`,
        evidence: summary,
        remediation: 'None needed.',
      },
    ]
  },
}
