/** Chunked prefill for the prefill worker: one prefill loop per process that, each step, runs a
 *  bounded number of prompt tokens (the step budget) through one batched forward pass, shared
 *  fairly among every prompt being prefilled, and yields to the event loop between steps. So a
 *  long prompt never holds the worker for more than one step, and a short prompt that arrives
 *  behind it is done within a few steps instead of waiting for the long one.
 *  Knows sequences and token ids; knows nothing of transfers, HTTP, tenants or text. */
import { setImmediate as yieldToLoop } from 'node:timers/promises'
import { KvfenceError } from '../common/errors.js'
import type { KvPool } from '../kv/pool.js'
import { forwardBatch, type Rope } from '../model/forward.js'
import type { Model } from '../model/weights.js'
import type { Sequence } from './sequence.js'

/** Options of {@link PrefillScheduler}. */
export interface PrefillSchedulerOptions {
  /** Most prompt tokens per forward step, over all prompts (≥ 1). */
  maxTokensPerStep: number
  /** Called after every step with the tokens each prompt got, in submission order (tests, metrics). */
  onStep?: (numTokensPerPrompt: number[]) => void
}

/** A sequence whose prompt to prefill into its leased pages. */
export interface PrefillJob {
  /** Its lease holds at least `pool.pagesFor(seq.numPromptTokens)` pages. */
  seq: Sequence
  /** Leading tokens whose KV the pages already hold (a prefix-cache hit; default 0); prefill starts
   *  after them. Must be below `seq.numPromptTokens`: the last token is always computed. */
  numCached?: number
  /** Aborts the job at the next step boundary (`request_aborted`). */
  signal: AbortSignal
}

interface Active {
  job: PrefillJob
  /** Tokens already prefilled. */
  numDone: number
  resolve: (logits: Float32Array) => void
  reject: (err: Error) => void
}

/** The prefill loop of one worker process. */
export class PrefillScheduler {
  /** Prompts being prefilled, in submission order. */
  private readonly active: Active[] = []
  /** Rotates which prompt gets a step's leftover tokens (and, when prompts outnumber the budget,
   *  which prompts run at all), so that no prompt is favoured step after step. */
  private turn = 0
  private isLooping = false

  /** Throws RangeError for a step budget below 1. */
  constructor(
    private readonly model: Model,
    private readonly rope: Rope,
    private readonly pool: KvPool,
    private readonly options: PrefillSchedulerOptions,
  ) {
    if (!Number.isInteger(options.maxTokensPerStep) || options.maxTokensPerStep < 1)
      throw new RangeError(
        `tokens per step must be an integer ≥ 1, got ${options.maxTokensPerStep}`,
      )
  }

  /** Prompts being prefilled. */
  get numActive(): number {
    return this.active.length
  }

  /** Prefill `job.seq`'s prompt into its pages; resolves with the last token's logits `[vocabSize]`.
   *  Rejects with `request_aborted` when its signal fires, a guard error (G5) when a write or read
   *  of its pages is refused; no step touches its pages once the promise settled. */
  run(job: PrefillJob): Promise<Float32Array> {
    const { numPromptTokens } = job.seq
    return new Promise((resolve, reject) => {
      if (numPromptTokens === 0) {
        reject(new KvfenceError('invalid_request', 'nothing to prefill: the prompt is empty'))
        return
      }
      const numCached = job.numCached ?? 0
      if (!Number.isInteger(numCached) || numCached < 0 || numCached >= numPromptTokens) {
        reject(
          new KvfenceError(
            'internal_error',
            `cached tokens ${numCached} out of range for a prompt of ${numPromptTokens}`,
          ),
        )
        return
      }
      this.active.push({ job, numDone: numCached, resolve, reject })
      if (!this.isLooping) void this.loop()
    })
  }

  private async loop(): Promise<void> {
    this.isLooping = true
    try {
      while (this.active.length > 0) {
        // Let new prompts, transfers and aborts in before each step (prompts that arrive in the
        // same turn of the event loop share the first step).
        await yieldToLoop()
        this.step()
      }
    } catch (err) {
      // A bug in this loop, not any one prompt's fault: end every prompt rather than the process.
      const e = new KvfenceError('internal_error', `prefill loop failed: ${String(err)}`)
      for (const a of [...this.active]) this.settle(a, e)
    } finally {
      this.isLooping = false
    }
  }

  /** One forward step over a fair share of every prompt's next tokens. */
  private step(): void {
    for (const a of [...this.active]) {
      if (a.job.signal.aborted)
        this.settle(a, new KvfenceError('request_aborted', 'request aborted during prefill'))
    }
    if (this.active.length === 0) return
    const shares = fairShares(
      this.active.map((a) => a.job.seq.numPromptTokens - a.numDone),
      this.options.maxTokensPerStep,
      this.turn++,
    )
    const chunks = this.active.flatMap((a, i) =>
      shares[i] === 0 ? [] : [{ a, numTokens: shares[i] }],
    )
    let results
    try {
      results = forwardBatch(
        this.model,
        this.rope,
        this.pool,
        chunks.map(({ a, numTokens }) =>
          a.job.seq.forwardInput(
            a.job.seq.promptTokenIds.slice(a.numDone, a.numDone + numTokens),
            a.numDone,
          ),
        ),
      )
    } catch (err) {
      const e = new KvfenceError('internal_error', `prefill step failed: ${String(err)}`)
      for (const { a } of chunks) this.settle(a, e)
      return
    }
    this.options.onStep?.(shares)
    for (let i = 0; i < chunks.length; i++) {
      const { a, numTokens } = chunks[i]
      const result = results[i]
      if ('error' in result) {
        this.settle(a, result.error)
        continue
      }
      a.numDone += numTokens
      if (a.numDone === a.job.seq.numPromptTokens) this.settle(a, result.logits)
    }
  }

  private settle(a: Active, outcome: Float32Array | Error): void {
    const at = this.active.indexOf(a)
    if (at >= 0) this.active.splice(at, 1)
    if (outcome instanceof Error) a.reject(outcome)
    else a.resolve(outcome)
  }
}

/**
 * Split a step budget of `budget` tokens among prompts with `remaining[i]` tokens left
 * (max-min fairness, "water filling"): a prompt needing less than an equal share gets what it
 * needs and the rest is shared among the others; tokens that do not divide evenly go one each to
 * the prompts in turn starting at `turn mod count`. Returns tokens per prompt, in input order;
 * they sum to min(budget, Σ remaining).
 */
export function fairShares(remaining: readonly number[], budget: number, turn: number): number[] {
  const count = remaining.length
  const shares = new Array<number>(count).fill(0)
  if (count === 0) return shares
  const start = ((turn % count) + count) % count
  // Rotation order, then by need (ascending, stable): small needs are met first.
  const order = Array.from({ length: count }, (_, j) => (start + j) % count).sort(
    (a, b) => remaining[a] - remaining[b],
  )
  let left = budget
  let j = 0
  // Needs at or under an equal share of what is left are met in full...
  for (; j < count && remaining[order[j]] * (count - j) <= left; j++) {
    shares[order[j]] = remaining[order[j]]
    left -= remaining[order[j]]
  }
  // ...and the other prompts share the rest equally.
  const level = j < count ? Math.floor(left / (count - j)) : 0
  for (let m = j; m < count; m++) shares[order[m]] = level
  left -= level * (count - j)
  // Leftovers (fewer than the prompts still needing tokens), one each in turn order.
  for (let j = 0; j < count && left > 0; j++) {
    const i = (start + j) % count
    if (shares[i] < remaining[i]) {
      shares[i] += 1
      left -= 1
    }
  }
  return shares
}
