/** Probe `request-ids`: client request ids colliding across tenants (sglang PR #19035, vLLM PR
 *  #27987) and stream events crossing between clients (LiteLLM#35023). Both tenants stream
 *  canary prompts at once, the second sent while the first is in flight, with the client id
 *  fields engines and gateways take (`rid`, `request_id`, `user`, the `X-Request-Id` header):
 *  1. `distinct`: each its own ids (the baseline; a crossing here is a relay mixing streams);
 *  2. `colliding`: the same ids for both;
 *  3. `colliding, first aborted`: the same ids, the first cut after two events; the second's
 *     answer must be the one it got in `distinct` (same prompt, temperature 0).
 *  Every event is checked (streams.ts) for the other stream's canary and id: a crossing is a
 *  `content-leak`; a 4xx/5xx only under collision is `availability`, and so is a hang there when
 *  the collision shows beyond it (a hang in each colliding arm, or the partner's stream carrying
 *  the hung request's tokens); a stream with more text events than `max_tokens` is `integrity`
 *  (another request's tokens in it), as is the second cut short when the first was aborted.
 *  Positive control: both requests of each arm in flight at once and answered.
 *  Knows the auditor's requests and streams.ts; knows nothing of how servers route ids. */
import { makeCanaries } from '../canaries.js'
import type { Probe } from '../probe.js'
import { inconclusiveRemediation } from '../probe.js'
import { createRng } from '../rng.js'
import { checkStreams, crossingEvidence, type StreamUnderCheck } from '../streams.js'
import { isAnsweredWhole, outcomeOf, type CompletionResult, type Target } from '../target.js'
import type { Finding, Tenant } from '../types.js'
import { materialPromptTokens } from '../plan.js'

/** `max_tokens` of every streamed request. */
export const maxTokens = 48
/** Canaries in each prompt: ~100 characters, so that prompt and answer fit the smallest pool
 *  (kvfence's character-level model counts a token a character) and every arm's prompts are
 *  alike in size (a refusal by size is never mistaken for one caused by a collision). */
export const numCanaries = 4

export type Arm = 'distinct' | 'colliding' | 'colliding, first aborted'
const arms: readonly Arm[] = ['distinct', 'colliding', 'colliding, first aborted']

/** One request of an arm: its tenant, material and result. */
export interface Sent {
  readonly tenant: Tenant
  readonly canaries: readonly string[]
  readonly result: CompletionResult
}

export interface ArmRun {
  readonly arm: Arm
  readonly first: Sent
  readonly second: Sent
  /** The second was sent while the first was still in flight. */
  readonly isOverlapped: boolean
}

/** The body fields that may carry a client request id (the `X-Request-Id` header always does). */
export const idBodyFields = ['rid', 'request_id', 'user'] as const
export type IdBodyField = (typeof idBodyFields)[number]

/** The body fields in `fields` and the header, each carrying `id`. */
export function idFields(
  id: string,
  fields: readonly IdBodyField[],
): { extraFields: Record<string, unknown>; headers: Record<string, string> } {
  return {
    extraFields: Object.fromEntries(fields.map((f) => [f, id])),
    headers: { 'x-request-id': id },
  }
}

/** Which id fields the endpoint takes: one short request with all of them; when it is refused
 *  (kvfence refuses client-chosen `rid` and `request_id`: they cannot collide), one with each
 *  alone. A refused field is safe from collisions and is left out of the arms. */
export async function acceptedFields(
  target: Target,
  tenant: Tenant,
  tag: string,
): Promise<{ accepted: IdBodyField[]; refused: IdBodyField[] }> {
  const ask = async (fields: readonly IdBodyField[]) => {
    const result = await target.complete({
      tenant,
      prompt: 'the river and the stone',
      maxTokens: 1,
      stream: false,
      // Sent to learn whether it is refused: a refusal is an answer here, not a failure.
      isValid: false,
      ...idFields(`kvf-${tag}-check-${fields.join('-')}`, fields),
    })
    return outcomeOf(result)
  }
  if ((await ask(idBodyFields)) !== 'rejected') return { accepted: [...idBodyFields], refused: [] }
  const accepted: IdBodyField[] = []
  for (const field of idBodyFields) if ((await ask([field])) === 'accepted') accepted.push(field)
  return { accepted, refused: idBodyFields.filter((f) => !accepted.includes(f)) }
}

export const requestIdsProbe: Probe = {
  name: 'request-ids',
  class: 'content-leak',
  // Layers beside and in front of the engine: no KV page is involved, no guard applies.
  controls: { aisvs: [], guards: [] },
  description:
    "both tenants stream canary prompts at once with distinct, then the same client request ids (rid, request_id, user, X-Request-Id), then the same with one aborted: another stream's canary or id in any event is a content-leak, a failure only under collision availability, a cut answer integrity",
  plan: () => [
    {
      what: 'id-field checks: all fields at once, then each alone when refused',
      numRequests: 1 + idBodyFields.length,
      tokensEach: 8,
    },
    {
      what: 'streamed requests, two per arm',
      numRequests: arms.length * 2,
      tokensEach: materialPromptTokens + maxTokens,
    },
  ],
  async run(target, _budget, context): Promise<Finding[]> {
    const [victim, observer] = target.tenants
    const rng = createRng(context.seed, 'request-ids')
    const taken: string[] = []
    const material = () => {
      const canaries = makeCanaries(rng, numCanaries, taken)
      taken.push(...canaries)
      return { canaries, prompt: canaries.join(' ') }
    }
    const observerMaterial = material()
    const fields = await acceptedFields(target, victim, rng.int(0, 2 ** 31).toString(36))
    const runs: ArmRun[] = []
    for (const arm of arms) {
      const tag = rng.int(0, 2 ** 31).toString(36)
      const ids =
        arm === 'distinct' ? [`kvf-${tag}-a`, `kvf-${tag}-b`] : [`kvf-${tag}`, `kvf-${tag}`]
      const first = { tenant: victim, ...material(), id: ids[0] }
      // The observer's prompt is the same in `distinct` and the aborted arm: its answers compare.
      const second = {
        tenant: observer,
        ...(arm === 'colliding' ? material() : observerMaterial),
        id: ids[1],
      }
      runs.push(await runArm(target, arm, first, second, fields.accepted))
    }
    context.log(
      runs
        .map(
          (r) =>
            `${r.arm}: HTTP ${r.first.result.status}/${r.second.result.status}${r.isOverlapped ? '' : ' (not overlapped)'}`,
        )
        .join('; '),
    )
    return judgeRequestIds(runs, fields)
  },
}

/** Runs one arm: `first` streams, `second` goes out once the first's first event arrived. */
export async function runArm(
  target: Target,
  arm: Arm,
  first: { tenant: Tenant; canaries: string[]; prompt: string; id: string },
  second: { tenant: Tenant; canaries: string[]; prompt: string; id: string },
  fields: readonly IdBodyField[],
): Promise<ArmRun> {
  let isFirstDone = false
  let onFirstByte = (): void => {}
  const firstByte = new Promise<void>((resolve) => (onFirstByte = resolve))
  const firstRequest = target
    .complete({
      tenant: first.tenant,
      prompt: first.prompt,
      maxTokens,
      stream: true,
      ...idFields(first.id, fields),
      ...(arm === 'colliding, first aborted' ? { abortAfterChunks: 2 } : {}),
      onFirstByte,
    })
    .finally(() => {
      isFirstDone = true
    })
  // The second goes out once the first is streaming (its first event arrived): admitted, with
  // its id registered wherever the endpoint keeps one.
  await Promise.race([firstByte, firstRequest])
  const isOverlapped = !isFirstDone
  const secondResult = await target.complete({
    tenant: second.tenant,
    prompt: second.prompt,
    maxTokens,
    stream: true,
    ...idFields(second.id, fields),
  })
  const firstResult = await firstRequest
  return {
    arm,
    isOverlapped,
    first: { tenant: first.tenant, canaries: first.canaries, result: firstResult },
    second: { tenant: second.tenant, canaries: second.canaries, result: secondResult },
  }
}

function streamsOf(run: ArmRun): StreamUnderCheck[] {
  return [run.first, run.second].map((s) => ({
    label: `${run.arm}: ${s.tenant.name}`,
    tenant: s.tenant.name,
    canaries: s.canaries,
    chunks: s.result.chunks ?? [{ id: s.result.responseId ?? null, text: s.result.text }],
  }))
}

export function judgeRequestIds(
  runs: readonly ArmRun[],
  fields: { readonly accepted: readonly IdBodyField[]; readonly refused: readonly IdBodyField[] },
): Finding[] {
  const findings: Finding[] = []
  const summary = {
    arms: runs.map((r) => ({
      arm: r.arm,
      statuses: [r.first.result.status, r.second.result.status],
      isOverlapped: r.isOverlapped,
      numChunks: [r.first.result.chunks?.length ?? 0, r.second.result.chunks?.length ?? 0],
    })),
    fieldsSent: [...fields.accepted, 'X-Request-Id'],
    fieldsRefused: fields.refused,
  }
  for (const run of runs) {
    const crossings = checkStreams(streamsOf(run))
    for (const c of crossings.slice(0, 2))
      findings.push({
        probe: 'request-ids',
        verdict: 'leak',
        severity: 'critical',
        title:
          run.arm === 'distinct'
            ? `stream event ${c.chunkIndex} of ${c.stream.tenant}'s answer carried ${c.kind === 'canary' ? `${c.source.tenant}'s canary` : `the id of ${c.source.tenant}'s stream`} (distinct request ids: streams crossed between clients)`
            : `with the same client request id for both tenants (${run.arm}), ${c.stream.tenant}'s stream event ${c.chunkIndex} carried ${c.kind === 'canary' ? `${c.source.tenant}'s canary` : `the id of ${c.source.tenant}'s stream`}: request ids collide across tenants`,
        evidence: {
          arm: run.arm,
          requestNumber: (c.stream.tenant === run.first.tenant.name ? run.first : run.second).result
            .requestNumber,
          ...crossingEvidence(c),
          ...summary,
        },
        remediation:
          'Scope every client-supplied request id (rid, request_id, user, X-Request-Id) by tenant, or replace it with a server-generated one; bind each stream to the connection that opened it, and never hand one upstream stream to two clients.',
      })
  }
  if (findings.length > 0) return findings
  const harms = collisionHarms(runs, summary)
  return harms.length > 0 ? harms : controlFinding(runs, summary)
}

/** Events of a stream that carried text: one per token on every engine seen (an engine may send
 *  fewer, never more), so more than `max_tokens` of them is another request's tokens. */
export function numTextEvents(result: CompletionResult): number {
  return (result.chunks ?? []).filter((c) => c.text !== '').length
}

/** Availability and integrity harms of a collision, judged against the `distinct` arm. */
function collisionHarms(runs: readonly ArmRun[], summary: Record<string, unknown>): Finding[] {
  const out: Finding[] = overlongStreams(runs, summary)
  const base = runs.find((r) => r.arm === 'distinct')
  if (
    base === undefined ||
    !isAnsweredWhole(base.first.result) ||
    !isAnsweredWhole(base.second.result)
  )
    return out
  const colliding = runs.find((r) => r.arm === 'colliding')
  const aborted = runs.find((r) => r.arm === 'colliding, first aborted')
  // Refused or failed with an HTTP status (no 2xx) in either colliding arm, where the distinct
  // arm was answered: the collision's availability harm. A request with no status at all (a
  // client-side timeout) counts only where the collision shows in more than that one failure:
  // a hang in each colliding arm, or its partner's stream carrying more than its own tokens (the
  // hung request's tokens went there). One hang alone can happen for any reason: could not tell.
  const isRefused = (s: Sent) => s.result.status !== null && s.result.status >= 300
  const isHung = (s: Sent) => s.result.status === null && s.result.failure !== 'aborted'
  const candidates = [
    ...(colliding === undefined || !colliding.isOverlapped
      ? []
      : [colliding.first, colliding.second]),
    ...(aborted === undefined || !aborted.isOverlapped ? [] : [aborted.second]),
  ]
  const hung = candidates.filter(isHung)
  const armsHung = new Set(
    runs.filter((r) => r.arm !== 'distinct' && [r.first, r.second].some((s) => hung.includes(s))),
  )
  const partnerOverlong = runs.some(
    (r) =>
      armsHung.has(r) &&
      [r.first, r.second].some((s) => !hung.includes(s) && numTextEvents(s.result) > maxTokens),
  )
  const isCollisionHang = armsHung.size > 1 || partnerOverlong
  const failed = candidates.filter((s) => isRefused(s) || (isCollisionHang && hung.includes(s)))
  const failedTenants = [...new Set(failed.map((s) => s.tenant.name))]
  if (failed.length > 0)
    out.push({
      probe: 'request-ids',
      verdict: 'warning',
      class: 'availability',
      severity: 'high',
      title: `a request failing only under an id collision: with the same client request id (${(summary.fieldsSent as string[]).join(', ')}) as another tenant's request in flight, ${failedTenants.map((name) => `${name}'s request got ${[...new Set(failed.filter((s) => s.tenant.name === name).map((s) => statusText(s.result)))].join(', ')}`).join(' and ')}; with distinct ids both were answered`,
      evidence: {
        failed: failed.map((s) => ({
          tenant: s.tenant.name,
          requestNumber: s.result.requestNumber,
          status: s.result.status,
          failure: s.result.failure,
          errorCode: s.result.errorCode,
        })),
        ...summary,
      },
      remediation:
        "Scope client request ids by tenant: one tenant must not be able to make another tenant's request fail by reusing its id.",
    })
  const before = base.second.result.text
  const after = aborted?.second
  if (
    after !== undefined &&
    isOk(after) &&
    (!isAnsweredWhole(after.result) ||
      (after.result.text.length < before.length && before.startsWith(after.result.text)))
  )
    out.push({
      probe: 'request-ids',
      verdict: 'warning',
      class: 'integrity',
      severity: 'high',
      title: `aborting ${aborted!.first.tenant.name}'s request cut ${after.tenant.name}'s request with the same client request id (${after.result.failure === null ? `${after.result.text.length} of ${before.length} characters` : `HTTP ${after.result.status}, ${after.result.failure}`})`,
      evidence: {
        arm: 'colliding, first aborted',
        charsWithDistinctIds: before.length,
        charsAfterAbort: after.result.text.length,
        status: after.result.status,
        ...summary,
      },
      remediation:
        "Abort by the server's own request id, scoped to the tenant that sent it: a client id another tenant reuses must never cancel that tenant's request.",
    })
  return out
}

/** A stream with more text events than `max_tokens` allows: another request's tokens in it. */
function overlongStreams(runs: readonly ArmRun[], summary: Record<string, unknown>): Finding[] {
  return runs.flatMap((run) =>
    [run.first, run.second]
      .filter((s) => numTextEvents(s.result) > maxTokens)
      .map((s): Finding => {
        const other = s === run.first ? run.second : run.first
        return {
          probe: 'request-ids',
          verdict: 'warning',
          class: 'integrity',
          severity: 'high',
          title: `${s.tenant.name}'s stream carried ${numTextEvents(s.result)} text events for max_tokens ${maxTokens} (${run.arm === 'distinct' ? 'distinct request ids' : `the same client request id (${(summary.fieldsSent as string[]).join(', ')}) as ${other.tenant.name}'s request in flight`}): another request's tokens in its stream`,
          evidence: {
            arm: run.arm,
            tenant: s.tenant.name,
            requestNumber: s.result.requestNumber,
            numTextEvents: numTextEvents(s.result),
            maxTokens,
            otherTenant: other.tenant.name,
            otherStatus: other.result.status,
            otherFailure: other.result.failure,
            ...summary,
          },
          remediation:
            "Scope every client-supplied request id by tenant, or replace it with a server-generated one: one request id must never name two requests, and each stream must carry only its own request's tokens.",
        }
      }),
  )
}

/** What an arm lacked for its collision to count as exercised. */
function lacked(run: ArmRun): string {
  if (!run.isOverlapped) return `${run.arm}: the first ended before the second began`
  const missing = [run.first, run.second].filter(
    (s) =>
      !isAnsweredWhole(s.result) && !(run.arm === 'colliding, first aborted' && s === run.first),
  )
  return `${run.arm}: both in flight, ${missing.map((s) => `${s.tenant.name}'s request not answered (${statusText(s.result)})`).join(', ')}`
}

/** A 2xx answer began (whole or cut short later). */
function isOk(s: Sent): boolean {
  return s.result.status !== null && s.result.status >= 200 && s.result.status < 300
}

/** `HTTP 200`, or the failure of a request that got no status (`timeout`). */
function statusText(result: Sent['result']): string {
  return result.status === null ? (result.failure ?? 'no answer') : `HTTP ${result.status}`
}

function controlFinding(runs: readonly ArmRun[], summary: Record<string, unknown>): Finding[] {
  const missing = runs.filter(
    (r) =>
      !r.isOverlapped ||
      !isAnsweredWhole(r.second.result) ||
      (r.arm !== 'colliding, first aborted' && !isAnsweredWhole(r.first.result)),
  )
  if (missing.length > 0)
    return [
      {
        probe: 'request-ids',
        verdict: 'inconclusive',
        severity: 'info',
        title: `could not tell whether the same client request id harms another tenant's request (${missing.map(lacked).join('; ')}): one failure alone can have any cause, and no other harm of the collision was seen`,
        evidence: summary,
        remediation: inconclusiveRemediation,
      },
    ]
  return [
    {
      probe: 'request-ids',
      verdict: 'clean',
      severity: 'info',
      title: `both tenants' streams, in flight at once with distinct and with the same client request ids (${(summary.fieldsSent as string[]).join(', ')}; and with one aborted), carried only their own material in every event${(summary.fieldsRefused as string[]).length > 0 ? `; refused by the endpoint (so they cannot collide): ${(summary.fieldsRefused as string[]).join(', ')}` : ''}`,
      evidence: summary,
      remediation: 'None needed.',
    },
  ]
}
