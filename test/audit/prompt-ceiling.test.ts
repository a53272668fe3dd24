/** The prompt ceiling (prompt-ceiling.ts) with no limit known: it grows from answered prompts and
 *  stops at the engine's first server error or missing answer, but not at a request the audit's
 *  own deadline cut (that missing answer is ours, not the engine's refusal). */
import assert from 'node:assert/strict'
import { describe, test } from 'node:test'
import { PromptCeiling } from '../../src/audit/prompt-ceiling.js'
import type { CompletionResult } from '../../src/audit/target.js'

let requestNumber = 0
/** A completion's result: answered 200, or `status`/`failure` as given. */
function result(
  status: number | null,
  failure: CompletionResult['failure'] = null,
): CompletionResult {
  requestNumber++
  return {
    status,
    failure,
    text: status === 200 ? 'ok' : '',
    promptTokens: null,
    cachedTokens: null,
    ttftMs: null,
    requestNumber,
    atMs: requestNumber,
    errorCode: null,
    errorMessage: null,
  }
}

describe('prompt ceiling with no limit known', () => {
  test('a request cut by the audit’s deadline does not stop the growth; the engine’s timeout does', () => {
    const ceiling = new PromptCeiling(null, false)
    assert.equal(ceiling.maxRequestTokens(), 256) // before any answer
    ceiling.observe(true, 300, result(200))
    assert.equal(ceiling.maxRequestTokens(), 600) // twice the largest answered
    // Timed out when the audit's time ran out: ours.
    ceiling.observe(true, 500, result(null, 'timeout'), true)
    assert.equal(ceiling.maxRequestTokens(), 600)
    ceiling.observe(true, 400, result(200))
    assert.equal(ceiling.maxRequestTokens(), 800)
    assert.doesNotMatch(ceiling.describe(), /no larger since/)
    // Timed out with the audit's time left: the engine did not answer; growth stops there.
    ceiling.observe(true, 500, result(null, 'timeout'))
    assert.equal(ceiling.maxRequestTokens(), 400)
    assert.match(ceiling.describe(), /no larger since request #\d+ got a server error or no answer/)
  })

  test('a 5xx stops the growth even at the deadline (the engine answered it)', () => {
    const ceiling = new PromptCeiling(null, false)
    ceiling.observe(true, 300, result(200))
    ceiling.observe(true, 500, result(500), true)
    assert.equal(ceiling.maxRequestTokens(), 300)
  })

  test('capped at 1,024 tokens without --aggressive; a known limit is the ceiling', () => {
    const ceiling = new PromptCeiling(null, false)
    ceiling.observe(true, 900, result(200))
    assert.equal(ceiling.maxRequestTokens(), 1024)
    const aggressive = new PromptCeiling(null, true)
    aggressive.observe(true, 900, result(200))
    assert.equal(aggressive.maxRequestTokens(), 1800)
    assert.equal(new PromptCeiling(4096, false).maxRequestTokens(), 4096)
  })
})
