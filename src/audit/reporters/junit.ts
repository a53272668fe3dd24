/** The JUnit XML report: one test suite for the audit, one test case per probe run, so that CI
 *  systems show the audit like a test run, plus an `availability` case when the audit's own check
 *  found valid requests failing. A case is decided by its findings and the gate (`--fail-on`,
 *  gate.ts):
 *  - a finding the gate fails on (a leak always) → `<failure type="CLASS">`, the class of the
 *    first such finding (`content-leak`, `side-channel`, …);
 *  - else an inconclusive finding → `<error type="inconclusive">` when the gate names
 *    `inconclusive`, else `<skipped>` (could not tell: neither passed nor failed);
 *  - else a passed case whose `<system-out>` lists its findings (warnings the gate lets pass too).
 *  So the XML fails exactly when the exit code is 1. Evidence is not copied into the XML (it is
 *  in the JSON report); titles, classes, CWE ids and remediations are. */
import { writeFile } from 'node:fs/promises'
import type { AuditReport } from '../types.js'
import { formatControls } from '../controls.js'
import { withClass } from '../classes.js'
import {
  asTerms,
  defaultFailOn,
  failsGate,
  formatFailOn,
  isInconclusiveGated,
  type FailOnTerm,
} from '../gate.js'

/** The report as JUnit XML (the common Jenkins/Surefire dialect), under the gate `failOn`. */
export function formatJunitReport(
  report: AuditReport,
  gate: FailOnTerm | readonly FailOnTerm[] = defaultFailOn,
): string {
  const failOn = asTerms(gate)
  let numFailures = 0
  let numErrors = 0
  let numSkipped = 0
  // The audit's own checks have no run of their own: a case only when they found something.
  const runs: { probe: string; durationMs: number }[] = [...report.probeRuns]
  if (report.findings.some((f) => f.probe === 'availability'))
    runs.push({ probe: 'availability', durationMs: 0 })
  const cases = runs.map((run) => {
    // Reports written before classes get them as the audit gives them now.
    const findings = report.findings.filter((f) => f.probe === run.probe).map((f) => withClass(f))
    const lines = findings.map(
      (f) =>
        `[${f.verdict}/${f.severity}] ${f.class ?? ''} ${(f.cwe ?? []).join(' ')}: ${f.title}\n  controls: ${formatControls(f.controls)}\n  fix: ${f.remediation}`,
    )
    const body = lines.join('\n')
    const open = `    <testcase classname="kvfence.audit" name="${esc(run.probe)}" time="${seconds(run.durationMs)}">`
    const failing = findings.find((f) => f.verdict !== 'inconclusive' && failsGate(f, failOn))
    // With no finding at all a probe proved nothing.
    const unsure = findings.find((f) => f.verdict === 'inconclusive')
    const isUnsure = findings.length === 0 || unsure !== undefined
    const message = esc((failing ?? unsure)?.title ?? '')
    let inner: string
    if (failing !== undefined) {
      numFailures++
      inner = `      <failure type="${esc(failing.class ?? failing.verdict)}" message="${message}">${esc(body)}</failure>`
    } else if (isUnsure && isInconclusiveGated(failOn)) {
      numErrors++
      inner = `      <error type="inconclusive" message="${message}">${esc(body)}</error>`
    } else if (isUnsure) {
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
    `      <property name="failOn" value="${esc(formatFailOn(failOn))}"/>`,
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
  failOn: FailOnTerm | readonly FailOnTerm[] = defaultFailOn,
): Promise<void> {
  await writeFile(file, formatJunitReport(report, failOn), 'utf8')
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
