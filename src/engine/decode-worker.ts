/** Decode worker: reserves pages for a prompt, receives and verifies its KV from the prefill worker,
 *  then generates tokens for many requests at once (continuous batching: decode-scheduler.ts).
 *  Knows token ids, tenants and the transfer receiver's hooks; knows nothing of HTTP, keys or text. */
import assert from 'node:assert/strict'
import { KvfenceError } from '../common/errors.js'
import { leasePrefix, type PageLease } from '../kv/pool.js'
import type { BeginInfo, ReceiverHooks, Reservation } from '../transfer/index.js'
import type { DecodeEvent, GenerateRequest } from '../control/messages.js'
import { DecodeScheduler } from './decode-scheduler.js'
import { RequestSampler } from './request-sampler.js'
import { Sequence } from './sequence.js'
import { failureReason, pageSlices, scatterPage, type WorkerCore } from './worker-core.js'

/** How long a reservation waits for its transfer to begin before it is given up (ms). Only a
 *  transfer that never began may be given up on a timer: its pages cannot be written any more. */
export const bootstrapTimeoutMs = 30_000

/** Phases of a decode reservation: its pages are leased and it waits for a BEGIN (`waiting`), a
 *  transfer writes its prompt's pages (`receiving`), every page is verified (`received`, it may
 *  decode), or it ended with an error (`failed`). */
export type ReservationPhase = 'waiting' | 'receiving' | 'received' | 'failed'

/** Every phase change a reservation may make. {@link PendingSequence.transition} is the only code
 *  that changes a phase, and refuses any change not listed here. */
export const reservationPhaseChanges: Readonly<
  Record<ReservationPhase, readonly ReservationPhase[]>
> = {
  // A BEGIN that matches the reservation; or the bootstrap timeout, the router's abort, a G4 refusal.
  waiting: ['receiving', 'failed'],
  // complete() verified every page; or the router's abort, a refused frame, a teardown.
  receiving: ['received', 'failed'],
  // The router's abort once verified, before decoding takes over.
  received: ['failed'],
  // The transfer settles after the router's abort already failed the reservation.
  failed: ['failed'],
}

/** How a reservation gives its pages back. */
interface PageRelease {
  /** Release the lease unless a transfer still pins it (then that transfer's end releases it). */
  release: () => void
  /** Fault `early-release` only: free the pages now, whatever still writes into them. */
  releaseNow: () => void
}

/** What makes a {@link PendingSequence}. */
interface PendingFields {
  seq: Sequence
  numPromptPages: number
  secret: Buffer
  pages: PageRelease
  settle: (result: { firstTokenId: number } | KvfenceError) => void
}

/** A sequence between reservation and the end of its transfer. */
class PendingSequence {
  readonly seq: Sequence
  readonly numPromptPages: number
  /** The per-request secret whose HMAC the transfer's BEGIN must carry (G10). */
  readonly secret: Buffer
  readonly pages: PageRelease
  /** Ends the reservation: resolves the waiting generate() or fails it, exactly once. */
  readonly settle: (result: { firstTokenId: number } | KvfenceError) => void
  /** Why the transfer in flight must stop at its next frame (G8 abort, or an early-release fault
   *  refused by G7); null while it may go on. */
  cancel: KvfenceError | null = null
  private current: ReservationPhase = 'waiting'

  constructor(fields: PendingFields) {
    this.seq = fields.seq
    this.numPromptPages = fields.numPromptPages
    this.secret = fields.secret
    this.pages = fields.pages
    this.settle = fields.settle
  }

  get phase(): ReservationPhase {
    return this.current
  }

  /** Move to phase `to`. Asserts that the change is in {@link reservationPhaseChanges}: any other
   *  is a bug in this file, not a fault of the request. */
  transition(to: ReservationPhase): void {
    assert(
      reservationPhaseChanges[this.current].includes(to),
      `reservation of ${this.seq.id}: no phase change ${this.current} → ${to}`,
    )
    this.current = to
  }
}

/** What {@link DecodeWorker.awaitTransfer} waits on. */
interface AwaitTransferOptions {
  seq: Sequence
  /** Hex, from the router's request. */
  transferSecret: string
  signal: AbortSignal
  emit: (e: DecodeEvent) => void
  pages: PageRelease
}

/** Options of {@link DecodeWorker}. */
export interface DecodeWorkerOptions {
  /** Most sequences per decode step (`--max-batch`); default `defaultMaxBatch` of
   *  decode-scheduler.ts. */
  maxBatch?: number
  /** Most verified sequences waiting for a batch slot; default `defaultMaxWaiting` there. */
  maxWaiting?: number
  /** How long a reservation waits for its transfer to begin, ms (> 0); default
   *  {@link bootstrapTimeoutMs}. Not a flag: a benchmark whose cold prefill on a slow model
   *  outlasts the default sets it (bench/offload.ts). */
  bootstrapTimeoutMs?: number
}

/** The decode side of a disaggregated pair. One instance per process. */
export class DecodeWorker {
  private readonly pending = new Map<string, PendingSequence>()
  private scheduler: DecodeScheduler | undefined

  /** Throws RangeError for a `bootstrapTimeoutMs` that is not a number > 0. */
  constructor(
    readonly core: WorkerCore,
    private readonly options: DecodeWorkerOptions = {},
  ) {
    const wait = options.bootstrapTimeoutMs
    if (wait !== undefined && !(wait > 0 && Number.isFinite(wait)))
      throw new RangeError(`decode bootstrap timeout must be a number of ms > 0, got ${wait}`)
  }

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
    this.admit(req)
    const seq = this.leaseFor(req)
    const pages = this.pageReleaseOf(seq)
    let received: { firstTokenId: number }
    try {
      received = await this.awaitTransfer({
        seq,
        transferSecret: req.transferSecret,
        signal,
        emit,
        pages,
      })
    } catch (err) {
      pages.release() // deferred when a transfer still holds the pages: its abort() releases them.
      throw err
    }

    try {
      await this.decode(seq, received.firstTokenId, signal, emit)
    } finally {
      pages.release()
    }
  }

  /** Refuse, before any page is leased, a request this worker can never hold (G3) or cannot now. */
  private admit(req: GenerateRequest): void {
    const { trips, maxSequenceTokens: limit } = this.core
    const numPromptTokens = req.promptTokenIds.length
    if (numPromptTokens + req.maxTokens > limit && this.core.guards.G3) {
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
  }

  /** Lease pages for the prompt and the tokens to generate (as many as fit: G3 off lets a request
   *  past the limit, and it then stops at the lease's end), and make the request's sequence. */
  private leaseFor(req: GenerateRequest): Sequence {
    const { pool } = this.core
    const numTokens = Math.min(
      req.promptTokenIds.length + req.maxTokens,
      this.core.maxSequenceTokens,
    )
    return new Sequence({
      id: req.requestId,
      tenant: req.tenant,
      promptTokenIds: req.promptTokenIds,
      sampling: req.sampling,
      maxTokens: req.maxTokens,
      stopTokenIds: new Set(req.stopTokenIds),
      lease: pool.allocate(
        pool.pagesFor(numTokens),
        this.core.nextOwner(),
        this.core.tenantId(req.tenant),
      ),
    })
  }

  /** The sequence's way of giving its pages back, at most once. */
  private pageReleaseOf(seq: Sequence): PageRelease {
    const { pool } = this.core
    let isReleased = false
    return {
      release: () => {
        if (isReleased || pool.isPinned(seq.lease)) return
        isReleased = true
        pool.release(seq.lease)
      },
      // The fault's premature free: no pin check here, only the pool's own G7 can refuse it.
      releaseNow: () => {
        if (isReleased) return
        pool.release(seq.lease)
        isReleased = true
      },
    }
  }

  /** Register the reservation, announce it, and wait until its transfer is verified. */
  private awaitTransfer(opts: AwaitTransferOptions): Promise<{ firstTokenId: number }> {
    const { seq, signal, pages } = opts
    const { pool, guards } = this.core
    const aborted = () => new KvfenceError('request_aborted', 'request aborted by the router')
    const waitMs = this.options.bootstrapTimeoutMs ?? bootstrapTimeoutMs
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => {
        if (entry.phase === 'waiting')
          entry.settle(
            new KvfenceError(
              'transfer_failed',
              `no transfer for request ${seq.id} within ${waitMs} ms`,
            ),
          )
      }, waitMs)
      const onAbort = () => {
        // A transfer in flight keeps its pages pinned; they are released when it settles (G7).
        if (entry.phase === 'waiting' || entry.phase === 'received') entry.settle(aborted())
        else if (entry.phase === 'receiving') {
          entry.transition('failed')
          // G8: the transfer in flight is cancelled at its next frame (NACK); its pages are freed
          // once the receiver calls abort(), i.e. once nothing can write them any more (G7).
          if (guards.G8) entry.cancel ??= aborted()
        }
      }
      const entry = new PendingSequence({
        seq,
        numPromptPages: pool.pagesFor(seq.numPromptTokens),
        secret: Buffer.from(opts.transferSecret, 'hex'),
        pages,
        settle: (result) => {
          clearTimeout(timer)
          signal.removeEventListener('abort', onAbort)
          this.pending.delete(seq.id)
          const err = result instanceof KvfenceError ? result : signal.aborted ? aborted() : null
          if (err !== null) {
            entry.transition('failed')
            reject(err)
            pages.release()
          } else {
            entry.transition('received')
            resolve(result as { firstTokenId: number })
          }
        },
      })
      this.pending.set(seq.id, entry)
      signal.addEventListener('abort', onAbort, { once: true })
      opts.emit({ type: 'reserved', numPages: seq.lease.pages.length })
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

  /** The waiting reservation `info` names, checked against it (G4), its prompt's pages pinned. */
  private reserve(info: BeginInfo): Reservation {
    const { pool } = this.core
    const entry = this.pending.get(info.requestId)
    if (!entry || entry.phase !== 'waiting') {
      throw new KvfenceError(
        'transfer_failed',
        `transfer ${info.transferId}: no reservation waiting for request ${info.requestId}`,
      )
    }
    this.checkManifest(entry, info)
    const promptPages = leasePrefix(entry.seq.lease, entry.numPromptPages)
    pool.pin(promptPages)
    entry.transition('receiving')
    if (this.core.hasFault('early-release')) {
      // The bug class of sglang#24527: a cleanup path frees the request's pages while its transfer
      // still writes into them. G7 (in pool.release) refuses while they are pinned; the refusal
      // fails the request, and the pages are freed once the transfer settled.
      try {
        entry.pages.releaseNow()
      } catch (err) {
        entry.cancel = err as KvfenceError
      }
    }
    return this.receiverFor(entry, info, promptPages)
  }

  /** G4 at BEGIN: the transfer announces exactly the reserved request (tenant, tokens, pages, page
   *  size). A mismatch fails the reservation and throws the guard error. */
  private checkManifest(entry: PendingSequence, info: BeginInfo): void {
    const { pool, trips, guards } = this.core
    if (!guards.G4) return
    const { seq } = entry
    const problems: string[] = []
    if (info.tenant !== seq.tenant) problems.push(`tenant ${info.tenant} ≠ ${seq.tenant}`)
    if (info.numTokens !== seq.numPromptTokens)
      problems.push(`token count ${info.numTokens} ≠ ${seq.numPromptTokens}`)
    if (info.numPages !== entry.numPromptPages)
      problems.push(`page count ${info.numPages} ≠ ${entry.numPromptPages}`)
    if (info.pageBytes !== pool.pageBytes)
      problems.push(`page bytes ${info.pageBytes} ≠ ${pool.pageBytes}`)
    if (problems.length === 0) return
    const err = trips.trip(
      'G4',
      `transfer ${info.transferId} does not match request ${seq.id}: ${problems.join(', ')}`,
      'transfer_failed',
    )
    entry.settle(err)
    throw err
  }

  /** The receiver's view of a reservation: where each page goes, and how the transfer ends. */
  private receiverFor(
    entry: PendingSequence,
    info: BeginInfo,
    promptPages: PageLease,
  ): Reservation {
    const { pool, metrics } = this.core
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
    const reservation: Reservation = {
      pageSize: pool.shape.pageSize,
      writePage: (ordinal, tokensOnPage, payload) => {
        if (isSettled) throw ended()
        if (entry.cancel !== null) throw entry.cancel // → NACK, then abort() frees the pages
        this.writePage(info, promptPages, { ordinal, tokensOnPage, payload })
      },
      complete: (firstTokenId) => {
        if (isSettled) throw ended()
        if (entry.cancel !== null) throw entry.cancel // → NACK, then abort() frees the pages
        this.checkComplete(entry, info, promptPages, firstTokenId)
        unpinOnce()
        metrics.transfers.inc({ outcome: 'completed' })
        metrics.transferBytes.inc(promptPages.pages.length * pool.pageBytes)
        if (entry.phase === 'failed') {
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
    // The copy-free path (payloads land in the pool's slices). Not enumerable: a wrapper that
    // spreads this reservation and replaces writePage must still see every page through it.
    Object.defineProperty(reservation, 'placePage', {
      enumerable: false,
      value: (ordinal: number, tokensOnPage: number): Uint8Array[] => {
        if (isSettled) throw ended()
        if (entry.cancel !== null) throw entry.cancel // → NACK, then abort() frees the pages
        return this.placePage(info, promptPages, ordinal, tokensOnPage)
      },
    })
    return reservation
  }

  /** Write one received page into the prompt's pages: bounds first (whatever the guards), then
   *  the owner's claim (G5), then the payload. */
  private writePage(
    info: BeginInfo,
    promptPages: PageLease,
    page: { ordinal: number; tokensOnPage: number; payload: Uint8Array },
  ): void {
    const { payload, ordinal } = page
    this.claimPage(info, promptPages, page.ordinal, page.tokensOnPage, payload.byteLength)
    scatterPage(this.core.pool, promptPages.pages[ordinal].page, payload)
  }

  /** Claim one prompt page for a payload the receiver copies in itself (the copy-free path):
   *  the same bounds and claim as {@link writePage}; returns the page's slices of the pool. */
  private placePage(
    info: BeginInfo,
    promptPages: PageLease,
    ordinal: number,
    tokensOnPage: number,
  ): Uint8Array[] {
    const { pool } = this.core
    this.claimPage(info, promptPages, ordinal, tokensOnPage, pool.pageBytes)
    return pageSlices(pool, promptPages.pages[ordinal].page)
  }

  /** Bounds first (whatever the guards), then the owner's claim (G5). */
  private claimPage(
    info: BeginInfo,
    promptPages: PageLease,
    ordinal: number,
    tokensOnPage: number,
    numPayloadBytes: number,
  ): void {
    const { pool } = this.core
    // Bounds are checked whatever the guards: a write outside the reservation is never possible.
    if (
      ordinal < 0 ||
      ordinal >= promptPages.pages.length ||
      tokensOnPage > pool.shape.pageSize ||
      numPayloadBytes !== pool.pageBytes
    ) {
      throw new KvfenceError(
        'transfer_failed',
        `transfer ${info.transferId}: page ${ordinal} (${tokensOnPage} tokens, ${numPayloadBytes} bytes) is outside the reservation`,
      )
    }
    // Claim first (owner, epoch, no gap: G5), then write.
    pool.noteWrite(promptPages, ordinal * pool.shape.pageSize, tokensOnPage)
  }

  /** At END: every prompt position holds KV that arrived for this request (G4), and the first
   *  token is in the vocabulary. Throws `transfer_failed` otherwise. */
  private checkComplete(
    entry: PendingSequence,
    info: BeginInfo,
    promptPages: PageLease,
    firstTokenId: number,
  ): void {
    const { pool, trips, guards } = this.core
    const { pageSize } = pool.shape
    if (guards.G4) {
      for (let ordinal = 0; ordinal < promptPages.pages.length; ordinal++) {
        const want = Math.min(pageSize, entry.seq.numPromptTokens - ordinal * pageSize)
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
