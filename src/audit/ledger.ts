/** The ledger: what became of every completion the audit sent, whichever probe sent it. It is
 *  what lets the audit tell "the endpoint refused or failed everything" apart from "the endpoint
 *  is safe": per-probe counts for the report, the timeline the HTML report draws, the
 *  availability finding (valid requests that failed) and the tool error for a target that never
 *  answered a valid completion (a static file server, a wrong `--model`, a wrong path prefix).
 *  Knows completion results and tenants' names; knows nothing of how the probes judge them. */
import type { CompletionResult } from './target.js'
import type { CompletionCounts, CompletionEntry, CompletionFate, ProbeName } from './types.js'

/** A completion's fate (see {@link CompletionFate}). `isDeadline`: the budget's deadline had
 *  passed when it ended (a timeout then is the audit's own cut, not the endpoint's fault). */
export function fateOf(result: CompletionResult, isDeadline: boolean): CompletionFate {
  const { status, failure } = result
  if (failure === 'aborted') return 'cut'
  if (status === null) return failure === 'timeout' && isDeadline ? 'cut' : 'failed'
  if (status >= 200 && status < 300) {
    // `truncated`: the answer went on past its size cap (it did not end at max_tokens), so it was
    // never seen whole; the endpoint did not do its job.
    if (failure === 'stream_error' || failure === 'bad_response' || failure === 'truncated')
      return 'failed'
    return 'answered'
  }
  // 429 and 503 are load shed on purpose (a tenant's limit, a full queue): the endpoint said
  // no, it did not break.
  if ((status >= 400 && status < 500) || status === 503) return 'refused'
  return 'failed'
}

/** What the ledger keeps per completion (the report's `completions`), and whether an earlier
 *  run recorded it (a resumed audit's kept probes). */
interface Entry extends CompletionEntry {
  readonly isValid: boolean
  readonly isEarlier: boolean
}

/** What the valid completions of one run came to, for the audit's gate: those the endpoint was
 *  expected to answer (valid, not cut by the auditor on purpose), how many it answered whole, and
 *  the others by cause (`HTTP 501`, `HTTP 200 truncated`, `cut at the deadline`). */
export interface AnswerSummary {
  readonly numExpected: number
  /** Valid completions of this run that their probe cut on purpose (an abort-race cut, a read
   *  stopped at its cap): not expected to be answered, but proof that completions were sent. */
  readonly numCutByProbes: number
  readonly numAnswered: number
  readonly notAnsweredBy: Readonly<Record<string, number>>
}

/** The cause a valid completion cut at the time budget's deadline is counted under. */
export const cutAtDeadline = 'cut at the deadline'

/** What a {@link Ledger} calls (synchronously) as completions are recorded: `onRecord` for each
 *  one of this run, `onFailure` after it for each valid one that failed. */
export interface LedgerHooks {
  readonly onRecord?: (isValid: boolean, result: CompletionResult) => void
  readonly onFailure?: () => void
}

/** Per-audit record of completions. One is made by `runAudit` and handed to the target; the
 *  probe that is running when a completion ends is the one it is counted for. */
export class Ledger {
  private readonly entries: Entry[] = []
  private probe: ProbeName | null = null
  private readonly hooks: LedgerHooks

  constructor(hooks: LedgerHooks = {}) {
    this.hooks = hooks
  }

  /** The probe the next completions belong to (null: before or between probes). */
  setProbe(probe: ProbeName | null): void {
    this.probe = probe
  }

  /** The probe whose completions are being recorded now (null: the audit's own). */
  get currentProbe(): ProbeName | null {
    return this.probe
  }

  /** Takes an earlier run's completions (a resumed audit's kept probes) as they were recorded;
   *  they count in every summary but {@link answerSummary}, which is this run's. An entry
   *  without `isValid` (none is written without it) is taken as valid. */
  addEarlier(entries: readonly CompletionEntry[]): void {
    for (const e of entries)
      this.entries.push({ ...e, isValid: e.isValid ?? true, isEarlier: true })
  }

  /** Records one completion. `isValid`: a request the endpoint should answer (false for prompts
   *  sent to be refused, e.g. over capacity, or to learn whether an entrypoint is served);
   *  `endpoint`: where it was sent, as `POST /v1/messages`. */
  record(
    tenant: string,
    isValid: boolean,
    result: CompletionResult,
    isDeadline: boolean,
    endpoint: string,
  ): void {
    const fate = fateOf(result, isDeadline)
    this.entries.push({
      isEarlier: false,
      requestNumber: result.requestNumber,
      atMs: result.atMs,
      tenant,
      probe: this.probe,
      endpoint,
      isValid,
      status: result.status,
      failure: result.failure,
      fate,
    })
    this.hooks.onRecord?.(isValid, result)
    if (isValid && fate === 'failed') this.hooks.onFailure?.()
  }

  /** Counts for one probe, or for the whole audit when `probe` is omitted. */
  counts(probe?: ProbeName): CompletionCounts {
    const of = probe === undefined ? this.entries : this.entries.filter((e) => e.probe === probe)
    const n = (fate: CompletionFate) => of.filter((e) => e.fate === fate).length
    return {
      sent: of.length,
      answered: n('answered'),
      refused: n('refused'),
      failed: n('failed'),
      cut: n('cut'),
    }
  }

  /** Valid completions only: how many were sent, answered, and how the failed ones ended, as
   *  `{ "HTTP 502": 9, "timeout": 2 }`. */
  validSummary(): {
    numSent: number
    numAnswered: number
    numFailed: number
    failedBy: Record<string, number>
    refusedBy: Record<string, number>
    failedByProbe: Record<string, number>
    /** The first that failed (request number, probe, endpoint), null when none did. */
    firstFailed: CompletionEntry | null
  } {
    const valid = this.entries.filter((e) => e.isValid && e.fate !== 'cut')
    const tally = (list: Entry[], key: (e: Entry) => string): Record<string, number> => {
      const out: Record<string, number> = {}
      for (const e of list) out[key(e)] = (out[key(e)] ?? 0) + 1
      return out
    }
    const failed = valid.filter((e) => e.fate === 'failed')
    return {
      numSent: valid.length,
      numAnswered: valid.filter((e) => e.fate === 'answered').length,
      numFailed: failed.length,
      failedBy: tally(failed, causeOf),
      refusedBy: tally(
        valid.filter((e) => e.fate === 'refused'),
        causeOf,
      ),
      failedByProbe: tally(failed, (e) => e.probe ?? '(none)'),
      firstFailed: failed.length === 0 ? null : (({ isEarlier: _e, ...entry }) => entry)(failed[0]),
    }
  }

  /** This run's valid completions (an earlier run's are not: this run must show the endpoint
   *  answers, whatever an earlier one saw), for the gate: see {@link AnswerSummary}. */
  answerSummary(): AnswerSummary {
    const expected = this.entries.filter(
      (e) => !e.isEarlier && e.isValid && !(e.fate === 'cut' && e.failure === 'aborted'),
    )
    const notAnsweredBy: Record<string, number> = {}
    for (const e of expected) {
      if (e.fate === 'answered') continue
      const cause = e.fate === 'cut' ? cutAtDeadline : causeOf(e)
      notAnsweredBy[cause] = (notAnsweredBy[cause] ?? 0) + 1
    }
    const numCutByProbes = this.entries.filter(
      (e) => !e.isEarlier && e.isValid && e.fate === 'cut' && e.failure === 'aborted',
    ).length
    return {
      numExpected: expected.length,
      numCutByProbes,
      numAnswered: expected.filter((e) => e.fate === 'answered').length,
      notAnsweredBy,
    }
  }

  /** Why a probe's valid completions went unanswered, in words for a title, e.g.
   *  `2 of 5 valid requests not answered (HTTP 500 ×2); 1 cut at the time budget's deadline`,
   *  with `marks`, the statuses or failures it names (`500`, `timeout`), so that a title that
   *  already names them all is left alone; null when every one was answered or cut by the
   *  auditor on purpose. */
  unansweredReason(probe: ProbeName): { text: string; marks: string[] } | null {
    const valid = this.entries.filter((e) => e.probe === probe && e.isValid)
    const atDeadline = valid.filter((e) => e.fate === 'cut' && e.failure === 'timeout').length
    const notAnswered = valid.filter((e) => e.fate === 'failed' || e.fate === 'refused')
    const judged = valid.filter((e) => e.fate !== 'cut').length
    const parts: string[] = []
    const marks = new Set<string>()
    if (notAnswered.length > 0) {
      for (const e of notAnswered)
        marks.add(
          e.status === null || e.failure === 'truncated' ? (e.failure ?? '') : `${e.status}`,
        )
      const by: Record<string, number> = {}
      for (const e of notAnswered) by[causeOf(e)] = (by[causeOf(e)] ?? 0) + 1
      const causes = Object.entries(by)
        .sort(([, a], [, b]) => b - a)
        .map(([cause, n]) => `${cause} ×${n}`)
        .join(', ')
      parts.push(`${notAnswered.length} of ${judged} valid requests not answered (${causes})`)
    }
    if (atDeadline > 0) {
      parts.push(`${atDeadline} cut at the time budget's deadline`)
      marks.add('deadline')
    }
    return parts.length === 0 ? null : { text: parts.join('; '), marks: [...marks] }
  }

  /** Every completion, in the order they ended (no text, no key); an earlier run's first. */
  timeline(): CompletionEntry[] {
    return this.entries.map(({ isEarlier: _isEarlier, ...entry }) => entry)
  }
}

/** `HTTP 502`, `timeout`, `network`, `HTTP 200 stream_error`, `HTTP 200 truncated`. */
export function causeOf(e: { status: number | null; failure: string | null }): string {
  if (e.status === null) return e.failure ?? 'no answer'
  return e.failure === 'stream_error' || e.failure === 'bad_response' || e.failure === 'truncated'
    ? `HTTP ${e.status} ${e.failure}`
    : `HTTP ${e.status}`
}
