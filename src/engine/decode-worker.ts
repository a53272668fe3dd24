/** Decode worker: reserves pages for a prompt, receives and verifies its KV from the prefill worker,
 *  then generates tokens for many requests at once (continuous batching: decode-scheduler.ts).
 *  Knows token ids, tenants and the transfer receiver's hooks; knows nothing of HTTP, keys or text. */
import { KvfenceError } from '../errors.js'
import { leasePrefix } from '../kv/pool.js'
import type { BeginInfo, ReceiverHooks, Reservation } from '../transfer/index.js'
import type { DecodeEvent, GenerateRequest } from './control.js'
import { DecodeScheduler } from './decode-scheduler.js'
import { RequestSampler } from './request-sampler.js'
import { Sequence } from './sequence.js'
import { failureReason, scatterPage, type WorkerCore } from './worker-core.js'

/** How long a reservation waits for its transfer to begin before it is given up (ms). Only a
 *  transfer that never began may be given up on a timer: its pages cannot be written any more. */
export const bootstrapTimeoutMs = 30_000

/** A sequence between reservation and the end of its transfer. */
interface Pending {
  seq: Sequence
  numPromptPages: number
  secret: Buffer
  state: 'waiting' | 'receiving' | 'received' | 'failed'
  /** Why the transfer in flight must stop at its next frame (G8 abort, or an early-release fault
   *  refused by G7); null while it may go on. */
  cancel: KvfenceError | null
  settle: (result: { firstTokenId: number } | KvfenceError) => void
  /** Fault `early-release` only: free the pages now, whatever still writes into them. */
  releaseNow: () => void
}

/** Options of {@link DecodeWorker}. */
export interface DecodeWorkerOptions {
  /** Most sequences per decode step (`--max-batch`); default `defaultMaxBatch` (32) of
   *  decode-scheduler.ts. */
  maxBatch?: number
  /** Most verified sequences waiting for a batch slot; default `defaultMaxWaiting` (256). */
  maxWaiting?: number
}

/** The decode side of a disaggregated pair. One instance per process. */
export class DecodeWorker {
  private readonly pending = new Map<string, Pending>()
  private scheduler: DecodeScheduler | undefined

  constructor(
    readonly core: WorkerCore,
    private readonly options: DecodeWorkerOptions = {},
  ) {}

  /** Hooks for the transfer receiver: secrets of known requests, and reservations verified
   *  against what the router told this worker (G4). */
  readonly receiverHooks: ReceiverHooks = {
    secretFor: (requestId) => this.pending.get(requestId)?.secret,
    begin: (info) => this.begin(info),
  }

  /** Generate tokens for `req`, calling `emit` for each event (first `reserved`, then `token`s, then
   *  `done`). Throws before `reserved` for a request this pool cannot hold (G3,
   *  `context_length_exceeded`) or momentarily cannot (`capacity_exhausted`); throws after it when
   *  the transfer fails or is aborted, a guard trips, or `signal` fires (`request_aborted`). */
  async generate(
    req: GenerateRequest,
    signal: AbortSignal,
    emit: (e: DecodeEvent) => void,
  ): Promise<void> {
    const { pool, model, trips } = this.core
    const numPromptTokens = req.promptTokenIds.length
    const total = numPromptTokens + req.maxTokens
    const limit = Math.min(pool.capacityTokens, model.config.maxPositionEmbeddings)
    if (total > limit && this.core.guards.G3) {
      throw trips.trip(
        'G3',
        `prompt of ${numPromptTokens} tokens + max_tokens ${req.maxTokens} exceeds this decode worker's KV capacity of ${limit} tokens`,
        'context_length_exceeded',
      )
    }
    if (this.pending.has(req.requestId))
      throw new KvfenceError('invalid_request', `request ${req.requestId} is already running`)
    // Refuse a full decode loop now, before any page is reserved or any prefill is spent: the
    // router retries `capacity_exhausted` before `reserved` (back-pressure), while a refusal after
    // the transfer could only fail the request. Reservations still awaiting their transfer count.
    const loop = this.decodeLoop()
    if (!loop.hasRoomFor(this.pending.size + 1))
      throw new KvfenceError(
        'capacity_exhausted',
        `decode worker busy: ${loop.numSequences} sequences decoding and ${this.pending.size} awaiting their transfer`,
      )

    const owner = this.core.nextOwner()
    const lease = pool.allocate(
      pool.pagesFor(Math.min(total, limit)),
      owner,
      this.core.tenantId(req.tenant),
    )
    const seq = new Sequence({
      id: req.requestId,
      tenant: req.tenant,
      promptTokenIds: req.promptTokenIds,
      sampling: req.sampling,
      maxTokens: req.maxTokens,
      stopTokenIds: new Set(req.stopTokenIds),
      lease,
    })
    let released = false
    const release = () => {
      if (released || pool.isPinned(lease)) return
      released = true
      pool.release(lease)
    }
    // The fault's premature free: no pin check here, only the pool's own G7 can refuse it.
    const releaseNow = () => {
      if (released) return
      pool.release(lease)
      released = true
    }
    let received: { firstTokenId: number }
    try {
      received = await this.awaitTransfer(
        seq,
        req.transferSecret,
        signal,
        emit,
        release,
        releaseNow,
      )
    } catch (err) {
      release() // deferred when a transfer still holds the pages: its abort() releases them.
      throw err
    }

    try {
      await this.decode(seq, received.firstTokenId, signal, emit)
    } finally {
      release()
    }
  }

  /** Register the reservation, announce it, and wait until its transfer is verified. */
  private awaitTransfer(
    seq: Sequence,
    transferSecret: string,
    signal: AbortSignal,
    emit: (e: DecodeEvent) => void,
    release: () => void,
    releaseNow: () => void,
  ): Promise<{ firstTokenId: number }> {
    const { pool, guards } = this.core
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => {
        if (entry.state === 'waiting')
          entry.settle(
            new KvfenceError(
              'transfer_failed',
              `no transfer for request ${seq.id} within ${bootstrapTimeoutMs} ms`,
            ),
          )
      }, bootstrapTimeoutMs)
      const onAbort = () => {
        // A transfer in flight keeps its pages pinned; they are released when it settles (G7).
        if (entry.state === 'waiting' || entry.state === 'received')
          entry.settle(new KvfenceError('request_aborted', 'request aborted by the router'))
        else if (entry.state === 'receiving') {
          entry.state = 'failed'
          // G8: the transfer in flight is cancelled at its next frame (NACK); its pages are freed
          // once the receiver calls abort(), i.e. once nothing can write them any more (G7).
          if (guards.G8)
            entry.cancel ??= new KvfenceError('request_aborted', 'request aborted by the router')
        }
      }
      const entry: Pending = {
        seq,
        numPromptPages: pool.pagesFor(seq.numPromptTokens),
        secret: Buffer.from(transferSecret, 'hex'),
        state: 'waiting',
        cancel: null,
        releaseNow,
        settle: (result) => {
          clearTimeout(timer)
          signal.removeEventListener('abort', onAbort)
          this.pending.delete(seq.id)
          if (result instanceof KvfenceError) {
            entry.state = 'failed'
            reject(result)
            release()
          } else if (signal.aborted) {
            entry.state = 'failed'
            reject(new KvfenceError('request_aborted', 'request aborted by the router'))
            release()
          } else {
            entry.state = 'received'
            resolve(result)
          }
        },
      }
      this.pending.set(seq.id, entry)
      signal.addEventListener('abort', onAbort, { once: true })
      emit({ type: 'reserved', numPages: seq.lease.pages.length })
      if (signal.aborted) onAbort()
    })
  }

  /** A BEGIN arrived with a valid HMAC: check it describes exactly the reserved request (G4) and
   *  hand the receiver a reservation over the prompt's pages, pinned until the transfer settles (G7). */
  private begin(info: BeginInfo): Reservation {
    const { metrics } = this.core
    try {
      return this.reserve(info)
    } catch (err) {
      // Refused at BEGIN: nothing was reserved, so abort() will not follow; count it here.
      metrics.transfers.inc({ outcome: 'failed' })
      metrics.transferFailures.inc({ reason: failureReason(err) })
      throw err
    }
  }

  private reserve(info: BeginInfo): Reservation {
    const { pool, trips, guards, metrics } = this.core
    const entry = this.pending.get(info.requestId)
    if (!entry || entry.state !== 'waiting') {
      throw new KvfenceError(
        'transfer_failed',
        `transfer ${info.transferId}: no reservation waiting for request ${info.requestId}`,
      )
    }
    const { seq } = entry
    const { numPromptTokens } = seq
    if (guards.G4) {
      const problems: string[] = []
      if (info.tenant !== seq.tenant) problems.push(`tenant ${info.tenant} ≠ ${seq.tenant}`)
      if (info.numTokens !== numPromptTokens)
        problems.push(`token count ${info.numTokens} ≠ ${numPromptTokens}`)
      if (info.numPages !== entry.numPromptPages)
        problems.push(`page count ${info.numPages} ≠ ${entry.numPromptPages}`)
      if (info.pageBytes !== pool.pageBytes)
        problems.push(`page bytes ${info.pageBytes} ≠ ${pool.pageBytes}`)
      if (problems.length > 0) {
        const err = trips.trip(
          'G4',
          `transfer ${info.transferId} does not match request ${seq.id}: ${problems.join(', ')}`,
          'transfer_failed',
        )
        entry.settle(err)
        throw err
      }
    }
    const promptPages = leasePrefix(seq.lease, entry.numPromptPages)
    pool.pin(promptPages)
    entry.state = 'receiving'
    if (this.core.hasFault('early-release')) {
      // The bug class of sglang#24527: a cleanup path frees the request's pages while its transfer
      // still writes into them. G7 (in pool.release) refuses while they are pinned; the refusal
      // fails the request, and the pages are freed once the transfer settled.
      try {
        entry.releaseNow()
      } catch (err) {
        entry.cancel = err as KvfenceError
      }
    }
    /** True once complete() returned or abort() ran: the transfer is over. */
    let isSettled = false
    // The receiver never calls a hook after the transfer ended; refuse anyway, so that a late write
    // or a second complete() can neither touch the pages (decoding by now, or another request's)
    // nor count the transfer twice.
    const ended = () =>
      new KvfenceError('transfer_failed', `transfer ${info.transferId} has already ended`)
    const unpinOnce = () => {
      if (isSettled) return false
      isSettled = true
      pool.unpin(promptPages)
      return true
    }
    return {
      pageSize: pool.shape.pageSize,
      writePage: (ordinal, tokensOnPage, payload) => {
        if (isSettled) throw ended()
        if (entry.cancel !== null) throw entry.cancel // → NACK, then abort() frees the pages
        // Bounds are checked whatever the guards: a write outside the reservation is never possible.
        if (
          ordinal < 0 ||
          ordinal >= promptPages.pages.length ||
          tokensOnPage > pool.shape.pageSize ||
          payload.byteLength !== pool.pageBytes
        ) {
          throw new KvfenceError(
            'transfer_failed',
            `transfer ${info.transferId}: page ${ordinal} (${tokensOnPage} tokens, ${payload.byteLength} bytes) is outside the reservation`,
          )
        }
        // Claim first (owner, epoch, no gap: G5), then write.
        pool.noteWrite(promptPages, ordinal * pool.shape.pageSize, tokensOnPage)
        scatterPage(pool, promptPages.pages[ordinal].page, payload)
      },
      complete: (firstTokenId) => {
        if (isSettled) throw ended()
        if (entry.cancel !== null) throw entry.cancel // → NACK, then abort() frees the pages
        if (guards.G4) {
          // Every prompt position must hold KV that arrived for this request.
          for (let ordinal = 0; ordinal < promptPages.pages.length; ordinal++) {
            const want = Math.min(
              pool.shape.pageSize,
              numPromptTokens - ordinal * pool.shape.pageSize,
            )
            const have = pool.fill[promptPages.pages[ordinal].page]
            if (have !== want) {
              throw trips.trip(
                'G4',
                `transfer ${info.transferId}: page ${ordinal} holds ${have} tokens, ${want} expected`,
                'transfer_failed',
              )
            }
          }
        }
        if (firstTokenId < 0 || firstTokenId >= this.core.model.config.vocabSize) {
          throw new KvfenceError(
            'transfer_failed',
            `transfer ${info.transferId}: first token ${firstTokenId} outside the vocabulary`,
          )
        }
        unpinOnce()
        metrics.transfers.inc({ outcome: 'completed' })
        metrics.transferBytes.inc(promptPages.pages.length * pool.pageBytes)
        if (entry.state === 'failed') {
          entry.settle(new KvfenceError('request_aborted', 'request aborted by the router'))
          return
        }
        entry.settle({ firstTokenId })
      },
      abort: (reason) => {
        let err =
          reason instanceof KvfenceError
            ? reason
            : new KvfenceError('transfer_failed', String(reason))
        try {
          if (!unpinOnce()) return
        } catch (unpinErr) {
          // A refused unpin (a guard saw the pages change hands) must still end the request.
          err = unpinErr instanceof KvfenceError ? unpinErr : err
        }
        metrics.transfers.inc({ outcome: 'failed' })
        metrics.transferFailures.inc({ reason: failureReason(err) })
        entry.settle(err)
      },
    }
  }

  /** Generate up to `maxTokens` tokens, the first one sampled by the prefill worker, in the
   *  process's decode loop (continuous batching: this request shares each forward step with every
   *  other running request, and a failure of another request never ends this one). */
  private async decode(
    seq: Sequence,
    firstTokenId: number,
    signal: AbortSignal,
    emit: (e: DecodeEvent) => void,
  ): Promise<void> {
    const { pool } = this.core
    // Full prompt pages are read-only from now on; the last one may still receive generated tokens.
    pool.seal(leasePrefix(seq.lease, Math.floor(seq.numPromptTokens / pool.shape.pageSize)))
    // The request's own stream (decode draws with seed + 1, prefill drew with seed), whatever
    // else shares the batch; its penalties count the first token too.
    const sampler = new RequestSampler(seq.sampling, 'decode')
    sampler.record(firstTokenId)
    await this.decodeLoop().run({
      seq,
      firstTokenId,
      sampleNext: (logits) => sampler.next(logits),
      signal,
      emit,
    })
  }

  /** The process's one decode loop, made on first use. */
  private decodeLoop(): DecodeScheduler {
    this.scheduler ??= new DecodeScheduler(this.core.model, this.core.rope, this.core.pool, {
      maxBatch: this.options.maxBatch,
      maxWaiting: this.options.maxWaiting,
    })
    return this.scheduler
  }
}
