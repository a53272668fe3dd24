/** The `near-duplicates` probe's cheap arm for the watch's rotation (rotation.ts): A sends a
 *  prompt of a few sentences with its canary and repeats it exactly (the positive control: a
 *  cache in front of the engine hits for A's own repeat), then B sends one near-duplicate holding
 *  none of A's canary, the probe's next in turn each run (recased; recased with whitespace
 *  changed; sentences reordered; …). Judged by the probe's own `judgeNearDuplicates`, and every
 *  answer checked for the cycle's plant and looks: A's canary or A's answer (its id and text) in
 *  B's answer is `leak:near-duplicates:<A>-><B>`.
 *  Knows the probe's prompts and judge; knows nothing of how a cache keys its entries. */
import { makeCanaries } from '../../canaries.js'
import type { Observed, Planted } from '../../probes/material.js'
import {
  answerMaxTokens,
  judgeNearDuplicates,
  nearDuplicates,
  victimPrompt,
} from '../../probes/near-duplicates.js'
import type { CompletionResult } from '../../target.js'
import type { Tenant } from '../../types.js'
import { crossingFindings, type ArmFinding, type ArmResult, type RotationArm } from './arm.js'

/** Characters of A's prompt and of any near-duplicate at most (a token is at least one of
 *  them): the probe's victim prompt is 16 filler words of at most 11 characters, a canary of at
 *  most 24, 16 spaces and 4 periods (220); a near-duplicate doubles the spaces (236) or adds a
 *  word (226). A property test checks it (test/audit/watch-arms.test.ts). */
export const nearArmPromptChars = 240
/** A's prompt, its repeat and one near-duplicate of B. */
const numRequests = 3

/** A fresh arm: its first run sends the probe's first near-duplicate. */
export function createNearDuplicateArm(): RotationArm {
  let turn = 0
  return {
    name: 'near-duplicate',
    probe: 'near-duplicates',
    description: `near-duplicates' cheap arm: A sends a canary prompt and repeats it (the control), B sends one near-duplicate without A's canary (the probe's next in turn)`,
    cost() {
      return {
        requests: numRequests,
        tokens: numRequests * (nearArmPromptChars + 4 + answerMaxTokens),
      }
    },
    async run({ target, rng, planted }): Promise<ArmResult> {
      const [victim, observer] = target.tenants
      const taken = planted.flatMap((p) => p.canaries)
      const [canary, ownCanary] = makeCanaries(rng, 2, taken)
      const prompt = victimPrompt(rng, canary)
      const duplicates = nearDuplicates(prompt, canary, ownCanary)
      const duplicate = duplicates[turn++ % duplicates.length]
      const send = (tenant: Tenant, p: string) =>
        target.complete({ tenant, prompt: p, maxTokens: answerMaxTokens, stream: false })
      const first = await send(victim, prompt)
      const repeat = await send(victim, prompt)
      const result = await send(observer, duplicate.prompt)
      const judged = judgeNearDuplicates({
        victim,
        observer,
        canary,
        first,
        repeat,
        answers: [{ duplicate, result }],
      })
      const findings: ArmFinding[] = judged
        .filter((f) => f.verdict === 'leak')
        .map((finding) => ({
          key: `leak:near-duplicates:${victim.name}->${observer.name}`,
          finding,
        }))
      const mine: Planted[] = [
        { id: 'near-arm-A', tenant: victim, canaries: [canary], prompt },
        { id: 'near-arm-B', tenant: observer, canaries: [ownCanary], prompt: duplicate.prompt },
      ]
      const observed = (p: Planted, r: CompletionResult, label: string): Observed => ({
        planted: p,
        label,
        stream: false,
        result: r,
      })
      // A's own canary in B's answer is the probe's finding above; here the cycle's material.
      const crossings = crossingFindings(
        'near-duplicates',
        'near-duplicate',
        [
          observed(mine[0], first, 'near-duplicate arm, A'),
          observed(mine[0], repeat, 'near-duplicate arm, A repeat'),
          observed(mine[1], result, `near-duplicate arm, B (${duplicate.label})`),
        ],
        [...planted, ...mine],
      ).filter((c) => !findings.some((f) => f.key === c.key))
      const notes = judged.filter((f) => f.verdict === 'inconclusive').map((f) => f.title)
      return {
        findings: [...findings, ...crossings],
        numAnswered: [first, repeat, result].filter((r) => r.status === 200).length,
        ...(notes.length > 0 ? { notes } : {}),
      }
    },
  }
}
