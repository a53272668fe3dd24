/** The concurrency probe's clean verdict names only the bursts it exercised: against
 *  `transformers serve` on a busy machine the ramp went 1/1 2/2 4/4 0/8 0/16 and the title said
 *  "bursts of 1, 2, 4, 8, 16" (trial). The target here is the probe's own interface, answering
 *  from memory: the first seven requests (bursts of 1, 2 and 4) are answered, later ones time
 *  out. */
import assert from 'node:assert/strict'
import { test } from 'node:test'
import { Budget } from '../../src/audit/budget.js'
import type { ProbeContext } from '../../src/audit/probe.js'
import { concurrencyProbe } from '../../src/audit/probes/concurrency.js'
import type { CompletionRequest, CompletionResult, Target } from '../../src/audit/target.js'

test('bursts with fewer than two answers are named as not exercised, not as clean', async () => {
  let numRequests = 0
  const target = {
    tenants: [
      { name: 'alice', key: 'ka' },
      { name: 'bob', key: 'kb' },
    ],
    async complete(request: CompletionRequest): Promise<CompletionResult> {
      const n = ++numRequests
      const isAnswered = n <= 7
      return {
        status: isAnswered ? 200 : null,
        failure: isAnswered ? null : 'timeout',
        // An answer carrying its own prompt's material (the probe plants it in the prompt).
        text: isAnswered ? request.prompt : '',
        promptTokens: isAnswered ? 10 : null,
        cachedTokens: null,
        ttftMs: isAnswered ? 5 : null,
        requestNumber: n,
        atMs: n,
        errorCode: null,
        errorMessage: null,
      }
    },
  } as unknown as Target
  const budget = new Budget({
    maxRequests: 100,
    maxSeconds: 60,
    concurrency: 4,
    maxConcurrency: 16,
  })
  const findings = await concurrencyProbe.run(target, budget, {
    seed: 1,
    overCapacityAttempts: 0,
    log: () => undefined,
  } as unknown as ProbeContext)
  assert.equal(findings.length, 1)
  assert.equal(findings[0].verdict, 'clean', findings[0].title)
  assert.equal(
    findings[0].title,
    '7 answers in bursts of 1, 2, 4 in flight carried only their own material; not exercised: bursts of 8, 16 (fewer than two answered)',
  )
})
