/** The JUnit XML report: one test suite for the audit, one test case per probe run, so that CI
 *  systems show the audit like a test run, plus an `availability` case when the audit's own check
 *  found valid requests failing. A case's worst verdict decides it:
 *  - `leak` → `<failure type="leak">` (always: a leak fails at every `--fail-on`);
 *  - `warning` → `<failure type="warning">` when `--fail-on` is `warning` or `inconclusive`,
 *    else a passed case whose `<system-out>` lists the warnings;
 *  - `inconclusive` → `<error type="inconclusive">` when `--fail-on inconclusive`, else
 *    `<skipped>` (could not tell: neither passed nor failed);
 *  - `clean` → a passed case.
 *  So the XML fails exactly when the exit code is 1. Evidence is not copied into the XML (it is
 *  in the JSON report); titles and remediations are. */
import { writeFile } from 'node:fs/promises'
import type { AuditReport, Finding, Verdict } from '../types.js'
import { verdictRank } from '../types.js'
import { formatControls } from '../controls.js'

/** The report as JUnit XML (the common Jenkins/Surefire dialect). */
export function formatJunitReport(report: AuditReport, failOn: Verdict = 'leak'): string {
  const threshold = verdictRank[failOn]
  let numFailures = 0
  let numErrors = 0
  let numSkipped = 0
  // The audit's own checks have no run of their own: a case only when they found something.
  const runs: { probe: string; durationMs: number }[] = [...report.probeRuns]
  if (report.findings.some((f) => f.probe === 'availability'))
    runs.push({ probe: 'availability', durationMs: 0 })
  const cases = runs.map((run) => {
    const findings = report.findings.filter((f) => f.probe === run.probe)
    const worst = worstVerdict(findings)
    const lines = findings.map(
      (f) =>
        `[${f.verdict}/${f.severity}] ${f.title}\n  controls: ${formatControls(f.controls)}\n  fix: ${f.remediation}`,
    )
    const body = lines.join('\n')
    const open = `    <testcase classname="kvfence.audit" name="${esc(run.probe)}" time="${seconds(run.durationMs)}">`
    const first = findings.find((f) => f.verdict === worst)
    const message = esc(first?.title ?? '')
    let inner: string
    if (worst === 'leak' || (worst === 'warning' && verdictRank.warning >= threshold)) {
      numFailures++
      inner = `      <failure type="${worst}" message="${message}">${esc(body)}</failure>`
    } else if (worst === 'inconclusive' && verdictRank.inconclusive >= threshold) {
      numErrors++
      inner = `      <error type="inconclusive" message="${message}">${esc(body)}</error>`
    } else if (worst === 'inconclusive') {
      numSkipped++
      inner = `      <skipped message="inconclusive: ${message}"/>\n      <system-out>${esc(body)}</system-out>`
    } else {
      inner = `      <system-out>${esc(body)}</system-out>`
    }
    return `${open}\n${inner}\n    </testcase>`
  })
  const attrs =
    `tests="${cases.length}" failures="${numFailures}" errors="${numErrors}" skipped="${numSkipped}" ` +
    `time="${seconds(report.durationMs)}"`
  return [
    '<?xml version="1.0" encoding="UTF-8"?>',
    `<testsuites name="kvfence audit" ${attrs}>`,
    `  <testsuite name="${esc(`kvfence audit of ${report.target}`)}" ${attrs} timestamp="${esc(report.startedAt)}">`,
    '    <properties>',
    `      <property name="target" value="${esc(report.target)}"/>`,
    `      <property name="model" value="${esc(report.model ?? '')}"/>`,
    `      <property name="seed" value="${report.seed}"/>`,
    `      <property name="requestsSent" value="${report.requestsSent}"/>`,
    `      <property name="failOn" value="${failOn}"/>`,
    '    </properties>',
    ...cases,
    '  </testsuite>',
    '</testsuites>',
    '',
  ].join('\n')
}

/** Writes {@link formatJunitReport} to `file`; throws the file system's error. */
export async function writeJunitReport(
  report: AuditReport,
  file: string,
  failOn: Verdict = 'leak',
): Promise<void> {
  await writeFile(file, formatJunitReport(report, failOn), 'utf8')
}

function worstVerdict(findings: readonly Finding[]): Verdict {
  // With no finding at all a probe proved nothing.
  if (findings.length === 0) return 'inconclusive'
  return findings.reduce<Verdict>(
    (w, f) => (verdictRank[f.verdict] > verdictRank[w] ? f.verdict : w),
    'clean',
  )
}

function seconds(ms: number): string {
  return (ms / 1000).toFixed(3)
}

/** XML-escapes text and drops characters XML 1.0 cannot hold. */
function esc(text: string): string {
  return (
    text
      // XML 1.0 cannot hold C0 control characters other than tab, newline and carriage return.
      // eslint-disable-next-line no-control-regex
      .replace(/[\u0000-\u0008\u000B\u000C\u000E-\u001F\uFFFE\uFFFF]/g, '')
      .replace(/&/g, '&amp;')
      .replace(/</g, '&lt;')
      .replace(/>/g, '&gt;')
      .replace(/"/g, '&quot;')
  )
}
