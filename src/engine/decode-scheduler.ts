/** Continuous batching for the decode worker: one decode loop per process that, each step, runs one
 *  batched forward pass over every running sequence, samples a token for each, and yields to the
 *  event loop. Sequences join between steps (once their transfer is verified) and leave between
 *  steps (done, aborted or failed); a guard error in one sequence ends that sequence only.
 *  Knows sequences and token ids; knows nothing of transfers, HTTP, tenants or text. */
import { setImmediate as yieldToLoop } from 'node:timers/promises'
import { KvfenceError } from '../common/errors.js'
import type { KvPool } from '../kv/pool.js'
import { forwardBatch, type Rope } from '../model/forward.js'
import type { Model } from '../model/weights.js'
import type { DecodeEvent } from '../control/messages.js'
import type { SampledToken } from './request-sampler.js'
import type { Sequence } from './sequence.js'

/** Default most sequences per decode step (`kvfence decode --max-batch`). */
export const defaultMaxBatch = 32

/** Default most verified sequences waiting for a batch slot before new ones are refused. */
export const defaultMaxWaiting = 256

/** Options of {@link DecodeScheduler}. */
export interface DecodeSchedulerOptions {
  /** Most sequences per forward step (≥ 1). */
  maxBatch?: number
  /** Most sequences waiting for a slot (≥ 0); one more is refused with `capacity_exhausted`. */
  maxWaiting?: number
  /** Called after every step with the number of sequences it ran (for tests and metrics). */
  onStep?: (numSequences: number) => void
}

/** A sequence ready to decode (its prompt KV is in its leased pages and verified, the first token
 *  sampled), and how the loop talks back to its request. */
export interface DecodeJob {
  /** Its lease holds the prompt's pages and room for generated tokens. */
  seq: Sequence
  /** The first generated token (sampled by the prefill worker). */
  firstTokenId: number
  /** Picks the next token from `[vocabSize]` logits with this sequence's own random stream (and
   *  its own counts of generated tokens, for the penalties: see engine/request-sampler.ts), with
   *  its log-probabilities when the request asked for them. */
  sampleNext: (logits: Float32Array) => SampledToken
  /** Aborts the sequence at the next step boundary (`request_aborted`). */
  signal: AbortSignal
  /** Receives `token` events, then `done`. */
  emit: (e: DecodeEvent) => void
}

/** A sequence in the loop. */
interface Running {
  job: DecodeJob
  lastToken: number
  /** Of `lastToken`, when asked for (never for the first token: prefill reports those). */
  lastLogprobs: SampledToken['logprobs']
  numGenerated: number
  resolve: () => void
  reject: (err: Error) => void
}

/** The decode loop of one worker process. */
export class DecodeScheduler {
  private readonly maxBatch: number
  private readonly maxWaiting: number
  /** Sequences in the batch, in join order. */
  private readonly running: Running[] = []
  /** Verified sequences waiting for a batch slot, first come first served. */
  private readonly waiting: Running[] = []
  private isLooping = false

  /** Throws RangeError for a `maxBatch` below 1 or a negative `maxWaiting`. */
  constructor(
    private readonly model: Model,
    private readonly rope: Rope,
    private readonly pool: KvPool,
    private readonly options: DecodeSchedulerOptions = {},
  ) {
    this.maxBatch = options.maxBatch ?? defaultMaxBatch
    this.maxWaiting = options.maxWaiting ?? defaultMaxWaiting
    if (!Number.isInteger(this.maxBatch) || this.maxBatch < 1)
      throw new RangeError(`max batch must be an integer ≥ 1, got ${this.maxBatch}`)
    if (!Number.isInteger(this.maxWaiting) || this.maxWaiting < 0)
      throw new RangeError(`max waiting must be an integer ≥ 0, got ${this.maxWaiting}`)
  }

  /** Sequences in the current batch. */
  get numRunning(): number {
    return this.running.length
  }

  /** Sequences waiting for a batch slot. */
  get numWaiting(): number {
    return this.waiting.length
  }

  /** Sequences in the loop: running plus waiting. */
  get numSequences(): number {
    return this.running.length + this.waiting.length
  }

  /** Whether `numIncoming` more sequences would still fit (running + waiting ≤ maxBatch +
   *  maxWaiting). The decode worker asks before reserving pages, so that a full loop refuses a
   *  request before its prefill and transfer are spent, not after. */
  hasRoomFor(numIncoming: number): boolean {
    return (
      this.running.length + this.waiting.length + numIncoming <= this.maxBatch + this.maxWaiting
    )
  }

  /** Emit the first token, then decode `job.seq` in the shared loop until it stops. Resolves once its
   *  `done` event was emitted; rejects with `request_aborted` when its signal fires, with a guard
   *  error (G5) when a read of its pages is refused, with `internal_error` when its logits cannot be
   *  sampled, and with `capacity_exhausted` (nothing emitted) when too many sequences wait. The
   *  caller releases the pages once this settles: no step touches them afterwards. */
  run(job: DecodeJob): Promise<void> {
    if (!this.hasRoomFor(1)) {
      return Promise.reject(
        new KvfenceError(
          'capacity_exhausted',
          `decode worker busy: ${this.running.length} sequences running and ${this.waiting.length} waiting`,
        ),
      )
    }
    return new Promise<void>((resolve, reject) => {
      const r: Running = {
        job,
        lastToken: job.firstTokenId,
        lastLogprobs: undefined,
        numGenerated: 1,
        resolve,
        reject,
      }
      if (!this.emitToken(r)) return
      this.waiting.push(r)
      if (!this.isLooping) void this.loop()
    })
  }

  /** Step until no sequence is left. Only one loop runs at a time. */
  private async loop(): Promise<void> {
    this.isLooping = true
    try {
      while (this.running.length + this.waiting.length > 0) {
        // Let transfers, new requests and aborts in before each step (sequences that arrive in the
        // same turn of the event loop share the first step).
        await yieldToLoop()
        // Join between steps, first come first served, up to the batch bound.
        while (this.running.length < this.maxBatch && this.waiting.length > 0)
          this.running.push(this.waiting.shift()!)
        this.step()
      }
    } catch (err) {
      // A bug in this loop, not any one sequence's fault: end every sequence rather than the process.
      const e = new KvfenceError('internal_error', `decode loop failed: ${String(err)}`)
      for (const r of [...this.running, ...this.waiting]) this.fail(r, e)
    } finally {
      this.isLooping = false
    }
  }

  /** One forward step over the batch, one token for each sequence. */
  private step(): void {
    for (const r of [...this.running, ...this.waiting]) {
      if (r.job.signal.aborted)
        this.fail(r, new KvfenceError('request_aborted', 'request aborted by the router'))
    }
    const batch = [...this.running]
    if (batch.length === 0) return
    let results
    try {
      results = forwardBatch(
        this.model,
        this.rope,
        this.pool,
        batch.map((r) =>
          r.job.seq.forwardInput([r.lastToken], r.job.seq.numPromptTokens + r.numGenerated - 1),
        ),
      )
    } catch (err) {
      // Not any one sequence's fault (e.g. the kernels' memory is full): every sequence of the step fails.
      const e = new KvfenceError('internal_error', `decode step failed: ${String(err)}`)
      for (const r of batch) this.fail(r, e)
      return
    }
    this.options.onStep?.(batch.length)
    for (let i = 0; i < batch.length; i++) {
      const r = batch[i]
      const result = results[i]
      if ('error' in result) {
        this.fail(r, result.error)
        continue
      }
      try {
        const next = r.job.sampleNext(result.logits)
        r.lastToken = next.tokenId
        r.lastLogprobs = next.logprobs
      } catch (err) {
        this.fail(r, err instanceof Error ? err : new Error(String(err)))
        continue
      }
      r.numGenerated += 1
      this.emitToken(r)
    }
  }

  /** Emit `r`'s last token, and `done` when it was the last one. Returns whether `r` goes on. */
  private emitToken(r: Running): boolean {
    const { job } = r
    const { seq } = job
    try {
      job.emit(
        r.lastLogprobs === undefined
          ? { type: 'token', tokenId: r.lastToken }
          : { type: 'token', tokenId: r.lastToken, logprobs: r.lastLogprobs },
      )
      const isStop = seq.stopTokenIds.has(r.lastToken)
      // The next step would write position numPromptTokens + numGenerated - 1.
      const position = seq.numPromptTokens + r.numGenerated - 1
      const isFull = position >= seq.capacityTokens(this.pool.shape.pageSize)
      if (!isStop && r.numGenerated < seq.maxTokens && !isFull) return true
      job.emit({
        type: 'done',
        finishReason: isStop ? 'stop' : 'length',
        promptTokens: seq.numPromptTokens,
        completionTokens: r.numGenerated,
      })
    } catch (err) {
      this.fail(r, err instanceof Error ? err : new Error(String(err)))
      return false
    }
    this.remove(r)
    r.resolve()
    return false
  }

  private fail(r: Running, err: Error): void {
    this.remove(r)
    r.reject(err)
  }

  private remove(r: Running): void {
    for (const list of [this.running, this.waiting]) {
      const at = list.indexOf(r)
      if (at >= 0) list.splice(at, 1)
    }
  }
}
