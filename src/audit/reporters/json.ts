/** The JSON report: the `AuditReport` as is (schema version 1), pretty-printed. Evidence holds
 *  no key and only redacted outputs, so the file can be shared. Written atomically (a temporary
 *  file renamed over it): the audit rewrites it after every probe, and a reader, or an audit
 *  killed mid-write, never sees half a report. */
import writeFileAtomic from 'write-file-atomic'
import type { AuditReport } from '../types.js'

export function formatJsonReport(report: AuditReport): string {
  return `${JSON.stringify(report, null, 2)}\n`
}

export async function writeJsonReport(report: AuditReport, file: string): Promise<void> {
  await writeFileAtomic(file, formatJsonReport(report), { encoding: 'utf8' })
}
