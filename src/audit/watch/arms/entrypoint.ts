/** The `entrypoints` probe's cheap arm for the watch's rotation (rotation.ts): the generation
 *  entrypoints the target serves are discovered once, on the arm's first run (one 1-token
 *  request per entrypoint, as the probe does); each run then takes the next served one in turn
 *  and runs the probe's same-path trial there: A primes a prefix with its canaries, B sends the
 *  same prefix with its own, A repeats it (the positive control). Judged by the probe's own
 *  `judgePath`, with the cycle's plant and looks among each tenant's canaries.
 *  Alerts: a canary crossing on an entrypoint is `leak:entrypoints:<entrypoint>`; B served A's
 *  cached prefix is `warning:entrypoints:<entrypoint>` (a side channel).
 *  Knows the probe's send and judge functions; knows nothing of any engine. */
import {
  answerMaxTokens,
  discoverEntrypoints,
  discoveryPrompt,
  materialDrawer,
  prefixChars,
  runTrials,
  tailAndTemplateTokens,
  type EntrypointStatus,
} from '../../probes/entrypoints.js'
import { entrypointNames } from '../../probes/entrypoint-shapes.js'
import { judgePath, type Exchange, type Trial } from '../../probes/entrypoint-trials.js'
import type { Planted } from '../../probes/material.js'
import type { Tenant } from '../../types.js'
import type { ArmDiscovery, ArmFinding, ArmResult, RotationArm } from './arm.js'

/** A trial's three requests, each at most the prefix, two canaries and a chat template's tokens
 *  (a token per character, the worst case) and its answer. */
const trialRequests = 3
/** The discovery request: its prompt, a chat template's tokens and one answer token. */
const discoveryTokens = discoveryPrompt.length + tailAndTemplateTokens + 1

function trialTokens(discovery: ArmDiscovery): number {
  return trialRequests * (prefixChars(discovery) + tailAndTemplateTokens + answerMaxTokens)
}

/** Canaries of the cycle's plant and looks sent by anyone but `notBy`. */
function plantedBy(planted: readonly Planted[], notBy: Tenant): string[] {
  return planted.filter((p) => p.tenant.name !== notBy.name).flatMap((p) => p.canaries)
}

/** A fresh arm: it has discovered nothing yet. */
export function createEntrypointArm(): RotationArm {
  let table: EntrypointStatus[] | null = null
  let turn = 0
  return {
    name: 'entrypoint',
    probe: 'entrypoints',
    description: `entrypoints' cheap arm: the served entrypoints discovered once (${entrypointNames.length} one-token requests), then one a cycle in turn: A primes a prefix with canaries, B sends it with its own, A repeats it (the control)`,
    cost(discovery) {
      const toDiscover = table === null ? entrypointNames.length : 0
      return {
        requests: toDiscover + trialRequests,
        tokens: toDiscover * discoveryTokens + trialTokens(discovery),
      }
    },
    async run({ target, rng, discovery, planted }): Promise<ArmResult> {
      const [a, b] = target.tenants
      if (table === null) {
        const found = await discoverEntrypoints(target, a)
        // Discovery that found nothing served (every entrypoint failed) is tried again next time.
        if (found.some((r) => r.isServed)) table = found
        else
          return {
            findings: [],
            numAnswered: 0,
            notes: ['no generation entrypoint answered a 3-word prompt: nothing was exercised'],
          }
      }
      const served = table.filter((r) => r.isServed)
      const row = served[turn++ % served.length]
      // Each side's canaries start with the cycle's material an answer to the other side must
      // not carry; the trial's own are drawn apart from them and added.
      const taken = { A: plantedBy(planted, b), B: plantedBy(planted, a) }
      const draw = materialDrawer(rng, taken, prefixChars(discovery))
      const trials: Trial[] = []
      const exchanges: Exchange[] = []
      await runTrials(target, [[row.entrypoint, row.entrypoint]], draw, trials, exchanges)
      const canaries = { ...taken, names: { A: a.name, B: b.name } }
      const rows = table.map((r) => ({ ...r }))
      const judged = judgePath(row.entrypoint, row.endpoint, trials, exchanges, canaries, rows)
      const findings: ArmFinding[] = judged
        .filter((f) => f.verdict === 'leak' || f.verdict === 'warning')
        .map((finding) => ({ key: `${finding.verdict}:entrypoints:${row.entrypoint}`, finding }))
      const notes = judged.filter((f) => f.verdict === 'inconclusive').map((f) => f.title)
      return {
        findings,
        numAnswered: exchanges.filter((e) => e.answer.isAnswered).length,
        ...(notes.length > 0 ? { notes } : {}),
      }
    },
  }
}
