/** A `CompletionResult` for unit tests of what the auditor makes of an answer: an empty answer
 *  with no counts, as the first request of a run, with `fields` set over it. */
import type { CompletionResult } from '../../src/audit/target.js'

/** An empty answer (no text, no counts, request 1 at 0 ms) with `fields` over it. */
export function completionResult(fields: Partial<CompletionResult>): CompletionResult {
  return {
    status: null,
    failure: null,
    text: '',
    promptTokens: null,
    cachedTokens: null,
    ttftMs: null,
    requestNumber: 1,
    atMs: 0,
    errorCode: null,
    errorMessage: null,
    ...fields,
  }
}
