/** What every rotating arm is (rotation.ts runs them one a cycle): its context, its result and
 *  the keyed findings it returns; and the crossing check every arm applies to the answers it reads.
 *  Knows the audit's material and targets; knows nothing of any engine. */
import type { Discovery } from '../../discovery.js'
import {
  crossingRemediation,
  findCrossings,
  leakFindings,
  type Observed,
  type Planted,
} from '../../probes/material.js'
import type { Rng } from '../../rng.js'
import type { Target } from '../../target.js'
import type { Finding, ProbeName } from '../../types.js'
import type { Spend } from '../hourly.js'

/** A finding with the key that identifies it across cycles (one alert per key). */
export interface ArmFinding {
  readonly key: string
  readonly finding: Finding
}

/** What an arm sizes its prompts from: the limits discovery read (null: not reported). */
export type ArmDiscovery = Pick<Discovery, 'poolTokens' | 'contextTokens' | 'inputLimitTokens'>

/** What an arm is given. `planted`: the cycle's own material (the plant, the looks), so that an
 *  arm's answer carrying it is seen too. */
export interface ArmContext {
  readonly target: Target
  readonly rng: Rng
  readonly discovery: ArmDiscovery
  readonly planted: readonly Planted[]
}

/** What an arm did: its findings and how many completions it read whole. What it spent is
 *  metered by the cycle (cycle.ts: the requests sent, and each completion's tokens as the
 *  endpoint reported them, else their bound). */
export interface ArmResult {
  readonly findings: readonly ArmFinding[]
  /** Completions answered whole (an arm that read none proved nothing). */
  readonly numAnswered: number
  /** What the arm could not tell (its positive control did not show, nothing was served), one
   *  line each, for the cycle's log line; absent: it exercised what it checks. */
  readonly notes?: readonly string[]
}

export interface RotationArm {
  readonly name: string
  readonly probe: ProbeName
  /** One line for `watch --plan`. */
  readonly description: string
  /** Requests and tokens the arm's next run sends at most: it runs only when what the cycle has
   *  left holds this; it is then charged what it really spent. */
  cost(discovery: ArmDiscovery): Spend
  run(context: ArmContext): Promise<ArmResult>
}

/** Leak findings, keyed `leak:<probe>:<victim>-><observer>`, for every answer of `observed`
 *  carrying a canary of another request of `planted` (the arm's own and the cycle's). */
export function crossingFindings(
  probe: ProbeName,
  arm: string,
  observed: readonly Observed[],
  planted: readonly Planted[],
): ArmFinding[] {
  const crossings = findCrossings(observed, planted)
  return leakFindings(probe, crossings, planted, { arm }, crossingRemediation)
    .filter((f) => f.verdict === 'leak')
    .map((finding) => ({
      key: `leak:${probe}:${String(finding.evidence.victimTenant)}->${String(finding.evidence.observerTenant)}`,
      finding,
    }))
}
