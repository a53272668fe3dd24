/** A request as the engine knows it: one `Sequence` per request on a worker, from the moment its
 *  pages are leased until they are released. The prefill worker, the decode worker, both loops and
 *  the single-process engine all speak of this one noun.
 *  Knows token ids, tenants, sampling parameters and the request's page lease; knows nothing of
 *  HTTP, transfers, API keys or text. */
import type { PageLease } from '../kv/pool.js'
import type { BatchSequence } from '../model/forward.js'
import type { Sampling } from '../control/messages.js'

/** What a {@link Sequence} is made of. */
export interface SequenceFields {
  /** The request id (32 hex digits from the router; any string in tests and the local engine). */
  id: string
  /** The tenant the router authenticated. */
  tenant: string
  /** The prompt as this worker runs it. */
  promptTokenIds: readonly number[]
  sampling: Sampling
  /** Tokens to generate at most, the first one included (1 on a prefill worker: it samples only
   *  the first token). */
  maxTokens: number
  stopTokenIds: ReadonlySet<number>
  /** The request's pages: room for the prompt, and on a decode worker for the generated tokens. */
  lease: PageLease
}

/** One request in the engine. Immutable: where it is in its life is the worker's business (the
 *  decode worker's reservation phases, the loops' queues), never a field to assign here. */
export class Sequence implements SequenceFields {
  readonly id: string
  readonly tenant: string
  readonly promptTokenIds: readonly number[]
  readonly sampling: Sampling
  readonly maxTokens: number
  readonly stopTokenIds: ReadonlySet<number>
  readonly lease: PageLease

  constructor(fields: SequenceFields) {
    this.id = fields.id
    this.tenant = fields.tenant
    this.promptTokenIds = fields.promptTokenIds
    this.sampling = fields.sampling
    this.maxTokens = fields.maxTokens
    this.stopTokenIds = fields.stopTokenIds
    this.lease = fields.lease
  }

  /** The owner id of the pages (never reused while the process lives). */
  get owner(): number {
    return this.lease.owner
  }

  get numPromptTokens(): number {
    return this.promptTokenIds.length
  }

  /** Positions the lease holds: pages × `pageSize` tokens. */
  capacityTokens(pageSize: number): number {
    return this.lease.pages.length * pageSize
  }

  /** This sequence's share of a batched forward step: `tokenIds` at positions
   *  [startPos, startPos + n). The one place an engine sequence becomes the model's input. */
  forwardInput(tokenIds: readonly number[], startPos: number, allLogits = false): BatchSequence {
    return { lease: this.lease, tokenIds, startPos, ...(allLogits ? { allLogits } : {}) }
  }
}
