/** The watch's rotation: besides its cheap triggers (cycle.ts), each cycle runs one cheap arm of
 *  an audit probe, the next in {@link rotation} (cycle 1 the first, cycle 2 the second, …), when
 *  its cost bound fits what the cycle's allowance has left; else it is skipped and named in the
 *  cycle's log line. An arm checks every answer it reads for other requests' canaries (its own
 *  and the cycle's plant) with the audit's detector.
 *  Adding a probe's arm: write a {@link RotationArm} (a name, the probe whose findings it gives,
 *  a cost bound from discovery alone, and `run`, which sends only through the target it is given
 *  and returns findings keyed as the cycle's are: `leak:<probe>:<victim>-><observer>` for a
 *  crossing), then add it to {@link rotation}. `watch --plan` lists the rotation with each arm's
 *  bound.
 *  Knows the audit's material and targets; knows nothing of any engine. */
import type { Discovery } from '../discovery.js'
import { firstCeilingTokens } from '../prompt-ceiling.js'
import {
  crossingRemediation,
  denseMaterial,
  findCrossings,
  leakFindings,
  type Observed,
  type Planted,
} from '../probes/material.js'
import type { Rng } from '../rng.js'
import type { Target } from '../target.js'
import type { ProbeName } from '../types.js'
import type { Spend } from './hourly.js'

/** A finding with the key that identifies it across cycles (one alert per key). */
export interface ArmFinding {
  readonly key: string
  readonly finding: import('../types.js').Finding
}

/** What an arm is given. `planted`: the cycle's own material (the plant, the looks), so that an
 *  arm's answer carrying it is seen too. */
export interface ArmContext {
  readonly target: Target
  readonly rng: Rng
  readonly discovery: Pick<Discovery, 'poolTokens' | 'contextTokens'>
  readonly planted: readonly Planted[]
}

/** What an arm did: its findings, its completions' token bound (what the cycle is charged) and
 *  how many completions it sent. */
export interface ArmResult {
  readonly findings: readonly ArmFinding[]
  readonly spent: Spend
  /** Completions answered whole (an arm that read none proved nothing). */
  readonly numAnswered: number
}

export interface RotationArm {
  readonly name: string
  readonly probe: ProbeName
  /** One line for `watch --plan`. */
  readonly description: string
  /** Requests and tokens the arm sends at most. */
  cost(discovery: Pick<Discovery, 'poolTokens' | 'contextTokens'>): Spend
  run(context: ArmContext): Promise<ArmResult>
}

/** The race arm's requests: one long prompt and three short ones, from both tenants. */
const raceArmRequests = 4
const raceArmMaxTokens = 16
const raceArmLongChars = 400
const raceArmShortChars = 100
/** Mean gap between the race arm's arrivals (ms). */
const raceArmGapMs = 10

/** Characters of the race arm's long prompt: {@link raceArmLongChars}, less where the smallest
 *  limit known would not hold it (a token is at least one byte, plus four special tokens), and
 *  where none is known, what the prompt ceiling allows before anything was answered
 *  (prompt-ceiling.ts: an engine that validates nothing is never sent more). */
function raceArmLong(discovery: Pick<Discovery, 'poolTokens' | 'contextTokens'>): number {
  const known = [discovery.poolTokens, discovery.contextTokens].filter((n) => n !== null)
  const limit = known.length === 0 ? firstCeilingTokens : Math.min(...known)
  return Math.max(raceArmShortChars, Math.min(raceArmLongChars, limit - raceArmMaxTokens - 8))
}

/** `race-load`'s cheap arm: four canary prompts, one long, arriving as a Poisson process (mean
 *  gap {@link raceArmGapMs}) so that they overlap, every answer checked for others' canaries. */
export const raceArm: RotationArm = {
  name: 'race',
  probe: 'race-load',
  description: `race-load's cheap arm: ${raceArmRequests} canary prompts (one long) in Poisson arrivals, overlapping`,
  cost(discovery) {
    const long = raceArmLong(discovery) + 4 + raceArmMaxTokens
    const short = raceArmShortChars + 4 + raceArmMaxTokens
    return { requests: raceArmRequests, tokens: long + (raceArmRequests - 1) * short }
  },
  async run({ target, rng, discovery, planted }) {
    const material = denseMaterial(
      rng,
      planted.flatMap((p) => p.canaries),
    )
    const mine: Planted[] = Array.from({ length: raceArmRequests }, (_, i) => ({
      id: `race-arm-${i}`,
      tenant: target.tenants[i % target.tenants.length],
      ...material.next(i === 0 ? raceArmLong(discovery) : raceArmShortChars),
    }))
    let dueMs = 0
    const observed = await Promise.all(
      mine.map(async (p): Promise<Observed> => {
        dueMs += -Math.log(1 - rng.next()) * raceArmGapMs
        await new Promise((r) => setTimeout(r, dueMs))
        const stream = rng.next() < 0.5
        const result = await target.complete({
          tenant: p.tenant,
          prompt: p.prompt,
          maxTokens: raceArmMaxTokens,
          stream,
        })
        return { planted: p, label: 'race arm', stream, result }
      }),
    )
    const all = [...planted, ...mine]
    const crossings = findCrossings(observed, all)
    const findings = leakFindings('race-load', crossings, all, { arm: 'race' }, crossingRemediation)
      .filter((f) => f.verdict === 'leak')
      .map((finding) => ({
        key: `leak:race-load:${String(finding.evidence.victimTenant)}->${String(finding.evidence.observerTenant)}`,
        finding,
      }))
    const numAnswered = observed.filter((o) => o.result.status === 200).length
    return { findings, spent: this.cost(discovery), numAnswered }
  },
}

/** The arms, in the order cycles take them. Arms of other probes (an entrypoint per cycle, the
 *  operational endpoints read, a near-duplicate pair) are added here as they are written. */
export const rotation: readonly RotationArm[] = [raceArm]

/** The arm of cycle `cycle` (1-based), or null when the rotation is empty. */
export function armOf(cycle: number): RotationArm | null {
  return rotation.length === 0 ? null : rotation[(cycle - 1) % rotation.length]
}
