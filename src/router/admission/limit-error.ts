/** Admission's refusals for load (429 for a tenant's own limits, 503 for the router-wide queue
 *  or an unreachable limit store), each with the wait to say in `Retry-After`. Below both the
 *  limiter (limits.ts) and the fair queue (fair-queue.ts), which both refuse with it.
 *  Knows error codes and seconds; knows nothing of HTTP, tenants or stores. */
import { KvfenceError } from '../../common/errors.js'

/** A refusal for load, with the seconds the client should wait before trying again, or null
 *  when no wait can help (the request is larger than the tenant's whole limit). */
export class LimitError extends KvfenceError {
  constructor(
    code: 'rate_limited' | 'capacity_exhausted',
    message: string,
    /** Whole seconds for `Retry-After` (≥ 1), or null: retrying the same request cannot succeed. */
    readonly retryAfterSec: number | null,
  ) {
    super(code, message)
    this.name = 'LimitError'
  }
}

/** A refusal because the shared limit store (Redis) cannot be reached under `fail-closed`: 503
 *  `capacity_exhausted` with `Retry-After`, counted apart from a tenant's own limits
 *  (`reason="limit_store_unavailable"` in `kvfence_router_admission_rejections_total`). */
export class LimitStoreUnavailableError extends LimitError {
  constructor(message: string, retryAfterSec: number) {
    super('capacity_exhausted', message, retryAfterSec)
    this.name = 'LimitStoreUnavailableError'
  }
}
