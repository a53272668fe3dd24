/** Console output: a line per probe as it runs, then a table of findings and a one-line result.
 *  Plain text (no colours), so it reads the same in a terminal, a CI log or a file. */
import type { ProgressEvent } from '../run.js'
import type { AuditReport, Finding } from '../types.js'

export function formatProgress(event: ProgressEvent): string {
  switch (event.type) {
    case 'probe-start':
      return `[${event.probe}] running`
    case 'probe-log':
      return `[${event.probe}]   ${event.message}`
    case 'probe-end':
      return `[${event.probe}] ${event.findings.map((f) => `${f.verdict} (${f.severity})`).join(', ')}`
  }
}

export function formatSummary(report: AuditReport): string {
  const rows = report.findings.map((f: Finding) => [f.probe, f.verdict, f.severity, f.title])
  const header = ['probe', 'verdict', 'severity', 'finding']
  const widths = header.map((h, i) => Math.max(h.length, ...rows.map((r) => r[i].length)))
  widths[3] = Math.min(widths[3], 100)
  const line = (cells: string[]): string =>
    cells
      .map((c, i) => (i === 3 ? truncate(c, widths[3]) : c.padEnd(widths[i])))
      .join('  ')
      .trimEnd()
  const count = (verdict: Finding['verdict']): number =>
    report.findings.filter((f) => f.verdict === verdict).length
  const numLeaks = count('leak')
  const numWarnings = count('warning')
  const numInconclusive = count('inconclusive')
  const result =
    numLeaks > 0
      ? `LEAK: ${numLeaks} finding(s) show data crossing tenants`
      : numWarnings + numInconclusive > 0
        ? `no leak observed; ${numWarnings} warning(s), ${numInconclusive} inconclusive` +
          (numInconclusive > 0 ? ' (isolation not proven)' : '')
        : 'clean: every probe passed'
  return [
    `kvfence audit of ${report.target} (model ${report.model ?? 'unknown'}, seed ${report.seed})`,
    line(header),
    line(widths.map((w) => '-'.repeat(w))),
    ...rows.map(line),
    '',
    `${result}. ${report.requestsSent} requests in ${(report.durationMs / 1000).toFixed(1)} s.`,
  ].join('\n')
}

function truncate(text: string, width: number): string {
  return text.length <= width ? text : `${text.slice(0, width - 1)}…`
}
