/** How large a request the auditor may send to an endpoint that does not say how much it holds.
 *  An engine that validates nothing can be wedged by one request: a `max_tokens` it generates to
 *  the end after the client has left, or a prompt over its KV pool that kills its batching worker
 *  (Hugging Face `transformers serve` with continuous batching: a 4,167-token prompt into a
 *  4,096-token pool, then 503 for every request). So, where neither discovery nor the operator
 *  (`--context-window`, `--kv-pool-tokens`) gives a limit, a request's tokens (prompt plus
 *  `max_tokens`) grow only from what was answered: at most twice the largest prompt answered
 *  so far (and {@link firstCeilingTokens} before any), never more than
 *  {@link unknownLimitTokens} (a size every serving engine of today holds), and not at all once
 *  a valid request got a 5xx or no answer. `--aggressive` lifts the fixed cap, never the rule
 *  about 5xx. Where a limit is known, the probes size their requests by it and this says that
 *  limit.
 *  Knows completions' sizes and fates; knows nothing of any probe. */
import type { CompletionResult } from './target.js'

/** A request's tokens at most before any prompt was answered, with nothing known. */
export const firstCeilingTokens = 256
/** A request's tokens at most with nothing known, under the default options. */
export const unknownLimitTokens = 1024

export class PromptCeiling {
  private largestAnsweredTokens = 0
  /** The first valid request that got a 5xx or no answer, by number; growth stops there. */
  private stoppedAt: number | null = null

  /** `knownLimitTokens`: the smallest of the context, the pool and the input limit the endpoint
   *  or the operator gave, or null. */
  constructor(
    readonly knownLimitTokens: number | null,
    readonly isAggressive: boolean,
  ) {}

  /** Takes one completion as it ends. `promptTokens`: the server's count, else the sender's
   *  estimate (null: unknown, then the answer does not raise the ceiling). `isCutByAudit`: it
   *  ended with the audit's own time (its deadline, the running probe's share, an interruption),
   *  so a missing answer is ours, not the engine's refusal, and does not stop the growth. */
  observe(
    isValid: boolean,
    promptTokens: number | null,
    result: CompletionResult,
    isCutByAudit = false,
  ): void {
    const status = result.status
    const isAnswered = status !== null && status >= 200 && status < 300 && result.failure === null
    if (isAnswered && promptTokens !== null)
      this.largestAnsweredTokens = Math.max(this.largestAnsweredTokens, promptTokens)
    const isServerFailure =
      (status !== null && status >= 500) ||
      (status === null &&
        !isCutByAudit &&
        (result.failure === 'network' || result.failure === 'timeout'))
    if (isValid && isServerFailure) this.stoppedAt ??= result.requestNumber
  }

  /** The most tokens (prompt plus `max_tokens`) one request may have now. */
  maxRequestTokens(): number {
    if (this.knownLimitTokens !== null) return this.knownLimitTokens
    const answered = this.largestAnsweredTokens
    const grown = this.stoppedAt !== null ? answered : Math.max(firstCeilingTokens, 2 * answered)
    return this.isAggressive ? grown : Math.min(grown, unknownLimitTokens)
  }

  /** Why the ceiling is where it is, for evidence and inconclusive titles. */
  describe(): string {
    if (this.knownLimitTokens !== null)
      return `the endpoint's limit of ${this.knownLimitTokens} tokens`
    const cap = this.isAggressive ? '' : `, at most ${unknownLimitTokens} (--aggressive lifts this)`
    const stop =
      this.stoppedAt === null
        ? ''
        : `; no larger since request #${this.stoppedAt} got a server error or no answer`
    return `no limit known (give --context-window or --kv-pool-tokens): ${this.maxRequestTokens()} tokens, grown from the largest prompt answered (${this.largestAnsweredTokens})${cap}${stop}`
  }
}
