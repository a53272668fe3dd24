/** The JSON report: the `AuditReport` as is (schema version 1), pretty-printed. Evidence holds
 *  no key and only redacted outputs, so the file can be shared. */
import { writeFile } from 'node:fs/promises'
import type { AuditReport } from '../types.js'

export function formatJsonReport(report: AuditReport): string {
  return `${JSON.stringify(report, null, 2)}\n`
}

export async function writeJsonReport(report: AuditReport, file: string): Promise<void> {
  await writeFile(file, formatJsonReport(report), 'utf8')
}
