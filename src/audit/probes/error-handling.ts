/** Probe `error-handling`: over-length and malformed requests must be refused with a 4xx (or a
 *  documented in-stream error event), never answered 200 with an error text in place of content
 *  (clients, caches and gateways then take the error, or worse, the text around it, as a valid
 *  completion; sglang#33507 answered an aborted request 200 with finish_reason "length").
 *  Sends a handful of requests, one per case.
 *  Engines legitimately differ from OpenAI where no tenant is harmed, and that is not judged:
 *  llama.cpp reads a negative `max_tokens` as "no limit" and a wrongly typed one as its default
 *  (those two cases are streamed and cut after their first event, so no engine generates for
 *  long), and answers a body it cannot parse with a 500 carrying an error object (a refusal:
 *  nothing was generated, noted beside the verdict). */
import { runUntilExhausted } from '../budget.js'
import type { Probe, ProbeContext } from '../probe.js'
import { inconclusiveRemediation, rejectionRemediation } from '../probe.js'
import { fillerText } from '../sizer.js'
import {
  outcomeOf,
  tryJson,
  type CompletionResult,
  type HttpResult,
  type Target,
} from '../target.js'
import type { Finding, Severity } from '../types.js'

interface Case {
  readonly name: string
  readonly body: string
  /** A 200 with normal content is tolerated (e.g. max_tokens clamped to what fits). */
  readonly isAcceptTolerated: boolean
  /** Severity when a 200 with content comes back. */
  readonly acceptSeverity: Severity
  /** A malformed body: a 5xx carrying an error object is a refusal too (llama.cpp answers a body
   *  it cannot parse so); elsewhere a 5xx says nothing. */
  readonly isMalformed: boolean
  /** Streamed and cut after its first event: an engine that reads the value as "no limit" must
   *  not generate to its context's end. */
  readonly isCutEarly?: boolean
}

type Result =
  | 'rejected'
  | 'rejected-5xx'
  | 'in-stream-error'
  | 'accepted'
  | 'error-as-200'
  | 'server-error'
  | 'no-answer'

/** A completion text that is an error message: it opens like one, or names the context limit. A
 *  model's own words may contain "error" anywhere, so only these count. */
const errorText =
  /^\s*(error|exception|traceback|invalid|bad request)\b|maximum context length|context length exceeded|exceeds the (available|maximum) context/i

export const errorHandlingProbe: Probe = {
  name: 'error-handling',
  description:
    'malformed JSON, a missing prompt, bad max_tokens and over-length prompts must get a 4xx, never a 200 carrying an error text',
  class: 'error-handling',
  controls: { aisvs: [], guards: ['G2'] },
  plan: ({ poolTokens, contextTokens, isAggressive }) => {
    const sizes = [poolTokens, contextTokens].filter((n) => n !== null)
    const limit = sizes.length === 0 ? null : Math.min(...sizes)
    const overMaxTokens = overContextMaxTokens(limit, isAggressive)
    return [
      { what: 'valid control', numRequests: 1, tokensEach: 3 },
      { what: 'malformed requests', numRequests: 4, tokensEach: 6 },
      // Refused when the endpoint validates; generated to the end when it does not: priced at
      // every token it asks for.
      {
        what: 'max_tokens over the context',
        numRequests: overMaxTokens === null ? 0 : 1,
        tokensEach: (overMaxTokens ?? 0) + 2,
      },
      {
        what: 'prompt twice the limit',
        numRequests: limit === null ? 0 : 1,
        tokensEach: limit === null ? 0 : 2 * limit + 2,
      },
    ]
  },
  async run(target, _budget, context): Promise<Finding[]> {
    const { cases, notSent } = planCases(target.model, context)
    const sent = await sendCases(target, cases)
    context.log(
      sent.results.length === 0
        ? `no invalid request sent (${sent.stoppedBy ?? 'the control was not answered'})`
        : sent.results.map((r) => `${r.case}: ${r.status ?? 'none'} ${r.result}`).join('; '),
    )
    return judge(cases, notSent, sent)
  },
}

/** The invalid requests to send, from what is known of the limits, and what is not sent (and
 *  why: a clean verdict names it). */
function planCases(
  modelName: string | null,
  context: ProbeContext,
): { cases: Case[]; notSent: string[] } {
  const { contextTokens, poolTokens } = context.discovery
  const model = modelName === null ? {} : { model: modelName }
  const json = (o: Record<string, unknown>) => JSON.stringify({ ...model, ...o })
  const known = [contextTokens, poolTokens].filter((n) => n !== null)
  const limit = known.length === 0 ? null : Math.min(...known)
  const overMaxTokens = overContextMaxTokens(limit, context.isAggressive === true)
  const cases: Case[] = [
    {
      name: 'malformed JSON',
      body: `{"prompt": "hello", "max_tokens": `,
      isAcceptTolerated: false,
      acceptSeverity: 'low',
      isMalformed: true,
    },
    {
      name: 'missing prompt',
      body: json({ max_tokens: 4 }),
      isAcceptTolerated: false,
      acceptSeverity: 'low',
      isMalformed: true,
    },
    // A value an engine may read its own way (llama.cpp: no limit, or its default): a normal
    // answer is tolerated; an error text in a 200 is not.
    {
      name: 'negative max_tokens',
      body: json({ prompt: 'hello', max_tokens: -1, stream: true }),
      isAcceptTolerated: true,
      acceptSeverity: 'info',
      isMalformed: true,
      isCutEarly: true,
    },
    {
      name: 'max_tokens not a number',
      body: json({ prompt: 'hello', max_tokens: 'many', stream: true }),
      isAcceptTolerated: true,
      acceptSeverity: 'info',
      isMalformed: true,
      isCutEarly: true,
    },
  ]
  if (overMaxTokens !== null) {
    cases.push({
      name: 'max_tokens over the context',
      body: json({ prompt: 'hello', max_tokens: overMaxTokens }),
      isAcceptTolerated: true,
      acceptSeverity: 'info',
      isMalformed: false,
    })
  }
  const notSent =
    overMaxTokens === null
      ? [
          'max_tokens over the context (no context window known: an engine that does not validate max_tokens would generate it all; give --context-window, or --aggressive)',
        ]
      : []
  if (limit !== null) {
    // Every filler word costs at least one token, so 2 × limit words are over the limit.
    cases.push({
      name: 'prompt twice the limit',
      body: json({ prompt: fillerText(2 * limit), max_tokens: 1 }),
      isAcceptTolerated: false,
      acceptSeverity: 'high',
      isMalformed: false,
    })
  }
  return { cases, notSent }
}

/** What the invalid requests got, after the valid control. */
interface Sent {
  readonly results: readonly CaseResult[]
  readonly control: CompletionResult | null
  readonly isControlAccepted: boolean
  readonly stoppedBy: string | null
}

interface CaseResult {
  readonly case: string
  readonly status: number | null
  readonly result: Result
  readonly detail: string | null
}

/** Sends the valid control (a valid request must be answered, else a 5xx says nothing about
 *  validation), then every case, as the last tenant. */
async function sendCases(target: Target, cases: readonly Case[]): Promise<Sent> {
  const tenant = target.tenants[target.tenants.length - 1]
  const results: CaseResult[] = []
  let control: CompletionResult | null = null
  const stoppedBy = await runUntilExhausted(async () => {
    control = await target.complete({ tenant, prompt: 'hello', maxTokens: 1, stream: false })
    for (const c of cases) {
      const http = await target.postRaw('/v1/completions', c.body, 'application/json', {
        tenant,
        ...(c.isCutEarly ? { abortAfterChunks: 1 } : {}),
      })
      const result = classify(http, c.isMalformed)
      results.push({
        case: c.name,
        status: http.status,
        result,
        detail: detailOf(http, result, target.scrub),
      })
    }
  })
  const answered = control as CompletionResult | null
  const isControlAccepted = answered !== null && outcomeOf(answered) === 'accepted'
  return { results, control: answered, isControlAccepted, stoppedBy }
}

/** The findings: a warning per kind of mishandling seen; else clean when the control was
 *  answered and every case was refused, inconclusive when not. */
function judge(cases: readonly Case[], notSent: readonly string[], sent: Sent): Finding[] {
  const { results, isControlAccepted, stoppedBy } = sent
  const controlAnswer = sent.control === null ? null : describeAnswer(sent.control)
  const evidence = {
    isControlAccepted,
    control: controlAnswer,
    cases: results,
    notSent,
    stoppedBy,
  }
  const findings = mishandlings(cases, results, isControlAccepted, evidence)
  if (findings.length > 0) return findings
  const refusedBy5xx = results.filter((r) => r.result === 'rejected-5xx')
  const numUnusable = results.filter(
    (r) => r.result === 'no-answer' || r.result === 'server-error',
  ).length
  if (!isControlAccepted || results.length < cases.length || numUnusable > 0) {
    return [
      {
        probe: 'error-handling',
        verdict: 'inconclusive',
        severity: 'low',
        title: isControlAccepted
          ? `${numUnusable + cases.length - results.length} of ${cases.length} invalid requests got no usable answer`
          : controlAnswer === null
            ? `not run: ${stoppedBy ?? 'no request could be sent'} before the valid control request was sent`
            : `the valid control request was not answered (${controlAnswer}), so answers to invalid ones would prove nothing`,
        evidence,
        remediation: inconclusiveRemediation,
      },
    ]
  }
  return [
    {
      probe: 'error-handling',
      verdict: 'clean',
      severity: 'info',
      title:
        `refused all ${cases.length} invalid requests with a 4xx (or clamped max_tokens)` +
        (refusedBy5xx.length === 0
          ? ''
          : `; refused with a 5xx and an error object instead of a 4xx: ${refusedBy5xx.map((r) => r.case).join(', ')}`) +
        (notSent.length === 0 ? '' : `; not sent: ${notSent.join('; ')}`),
      evidence,
      remediation: 'None needed.',
    },
  ]
}

/** A warning for each kind of mishandling: an error text in a 200, an invalid request accepted
 *  (not tolerated), a server error (only when the valid control was answered). */
function mishandlings(
  cases: readonly Case[],
  results: readonly CaseResult[],
  isControlAccepted: boolean,
  evidence: Record<string, unknown>,
): Finding[] {
  const findings: Finding[] = []
  const as200 = results.filter((r) => r.result === 'error-as-200')
  if (as200.length > 0) {
    findings.push({
      probe: 'error-handling',
      verdict: 'warning',
      severity: 'medium',
      title: `answered 200 with an error text instead of a 4xx: ${as200.map((r) => r.case).join(', ')}`,
      evidence,
      remediation:
        'Return errors with a 4xx status and the OpenAI error shape ({"error": {message, type, ' +
        'code}}), or in a stream as an explicit error event; never as a 200 completion.',
    })
  }
  const accepted = results.filter((r) => r.result === 'accepted')
  const worst = accepted
    .map((r) => cases.find((c) => c.name === r.case) as Case)
    .filter((c) => !c.isAcceptTolerated)
  if (worst.length > 0) {
    const isOverLength = worst.some((c) => c.acceptSeverity === 'high')
    findings.push({
      probe: 'error-handling',
      verdict: 'warning',
      severity: isOverLength ? 'high' : 'low',
      title: `accepted invalid requests with a 200: ${worst.map((c) => c.name).join(', ')}`,
      evidence,
      remediation: isOverLength
        ? rejectionRemediation
        : 'Validate request bodies at the boundary and refuse invalid ones with 400 invalid_request_error.',
    })
  }
  const serverErrors = results.filter((r) => r.result === 'server-error')
  if (serverErrors.length > 0 && isControlAccepted) {
    findings.push({
      probe: 'error-handling',
      verdict: 'warning',
      severity: 'low',
      title: `answered invalid requests with a server error instead of a 4xx: ${serverErrors.map((r) => r.case).join(', ')}`,
      evidence,
      remediation:
        'Validate requests before they reach the engine; a 5xx hides a client error and gets retried.',
    })
  }
  return findings
}

const notARejection = new Set([401, 403, 404, 408, 429])

/** `max_tokens` past the context, for the case that checks it is validated: one token past the
 *  smallest limit known (an engine that does not validate generates at most that many, a bounded
 *  cost); with no limit known, none under the default options (an engine that does not validate
 *  would generate until it wedged: `transformers serve` kept generating `max_tokens: 10000000`
 *  after the client left, and hung), and with `--aggressive` 2^20 + 1, past every context served
 *  today. */
export function overContextMaxTokens(limit: number | null, isAggressive: boolean): number | null {
  if (limit !== null) return limit + 1
  return isAggressive ? 2 ** 20 + 1 : null
}

/** `HTTP 503 capacity_exhausted`, `timeout`, `network (ECONNRESET)`: what a completion got. */
function describeAnswer(result: CompletionResult): string {
  if (result.status === null)
    return result.failure === 'timeout'
      ? 'no answer before its time limit'
      : (result.failure ?? 'no answer')
  const code = result.errorCode === null ? '' : ` ${result.errorCode}`
  const failure = result.failure === null ? '' : ` (${result.failure})`
  return `HTTP ${result.status}${code}${failure}`
}

/** What became of one invalid request. A 5xx carrying an error object refuses a malformed body
 *  (`isMalformed`); any other 5xx tells nothing. A cut stream keeps what arrived before the cut. */
function classify(http: HttpResult, isMalformed: boolean): Result {
  const { status } = http
  if (status === null) return 'no-answer'
  if (status >= 500)
    return isMalformed && status !== 503 && isErrorObject(tryJson(http.body))
      ? 'rejected-5xx'
      : 'server-error'
  if (status >= 400) return notARejection.has(status) ? 'no-answer' : 'rejected'
  const json = tryJson(http.body)
  if (json !== null && typeof json === 'object') {
    const o = json as Record<string, unknown>
    if (isErrorObject(o)) return 'error-as-200'
    const choices = Array.isArray(o.choices) ? (o.choices as Record<string, unknown>[]) : []
    const text = choices.map((c) => String(c?.text ?? '')).join('')
    return errorText.test(text) ? 'error-as-200' : 'accepted'
  }
  // Server-sent events: an error event is the documented in-stream refusal.
  const events = http.body
    .split(/\r?\n/)
    .filter((line) => line.startsWith('data:'))
    .map((line) => tryJson(line.slice(5).trim()))
  if (events.some(isErrorObject)) return 'in-stream-error'
  const text = events.map(eventText).join('')
  return errorText.test(events.length > 0 ? text : http.body) ? 'error-as-200' : 'accepted'
}

/** The text a streamed completion event carries (`choices[].text` or `.delta.content`). */
function eventText(event: unknown): string {
  if (event === null || typeof event !== 'object') return ''
  const choices = (event as Record<string, unknown>).choices
  if (!Array.isArray(choices)) return ''
  return choices
    .map((c: unknown) => {
      const choice = (c ?? {}) as { text?: unknown; delta?: { content?: unknown } }
      const text = choice.text ?? choice.delta?.content
      return typeof text === 'string' ? text : ''
    })
    .join('')
}

/** An error body: OpenAI's `{error: {...}}` (or a string), vLLM's `{object: "error"}`; an
 *  `error` field that is null (some servers send one with every answer) is not one. */
function isErrorObject(json: unknown): boolean {
  if (json === null || typeof json !== 'object') return false
  const o = json as Record<string, unknown>
  return (o.error !== undefined && o.error !== null) || o.object === 'error'
}

/** What the error said (for `error-as-200`), keys scrubbed, at most 120 characters. */
function detailOf(http: HttpResult, result: Result, scrub: (t: string) => string): string | null {
  if (result !== 'error-as-200' && result !== 'server-error' && result !== 'rejected-5xx')
    return null
  return scrub(http.body).slice(0, 120)
}
