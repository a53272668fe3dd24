/** Stored responses (`store: true`), in memory, each owned by the tenant that created it: what
 *  `GET /v1/responses/{id}` (and `…/input_items`) returns and what `previous_response_id` continues.
 *  Bounded per tenant in count and bytes; when a new response would pass either bound, that
 *  tenant's oldest responses are evicted first (one tenant's traffic never evicts another's).
 *  A lookup answers the same for an unknown id and another tenant's id (404 `not_found`, the same
 *  body but for the id), and does the same work for a malformed id before refusing it (400): the
 *  answer reveals nothing of whether an id exists for someone else.
 *  Holds prompt text; logs none of it. Knows tenants' names; knows nothing of HTTP or backends. */
import { KvfenceError } from '../../common/errors.js'
import type { ChatMessage } from '../../model/tokenizer.js'
import type { InputItem } from './input-items.js'

/** A response as stored. */
export interface StoredResponse {
  readonly tenant: string
  /** The Response object as `GET` returns it. */
  readonly body: Record<string, unknown>
  /** The conversation a continuation starts from: every earlier turn's input and output and this
   *  response's own (never `instructions`, which a continuation does not inherit). */
  readonly conversation: readonly ChatMessage[]
  /** This response's own input items, in input order (`GET …/input_items`). */
  readonly inputItems: readonly InputItem[]
  /** What the entry counts against its tenant's byte bound. */
  readonly numBytes: number
}

/** Bounds of each tenant's stored responses. */
export interface ResponseStoreLimits {
  /** Responses kept per tenant at most. */
  maxResponsesPerTenant: number
  /** Bytes (UTF-8 of the stored body and conversation) kept per tenant at most. */
  maxBytesPerTenant: number
}

/** The default bounds: 1000 responses and 16 MiB per tenant. */
export const defaultResponseStoreLimits: ResponseStoreLimits = {
  maxResponsesPerTenant: 1000,
  maxBytesPerTenant: 16 * 1024 * 1024,
}

/** A response id as this server draws them: `resp_` and 32 hex digits (128 random bits). */
export const responseIdPattern = /^resp_[0-9a-f]{32}$/

/** One tenant's entries, oldest first (a Set keeps insertion order), and their bytes. */
interface TenantShelf {
  ids: Set<string>
  numBytes: number
}

/** The store: see the module's header. */
export class ResponseStore {
  private readonly entries = new Map<string, StoredResponse>()
  private readonly shelves = new Map<string, TenantShelf>()

  constructor(private readonly limits: ResponseStoreLimits = defaultResponseStoreLimits) {}

  /** Responses stored now, over all tenants. */
  get size(): number {
    return this.entries.size
  }

  /** Stores `body` (whose `id` is its key), its conversation and its input items for `tenant`,
   *  evicting the tenant's oldest entries
   *  while a bound would be passed. Returns false (nothing stored) when the entry alone is larger
   *  than the byte bound. */
  put(
    tenant: string,
    body: Record<string, unknown>,
    conversation: readonly ChatMessage[],
    inputItems: readonly InputItem[] = [],
  ): boolean {
    const id = String(body.id)
    const numBytes =
      Buffer.byteLength(JSON.stringify(body)) +
      conversationBytes(conversation) +
      inputItems.reduce((n, item) => n + Buffer.byteLength(JSON.stringify(item)), 0)
    if (numBytes > this.limits.maxBytesPerTenant) return false
    let shelf = this.shelves.get(tenant)
    if (shelf === undefined) {
      shelf = { ids: new Set(), numBytes: 0 }
      this.shelves.set(tenant, shelf)
    }
    while (
      shelf.ids.size > 0 &&
      (shelf.ids.size + 1 > this.limits.maxResponsesPerTenant ||
        shelf.numBytes + numBytes > this.limits.maxBytesPerTenant)
    ) {
      const oldest = shelf.ids.values().next().value as string
      this.remove(shelf, oldest)
    }
    this.entries.set(id, { tenant, body, conversation, inputItems, numBytes })
    shelf.ids.add(id)
    shelf.numBytes += numBytes
    return true
  }

  /** `tenant`'s response `id`. Throws `invalid_request` (400) for an id that is not of the form
   *  {@link responseIdPattern}, and `not_found` (404) for one that is unknown, deleted, evicted,
   *  not stored or another tenant's — the same error for each. `param` names the field the id
   *  came from (null for a path). */
  get(tenant: string, id: string, param: string | null): StoredResponse {
    // The map is read and the owner compared for every id, well-formed or not, so that a refusal
    // costs the same whatever the id is.
    const entry = this.entries.get(id)
    const isOwned = entry !== undefined && entry.tenant === tenant
    if (!responseIdPattern.test(id)) {
      throw new KvfenceError(
        'invalid_request',
        `Invalid '${param ?? 'response_id'}': expected an ID that begins with 'resp_' followed by 32 hexadecimal digits.`,
        param,
      )
    }
    if (!isOwned) {
      throw new KvfenceError('not_found', `No response found with id '${id}'.`, param)
    }
    return entry
  }

  /** Deletes `tenant`'s response `id`; throws as {@link get} does. */
  delete(tenant: string, id: string): void {
    this.get(tenant, id, null)
    const shelf = this.shelves.get(tenant)
    if (shelf !== undefined) this.remove(shelf, id)
  }

  private remove(shelf: TenantShelf, id: string): void {
    const entry = this.entries.get(id)
    if (entry === undefined) return
    this.entries.delete(id)
    shelf.ids.delete(id)
    shelf.numBytes -= entry.numBytes
  }
}

function conversationBytes(conversation: readonly ChatMessage[]): number {
  let numBytes = 0
  for (const m of conversation) numBytes += Buffer.byteLength(m.content) + m.role.length + 16
  return numBytes
}
