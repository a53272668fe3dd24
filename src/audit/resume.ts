/** `--resume REPORT`: what an earlier run of the same audit established, read back from its JSON
 *  report, and what that audit was (`recordedAudit`: target, model, tenants' names, probes, for
 *  the CLI to take what is not given again). A report is continued only when it is of the same
 *  audit: schema version, target, tenants (by name, in order), probe selection, seed (when one is
 *  given) and model; otherwise the audit refuses with one line (`AuditError('cannot_resume')`).
 *  The probes it ran to their
 *  end are kept as they were (runs, findings, completions); the others (`pendingProbes`) run
 *  again. Knows the report's shape; knows nothing of HTTP or of how probes judge. */
import { z } from 'zod'
import type { BudgetOrigin } from './budget.js'
import {
  AuditError,
  probeNames,
  type AuditReport,
  type CompletionEntry,
  type Finding,
  type ProbeName,
  type ProbeRun,
} from './types.js'

/** A report to continue, and how to name it in errors (its file). */
export interface ResumeSource {
  /** The parsed JSON of the report. */
  readonly report: unknown
  readonly source: string
}

/** What a resumed audit starts from. */
export interface ResumePoint {
  readonly seed: number
  readonly model: string | null
  /** The first run's start, ISO 8601: the report's `startedAt`. */
  readonly startedAt: string
  readonly origin: BudgetOrigin
  /** Probes kept from the report, in the order they run. */
  readonly kept: readonly ProbeName[]
  readonly probeRuns: readonly ProbeRun[]
  /** The kept probes' findings (never `availability`: that is drawn again over every run). */
  readonly findings: readonly Finding[]
  /** The kept probes' completions and the audit's own (no probe), as recorded. */
  readonly completions: readonly CompletionEntry[]
}

/** What this audit is, to compare with the report. `seed`: null when none was given. */
export interface ResumeAudit {
  readonly baseUrl: string
  readonly tenants: readonly string[]
  readonly probes: readonly ProbeName[]
  readonly seed: number | null
  readonly model: string | null
}

const ProbeNameSchema = z.enum(probeNames)
/** The fields `--resume` reads; the rest of each kept entry is carried over as written. */
const Resumable = z.looseObject({
  schemaVersion: z.number(),
  target: z.string(),
  model: z.string().nullable(),
  startedAt: z.string(),
  durationMs: z.number().int().nonnegative(),
  seed: z.number().int().nonnegative(),
  requestsSent: z.number().int().nonnegative(),
  tenants: z.array(z.string()),
  probes: z.array(ProbeNameSchema),
  state: z.enum(['running', 'interrupted', 'finished', 'tool-error']),
  pendingProbes: z.array(ProbeNameSchema),
  probeRuns: z.array(z.looseObject({ probe: ProbeNameSchema })),
  findings: z.array(z.looseObject({ probe: z.string() })),
  completions: z.array(z.looseObject({ probe: ProbeNameSchema.nullable() })),
})

/** What a report says its audit was, for `--resume` to take what was not given again: the
 *  target, the model, the tenants' names (never keys: the report has none) and the probes.
 *  Throws `cannot_resume` as {@link resumePoint} does for a report it cannot read. */
export function recordedAudit(from: ResumeSource): {
  readonly target: string
  readonly model: string | null
  readonly tenants: readonly string[]
  readonly probes: readonly ProbeName[]
} {
  const r = parseResumable(from)
  return { target: r.target, model: r.model, tenants: r.tenants, probes: r.probes }
}

/** `from.report` parsed, or `cannot_resume` naming the file and what it lacks. */
function parseResumable(from: ResumeSource): z.infer<typeof Resumable> {
  const refuse = (why: string): never => {
    throw new AuditError('cannot_resume', `cannot resume ${from.source}: ${why}`)
  }
  const version = (from.report as { schemaVersion?: unknown } | null)?.schemaVersion
  // Version 1 lacks only the findings' classes, which the audit gives kept findings again.
  if (version !== 1 && version !== 2)
    refuse(
      `it is not a kvfence audit report of schema version 1 or 2 (schemaVersion ${String(version)})`,
    )
  const parsed = Resumable.safeParse(from.report)
  if (!parsed.success) {
    const issue = parsed.error.issues[0]
    return refuse(
      `it lacks what --resume reads (${issue.path.join('.') || 'the report'}: ${issue.message}); reports of kvfence audits before --resume existed cannot be continued`,
    )
  }
  return parsed.data
}

/** Reads `from.report` and checks it is of `audit`; throws `AuditError('cannot_resume')` with one
 *  line naming the file and what differs, or saying there is nothing left to run. */
export function resumePoint(from: ResumeSource, audit: ResumeAudit): ResumePoint {
  const refuse = (why: string): never => {
    throw new AuditError('cannot_resume', `cannot resume ${from.source}: ${why}`)
  }
  const r = parseResumable(from)
  const list = (names: readonly string[]) => names.join(', ') || '(none)'
  if (r.target !== audit.baseUrl) refuse(`it audited ${r.target}, not ${audit.baseUrl}`)
  if (r.tenants.join('\n') !== audit.tenants.join('\n'))
    refuse(
      `its tenants are ${list(r.tenants)}, this audit's ${list(audit.tenants)}: give a key for each of its tenants`,
    )
  if (r.probes.join(',') !== audit.probes.join(','))
    refuse(
      `its probes are ${list(r.probes)}, this audit's ${list(audit.probes)}: give the same --probes`,
    )
  if (audit.seed !== null && audit.seed !== r.seed)
    refuse(`its seed is ${r.seed}, not ${audit.seed}: leave --seed out, or give ${r.seed}`)
  if (audit.model !== null && audit.model !== r.model)
    refuse(`its model is ${JSON.stringify(r.model)}, not ${JSON.stringify(audit.model)}`)
  const pending = new Set(r.pendingProbes)
  if (pending.size === 0) refuse('nothing to resume: every probe in it ran to its end')
  const kept = r.probes.filter((p) => !pending.has(p))
  const isKept = (probe: string | null) => probe === null || kept.includes(probe as ProbeName)
  return {
    seed: r.seed,
    model: r.model,
    startedAt: r.startedAt,
    origin: { requestsBefore: r.requestsSent, msBefore: r.durationMs },
    kept,
    probeRuns: (r.probeRuns as unknown as ProbeRun[]).filter((run) => isKept(run.probe)),
    findings: (r.findings as unknown as Finding[]).filter(
      (f) => f.probe !== 'availability' && isKept(f.probe),
    ),
    completions: (r.completions as unknown as CompletionEntry[]).filter((c) => isKept(c.probe)),
  }
}

/** Throws `cannot_resume` when the target now serves another model first than the report's
 *  (no `--model` given): the kept probes judged that one. */
export function checkResumedModel(point: ResumePoint, source: string, model: string | null): void {
  if (model === point.model) return
  throw new AuditError(
    'cannot_resume',
    `cannot resume ${source}: its model is ${JSON.stringify(point.model)}, and ${JSON.stringify(model)} would be audited now: give --model ${point.model ?? ''}`.trimEnd(),
  )
}

/** The report's `resumed` field for an audit continued from `point`. */
export function resumedFrom(point: ResumePoint, resumedAt: Date): AuditReport['resumed'] {
  return {
    probes: point.kept,
    resumedAt: resumedAt.toISOString(),
    previousDurationMs: point.origin.msBefore,
    previousRequestsSent: point.origin.requestsBefore,
  }
}
