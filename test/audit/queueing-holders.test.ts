/** The queueing probe when a long generation it starts fails while the probe pauses before the
 *  queued requests (the budget running out, as `transformers serve` on a busy machine made it in
 *  a trial): the probe ends with its verdict, and the process does not die of an unhandled
 *  rejection (it did: exit 1, no report). The target here is the probe's own interface, answering
 *  from memory so that the failure lands inside the pause every time. */
import assert from 'node:assert/strict'
import { test } from 'node:test'
import { Budget, BudgetExhaustedError } from '../../src/audit/budget.js'
import type { ProbeContext } from '../../src/audit/probe.js'
import { queueingProbe } from '../../src/audit/probes/queueing.js'
import type { CompletionRequest, CompletionResult, Target } from '../../src/audit/target.js'

test('a holder that fails during the pause before the queued requests: inconclusive, no crash', async () => {
  let numRequests = 0
  const answer = (request: CompletionRequest): CompletionResult => ({
    status: 200,
    failure: null,
    text: `answer to ${request.prompt.slice(0, 8)}`,
    promptTokens: 10,
    cachedTokens: null,
    ttftMs: 5,
    requestNumber: ++numRequests,
    atMs: numRequests,
    errorCode: null,
    errorMessage: null,
  })
  const tenants = [
    { name: 'alice', key: 'ka' },
    { name: 'bob', key: 'kb' },
  ]
  let isBaselineDone = false
  const target = {
    tenants,
    async complete(request: CompletionRequest): Promise<CompletionResult> {
      // The baseline is sent first, one at a time; then the holders, which fail at once.
      if (request.tenant.name === 'alice') {
        isBaselineDone = true
        throw new BudgetExhaustedError('seconds')
      }
      if (isBaselineDone) throw new BudgetExhaustedError('seconds')
      return answer(request)
    },
  } as unknown as Target
  const budget = new Budget({ maxRequests: 100, maxSeconds: 60, concurrency: 4 })
  const findings = await queueingProbe.run(target, budget, {
    seed: 1,
    overCapacityAttempts: 0,
    discovery: { contextTokens: null },
    log: () => undefined,
  } as unknown as ProbeContext)
  assert.equal(findings.length, 1)
  assert.equal(findings[0].verdict, 'inconclusive')
})
