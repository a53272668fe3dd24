/** The one line of the `no_completion_answered` tool error when no valid completion of the run was
 *  answered whole, worked by hand for each case: nothing sent before a budget ran out, and
 *  completions that were sent but cut by their own probes before they ended (a fresh-user trial
 *  got "no valid completion was sent" against an endpoint whose answers never end). */
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
