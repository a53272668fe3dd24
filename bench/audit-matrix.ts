/** The fault × probe matrix of docs/faults.md, written from the audit benchmark's JSON
 *  (`npm run bench -- audit --json FILE`), never by hand: per injectable fault of
 *  src/engine/faults.ts, the probes run, the outcome, which probe found it first and after how
 *  many requests. A fault the JSON does not hold (a run with `--faults`) gets a row saying so.
 *  `node dist/bench/audit-matrix.js JSON DOC` rewrites DOC's generated section from JSON; the
 *  bench does the same with `--docs DOC`. Knows the benchmark's JSON and the doc's markers;
 *  knows nothing of how the audit runs. */
import { readFileSync, writeFileSync } from 'node:fs'
import { fileURLToPath } from 'node:url'
import { faultDescriptions } from '../src/engine/faults.js'

/** One fault's row of the benchmark's JSON (`faults[]`). */
export interface FaultRow {
  readonly fault: string
  readonly probes: readonly string[]
  readonly outcome: 'detected' | 'tool error' | 'inconclusive' | 'not detected'
  /** The audit's one-line error when it ended with exit 2 (`tool error`), else null; absent in
   *  JSON written before the field existed. */
  readonly toolError?: string | null
  readonly detectedBy: readonly string[]
  readonly inconclusive: readonly string[]
  /** The alarm (leak or warning above the baseline) with the lowest request number: its probe,
   *  verdict, request number (1 = the audit's first request) and time (s); null when no alarm
   *  named its request. */
  readonly firstFinding: {
    readonly probe: string
    readonly verdict: string
    readonly requestNumber: number
    readonly seconds: number | null
  } | null
  readonly requestsSent: number
  readonly auditSeconds: number
}

/** What the table is written from: the benchmark's JSON, the fields read here. */
export interface AuditBenchJson {
  readonly seed: number
  readonly fault_seconds: number
  readonly faults: readonly FaultRow[]
}

/** `fresh`'s fault rows merged into `earlier` (the JSON of an earlier run, e.g. the committed
 *  whole matrix): each fault `fresh` ran replaces that fault's row, in the order of
 *  src/engine/faults.ts; the lists of faults by outcome are recomputed from the merged rows; the
 *  shipped runs and their false findings are `fresh`'s when it ran any seed (they audit the
 *  probes as they are now), else `earlier`'s; `incident_detect_requests` / `_seconds` are
 *  `fresh`'s when it ran `placeholder-forward`, else `earlier`'s; `merged` records which faults each run gave.
 *  Throws as {@link checkBenchJson} for either JSON, and when the two runs differ in seed or
 *  seconds per fault (their rows would not compare). */
export function mergeBenchJson(earlier: unknown, fresh: unknown): Record<string, unknown> {
  const a = checkBenchJson(earlier) as AuditBenchJson & Record<string, unknown>
  const b = checkBenchJson(fresh) as AuditBenchJson & Record<string, unknown>
  if (a.seed !== b.seed || a.fault_seconds !== b.fault_seconds)
    throw new Error(
      `audit bench JSON: cannot merge a run of seed ${b.seed}, ${b.fault_seconds} s per fault into one of seed ${a.seed}, ${a.fault_seconds} s`,
    )
  const byFault = new Map(a.faults.map((r) => [r.fault, r]))
  for (const r of b.faults) byFault.set(r.fault, r)
  const faults = Object.keys(faultDescriptions)
    .map((f) => byFault.get(f))
    .filter((r): r is FaultRow => r !== undefined)
  const withOutcome = (o: FaultRow['outcome']) =>
    faults.filter((r) => r.outcome === o).map((r) => r.fault)
  const isShippedFresh = typeof b.shipped_seeds === 'number' && b.shipped_seeds > 0
  const shippedFrom = isShippedFresh ? b : a
  const earlierRuns = Array.isArray(a.merged)
    ? (a.merged as unknown[])
    : [{ faults: a.faults.map((r) => r.fault) }]
  // The incident's figures go with its row: the fresh run's when it ran that fault.
  const incidentFrom = b.faults.some((r) => r.fault === 'placeholder-forward') ? b : a
  return {
    ...a,
    incident_detect_requests: incidentFrom.incident_detect_requests,
    incident_detect_seconds: incidentFrom.incident_detect_seconds,
    faults_detected: withOutcome('detected'),
    faults_inconclusive: withOutcome('inconclusive'),
    faults_tool_error: withOutcome('tool error'),
    faults_not_detected: withOutcome('not detected'),
    false_findings: shippedFrom.false_findings,
    shipped_seeds: shippedFrom.shipped_seeds,
    shipped: shippedFrom.shipped,
    faults,
    merged: [
      ...earlierRuns,
      { faults: b.faults.map((r) => r.fault), shipped_seeds: b.shipped_seeds ?? 0 },
    ],
  }
}

export const matrixBegin =
  '<!-- fault-matrix: generated from bench/results/audit.json by bench/audit-matrix.ts; do not edit by hand -->'
export const matrixEnd = '<!-- fault-matrix: end -->'

/** Throws with the first field that does not have the shape {@link AuditBenchJson} says. */
export function checkBenchJson(json: unknown): AuditBenchJson {
  const fail = (what: string): never => {
    throw new Error(`audit bench JSON: ${what}`)
  }
  if (typeof json !== 'object' || json === null) return fail('not an object')
  const o = json as Record<string, unknown>
  if (!Number.isInteger(o.seed)) fail('seed is not an integer')
  if (typeof o.fault_seconds !== 'number') fail('fault_seconds is not a number')
  if (!Array.isArray(o.faults)) return fail('faults is not an array')
  for (const [i, r] of (o.faults as Record<string, unknown>[]).entries()) {
    const at = `faults[${i}]`
    if (typeof r.fault !== 'string' || !Object.hasOwn(faultDescriptions, r.fault))
      fail(`${at}.fault is not a fault of src/engine/faults.ts`)
    if (!Array.isArray(r.probes)) fail(`${at}.probes is not an array`)
    if (!['detected', 'tool error', 'inconclusive', 'not detected'].includes(r.outcome as string))
      fail(`${at}.outcome is not detected, tool error, inconclusive or not detected`)
    if (r.outcome === 'tool error' && typeof r.toolError !== 'string')
      fail(`${at}.toolError is missing for a tool error`)
    if (!Array.isArray(r.detectedBy) || !Array.isArray(r.inconclusive))
      fail(`${at}.detectedBy or .inconclusive is not an array`)
    const first = r.firstFinding as Record<string, unknown> | null | undefined
    if (first === undefined) return fail(`${at}.firstFinding is missing`)
    if (
      first !== null &&
      (typeof first.probe !== 'string' || !Number.isInteger(first.requestNumber))
    )
      fail(`${at}.firstFinding has no probe or requestNumber`)
    if (!Number.isInteger(r.requestsSent) || typeof r.auditSeconds !== 'number')
      fail(`${at}.requestsSent or .auditSeconds is missing`)
  }
  return o as unknown as AuditBenchJson
}

/** The generated section's body (between the markers): a line saying where it is from, then a
 *  row per fault of src/engine/faults.ts, in that file's order. */
export function faultMatrixTable(json: AuditBenchJson): string {
  const byFault = new Map(json.faults.map((r) => [r.fault, r]))
  const rows = Object.keys(faultDescriptions).map((fault) => {
    const r = byFault.get(fault)
    if (r === undefined) return `| \`${fault}\` | — | not run in this JSON | — | — |`
    const first = r.firstFinding
    const outcome =
      r.outcome === 'detected'
        ? `**detected**: ${unique(r.detectedBy.map((d) => d.split(':').slice(0, 2).join(':'))).join('; ')}`
        : r.outcome === 'tool error'
          ? `**tool error** (exit 2): ${r.toolError}`
          : r.outcome === 'inconclusive'
            ? `inconclusive: ${unique(r.inconclusive.map((d) => d.split(':')[0])).join(', ')}`
            : 'not detected'
    const foundBy =
      first !== null
        ? first.probe
        : r.outcome === 'detected'
          ? 'by the end'
          : r.outcome === 'tool error'
            ? 'the audit (exit 2)'
            : '—'
    const after =
      first === null
        ? r.outcome === 'detected' || r.outcome === 'tool error'
          ? `${r.requestsSent} (all sent)`
          : '—'
        : `${first.requestNumber}${first.seconds === null ? '' : ` (${first.seconds.toFixed(1)} s)`}`
    return `| \`${fault}\` | ${r.probes.join(', ')} | ${outcome} | ${foundBy} | ${after} |`
  })
  return [
    `One run: seed ${json.seed}, at most ${json.fault_seconds} s per fault.`,
    '',
    '| fault | probes run | outcome (probe: verdict above the baseline) | first found by | after requests (time) |',
    '| --- | --- | --- | --- | --- |',
    ...rows,
    '',
  ].join('\n')
}

/** `doc` with its generated section replaced by `table` (appended at the end when it has no
 *  markers yet). */
export function withMatrix(doc: string, table: string): string {
  const current = generatedMatrix(doc)
  const section = `${matrixBegin}\n${table}${matrixEnd}`
  if (current === null) return `${doc.trimEnd()}\n\n${section}\n`
  return doc.replace(`${matrixBegin}\n${current}${matrixEnd}`, () => section)
}

/** The body between the markers in `doc`, or null when it has none. */
export function generatedMatrix(doc: string): string | null {
  const begin = doc.indexOf(matrixBegin)
  const end = doc.indexOf(matrixEnd)
  if (begin < 0 || end < begin) return null
  return doc.slice(begin + matrixBegin.length + 1, end)
}

/** Rewrites `docPath`'s generated section from the JSON at `jsonPath`. */
export function writeMatrix(jsonPath: string, docPath: string): void {
  const json = checkBenchJson(JSON.parse(readFileSync(jsonPath, 'utf8')))
  writeFileSync(docPath, withMatrix(readFileSync(docPath, 'utf8'), faultMatrixTable(json)))
}

function unique(items: readonly string[]): string[] {
  return [...new Set(items)]
}

if (process.argv[1] === fileURLToPath(import.meta.url)) {
  const [jsonPath, docPath] = process.argv.slice(2)
  if (jsonPath === undefined || docPath === undefined) {
    process.stderr.write('usage: node dist/bench/audit-matrix.js BENCH_JSON DOC\n')
    process.exit(2)
  }
  try {
    writeMatrix(jsonPath, docPath)
  } catch (err) {
    process.stderr.write(`audit-matrix: ${err instanceof Error ? err.message : String(err)}\n`)
    process.exit(2)
  }
}
