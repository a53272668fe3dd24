/** Console output: a line per probe as it runs, then a table of findings and a one-line result;
 *  when a probe could not tell, a loud "isolation not proven" block. Plain text (no colours),
 *  so it reads the same in a terminal, a CI log or a file. */
import type { ProgressEvent } from '../run.js'
import type { AuditReport, Finding } from '../types.js'
import { formatControls } from '../controls.js'

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
  const rows = report.findings.map((f: Finding) => [
    f.probe,
    f.verdict,
    f.severity,
    formatControls(f.controls),
    f.title,
  ])
  const header = ['probe', 'verdict', 'severity', 'controls', 'finding']
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
  const inconclusiveProbes = [
    ...new Set(report.findings.filter((f) => f.verdict === 'inconclusive').map((f) => f.probe)),
  ]
  const result =
    numLeaks > 0
      ? `LEAK: ${numLeaks} finding(s) show data crossing tenants`
      : numWarnings + numInconclusive > 0
        ? `no leak observed; ${numWarnings} warning(s), ${numInconclusive} inconclusive` +
          (numInconclusive > 0 ? ' (isolation not proven)' : '')
        : 'clean: every probe passed'
  // "Could not tell" must not read like a pass: say so on a line of its own.
  const notProven =
    numLeaks === 0 && numInconclusive > 0
      ? [
          '',
          `!! ISOLATION NOT PROVEN: ${inconclusiveProbes.length} probe(s) could not tell: ${inconclusiveProbes.join(', ')}.`,
          '!! An inconclusive probe is not a pass; see each finding for what to change and re-run.',
        ]
      : []
  return [
    `kvfence audit of ${report.target} (model ${report.model ?? 'unknown'}, seed ${report.seed})`,
    line(header),
    line(widths.map((w) => '-'.repeat(w))),
    ...rows.map(line),
    ...notProven,
    '',
    `${result}. ${report.requestsSent} requests in ${(report.durationMs / 1000).toFixed(1)} s.`,
  ].join('\n')
}

function truncate(text: string, width: number): string {
  return text.length <= width ? text : `${text.slice(0, width - 1)}…`
}
