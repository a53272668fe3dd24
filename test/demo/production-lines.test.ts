/** The demo's act 3 lines say which answer the watch's delay is counted from: with only the
 *  sentinel's flag seen, "3.6 s after the first" beside "tenant-b received tenant-a's text: not
 *  seen" read as a contradiction (trial). Exact lines, worked by hand from the outcome's times. */
import assert from 'node:assert/strict'
import { test } from 'node:test'
import { productionLines, type ProductionOutcome } from '../../src/cli/demo-production.js'

const base: ProductionOutcome = {
  faultOnAtMs: 10_000,
  contaminatedAtMs: null,
  sentinelAtMs: 11_400,
  sentinelKind: 'suspected',
  watchAtMs: 15_000,
  watchProbe: 'canary',
  watchAlertAtMs: 14_000,
  watchAlert: 'warning:capacity',
}

test('only the sentinel saw a contaminated answer: the delay is after its flag, within 78 columns (the demo indents by 2)', () => {
  const lines = productionLines(base)
  assert.equal(lines[2], `tenant-b received tenant-a's text`.padEnd(40) + ' not seen')
  assert.equal(
    lines[4],
    'watch: leak alert (canary probe)'.padEnd(40) + ' +5.0 s, 3.6 s after the sentinel',
  )
  for (const line of lines) assert.ok(line.length <= 78, line)
})

test("tenant-b's answer came first: the delay is after it", () => {
  const lines = productionLines({ ...base, contaminatedAtMs: 11_000, watchAtMs: 25_000 })
  assert.equal(
    lines[4],
    'watch: leak alert (canary probe)'.padEnd(40) + ' +15.0 s, 14.0 s after tenant-b',
  )
  for (const line of lines) assert.ok(line.length <= 78, line)
})
