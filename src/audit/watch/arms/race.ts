/** `race-load`'s cheap arm for the watch's rotation (rotation.ts).
 *  Knows the audit's material and targets; knows nothing of any engine. */
import { firstCeilingTokens } from '../../prompt-ceiling.js'
import { denseMaterial, type Observed, type Planted } from '../../probes/material.js'
import { crossingFindings, type ArmDiscovery, type RotationArm } from './arm.js'

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
function raceArmLong(discovery: ArmDiscovery): number {
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
    const findings = crossingFindings('race-load', 'race', observed, [...planted, ...mine])
    const numAnswered = observed.filter((o) => o.result.status === 200).length
    return { findings, numAnswered }
  },
}
