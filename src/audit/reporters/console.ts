/** Console output: a line per probe as it runs, then a table of findings and a one-line result;
 *  when a probe could not tell, a loud "isolation not proven" block. Plain text (no colours),
 *  so it reads the same in a terminal, a CI log or a file. Every line fits a given width (the
 *  terminal's): long titles wrap inside their column, and nothing is cut (the JSON report has
 *  the same text whole). Knows the report's shape; knows nothing of terminals. */
import stringWidth from 'string-width'
import wrapAnsi from 'wrap-ansi'
import type { ProgressEvent } from '../run.js'
import type { AuditReport, Finding } from '../types.js'
import { formatControls } from '../controls.js'
import { withClass } from '../classes.js'

/** Columns the console output fits when the terminal's are unknown (not a TTY: a CI log, a
 *  pipe, a file). */
export const defaultConsoleWidth = 100
/** The narrowest width honoured: below it lines are wrapped at this width. */
const minConsoleWidth = 40
/** Below these, the table gives way to one block per finding. */
const minControlsWidth = 12
const minFindingWidth = 20
const gap = '  '

/** The columns to fit: `columns` when it is a positive integer (a terminal's width), else
 *  {@link defaultConsoleWidth}; never below 40. */
export function consoleWidth(columns: number | undefined): number {
  const width =
    columns !== undefined && Number.isInteger(columns) && columns > 0
      ? columns
      : defaultConsoleWidth
  return Math.max(minConsoleWidth, width)
}

/** One progress line per event, wrapped to `width` columns (default: not wrapped) with the
 *  continuation lines indented under the message. */
export function formatProgress(event: ProgressEvent, width?: number): string {
  const prefix = `[${event.probe}] `
  const text = ((): string => {
    switch (event.type) {
      case 'probe-start':
        return 'running'
      case 'probe-log':
        return `  ${event.message}`
      case 'probe-end':
        return countedVerdicts(event.findings)
    }
  })()
  if (width === undefined) return `${prefix}${text}`
  return hanging(prefix + text, consoleWidth(width), prefix.length + 2)
}

/** A probe's findings as `verdict (severity)`, in order, each run of equal ones said once with
 *  its count: "leak (critical) ×5, warning (high)" (a canary probe with ten leaking answers made
 *  a line wider than the demo's 80 columns). */
export function countedVerdicts(
  findings: readonly Pick<Finding, 'verdict' | 'severity'>[],
): string {
  const runs: { text: string; count: number }[] = []
  for (const f of findings) {
    const text = `${f.verdict} (${f.severity})`
    const last = runs.at(-1)
    if (last?.text === text) last.count++
    else runs.push({ text, count: 1 })
  }
  return runs.map((r) => (r.count === 1 ? r.text : `${r.text} ×${r.count}`)).join(', ')
}

/** The summary after an audit: its target, a table of findings (probe, verdict, severity,
 *  controls, finding) whose every line is at most `width` columns (see {@link consoleWidth}),
 *  the "isolation not proven" block when a probe could not tell, and the result line. */
export function formatSummary(report: AuditReport, width: number = defaultConsoleWidth): string {
  const columns = consoleWidth(width)
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
        ? `no leak observed; ${numWarnings} warning(s)${byClass(report.findings)}, ${numInconclusive} inconclusive` +
          (numInconclusive > 0 ? ' (isolation not proven)' : '')
        : 'clean: every probe passed'
  // "Could not tell" must not read like a pass: say so on lines of their own.
  const notProven =
    numLeaks === 0 && numInconclusive > 0
      ? [
          '',
          banner(
            `ISOLATION NOT PROVEN: ${inconclusiveProbes.length} probe(s) could not tell: ${inconclusiveProbes.join(', ')}.`,
            columns,
          ),
          banner(
            'An inconclusive probe is not a pass; see each finding for what to change and re-run.',
            columns,
          ),
        ]
      : []
  return [
    hanging(
      `kvfence audit of ${report.target} (model ${report.model ?? 'unknown'}, seed ${report.seed})`,
      columns,
      2,
    ),
    findingsTable(report.findings, columns),
    ...notProven,
    '',
    hanging(
      `${result}. ${report.requestsSent} requests in ${(report.durationMs / 1000).toFixed(1)} s.`,
      columns,
      2,
    ),
  ].join('\n')
}

/** The warnings' classes with their counts, most first: ` (side-channel ×2, integrity ×1)`, or
 *  '' when there is no warning. */
function byClass(findings: readonly Finding[]): string {
  const counts = new Map<string, number>()
  for (const f of findings)
    if (f.verdict === 'warning')
      counts.set(withClass(f).class, (counts.get(withClass(f).class) ?? 0) + 1)
  if (counts.size === 0) return ''
  const sorted = [...counts].sort(([, a], [, b]) => b - a)
  return ` (${sorted.map(([c, n]) => `${c} ×${n}`).join(', ')})`
}

/** The findings as a table of at most `width` columns: probe, verdict and severity as they are;
 *  controls and the finding's title wrapped in what is left (the title gets most of it). Too
 *  narrow for that: one block per finding, its title wrapped under a line naming the rest. */
function findingsTable(findings: readonly Finding[], width: number): string {
  const header = ['probe', 'verdict', 'severity', 'controls', 'finding']
  // A finding seen leads with its class, so a side channel never reads as a leak at a glance
  // (a column of its own would not fit 80 columns).
  const rows = findings.map((f) => [
    f.probe,
    f.verdict,
    f.severity,
    formatControls(f.controls),
    f.verdict === 'leak' || f.verdict === 'warning'
      ? `[${withClass(f).class}] ${f.title}`
      : f.title,
  ])
  const natural = header.map((h, i) =>
    Math.max(stringWidth(h), ...rows.map((r) => stringWidth(r[i]))),
  )
  const fixed = natural[0] + natural[1] + natural[2] + gap.length * (header.length - 1)
  const room = width - fixed
  if (room < minControlsWidth + minFindingWidth) return findingBlocks(rows, width)
  // 35 %: at 100 columns most controls ("AISVS 5.5.5; G4, G5", 19) fit on one line.
  const controls = Math.min(natural[3], Math.max(minControlsWidth, Math.floor(room * 0.35)))
  const widths = [
    natural[0],
    natural[1],
    natural[2],
    controls,
    Math.min(natural[4], room - controls),
  ]
  const line = (cells: readonly string[]): string =>
    cells
      .map((c, i) => c + ' '.repeat(widths[i] - stringWidth(c)))
      .join(gap)
      .trimEnd()
  const lines = [line(header), line(widths.map((w) => '-'.repeat(w)))]
  for (const row of rows) {
    const cells = row.map((cell, i) => wrap(cell, widths[i]))
    const height = Math.max(...cells.map((c) => c.length))
    for (let k = 0; k < height; k++) lines.push(line(cells.map((c) => c[k] ?? '')))
  }
  return lines.join('\n')
}

/** One block per finding: `probe: verdict (severity) [controls]`, then its title indented. */
function findingBlocks(rows: readonly string[][], width: number): string {
  return rows
    .map(([probe, verdict, severity, controls, title]) =>
      [
        hanging(`${probe}: ${verdict} (${severity}) [${controls}]`, width, 4),
        ...wrap(title, width - 2).map((l) => `  ${l}`),
      ].join('\n'),
    )
    .join('\n')
}

/** `text` wrapped to `width` columns: at spaces, and inside a word longer than the width. */
function wrap(text: string, width: number): string[] {
  return wrapAnsi(text, Math.max(1, width), { hard: true, trim: true }).split('\n')
}

/** `text` wrapped to `width` columns, lines after the first indented by `indent` spaces (kept
 *  under `width − 20`). The first line is cut from the text as it is, so a word split across the
 *  first two lines is never joined back with a space. */
function hanging(text: string, width: number, indent: number): string {
  const pad = Math.min(indent, Math.max(0, width - minFindingWidth))
  const first = wrap(text, width)[0]
  const at = text.indexOf(first)
  const [head, rest] = first !== '' && at >= 0 ? [first, text.slice(at + first.length)] : ['', text] // not expected (wrap only trims and splits); wrap all of it under the indent
  const more = rest.trim() === '' ? [] : wrap(rest, width - pad)
  const lines = head === '' ? more : [head, ...more.map((l) => ' '.repeat(pad) + l)]
  return lines.join('\n')
}

/** `!! text`, each wrapped line marked `!!`. */
function banner(text: string, width: number): string {
  return wrap(text, width - 3)
    .map((l) => `!! ${l}`)
    .join('\n')
}
