/** The audit's gates. The CI gate (`--fail-on`): which findings fail the run, by class, severity,
 *  tag or verdict. The answer gate: an audit in which the target answered no valid completion whole audited
 *  nothing, and must end as a tool error (exit 2), never as "no leak observed". Also what the
 *  audit concludes from every probe's requests together: valid requests that failed, and a
 *  `/health` that said all was well meanwhile (availability findings).
 *  Knows the ledger's counts, discovery's model list and how to send one plain completion;
 *  knows nothing of how probes judge answers. */
import { BudgetExhaustedError, type Budget } from './budget.js'
import type { Discovery } from './discovery.js'
import { cutAtDeadline, fateOf, type AnswerSummary, type Ledger } from './ledger.js'
import type { CompletionResult, HttpResult, Target } from './target.js'
import { findingClasses, findingTags, severityRank, withClass } from './classes.js'
import type { FindingClass, FindingTag } from './classes.js'
import { AuditError, verdictRank, type Finding, type Severity, type Verdict } from './types.js'

/** Statuses that say the endpoint does not serve `POST /v1/completions` at all, whatever its
 *  load: 404 (no such path, or no such model), 405 (method not allowed), 501 (not implemented: a
 *  static file server). A warming, slow or overloaded endpoint answers 503, 429, 5xx or nothing
 *  in time instead, and those never count. */
const notServedStatuses: ReadonlySet<number> = new Set([404, 405, 501])

/** How many valid completions, all not served (see {@link NoAnswerWatch}), end the audit early. */
export const notServedLimit = 6

/** Whether one completion shows the endpoint serves completions (`served`: any HTTP answer but
 *  404/405/501), shows it does not (`not-served`: one of those, or a connection refused), or
 *  tells neither (`neither`: a timeout, a reset, a cut by the auditor before any answer). */
export function servedSignOf(result: CompletionResult): 'served' | 'not-served' | 'neither' {
  if (result.status !== null) return notServedStatuses.has(result.status) ? 'not-served' : 'served'
  return result.failure === 'network' && result.failureDetail === 'ECONNREFUSED'
    ? 'not-served'
    : 'neither'
}

/** Decides early that a target will answer no completion, so that a static file server, a wrong
 *  path prefix or a closed port ends the audit after a few requests instead of after every
 *  probe's. The rule: the first {@link notServedLimit} valid completions that told anything were
 *  all not served, and no completion of this run, valid or not, was served. Any other answer
 *  (a 200, a 400, a 429, a 503, a 500) turns the watch off for the rest of the run, and timeouts
 *  count for nothing, so an endpoint that is slow, warming up or shedding load is never cut
 *  short. One per audit run; feed it every completion as it ends. */
export class NoAnswerWatch {
  private numNotServed = 0
  private isServed = false

  /** Takes one completion of this run; true when this one makes the rule hold (once). */
  observe(isValid: boolean, result: CompletionResult): boolean {
    if (this.isServed || this.numNotServed >= notServedLimit) return false
    const sign = servedSignOf(result)
    if (sign === 'served') this.isServed = true
    if (sign !== 'not-served' || !isValid) return false
    this.numNotServed++
    return this.numNotServed === notServedLimit
  }
}

/** The one completion the audit sends of its own to see that the target answers: a short prompt
 *  any model takes, 4 tokens at most, not streamed. */
const checkPrompt = 'Reply with one word: is this endpoint answering?'
const checkMaxTokens = 4
/** The check's tokens at most, for `--plan`: its 8 words at up to 2 tokens each, plus the
 *  beginning-of-sequence token and `max_tokens`. */
export const answerCheckTokens = 2 * 8 + 1 + checkMaxTokens

/** Sends the check completion as the first tenant (valid; counted in the ledger under no probe).
 *  Null when the budget allows no request. */
export async function sendAnswerCheck(target: Target): Promise<CompletionResult | null> {
  try {
    return await target.complete({
      tenant: target.tenants[0],
      prompt: checkPrompt,
      maxTokens: checkMaxTokens,
      stream: false,
    })
  } catch (err) {
    if (err instanceof BudgetExhaustedError) return null
    throw err
  }
}

/** `--model` names a model `/v1/models` does not list: one check completion decides, before any
 *  probe spends the budget on requests that all get 404. Answered whole: the model is served
 *  under a name the list omits (a gateway's alias), and the audit goes on. Otherwise throws
 *  `AuditError('model_not_served')`. Nothing is sent when the model is listed, when none was
 *  given, or when the target lists none (many gateways do not serve `/v1/models`). */
export async function checkModelServed(
  target: Target,
  discovery: Discovery,
  requestedModel: string | null,
): Promise<void> {
  const listed = discovery.modelsListed
  if (requestedModel === null || listed.length === 0 || listed.includes(requestedModel)) return
  const result = await sendAnswerCheck(target)
  if (result === null || fateOf(result, false) === 'answered') return
  const answer =
    result.status === null
      ? (result.failure ?? 'no answer')
      : `HTTP ${result.status}${result.errorCode === null ? '' : ` (${result.errorCode})`}`
  throw new AuditError(
    'model_not_served',
    `model ${JSON.stringify(requestedModel)} is not served by ${target.baseUrl}: /v1/models lists ` +
      `${listed.slice(0, 5).join(', ')}${listed.length > 5 ? ', …' : ''}, and a completion naming it got ${answer}: check --model`,
  )
}

/** What `GET /health` answered: an HTTP status, or why none came (`timeout`, `network`,
 *  `budget`). */
export interface HealthReading {
  readonly endpoint: '/health'
  readonly status: number | string
}

export async function readHealth(target: Target): Promise<HealthReading> {
  let res: HttpResult
  try {
    res = await target.get('/health', { tenant: target.tenants[0] })
  } catch (err) {
    if (err instanceof BudgetExhaustedError) return { endpoint: '/health', status: 'budget' }
    throw err
  }
  return { endpoint: '/health', status: res.status ?? res.failure ?? 'network' }
}

/** The one line of the `no_completion_answered` tool error when this run's valid completions
 *  include none answered whole, else null. `summary` is this run's (see `Ledger.answerSummary`). */
export function noAnswerMessage(
  summary: AnswerSummary,
  baseUrl: string,
  budget: Budget,
  health: HealthReading | null,
): string | null {
  if (summary.numAnswered > 0) return null
  const url = `${baseUrl}/v1/completions`
  if (summary.numExpected === 0) {
    const spent =
      budget.remainingRequests <= 0
        ? `the request budget (--max-requests ${budget.limits.maxRequests})`
        : `the time budget (--max-seconds ${budget.limits.maxSeconds})`
    // Completions the probes cut themselves were sent: say that none of them ended, not that
    // none was sent (an endpoint whose answers never end looks like this).
    if (summary.numCutByProbes > 0)
      return `none of the ${summary.numCutByProbes} valid completions sent to ${url} ended before its probe cut it (do the endpoint's answers end at max_tokens?), and ${spent} ran out before one could be answered whole. Nothing was audited`
    return `no valid completion was sent to ${url}: ${spent} ran out before the first one. Nothing was audited`
  }
  const sorted = Object.entries(summary.notAnsweredBy).sort(([, a], [, b]) => b - a)
  const byCause = sorted.map(([cause, n]) => `${cause} ×${n}`).join(', ')
  // A cut at the deadline is the audit's own, and its hint asks whether the endpoint ends its
  // answers; an answer truncated at its size cap says it does not, however many were cut.
  const truncated = sorted.find(([cause]) => cause.endsWith(' truncated'))?.[0]
  const top =
    sorted[0]?.[0] === cutAtDeadline ? (truncated ?? cutAtDeadline) : (sorted[0]?.[0] ?? '')
  let hint: string
  if (top === cutAtDeadline)
    hint = `none ended before the time budget's deadline: raise --max-seconds, or check that the endpoint ends its answers at max_tokens`
  else if (top.endsWith(' truncated'))
    hint =
      cutAtDeadline in summary.notAnsweredBy
        ? `every answer not cut at the deadline went on past max_tokens until it was cut at its size cap: the endpoint does not end its answers`
        : `every answer went on past max_tokens until it was cut at its size cap: the endpoint does not end its answers`
  else if (top === 'HTTP 404')
    hint = `check --model and the target's path prefix (${url} was asked)`
  else if (top === 'HTTP 405' || top === 'HTTP 501')
    hint = `${baseUrl} does not serve POST /v1/completions: check that --target is an OpenAI-compatible endpoint, with its path prefix`
  else if (top.startsWith('HTTP 4'))
    hint =
      'every one was refused: check --model and that the endpoint takes prompt, max_tokens and temperature'
  else if (top === 'timeout') hint = 'none was answered within the request timeout'
  else if (top === 'network')
    hint = `no connection to ${baseUrl} could be made or kept: check that the endpoint is still running there`
  else hint = 'the endpoint failed every one'
  // A health check the budget no longer allowed says nothing.
  const healthNote =
    health === null || health.status === 'budget' ? '' : `; /health answered ${health.status}`
  return (
    `the target answered none of the ${summary.numExpected} valid completions sent to ${url} ` +
    `(${byCause})${healthNote}: ${hint}. Nothing was audited`
  )
}

/** An `availability` finding that says the endpoint went down during the audit (outage.ts): it
 *  fails the gate whatever `--fail-on` says, as a leak does, because the probes after it
 *  audited nothing and an audit that harmed or lost its endpoint must never read as "no leak
 *  observed" with exit 0. */
export function isOutageFinding(finding: Finding): boolean {
  return finding.probe === 'availability' && finding.evidence.outage !== undefined
}

/** Failed valid requests that make a pattern: one is an event (a timeout, a dropped
 *  connection), two or more are what `kvfence watch` reports of a cycle too (watch/cycle.ts). */
export const failurePatternMin = 2

/** Valid completions that failed (5xx, timeouts, broken or endless streams) are one warning
 *  whatever the probes made of them: a probe that could not tell says inconclusive, but an
 *  endpoint failing valid requests is itself a finding; a single one is named (its request
 *  number, probe and endpoint). A `/health` that answered 200 meanwhile is another, once the
 *  failures are a pattern ({@link failurePatternMin}): one failed request does not show a health
 *  check blind, and a `/health` that itself turned bad is the outage finding's (outage.ts). Over
 *  the whole audit (a resumed one's earlier completions too). */
export function availabilityFindings(ledger: Ledger, health: HealthReading | null): Finding[] {
  const valid = ledger.validSummary()
  if (valid.numFailed === 0) return []
  const first = valid.firstFailed
  const byCause =
    Object.entries(valid.failedBy)
      .sort(([, a], [, b]) => b - a)
      .map(([cause, n]) => `${cause} ×${n}`)
      .join(', ') +
    (valid.numFailed === 1 && first !== null
      ? `: request #${first.requestNumber}, ${first.probe ?? 'the audit'}, ${first.endpoint ?? 'POST /v1/completions'}`
      : '')
  const evidence = {
    numValidSent: valid.numSent,
    numValidAnswered: valid.numAnswered,
    numValidFailed: valid.numFailed,
    failedBy: valid.failedBy,
    refusedBy: valid.refusedBy,
    failedByProbe: valid.failedByProbe,
    health,
  }
  const findings: Finding[] = [
    {
      probe: 'availability',
      verdict: 'warning',
      severity: valid.numFailed * 10 >= valid.numSent ? 'high' : 'medium',
      title: `${valid.numFailed} of ${valid.numSent} valid requests failed (${byCause})`,
      evidence,
      remediation:
        'Find why the endpoint fails requests it should answer (its logs at the times in the ' +
        "report's completions); probes that saw these failures could not tell, and a failing " +
        'transfer or decode path is where stale pages get read.',
    },
  ]
  if (health !== null && health.status === 200 && valid.numFailed >= failurePatternMin) {
    findings.push({
      probe: 'availability',
      verdict: 'warning',
      severity: 'high',
      title: `/health answered 200 while ${valid.numFailed} of ${valid.numSent} valid requests failed`,
      evidence,
      remediation:
        'Make the health check exercise the path requests take (a short completion, or the ' +
        "workers' own state), so that a load balancer stops sending traffic to an endpoint that " +
        'fails them.',
    })
  }
  return findings
}

// ─── The CI gate: --fail-on ──────────────────────────────────────────────────────────────────

/** One term of `--fail-on`:
 *  - a class (`content-leak`, `side-channel`, …): a finding of that class seen (verdict `leak` or
 *    `warning`);
 *  - a severity (`critical` … `info`): a finding seen at that severity or above;
 *  - a tag (`over-pool-accepted`): a finding seen that carries it;
 *  - a verdict, as before classes: `leak`, `warning` (and `leak`), `inconclusive` (and both).
 *  A `leak` verdict (a content leak) fails under every gate: the auditor fails closed. */
export type FailOnTerm = FindingClass | Severity | FindingTag | Exclude<Verdict, 'clean'>

const verdictTerms = ['leak', 'warning', 'inconclusive'] as const
const severityTerms = ['critical', 'high', 'medium', 'low', 'info'] as const
/** Every term `--fail-on` takes, in the order `--help` lists them. */
export const failOnTerms: readonly FailOnTerm[] = [
  ...findingClasses,
  ...severityTerms,
  ...findingTags,
  ...verdictTerms,
]

/** The default gate: another tenant's material seen, a credential served (operational-endpoints),
 *  and the incident's precondition (a prompt over the reported KV pool accepted with 200, no other
 *  tier reported). */
export const defaultFailOn: readonly FailOnTerm[] = [
  'content-leak',
  'credential-exposure',
  'over-pool-accepted',
]

/** `--fail-on`'s text (terms separated by commas, spaces allowed) as terms; throws
 *  `AuditError('invalid_options')` naming an unknown term and the known ones. */
export function parseFailOn(text: string): FailOnTerm[] {
  const terms = text
    .split(',')
    .map((t) => t.trim())
    .filter((t) => t !== '')
  if (terms.length === 0)
    throw new AuditError(
      'invalid_options',
      `--fail-on needs at least one of ${failOnTerms.join(', ')}`,
    )
  const fault = failOnFault(terms)
  if (fault !== null) throw new AuditError('invalid_options', `--fail-on: ${fault}`)
  return [...new Set(terms)] as FailOnTerm[]
}

/** The fault of the first term of `terms` that `--fail-on` does not take (`unknown term "x"
 *  (known: content-leak, …)`), or null when it takes them all: the one wording of the flag and of
 *  the config file's `failOn`. */
export function failOnFault(terms: readonly string[]): string | null {
  const unknown = terms.find((term) => !(failOnTerms as readonly string[]).includes(term))
  if (unknown === undefined) return null
  return `unknown term ${JSON.stringify(unknown)} (known: ${failOnTerms.join(', ')})`
}

/** Whether `finding` fails a gate of `terms` (see {@link FailOnTerm}). */
export function failsGate(finding: Finding, terms: readonly FailOnTerm[]): boolean {
  if (finding.verdict === 'leak') return true
  const isSeen = finding.verdict === 'warning'
  return terms.some((term) => {
    if ((verdictTerms as readonly string[]).includes(term))
      return verdictRank[finding.verdict] >= verdictRank[term as Verdict]
    if (!isSeen) return false
    if ((severityTerms as readonly string[]).includes(term))
      return severityRank[finding.severity] >= severityRank[term as Severity]
    if ((findingTags as readonly string[]).includes(term))
      return (finding.tags ?? []).includes(term as FindingTag)
    return (finding.class ?? withClass(finding).class) === term
  })
}

/** A gate given as one term or as several, as a list. */
export function asTerms(failOn: FailOnTerm | readonly FailOnTerm[]): readonly FailOnTerm[] {
  return typeof failOn === 'string' ? [failOn as FailOnTerm] : (failOn as readonly FailOnTerm[])
}

/** Whether the gate lets inconclusive findings fail (an `inconclusive` term): the JUnit report
 *  then shows them as errors, not as skipped. */
export function isInconclusiveGated(terms: readonly FailOnTerm[]): boolean {
  return terms.includes('inconclusive')
}

/** The gate as one line (`content-leak, credential-exposure, over-pool-accepted`). */
export function formatFailOn(terms: readonly FailOnTerm[]): string {
  return terms.join(',')
}
