/** Whether the audited endpoint went down during the audit, and what was sent just before.
 *  An endpoint that answered, then failed every valid request from some point on (a 503 for
 *  everything, 5xx, connections refused) and did not come back, or whose `/health` answered 200
 *  at the start and something else at the end, was harmed or broke while it was audited: an
 *  `availability` finding (severity high) that says when, during which probe, and the requests
 *  that ended just before the first failure (their sizes, never their text), since one of them
 *  may be what killed it. A 503 that the endpoint sends to shed load for a moment does not count:
 *  the run of failures must hold {@link outageMinRequests} valid requests and, to stop the audit
 *  early, {@link outageMinMs}; an endpoint that failed before it ever answered is warming up (the
 *  gate's `no_completion_answered` covers one that never answers).
 *  Knows completions' sizes and fates; knows nothing of how probes judge them. */
import type { CompletionResult } from './target.js'
import type { Finding, ProbeName } from './types.js'

/** Valid requests in a row that failed, after one was answered, for the endpoint to count as
 *  down. */
export const outageMinRequests = 6
/** How long (ms) such a run must have lasted for the audit to stop sending. */
export const outageMinMs = 10_000
/** Requests kept to say what was sent just before the first failure. */
const numRecent = 16

/** One completion, without its text: what the outage finding names. */
export interface SentRequest {
  readonly requestNumber: number
  /** Milliseconds from the audit's start to the end of the request. */
  readonly atMs: number
  readonly probe: ProbeName | null
  readonly tenant: string
  /** `usage.prompt_tokens`, else the sender's estimate, else null. */
  readonly promptTokens: number | null
  readonly promptChars: number
  readonly maxTokens: number
  readonly isStream: boolean
  readonly status: number | null
  readonly failure: string | null
}

/** `GET /health`'s status at the start and at the end (`null`: not read). */
export interface HealthChange {
  readonly before: number | string | null
  readonly after: number | string | null
}

export class OutageWatch {
  private readonly recent: SentRequest[] = []
  private hasAnswered = false
  /** The run of failed valid requests since the last answer, oldest first. */
  private streak: SentRequest[] = []
  /** What ended just before the streak's first request. */
  private before: SentRequest[] = []

  /** `during`: what the titles say the endpoint went down during (the audit, or the watch). */
  constructor(readonly during: 'audit' | 'watch' = 'audit') {}

  /** Takes one completion as it ends; true when the endpoint now counts as down for good (the
   *  run of failures is long enough in requests and in time: stop sending). */
  observe(isValid: boolean, sent: SentRequest, result: CompletionResult): boolean {
    const status = result.status
    const isAnswered = status !== null && status >= 200 && status < 300 && result.failure === null
    const isServerFailure =
      (status !== null && status >= 500) ||
      (status === null && (result.failure === 'network' || result.failure === 'timeout'))
    if (isValid && isAnswered) {
      this.hasAnswered = true
      this.streak = []
    } else if (isValid && isServerFailure && this.hasAnswered) {
      if (this.streak.length === 0) this.before = [...this.recent]
      this.streak.push(sent)
    }
    this.recent.push(sent)
    if (this.recent.length > numRecent) this.recent.shift()
    return this.isDown() && sent.atMs - this.streak[0].atMs >= outageMinMs
  }

  /** The endpoint failed the last {@link outageMinRequests} or more valid requests in a row,
   *  after it had answered. */
  isDown(): boolean {
    return this.streak.length >= outageMinRequests
  }

  /** The finding, or null when the endpoint did not go down. */
  finding(health: HealthChange): Finding | null {
    const isHealthTurned = health.before === 200 && health.after !== null && health.after !== 200
    if (!this.isDown() && !isHealthTurned) return null
    const first = this.streak[0] ?? null
    const byStatus = new Map<string, number>()
    for (const s of this.streak) {
      const key = s.status === null ? (s.failure ?? 'no answer') : `HTTP ${s.status}`
      byStatus.set(key, (byStatus.get(key) ?? 0) + 1)
    }
    const statuses = [...byStatus].map(([k, n]) => `${k} ×${n}`).join(', ')
    const healthText = `/health ${health.before ?? 'not read'} at the start, ${health.after ?? 'not read'} at the end`
    const largest = this.before.reduce<SentRequest | null>(
      (a, b) =>
        a === null || (b.promptTokens ?? 0) + b.maxTokens > (a.promptTokens ?? 0) + a.maxTokens
          ? b
          : a,
      null,
    )
    const title =
      first === null
        ? `the endpoint's health turned bad during the ${this.during} (${healthText})`
        : `the endpoint went down during the ${this.during} at request #${first.requestNumber} (${(first.atMs / 1000).toFixed(1)} s in, ${first.probe ?? `the ${this.during}`}): the ${this.streak.length} valid requests from then on failed (${statuses}) and none was answered again; ${healthText}` +
          (largest === null
            ? ''
            : `; the largest request just before: ${describe(largest, this.during)}`)
    return {
      probe: 'availability',
      verdict: 'warning',
      severity: 'high',
      title,
      evidence: {
        outage: {
          firstFailure: first,
          numFailedInARow: this.streak.length,
          failedBy: Object.fromEntries(byStatus),
          sentJustBefore: this.before.slice(-5),
          largestJustBefore: largest,
          health,
        },
      },
      remediation:
        'Find what stopped the endpoint at that time in its logs (the requests just before are ' +
        'listed by number, probe and size) and restart it; make it refuse what it cannot hold ' +
        '(max_tokens over its context, a prompt over its KV pool) with a 400 instead of failing. ' +
        'Probes that ran after it could not tell: re-run the audit once the endpoint is healthy.',
    }
  }
}

function describe(s: SentRequest, during: 'audit' | 'watch'): string {
  const prompt =
    s.promptTokens === null ? `${s.promptChars} characters` : `${s.promptTokens} tokens`
  return `#${s.requestNumber} (${s.probe ?? `the ${during}`}, ${s.tenant}: a prompt of ${prompt}, max_tokens ${s.maxTokens}, ${s.status === null ? (s.failure ?? 'no answer') : `HTTP ${s.status}`})`
}
