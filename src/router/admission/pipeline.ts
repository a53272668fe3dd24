/** A request's admission, in order: G1 (the backend can hold the advertised window), the
 *  tenant's concurrency (held before the prompt is counted: a tenant at its limit must not spend
 *  the event loop every tenant shares on prompts refused anyway), G2 (the prompt and the tokens it
 *  may generate fit the window), the tenant's token rate, then a running slot of the router-wide
 *  queue, fair between tenants (fair-queue.ts). Every refusal is counted in one place, under the reason of the step that refused.
 *  Knows the limiter, the backend's window and prompt count; knows nothing of HTTP or workers. */
import { performance } from 'node:perf_hooks'
import { KvfenceError } from '../../common/errors.js'
import { admit, refuseUntokenizable } from './context-window.js'
import type { Backend, Outcome, PreparedPrompt } from '../backend.js'
import { LimitError, LimitStoreUnavailableError } from './limit-error.js'
import { type Limiter, type RoomHold, type TenantTicket } from './limits.js'
import { type Slot } from './queue-limits.js'
import type { RouterMetrics } from '../metrics/metrics.js'
import { type ParsedRequest, promptParamOf } from '../api/schemas.js'
import { type Tenant, defaultTenantWeight } from '../tenants/tenants.js'

/** What admission needs. */
export interface AdmissionDeps {
  backend: Backend
  limiter: Limiter
  metrics: RouterMetrics
}

/** The request to admit. */
export interface AdmissionRequest {
  tenant: Tenant
  parsed: ParsedRequest
  signal: AbortSignal
  /** Gets the prompt's token count as soon as it is known (a refused request logs it too). */
  outcome: Outcome
}

/** What an admitted request holds until it ends; filled step by step, so that a request refused
 *  or failed at any step releases what it got ({@link releaseHolds}). */
export interface AdmissionHolds {
  room: RoomHold | null
  ticket: TenantTicket | null
  /** Completion tokens charged to the tenant's token rate. */
  numReservedCompletion: number
  slot: Slot | null
}

/** An admitted request's prompt and the completion tokens it may generate. */
export interface Admitted {
  prompt: PreparedPrompt
  maxTokens: number
}

/** The label of `kvfence_router_admission_rejections_total` a step's refusals count under. */
type RejectionReason =
  'tenant_limit' | 'context_length_exceeded' | 'queue_full' | 'limit_store_unavailable'

/** Holds that hold nothing yet. */
export function emptyHolds(): AdmissionHolds {
  return { room: null, ticket: null, numReservedCompletion: 0, slot: null }
}

/** Releases what `holds` holds, refunding the completion tokens not generated and counting those
 *  generated to the tenant's service in the fair queue. Idempotent. */
export function releaseHolds(holds: AdmissionHolds, numCompletionTokens: number): void {
  holds.slot?.release(numCompletionTokens) // the tenant's service: what it generated
  holds.ticket?.release(Math.max(0, holds.numReservedCompletion - numCompletionTokens))
  holds.room?.release() // a request refused or failed before its ticket (idempotent after it)
}

/** Admits `r` (see the module's header), filling `holds`. Throws the refusal: G1's error,
 *  {@link LimitError} `rate_limited` (429) or `capacity_exhausted` (503),
 *  `context_length_exceeded` (400), a prompt the backend cannot count, or `request_aborted`. */
export async function admitRequest(
  deps: AdmissionDeps,
  r: AdmissionRequest,
  holds: AdmissionHolds,
): Promise<Admitted> {
  const { backend, limiter, metrics } = deps
  const { tenant, parsed } = r
  const counted = <T>(reason: RejectionReason, step: () => T | Promise<T>) =>
    countRefusal(metrics, reason, step)
  const refusal = backend.refusal()
  if (refusal !== null) throw refusal
  const room = await counted('tenant_limit', () =>
    limiter.holdTenantRoom(tenant.name, tenant.limits),
  )
  holds.room = room
  const { maxTokenChars } = backend
  if (maxTokenChars !== null) {
    await counted('context_length_exceeded', () =>
      refuseUntokenizable(parsed, backend.contextWindow(), maxTokenChars),
    )
  }
  const windowBefore = backend.contextWindow()
  const prompt = await backend.preparePrompt(parsed, tenant.name, r.signal, windowBefore)
  const { numPromptTokens } = prompt
  r.outcome.numPromptTokens = numPromptTokens
  // The smaller of the windows before and after counting: never more than the prompt was
  // prepared for (its ids are kept only below it), never more than the router enforces now.
  const contextWindow = Math.min(windowBefore, backend.contextWindow())
  const maxTokens = await counted('context_length_exceeded', () =>
    admit(numPromptTokens, parsed.maxTokens, contextWindow, {
      promptParam: promptParamOf(parsed),
      maxTokensParam: parsed.maxTokensParam,
    }),
  )
  holds.ticket = await counted('tenant_limit', () =>
    limiter.admitTenant(tenant.name, tenant.limits, numPromptTokens + maxTokens, room),
  )
  holds.numReservedCompletion = maxTokens
  const queuedAtMs = performance.now()
  holds.slot = await counted('queue_full', () =>
    limiter.acquireSlot(r.signal, {
      tenant: tenant.name,
      weight: tenant.weight ?? defaultTenantWeight,
      numPromptTokens,
    }),
  )
  metrics.queueWaitSeconds.observe({ tenant: tenant.name }, (performance.now() - queuedAtMs) / 1000)
  metrics.promptTokens.inc(numPromptTokens)
  return { prompt, maxTokens }
}

/** Runs one step of admission; a refusal it throws (for load or for length — not the client
 *  going away) is counted under `reason` (or `limit_store_unavailable` when the shared limit store
 *  could not be reached: not the tenant's limit), the one place admission counts. */
function countRefusal<T>(
  metrics: RouterMetrics,
  reason: RejectionReason,
  step: () => T | Promise<T>,
): T | Promise<T> {
  const count = (err: unknown): never => {
    if (isRefusal(err))
      metrics.admissionRejections.inc({
        reason: err instanceof LimitStoreUnavailableError ? 'limit_store_unavailable' : reason,
      })
    throw err
  }
  // A step that answers at once (most of them) costs no promise here.
  let result: T | Promise<T>
  try {
    result = step()
  } catch (err) {
    return count(err)
  }
  const isThenable = typeof (result as { then?: unknown } | null)?.then === 'function'
  return isThenable ? Promise.resolve(result).catch(count) : result
}

function isRefusal(err: unknown): boolean {
  return (
    err instanceof LimitError ||
    (err instanceof KvfenceError && err.code === 'context_length_exceeded')
  )
}
