/** The auditor's vocabulary: tenants, findings, verdicts and the report.
 *  Knows nothing of HTTP or of any serving engine; every other audit module speaks these words. */

/** What a probe concluded. `inconclusive` means "could not tell" and never counts as clean. */
export type Verdict = 'leak' | 'clean' | 'inconclusive' | 'warning'

export type Severity = 'critical' | 'high' | 'medium' | 'low' | 'info'

/** Every probe, in the order an audit runs them. */
export const probeNames = [
  'capacity',
  'boundary',
  'canary',
  'abort-race',
  'concurrency',
  'queueing',
  'page-leak',
  'determinism',
  'prefix-timing',
  'error-handling',
] as const
export type ProbeName = (typeof probeNames)[number]

/** A tenant of the audited endpoint. `key` is sent as a bearer token and never printed or stored. */
export interface Tenant {
  readonly name: string
  readonly key: string
}

/** One conclusion of one probe. `evidence` is JSON and holds no key and no unredacted output. */
export interface Finding {
  readonly probe: ProbeName
  readonly verdict: Verdict
  readonly severity: Severity
  readonly title: string
  readonly evidence: Record<string, unknown>
  readonly remediation: string
}

export interface BudgetLimits {
  readonly maxRequests: number
  readonly maxSeconds: number
  readonly concurrency: number
}

/** How one probe ran (for JUnit test-case times and the HTML report). */
export interface ProbeRun {
  readonly probe: ProbeName
  readonly durationMs: number
  readonly requestsSent: number
}

/** The JSON report (schema version 1; `probeRuns` was added without breaking readers). */
export interface AuditReport {
  readonly schemaVersion: 1
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
}

/** Verdicts from least to most alarming; `--fail-on V` fails on V and everything after it. */
export const verdictRank: Readonly<Record<Verdict, number>> = {
  clean: 0,
  inconclusive: 1,
  warning: 2,
  leak: 3,
}

export type AuditErrorCode = 'invalid_options' | 'invalid_config' | 'target_unreachable'

/** A tool error: the audit could not run at all (bad options, target unreachable). The message
 *  is one line, names tenants but never keys. */
export class AuditError extends Error {
  constructor(
    readonly code: AuditErrorCode,
    message: string,
  ) {
    super(message)
    this.name = 'AuditError'
  }
}
