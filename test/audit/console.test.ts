/** The console summary fits the terminal: every line at most the width given (a terminal's
 *  columns, 100 when stdout is not one), long titles wrapped inside their column, never cut: the
 *  words of each title and its controls are all in the table, in order, and the JSON report keeps
 *  the same text whole. A findings table used to be 568 columns wide. */
import assert from 'node:assert/strict'
import { describe, test } from 'node:test'
import {
  consoleWidth,
  countedVerdicts,
  formatProgress,
  formatSummary,
  type AuditReport,
  type Finding,
} from '../../src/audit/index.js'
import { formatJsonReport } from '../../src/audit/reporters/json.js'

function finding(
  probe: Finding['probe'],
  verdict: Finding['verdict'],
  severity: Finding['severity'],
  title: string,
  controls: Finding['controls'],
): Finding {
  return { probe, verdict, severity, title, evidence: {}, remediation: 'r', controls }
}

// Titles of the lengths real audits print; one holds a 150-character run with no space (a URL
// with a query), which must be split inside the word rather than overflow or be cut.
const longUrl = `http://127.0.0.1:8000/v1/completions?${'x'.repeat(113)}`
const titles = [
  "bob's output contained a canary planted by alice (over-capacity prompt, HTTP 200)",
  `the valid control request was not answered (no answer before its time limit), so answers to invalid ones would prove nothing (time budget exhausted; 1 cut at the time budget's deadline); ${'malformed JSON: 501 server-error; missing prompt: 501 server-error; negative max_tokens: 501 server-error; '.repeat(3)}max_tokens over the context: 501 server-error`,
  `an answer past the page edge differed from its cold one at ${longUrl} (warm 17 tokens, cold 16)`,
  'fits',
]
const report: AuditReport = {
  schemaVersion: 2,
  tool: 'kvfence audit',
  target: 'http://127.0.0.1:8000',
  model: 'tiny-echo',
  startedAt: '2026-11-30T10:00:00.000Z',
  durationMs: 12_345,
  seed: 7,
  budget: { maxRequests: 300, maxSeconds: 300, concurrency: 4 },
  requestsSent: 42,
  probeRuns: [],
  findings: [
    finding('canary', 'leak', 'critical', titles[0], {
      aisvs: ['5.5.5'],
      guards: ['G1', 'G2', 'G3', 'G4', 'G5', 'G6'],
    }),
    finding('error-handling', 'inconclusive', 'medium', titles[1], { aisvs: [], guards: ['G2'] }),
    finding('warm-equals-cold', 'warning', 'medium', titles[2], {
      aisvs: ['5.5.5'],
      guards: ['G4', 'G5'],
    }),
    finding('capacity', 'clean', 'info', titles[3], { aisvs: [], guards: ['G1'] }),
  ],
  completions: [],
}
const controls = ['AISVS 5.5.5; G1, G2, G3, G4, G5, G6', 'G2', 'AISVS 5.5.5; G4, G5', 'G1']
/** The finding column: a finding seen (leak, warning) leads with its class (classes.ts: a
 *  canary's leak is a content leak, warm-equals-cold's changed answer an integrity warning). */
const shown = [`[content-leak] ${titles[0]}`, titles[1], `[integrity] ${titles[2]}`, titles[3]]

/** Characters, not bytes: every title here is of one-column characters (hand-checked). */
const columnsOf = (line: string): number => [...line].length
const squeeze = (text: string): string => text.replace(/\s+/g, '')

/** The text of one column of the table, per finding: the header's column starts and ends it, a
 *  line with a probe name in the first column starts a finding. */
function columnTexts(summary: string, column: 'controls' | 'finding'): string[] {
  const lines = summary.split('\n')
  const headerAt = lines.findIndex((l) => l.startsWith('probe '))
  const header = lines[headerAt]
  const start = header.indexOf(column)
  const end = column === 'controls' ? header.indexOf('finding') : undefined
  const texts: string[] = []
  for (const line of lines.slice(headerAt + 2)) {
    if (line === '') break
    if (line[0] !== ' ') texts.push('')
    texts[texts.length - 1] += ` ${line.slice(start, end)}`
  }
  return texts
}

describe('the findings table fits the width', () => {
  for (const width of [100, 80, 120, 200]) {
    test(`${width} columns: every line fits, every title and control is whole and in order`, () => {
      const summary = formatSummary(report, width)
      const widest = Math.max(...summary.split('\n').map(columnsOf))
      assert.ok(widest <= width, `a line of ${widest} columns`)
      assert.deepEqual(columnTexts(summary, 'finding').map(squeeze), shown.map(squeeze))
      assert.deepEqual(columnTexts(summary, 'controls').map(squeeze), controls.map(squeeze))
    })
  }

  test('the widest title at 100 columns: wrapped over many lines, split inside the long URL', () => {
    const lines = formatSummary(report, 100).split('\n')
    // probe 16 + verdict 12 + severity 8 + four gaps of 2 = 44; controls 35 % of the 56 left
    // (19), the finding the other 37; controls start at column 42, the finding at 63.
    assert.equal(
      lines[1],
      `probe${' '.repeat(13)}verdict       severity  controls${' '.repeat(13)}finding`,
    )
    assert.equal(
      lines[2],
      ['-'.repeat(16), '-'.repeat(12), '-'.repeat(8), '-'.repeat(19), '-'.repeat(37)].join('  '),
    )
    assert.equal(
      lines[3],
      "canary            leak          critical  AISVS 5.5.5; G1,     [content-leak] bob's output contained",
    )
    assert.equal(lines[4], `${' '.repeat(42)}G2, G3, G4, G5, G6   a canary planted by alice`)
    assert.equal(lines[5], `${' '.repeat(63)}(over-capacity prompt, HTTP 200)`)
    // The URL's 113 x's fill whole lines of the finding column: split inside the word.
    assert.ok(lines.some((l) => l.endsWith(` ${'x'.repeat(37)}`)))
  })

  test('a table that fits is laid out as it was: columns as wide as their widest cell', () => {
    const small: AuditReport = { ...report, findings: [report.findings[0], report.findings[3]] }
    assert.equal(
      formatSummary(small, 200),
      [
        'kvfence audit of http://127.0.0.1:8000 (model tiny-echo, seed 7)',
        'probe     verdict  severity  controls                             finding',
        '--------  -------  --------  -----------------------------------  ' + '-'.repeat(96),
        `canary    leak     critical  AISVS 5.5.5; G1, G2, G3, G4, G5, G6  ${shown[0]}`,
        'capacity  clean    info      G1                                   fits',
        '',
        'LEAK: 1 finding(s) show data crossing tenants. 42 requests in 12.3 s.',
      ].join('\n'),
    )
  })

  test('narrower than the table (60 and 40 columns): one block per finding, nothing lost', () => {
    for (const width of [60, 40]) {
      const summary = formatSummary(report, width)
      const lines = summary.split('\n')
      assert.ok(Math.max(...lines.map(columnsOf)) <= width, `${width}: a line too wide`)
      // The block's first line names the probe, verdict, severity and (some of) the controls.
      assert.match(
        summary,
        width === 60
          ? /^canary: leak \(critical\) \[AISVS 5\.5\.5; G1, G2, G3, G4, G5,$/m
          : /^canary: leak \(critical\) \[AISVS 5\.5\.5;$/m,
      )
      for (const title of titles) assert.ok(squeeze(summary).includes(squeeze(title)))
    }
  })

  test('the JSON report keeps every title whole', () => {
    const json = JSON.parse(formatJsonReport(report)) as AuditReport
    assert.deepEqual(
      json.findings.map((f) => f.title),
      titles,
    )
  })

  test('the banner of a run that could not tell is wrapped with !! on every line', () => {
    const unproven: AuditReport = { ...report, findings: report.findings.slice(1) }
    const lines = formatSummary(unproven, 40).split('\n')
    const banner = lines.filter((l) => l.startsWith('!!'))
    assert.ok(banner.length > 2)
    assert.ok(banner.every((l) => columnsOf(l) <= 40))
    // "!! " and 37 columns of text: "… probe(s) could" would be 41.
    assert.equal(banner[0], '!! ISOLATION NOT PROVEN: 1 probe(s)')
  })
})

describe('the width used', () => {
  test('a terminal gives its columns; no terminal gives 100; never under 40', () => {
    assert.equal(consoleWidth(132), 132)
    assert.equal(consoleWidth(undefined), 100)
    assert.equal(consoleWidth(0), 100)
    assert.equal(consoleWidth(20), 40)
  })

  test('progress lines wrap under their message', () => {
    const message = 'malformed JSON: 501 server-error; missing prompt: 501 server-error'
    assert.equal(
      formatProgress({ type: 'probe-log', probe: 'error-handling', message }, 60),
      [
        '[error-handling]   malformed JSON: 501 server-error; missing',
        '                   prompt: 501 server-error',
      ].join('\n'),
    )
    // Without a width, one line as before.
    assert.equal(
      formatProgress({ type: 'probe-log', probe: 'error-handling', message }),
      `[error-handling]   ${message}`,
    )
  })
})

describe('a probe-end progress line', () => {
  const leak = { verdict: 'leak', severity: 'critical' } as const
  const warning = { verdict: 'warning', severity: 'high' } as const

  test('says each run of equal findings once, with its count', () => {
    assert.equal(countedVerdicts([leak, leak, leak, leak, leak]), 'leak (critical) ×5')
    assert.equal(
      countedVerdicts([leak, leak, warning, leak]),
      'leak (critical) ×2, warning (high), leak (critical)',
    )
    assert.equal(countedVerdicts([]), '')
  })

  test("the demo's canary line with ten leaking answers fits 80 columns", () => {
    const line = `  ${formatProgress({ type: 'probe-end', probe: 'canary', findings: Array(10).fill({ ...leak, probe: 'canary', title: '', evidence: {}, remediation: '' }) }, 78)}`
    assert.equal(line, '  [canary] leak (critical) ×10')
  })
})
