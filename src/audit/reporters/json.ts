/** The JSON report: the `AuditReport` as is (schema version 2), pretty-printed, its fields in one
 *  fixed order, the order docs/report-schema.json lists them in (whatever order the code built
 *  each object in), so that two reports diff line by line. Evidence is a probe's own and keeps
 *  its order. Evidence holds no key and only redacted outputs, so the file can be shared.
 *  Written atomically (a temporary file renamed over it): the audit rewrites it after every
 *  probe, and a reader, or an audit killed mid-write, never sees half a report. */
import writeFileAtomic from 'write-file-atomic'
import type { AuditReport } from '../types.js'

/** The order of each object's fields, as docs/report-schema.json lists them (a test holds the
 *  two equal). A field not listed (none is written) would follow the listed ones. */
export const jsonFieldOrder = {
  report: [
    'schemaVersion',
    'tool',
    'target',
    'model',
    'startedAt',
    'durationMs',
    'seed',
    'budget',
    'requestsSent',
    'probeRuns',
    'findings',
    'completions',
    'tenants',
    'probes',
    'state',
    'pendingProbes',
    'interruptedBy',
    'toolError',
    'resumed',
  ],
  budget: ['maxRequests', 'maxSeconds', 'concurrency', 'maxConcurrency'],
  probeRun: [
    'probe',
    'durationMs',
    'requestsSent',
    'completions',
    'inconclusiveReasons',
    'concurrencyReached',
  ],
  counts: ['sent', 'answered', 'refused', 'failed', 'cut'],
  finding: [
    'probe',
    'verdict',
    'class',
    'cwe',
    'tags',
    'severity',
    'title',
    'evidence',
    'controls',
    'remediation',
  ],
  controls: ['aisvs', 'guards'],
  completion: [
    'requestNumber',
    'atMs',
    'tenant',
    'probe',
    'endpoint',
    'status',
    'failure',
    'fate',
    'isValid',
  ],
  toolError: ['code', 'message'],
  resumed: ['probes', 'resumedAt', 'previousDurationMs', 'previousRequestsSent'],
} as const

/** `object`'s own fields, those in `order` first and in that order. */
function ordered<T extends object>(object: T, order: readonly string[]): T {
  const source = object as Record<string, unknown>
  const out: Record<string, unknown> = {}
  for (const key of order) if (key in source) out[key] = source[key]
  for (const key of Object.keys(source)) if (!(key in out)) out[key] = source[key]
  return out as T
}

/** `report` with every object's fields in {@link jsonFieldOrder} (evidence left as it is). */
export function inFieldOrder(report: AuditReport): AuditReport {
  const o = jsonFieldOrder
  return ordered(
    {
      ...report,
      budget: ordered(report.budget, o.budget),
      probeRuns: report.probeRuns.map((run) =>
        ordered({ ...run, completions: ordered(run.completions, o.counts) }, o.probeRun),
      ),
      findings: report.findings.map((f) =>
        ordered(
          f.controls === undefined ? f : { ...f, controls: ordered(f.controls, o.controls) },
          o.finding,
        ),
      ),
      completions: report.completions.map((c) => ordered(c, o.completion)),
      ...(report.toolError === undefined
        ? {}
        : { toolError: ordered(report.toolError, o.toolError) }),
      ...(report.resumed === undefined ? {} : { resumed: ordered(report.resumed, o.resumed) }),
    },
    o.report,
  )
}

/** The report as the JSON file holds it: {@link inFieldOrder}, two-space indented, a final newline. */
export function formatJsonReport(report: AuditReport): string {
  return `${JSON.stringify(inFieldOrder(report), null, 2)}\n`
}

/** Writes {@link formatJsonReport} to `file` atomically; rejects with the file system's error. */
export async function writeJsonReport(report: AuditReport, file: string): Promise<void> {
  await writeFileAtomic(file, formatJsonReport(report), { encoding: 'utf8' })
}
