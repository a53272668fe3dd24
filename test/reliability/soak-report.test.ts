/** The soak report's false-alarm fields (`sentinel`, `watch`): `failuresOf` fails a report whose
 *  sentinel flagged anything, whose sentinel counts were unread, or whose watch announced a
 *  finding, each with its own sentence; a clean report of the same shape has no failure. */
import assert from 'node:assert/strict'
import { test } from 'node:test'
import { failuresOf } from '../../src/soak/run.js'
import type { SoakReport } from '../../src/soak/types.js'

/** A report with every must-be-0 figure 0 (hand-written, not produced by a soak). */
const clean: SoakReport = {
  ok: true,
  failures: [],
  seed: 1,
  duration_s: 60,
  tenants: 3,
  requests: 10,
  completed: 10,
  streamed: 5,
  rejected_over_context: 0,
  aborts: { client_abort: 0, client_disconnect: 0 },
  errors: {},
  contaminated_responses: 0,
  oracle_mismatches: 0,
  over_context_accepted: 0,
  hung_requests: 0,
  page_leaks: 0,
  pages_used_at_end: { prefill: 0, decode: 0 },
  max_pages_used: { prefill: 4, decode: 8 },
  rss_growth_ratio: 1,
  rss_judged: false,
  rss_mb: {
    after_warmup: 100,
    at_end: 100,
    timeline: [],
    per_process_at_end: {},
    per_process_slope_mb_per_min: {},
  },
  heap_after_gc_mb: {},
  sentinel: { suspected: 0, confirmed: 0 },
  sentinel_window_s: 30,
  watch: { cycles: 2, findings: 0 },
  examples: [],
}

test('failuresOf: sentinel events and watch findings are false alarms, each named', () => {
  assert.deepEqual(failuresOf(clean), [])
  assert.deepEqual(failuresOf({ ...clean, watch: null }), [], 'a soak without the watch')
  assert.deepEqual(failuresOf({ ...clean, sentinel: { suspected: 2, confirmed: 1 } }), [
    'the sentinel flagged 2 suspected and 1 confirmed cross-tenant answers',
  ])
  assert.deepEqual(failuresOf({ ...clean, sentinel: null }), [
    "the router's sentinel counts could not be read",
  ])
  assert.deepEqual(failuresOf({ ...clean, watch: { cycles: 3, findings: 1 } }), [
    'kvfence watch announced 1 findings',
  ])
})
