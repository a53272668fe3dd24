/** The one line of the `no_completion_answered` tool error when no valid completion of the run was
 *  answered whole, worked by hand for each case: nothing sent before a budget ran out, and
 *  completions that were sent but cut by their own probes before they ended (a fresh-user trial
 *  got "no valid completion was sent" against an endpoint whose answers never end), and answers
 *  that never ended, truncated at their size cap or cut at the deadline in any mix. */
import assert from 'node:assert/strict'
import { test } from 'node:test'
import { Budget } from '../../src/audit/budget.js'
import { noAnswerMessage } from '../../src/audit/gate.js'

const url = 'http://127.0.0.1:9/v1/completions'
const budget = new Budget({ maxRequests: 500, maxSeconds: 40, concurrency: 4 })
const none = { numExpected: 0, numAnswered: 0, notAnsweredBy: {} }

test('nothing sent before the time budget ran out: says so', () => {
  assert.equal(
    noAnswerMessage({ ...none, numCutByProbes: 0 }, 'http://127.0.0.1:9', budget, null),
    `no valid completion was sent to ${url}: the time budget (--max-seconds 40) ran out before the first one. Nothing was audited`,
  )
})

test('completions sent but every one cut by its probe before it ended: says none ended', () => {
  assert.equal(
    noAnswerMessage({ ...none, numCutByProbes: 3 }, 'http://127.0.0.1:9', budget, null),
    `none of the 3 valid completions sent to ${url} ended before its probe cut it (do the endpoint's answers end at max_tokens?), and the time budget (--max-seconds 40) ran out before one could be answered whole. Nothing was audited`,
  )
})

test('an answered completion: no tool error', () => {
  assert.equal(
    noAnswerMessage(
      { numExpected: 1, numAnswered: 1, notAnsweredBy: {}, numCutByProbes: 2 },
      'http://127.0.0.1:9',
      budget,
      null,
    ),
    null,
  )
})

/** An endless endpoint's outcome: valid completions truncated at their size cap, and cut at the
 *  deadline, in the order the ledger met them. */
const endless = (notAnsweredBy: Record<string, number>) => {
  const numExpected = Object.values(notAnsweredBy).reduce((a, b) => a + b, 0)
  return { numExpected, numCutByProbes: 0, numAnswered: 0, notAnsweredBy }
}
const health = { endpoint: '/health', status: 200 } as const
const pastCap =
  'every answer went on past max_tokens until it was cut at its size cap: the endpoint does not end its answers'
const pastCapOrCut =
  'every answer not cut at the deadline went on past max_tokens until it was cut at its size cap: the endpoint does not end its answers'
const deadline =
  "none ended before the time budget's deadline: raise --max-seconds, or check that the endpoint ends its answers at max_tokens"

test('answers that never ended: a truncation names the endpoint, whatever the deadline cut', () => {
  const cases: [Record<string, number>, string][] = [
    [{ 'HTTP 200 truncated': 29 }, `(HTTP 200 truncated ×29); /health answered 200: ${pastCap}`],
    [
      { 'HTTP 200 truncated': 22, 'cut at the deadline': 1 },
      `(HTTP 200 truncated ×22, cut at the deadline ×1); /health answered 200: ${pastCapOrCut}`,
    ],
    // More cut than truncated (a loaded machine reads slowly): still the endpoint's fault.
    [
      { 'HTTP 200 truncated': 1, 'cut at the deadline': 3 },
      `(cut at the deadline ×3, HTTP 200 truncated ×1); /health answered 200: ${pastCapOrCut}`,
    ],
    [{ 'cut at the deadline': 4 }, `(cut at the deadline ×4); /health answered 200: ${deadline}`],
  ]
  for (const [notAnsweredBy, tail] of cases) {
    const summary = endless(notAnsweredBy)
    assert.equal(
      noAnswerMessage(summary, 'http://127.0.0.1:9', budget, health),
      `the target answered none of the ${summary.numExpected} valid completions sent to ${url} ${tail}. Nothing was audited`,
    )
  }
})
