/** The `operational-endpoints` probe's cheap arm for the watch's rotation (rotation.ts): A streams
 *  a short prompt of its canaries and, while it is in flight, every read-only operational path
 *  of the probe is read in turn with B's key (llama.cpp's `/slots` shows a running request's
 *  prompt); the paths the stream outlived are read with B's key after it, and then every path
 *  once with no key (GETs only, as the probe sends them). Judged by the probe's own
 *  `judgeReads`, against A's canaries and those A sent in the cycle's plant and looks: A's canary
 *  in a body is `leak:operational-endpoints:<path>`; a served secret (named by field, its value
 *  redacted) is `warning:operational-endpoints:<path>:<field>`.
 *  Knows the probe's read list and judge; knows nothing of any engine. */
import { makeCanaries } from '../../canaries.js'
import {
  inFlightMaxTokens,
  judgeReads,
  operationalPaths,
  readWhileInFlight,
  type Read,
} from '../../probes/operational-endpoints.js'
import { isAnsweredWhole } from '../../target.js'
import type { ArmFinding, ArmResult, RotationArm } from './arm.js'

/** Four canaries (at most 24 characters each, and spaces), as the probe plants. */
const plantCanaries = 4
const plantChars = plantCanaries * 25
/** The streamed plant, then each path read with B's key (in flight, or after) and with none. */
const numRequests = 1 + 2 * operationalPaths.length

/** `operational-endpoints`' cheap arm (it remembers nothing between runs). */
export const operationalArm: RotationArm = {
  name: 'operational',
  probe: 'operational-endpoints',
  description: `operational-endpoints' cheap arm: A streams ${plantCanaries} canaries; while it is in flight, then after, ${operationalPaths.length} read-only paths (/slots, /server_info, /metrics, …) are read with B's key, and with none, for A's canaries and for secrets (redacted)`,
  cost() {
    // The reads are GETs: no prompt, no answer tokens.
    return { requests: numRequests, tokens: plantChars + 4 + inFlightMaxTokens }
  },
  async run({ target, rng, planted }): Promise<ArmResult> {
    const [victim, observer] = target.tenants
    const taken = planted.flatMap((p) => p.canaries)
    const own = makeCanaries(rng, plantCanaries, taken)
    const inFlight = await readWhileInFlight(target, victim, observer, own.join(' '), [
      ...operationalPaths,
    ])
    const reads: Read[] = [...inFlight.reads]
    const readInFlight = new Set(inFlight.reads.map((r) => r.path))
    for (const path of operationalPaths)
      for (const reader of [observer, null]) {
        if (reader !== null && readInFlight.has(path)) continue
        const http = await target.get(path, reader === null ? {} : { tenant: reader })
        reads.push({ path, reader, phase: 'after-plant', http })
      }
    const victims = planted.filter((p) => p.tenant.name === victim.name)
    const canaries = [...own, ...victims.flatMap((p) => p.canaries)]
    const judged = judgeReads(reads, canaries, target.tenants, victim, [inFlight.result])
    const findings: ArmFinding[] = judged.flatMap((finding): ArmFinding[] => {
      const path = String(finding.evidence.endpoint)
      if (finding.verdict === 'leak')
        return [{ key: `leak:operational-endpoints:${path}`, finding }]
      if (finding.verdict === 'warning')
        return [
          {
            key: `warning:operational-endpoints:${path}:${String(finding.evidence.field)}`,
            finding,
          },
        ]
      return []
    })
    const notes = judged.filter((f) => f.verdict === 'inconclusive').map((f) => f.title)
    return {
      findings,
      numAnswered: isAnsweredWhole(inFlight.result) ? 1 : 0,
      ...(notes.length > 0 ? { notes } : {}),
    }
  },
}
