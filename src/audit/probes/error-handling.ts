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
import type { Probe } from '../probe.js'
import { inconclusiveRemediation, rejectionRemediation } from '../probe.js'
import { fillerText } from '../sizer.js'
import { outcomeOf, tryJson, type CompletionResult, type HttpResult } from '../target.js'
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
  plan: ({ poolTokens, contextTokens }) => {
    const sizes = [poolTokens, contextTokens].filter((n) => n !== null)
    const limit = sizes.length === 0 ? null : Math.min(...sizes)
    return [
      { what: 'valid control', numRequests: 1, tokensEach: 3 },
      { what: 'malformed requests', numRequests: 4, tokensEach: 6 },
      // Refused when the endpoint validates; generated to the end when it does not.
      { what: 'max_tokens over the context', numRequests: 1, tokensEach: (limit ?? 0) + 1002 },
      {
        what: 'prompt twice the limit',
        numRequests: limit === null ? 0 : 1,
        tokensEach: limit === null ? 0 : 2 * limit + 2,
      },
    ]
  },
  async run(target, _budget, context): Promise<Finding[]> {
    const tenant = target.tenants[target.tenants.length - 1]
    const { contextTokens, poolTokens } = context.discovery
    const model = target.model === null ? {} : { model: target.model }
    const json = (o: Record<string, unknown>) => JSON.stringify({ ...model, ...o })
    const limit = Math.min(...[contextTokens, poolTokens].filter((n) => n !== null), 1_000_000)
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
      {
        name: 'max_tokens over the context',
        body: json({
          prompt: 'hello',
          max_tokens: limit === 1_000_000 ? 10_000_000 : limit + 1000,
        }),
        isAcceptTolerated: true,
        acceptSeverity: 'info',
        isMalformed: false,
      },
    ]
    if (limit < 1_000_000) {
      // Every filler word costs at least one token, so 2 × limit words are over the limit.
      cases.push({
        name: 'prompt twice the limit',
        body: json({ prompt: fillerText(2 * limit), max_tokens: 1 }),
        isAcceptTolerated: false,
        acceptSeverity: 'high',
        isMalformed: false,
      })
    }

    const results: {
      case: string
      status: number | null
      result: Result
      detail: string | null
    }[] = []
    let isControlAccepted = false
    let control: CompletionResult | null = null
    const stoppedBy = await runUntilExhausted(async () => {
      // Control: a valid request must be answered, else a 5xx says nothing about validation.
      control = await target.complete({
        tenant,
        prompt: 'hello',
        maxTokens: 1,
        stream: false,
      })
      isControlAccepted = outcomeOf(control) === 'accepted'
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
    context.log(
      results.length === 0
        ? `no invalid request sent (${stoppedBy ?? 'the control was not answered'})`
        : results.map((r) => `${r.case}: ${r.status ?? 'none'} ${r.result}`).join('; '),
    )
    const controlAnswer = control === null ? null : describeAnswer(control)
    const evidence = { isControlAccepted, control: controlAnswer, cases: results, stoppedBy }

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
    if (findings.length > 0) return findings
    const refusedBy5xx = results.filter((r) => r.result === 'rejected-5xx')
    if (
      !isControlAccepted ||
      results.length < cases.length ||
      results.some((r) => r.result === 'no-answer' || r.result === 'server-error')
    ) {
      return [
        {
          probe: 'error-handling',
          verdict: 'inconclusive',
          severity: 'low',
          title: isControlAccepted
            ? `${results.filter((r) => r.result === 'no-answer' || r.result === 'server-error').length + cases.length - results.length} of ${cases.length} invalid requests got no usable answer`
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
            : `; refused with a 5xx and an error object instead of a 4xx: ${refusedBy5xx.map((r) => r.case).join(', ')}`),
        evidence,
        remediation: 'None needed.',
      },
    ]
  },
}

const notARejection = new Set([401, 403, 404, 408, 429])

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
