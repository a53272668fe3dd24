/** docs/faults.md's fault × probe matrix is written from the audit benchmark's JSON, not by
 *  hand: the committed `bench/results/audit.json` has the shape the writer reads, and the
 *  table in the doc is exactly what bench/audit-matrix.ts writes from it. The writer itself is
 *  checked on a hand-built JSON, row by row. */
import assert from 'node:assert/strict'
import { readFileSync } from 'node:fs'
import { join } from 'node:path'
import { describe, test } from 'node:test'
import {
  checkBenchJson,
  faultMatrixTable,
  generatedMatrix,
  matrixBegin,
  mergeBenchJson,
  matrixEnd,
  withMatrix,
  type AuditBenchJson,
} from '../../bench/audit-matrix.js'
import { probesFor } from '../../bench/audit.js'
import { probeNames } from '../../src/audit/types.js'
import { faultDescriptions } from '../../src/engine/faults.js'
import { repoRoot } from '../helpers/paths.js'

const faultsDoc = join(repoRoot, 'docs', 'faults.md')
const benchJson = join(repoRoot, 'bench', 'results', 'audit.json')

describe('docs/faults.md § What the auditor finds with guards off', () => {
  test('the committed bench JSON has the shape the table is written from', () => {
    assert.doesNotThrow(() => checkBenchJson(JSON.parse(readFileSync(benchJson, 'utf8'))))
  })

  test('the table is what bench/audit-matrix.ts writes from the committed JSON', () => {
    const json = checkBenchJson(JSON.parse(readFileSync(benchJson, 'utf8')))
    const table = faultMatrixTable(json)
    const current = generatedMatrix(readFileSync(faultsDoc, 'utf8'))
    assert.notEqual(current, null, `docs/faults.md has no ${matrixBegin} … ${matrixEnd} section`)
    assert.equal(
      current,
      table,
      'docs/faults.md differs from bench/results/audit.json: run `node dist/bench/audit-matrix.js bench/results/audit.json docs/faults.md`',
    )
  })

  test('every fault has probes to run, each a probe the audit has; abort-retry looks at publish-partial', () => {
    assert.deepEqual(Object.keys(probesFor).sort(), Object.keys(faultDescriptions).sort())
    for (const probes of Object.values(probesFor)) {
      assert.ok(probes.length > 0)
      for (const p of probes) assert.ok((probeNames as readonly string[]).includes(p), p)
    }
    assert.ok(probesFor['publish-partial'].includes('abort-retry'))
  })
})

describe('faultMatrixTable', () => {
  const json: AuditBenchJson = {
    seed: 1,
    fault_seconds: 120,
    faults: [
      {
        fault: 'publish-partial',
        probes: ['abort-race', 'abort-retry', 'determinism'],
        outcome: 'detected',
        detectedBy: ["abort-retry: leak: tenant-a's retry answer carried a canary: of tenant-b"],
        inconclusive: [],
        firstFinding: { probe: 'abort-retry', verdict: 'leak', requestNumber: 63, seconds: 9.25 },
        requestsSent: 70,
        auditSeconds: 12.5,
      },
      {
        fault: 'lost-ack',
        probes: ['page-leak', 'error-handling'],
        outcome: 'inconclusive',
        detectedBy: [],
        inconclusive: ['page-leak: the time budget ran out', 'error-handling: no answer'],
        firstFinding: null,
        requestsSent: 9,
        auditSeconds: 120,
      },
      {
        fault: 'drop-abort',
        probes: ['abort-race', 'page-leak'],
        outcome: 'detected',
        detectedBy: ['page-leak: warning: 36 pages still held'],
        inconclusive: [],
        firstFinding: null,
        requestsSent: 80,
        auditSeconds: 30,
      },
      {
        fault: 'corrupt-transfer',
        probes: ['canary', 'concurrency', 'determinism'],
        outcome: 'tool error',
        toolError: 'the target answered none of the 8 valid completions (HTTP 500 ×8)',
        detectedBy: [],
        inconclusive: ['canary: no answer'],
        firstFinding: null,
        requestsSent: 12,
        auditSeconds: 4,
      },
    ],
  }

  test('a row per fault of src/engine/faults.ts, in its order; faults not run say so', () => {
    const lines = faultMatrixTable(json).split('\n')
    assert.equal(lines[0], 'One run: seed 1, at most 120 s per fault.')
    const rows = lines.filter((l) => l.startsWith('| `'))
    assert.deepEqual(
      rows.map((r) => r.split(' | ')[0].slice(3, -1)),
      Object.keys(faultDescriptions),
    )
    const row = (fault: string): string => rows.find((r) => r.startsWith(`| \`${fault}\``))!
    assert.equal(
      row('publish-partial'),
      '| `publish-partial` | abort-race, abort-retry, determinism | **detected**: abort-retry: leak | abort-retry | 63 (9.3 s) |',
    )
    assert.equal(
      row('lost-ack'),
      '| `lost-ack` | page-leak, error-handling | inconclusive: page-leak, error-handling | — | — |',
    )
    assert.equal(
      row('drop-abort'),
      '| `drop-abort` | abort-race, page-leak | **detected**: page-leak: warning | by the end | 80 (all sent) |',
    )
    assert.equal(
      row('corrupt-transfer'),
      '| `corrupt-transfer` | canary, concurrency, determinism | **tool error** (exit 2): the target answered none of the 8 valid completions (HTTP 500 ×8) | the audit (exit 2) | 12 (all sent) |',
    )
    assert.equal(row('skip-scrub'), '| `skip-scrub` | — | not run in this JSON | — | — |')
  })

  test('withMatrix replaces only the section between the markers', () => {
    const doc = `# T\n\nbefore\n\n${matrixBegin}\nold\n${matrixEnd}\n\nafter\n`
    const table = faultMatrixTable(json)
    assert.equal(
      withMatrix(doc, table),
      `# T\n\nbefore\n\n${matrixBegin}\n${table}${matrixEnd}\n\nafter\n`,
    )
    assert.equal(generatedMatrix(withMatrix(doc, table)), table)
  })

  test('a tool error without its line is refused with the field', () => {
    assert.throws(
      () => checkBenchJson({ ...json, faults: [{ ...json.faults[3], toolError: undefined }] }),
      /faults\[0\]\.toolError is missing for a tool error/,
    )
  })

  test('mergeBenchJson: a run of some faults replaces their rows, keeps the others, recomputes the lists', () => {
    const earlier = {
      ...json,
      faults_detected: ['publish-partial', 'drop-abort'],
      false_findings: 1,
      shipped_seeds: 2,
      shipped: [{ seed: 1, falseFindings: ['x'], inconclusive: [] }],
    }
    const fresh = {
      seed: 1,
      fault_seconds: 120,
      shipped_seeds: 2,
      false_findings: 0,
      shipped: [{ seed: 1, falseFindings: [], inconclusive: [] }],
      faults: [
        { ...json.faults[1], outcome: 'detected', detectedBy: ['page-leak: warning: held'] },
        { ...json.faults[0], fault: 'offload-load-as-hit', probes: ['evict-then-return'] },
      ],
    }
    const merged = mergeBenchJson(earlier, fresh)
    assert.deepEqual(
      (merged.faults as { fault: string; outcome: string }[]).map((r) => [r.fault, r.outcome]),
      [
        ['drop-abort', 'detected'],
        ['corrupt-transfer', 'tool error'],
        ['lost-ack', 'detected'],
        ['publish-partial', 'detected'],
        ['offload-load-as-hit', 'detected'],
      ],
    )
    assert.deepEqual(merged.faults_detected, [
      'drop-abort',
      'lost-ack',
      'publish-partial',
      'offload-load-as-hit',
    ])
    assert.deepEqual(merged.faults_inconclusive, [])
    assert.deepEqual(merged.faults_tool_error, ['corrupt-transfer'])
    assert.deepEqual([merged.false_findings, merged.shipped], [0, fresh.shipped])
    assert.deepEqual(merged.merged, [
      { faults: ['publish-partial', 'lost-ack', 'drop-abort', 'corrupt-transfer'] },
      { faults: ['lost-ack', 'offload-load-as-hit'], shipped_seeds: 2 },
    ])
    // No shipped seed in the fresh run: the earlier shipped runs stand.
    assert.equal(mergeBenchJson(earlier, { ...fresh, shipped_seeds: 0 }).false_findings, 1)
    assert.doesNotThrow(() => checkBenchJson(merged))
    assert.throws(
      () => mergeBenchJson(earlier, { ...fresh, seed: 2 }),
      /cannot merge a run of seed 2, 120 s per fault into one of seed 1, 120 s/,
    )
  })

  // The incident's top-level figures were the earlier run's while its row was the fresh one's.
  test("mergeBenchJson: the incident's figures are those of the run that gave its row", () => {
    const earlier = { ...json, incident_detect_requests: 28, incident_detect_seconds: 3.47 }
    const row = { ...json.faults[0], fault: 'placeholder-forward', detectRequests: 22 }
    const fresh = {
      seed: 1,
      fault_seconds: 120,
      incident_detect_requests: 22,
      incident_detect_seconds: 1.7,
      faults: [row],
    }
    const merged = mergeBenchJson(earlier, fresh)
    assert.deepEqual([merged.incident_detect_requests, merged.incident_detect_seconds], [22, 1.7])
    const other = mergeBenchJson(earlier, { ...fresh, faults: [json.faults[1]] })
    assert.deepEqual([other.incident_detect_requests, other.incident_detect_seconds], [28, 3.47])
  })

  test('a JSON naming an unknown fault is refused with the field', () => {
    assert.throws(
      () => checkBenchJson({ ...json, faults: [{ ...json.faults[0], fault: 'no-such-fault' }] }),
      /faults\[0\]\.fault is not a fault of src\/engine\/faults\.ts/,
    )
  })
})
