/** The `request-ids` probe's cheap arm for the watch's rotation (rotation.ts): the client id
 *  fields the endpoint takes are learnt once, on the arm's first run (the probe's own check: one
 *  1-token request with every field, and one per field when that is refused); each run then
 *  sends one colliding pair, the probe's `colliding` arm: A streams a canary prompt and, once its
 *  first event arrived, B streams its own with the same client request id (`rid`, `request_id`,
 *  `user` where taken, and `X-Request-Id`). Judged by the probe's own `judgeRequestIds`, every
 *  event checked (streams.ts), and both answers checked for the cycle's plant and looks.
 *  Alerts: a crossing is `leak:request-ids:<victim>-><observer>`; a stream with more text
 *  events than its `max_tokens` (the other request's tokens in it) is
 *  `warning:request-ids:integrity:<tenant>`; a pair not in flight at once or not answered is
 *  "could not tell".
 *  Knows the probe's send and judge functions; knows nothing of any engine. */
import { makeCanaries } from '../../canaries.js'
import type { Observed, Planted } from '../../probes/material.js'
import {
  acceptedFields,
  idBodyFields,
  judgeRequestIds,
  maxTokens,
  numCanaries,
  runArm,
  type IdBodyField,
} from '../../probes/request-ids.js'
import { isAnsweredWhole } from '../../target.js'
import { crossingFindings, type ArmFinding, type ArmResult, type RotationArm } from './arm.js'

/** A canary is at most 24 characters: four and their spaces, plus 4 special tokens. */
const promptTokens = numCanaries * 25 + 4
/** The field check's prompt ('the river and the stone') and its one answer token. */
const checkTokens = 8
/** The field check at most: every field at once, then each alone. */
const checkRequests = 1 + idBodyFields.length

/** A fresh arm: it has not learnt which id fields the endpoint takes. */
export function createRequestIdsArm(): RotationArm {
  let fields: { accepted: IdBodyField[]; refused: IdBodyField[] } | null = null
  return {
    name: 'request-ids',
    probe: 'request-ids',
    description: `request-ids' cheap arm: the id fields taken learnt once (at most ${checkRequests} one-token requests), then one colliding pair a cycle: A and B stream canary prompts at once with the same client request id, every event checked`,
    cost() {
      const toCheck = fields === null ? checkRequests : 0
      return {
        requests: toCheck + 2,
        tokens: toCheck * checkTokens + 2 * (promptTokens + maxTokens),
      }
    },
    async run({ target, rng, planted }): Promise<ArmResult> {
      const [victim, observer] = target.tenants
      const tag = rng.int(0, 2 ** 31).toString(36)
      fields ??= await acceptedFields(target, victim, tag)
      const taken = planted.flatMap((p) => p.canaries)
      const [a, b] = [victim, observer].map((tenant) => {
        const canaries = makeCanaries(rng, numCanaries, taken)
        taken.push(...canaries)
        return { tenant, canaries, prompt: canaries.join(' '), id: `kvf-${tag}` }
      })
      const run = await runArm(target, 'colliding', a, b, fields.accepted)
      const judged = judgeRequestIds([run], fields)
      const findings: ArmFinding[] = judged.flatMap((finding): ArmFinding[] =>
        finding.verdict === 'leak'
          ? [
              {
                key: `leak:request-ids:${String(finding.evidence.sourceTenant)}->${String(finding.evidence.streamTenant)}`,
                finding,
              },
            ]
          : finding.verdict === 'warning'
            ? [
                {
                  key: `warning:request-ids:${finding.class ?? 'integrity'}:${String(finding.evidence.tenant)}`,
                  finding,
                },
              ]
            : [],
      )
      const mine: Planted[] = [a, b].map((s, i) => ({
        id: `request-ids-arm-${i}`,
        tenant: s.tenant,
        canaries: s.canaries,
        prompt: s.prompt,
      }))
      const observed: Observed[] = [run.first, run.second].map((s, i) => ({
        planted: mine[i],
        label: `request-ids arm, ${s.tenant.name}`,
        stream: true,
        result: s.result,
      }))
      // The pair's own crossings are the probe's findings above; here the cycle's material.
      const crossings = crossingFindings('request-ids', 'request-ids', observed, [
        ...planted,
        ...mine,
      ]).filter((c) => !findings.some((f) => f.key === c.key))
      const notes = judged.filter((f) => f.verdict === 'inconclusive').map((f) => f.title)
      return {
        findings: [...findings, ...crossings],
        numAnswered: [run.first, run.second].filter((s) => isAnsweredWhole(s.result)).length,
        ...(notes.length > 0 ? { notes } : {}),
      }
    },
  }
}
