/** The auditor's vocabulary: tenants, findings, verdicts and the report.
 *  Knows nothing of HTTP or of any serving engine; every other audit module speaks these words. */
import type { FindingClass, FindingTag } from './classes.js'
import type { AuditErrorCode } from './errors.js'
import type { ProbeName } from './probes/index.js'

/** What a probe concluded. `inconclusive` means "could not tell" and never counts as clean.
 *  `leak` is only ever the verdict of a `content-leak` (another tenant's material crossed); every
 *  other harm seen is a `warning`, its class (classes.ts) saying which kind. */
export type Verdict = 'leak' | 'clean' | 'inconclusive' | 'warning'

export type Severity = 'critical' | 'high' | 'medium' | 'low' | 'info'

/** Every probe's name, in the order an audit runs them: derived from the one registry,
 *  probes/index.ts. */
export { probeNames } from './probes/index.js'
export type { ProbeName }

/** A tenant of the audited endpoint. `key` is sent as a bearer token and never printed or stored. */
export interface Tenant {
  readonly name: string
  readonly key: string
}

/** What a finding is about: a probe, or `availability`, the audit's own check over every probe's
 *  requests (valid requests that failed, a health check that said all was well meanwhile). */
export type FindingSource = ProbeName | 'availability'

/** What a finding maps to (controls.ts): OWASP AISVS requirement ids (`5.5.5`) and kvfence's
 *  guards (`G1`–`G10`) that would have stopped it. */
export interface FindingControls {
  readonly aisvs: readonly string[]
  readonly guards: readonly string[]
}

/** One conclusion of one probe. `evidence` is JSON and holds no key and no unredacted output. */
export interface Finding {
  readonly probe: FindingSource
  readonly verdict: Verdict
  /** The kind of harm (classes.ts): for a clean or inconclusive finding, the kind its probe looks
   *  for. Set by the audit for every finding; a probe names it only where its probe's default
   *  class (`probeClass`) is not the one. */
  readonly class?: FindingClass
  /** The class's CWE ids (`CWE-226`); set by the audit with the class. */
  readonly cwe?: readonly string[]
  /** Marks a gate can name (`over-pool-accepted`); absent: none. */
  readonly tags?: readonly FindingTag[]
  readonly severity: Severity
  readonly title: string
  readonly evidence: Record<string, unknown>
  readonly remediation: string
  /** The controls it maps to; set by the audit for every finding (absent in findings a probe
   *  builds, before the audit adds it). */
  readonly controls?: FindingControls
}

export interface BudgetLimits {
  readonly maxRequests: number
  readonly maxSeconds: number
  /** Requests in flight at most, for every probe that does not ramp its load. */
  readonly concurrency: number
  /** Requests in flight at most for probes that ramp their load 1 → 2 → 4 → 8 → 16 (default:
   *  `concurrency`). */
  readonly maxConcurrency?: number
}

/** What became of one completion:
 *  - `answered`: a 2xx answer with a completion in it;
 *  - `refused`: a 4xx, or a 503 (the endpoint said no: size, model, key, its own limits);
 *  - `failed`: a 5xx other than 503, a timeout before the deadline, a broken connection or
 *    stream, a 2xx without a completion: the endpoint did not do its job;
 *  - `cut`: the auditor cut it (on purpose, or at the budget's deadline). */
export type CompletionFate = 'answered' | 'refused' | 'failed' | 'cut'

/** Completions of one probe (or of the audit), by fate. `sent` is their sum. */
export interface CompletionCounts {
  readonly sent: number
  readonly answered: number
  readonly refused: number
  readonly failed: number
  readonly cut: number
}

/** One completion in the report's timeline: no text, no key. */
export interface CompletionEntry {
  /** The request's number in the audit (1 = the first request sent, of any kind). */
  readonly requestNumber: number
  /** Milliseconds from the audit's start to the end of the request. */
  readonly atMs: number
  /** The tenant's name. */
  readonly tenant: string
  /** The probe that sent it (null: the audit's own requests). */
  readonly probe: ProbeName | null
  /** Where it was sent, as `POST /v1/chat/completions`; absent in reports written before it was
   *  recorded (they hold `POST /v1/completions` only). */
  readonly endpoint?: string
  readonly status: number | null
  readonly failure: string | null
  readonly fate: CompletionFate
  /** False for a prompt sent to be refused (over capacity, malformed); absent in reports written
   *  before it was recorded. */
  readonly isValid?: boolean
}

/** How one probe ran (for JUnit test-case times and the HTML report). */
export interface ProbeRun {
  readonly probe: ProbeName
  readonly durationMs: number
  /** Every HTTP request the probe sent (completions, reads of server info, malformed bodies). */
  readonly requestsSent: number
  /** Its completions, by fate. */
  readonly completions: CompletionCounts
  /** The titles of its inconclusive findings: why it could not tell (empty when it could). */
  readonly inconclusiveReasons: readonly string[]
  /** The most of its requests that were in flight at once (the highest concurrency reached). */
  readonly concurrencyReached?: number
}

/** Where an audit stands when its report is written:
 *  - `running`: written after a probe ended, more to come (a report left so was killed);
 *  - `interrupted`: stopped by SIGINT or SIGTERM (`interruptedBy`);
 *  - `finished`: every probe ran, or was stopped by the budget (see `pendingProbes`);
 *  - `tool-error`: the audit could not audit (`toolError`): never a verdict. */
export type AuditState = 'running' | 'interrupted' | 'finished' | 'tool-error'

/** What an audit continued with `--resume` carried over from the report it resumed. */
export interface ResumedFrom {
  /** Probes whose runs, findings and completions an earlier run established, kept as they were. */
  readonly probes: readonly ProbeName[]
  /** When this (the last) run started, ISO 8601. */
  readonly resumedAt: string
  /** What the earlier runs took together: milliseconds, and HTTP requests. */
  readonly previousDurationMs: number
  readonly previousRequestsSent: number
}

/** The JSON report, schema version 2 (docs/report-schema.json; fields are only ever added, and a
 *  change that breaks readers gets a new version). Version 2: every finding has its `class` and
 *  `cwe`, and a side channel is a `warning`, no longer a `leak`. The fields marked optional are
 *  absent only in reports written before they were added. */
export interface AuditReport {
  readonly schemaVersion: 2
  readonly tool: 'kvfence audit'
  /** The target's base URL, without credentials. */
  readonly target: string
  readonly model: string | null
  /** ISO 8601. */
  readonly startedAt: string
  readonly durationMs: number
  readonly seed: number
  readonly budget: BudgetLimits
  readonly requestsSent: number
  readonly probeRuns: readonly ProbeRun[]
  readonly findings: readonly Finding[]
  /** Every completion the audit sent, in the order they ended. */
  readonly completions: readonly CompletionEntry[]
  /** The tenants' names, in the order given (the first plants): never their keys. */
  readonly tenants?: readonly string[]
  /** The probes chosen, in the order they run. */
  readonly probes?: readonly ProbeName[]
  readonly state?: AuditState
  /** Chosen probes not run to their end (not run yet, interrupted, stopped by the budget, or
   *  failed): what `--resume` runs again. */
  readonly pendingProbes?: readonly ProbeName[]
  /** With state `interrupted`: the signal. */
  readonly interruptedBy?: 'SIGINT' | 'SIGTERM'
  /** With state `tool-error`: the error, as the one line on stderr says it. */
  readonly toolError?: { readonly code: AuditErrorCode; readonly message: string }
  /** Present when the audit was continued with `--resume`. */
  readonly resumed?: ResumedFrom
}

/** Verdicts from least to most alarming; `--fail-on V` (a verdict) fails on V and everything
 *  after it. */
export const verdictRank: Readonly<Record<Verdict, number>> = {
  clean: 0,
  inconclusive: 1,
  warning: 2,
  leak: 3,
}

export { AuditError, type AuditErrorCode } from './errors.js'
