/** G1: the context window the router may advertise, from what every worker reports.
 *  Knows worker `ServerInfo`s and the operator's wishes; knows nothing of HTTP or requests. */
import type { WorkerReport } from '../../control/worker-probe.js'
import { KvfenceError } from '../../common/errors.js'

/** What the operator asked for. */
export interface ContextWindowOptions {
  /** Advertised context window in tokens; undefined = the effective capacity. */
  contextWindow?: number
  /** Clamp an over-large `contextWindow` to the effective capacity instead of refusing. */
  clampContext: boolean
  /** False = the incident's configuration: an over-large window is allowed, with a warning. */
  guardsEnabled: boolean
}

/** The outcome of G1. */
export interface ContextWindowDecision {
  /** The window to advertise and admit against, in tokens. */
  contextWindow: number
  /** min over all workers of `capacityTokens` and `maxPositionEmbeddings`, in tokens. */
  effectiveCapacityTokens: number
  /** Lines to log at warn level (clamping, unsafe configuration). */
  warnings: string[]
}

/** A worker's report, tagged with where it came from (for messages): one type, the control
 *  plane's. */
export type { WorkerReport }

/** Decides the advertised context window (G1). Throws `guard_violation` with a one-line message
 *  naming both numbers when the window exceeds the effective capacity and neither clamping nor
 *  the unsafe (guards off) configuration allows it. */
export function decideContextWindow(
  reports: readonly WorkerReport[],
  options: ContextWindowOptions,
): ContextWindowDecision {
  const { tokens: effective, limitedBy } = effectiveCapacity(reports)
  const requested = options.contextWindow
  if (requested !== undefined && (!Number.isSafeInteger(requested) || requested < 1)) {
    throw new KvfenceError(
      'internal_error',
      `context window must be a positive integer, got ${requested}`,
    )
  }
  if (requested === undefined || requested <= effective) {
    return {
      contextWindow: requested ?? effective,
      effectiveCapacityTokens: effective,
      warnings: [],
    }
  }
  const excess = `context window ${requested} exceeds the effective KV capacity ${effective} tokens (limited by ${limitedBy})`
  if (options.clampContext) {
    return {
      contextWindow: effective,
      effectiveCapacityTokens: effective,
      warnings: [`G1: ${excess}; clamped to ${effective} (--clamp-context)`],
    }
  }
  if (!options.guardsEnabled) {
    return {
      contextWindow: requested,
      effectiveCapacityTokens: effective,
      warnings: [
        `UNSAFE: ${excess}; guards are disabled, so prompts longer than the pool will be admitted (the incident's configuration)`,
      ],
    }
  }
  throw new KvfenceError(
    'guard_violation',
    `G1: ${excess}; lower the context window to ${effective}, or clamp it: --clamp-context (router.clampContext: true in a cluster file)`,
  )
}

/** The effective capacity: min over all workers of `capacityTokens` and `maxPositionEmbeddings`,
 *  in tokens, and which worker and limit set it (for messages). Throws `internal_error` for no
 *  workers. */
export function effectiveCapacity(reports: readonly WorkerReport[]): {
  tokens: number
  limitedBy: string
} {
  if (reports.length === 0) throw new KvfenceError('internal_error', 'G1: no workers to check')
  let tokens = Infinity
  let limitedBy = ''
  for (const { url, info } of reports) {
    const limit = Math.min(info.capacityTokens, info.maxPositionEmbeddings)
    if (limit < tokens) {
      tokens = limit
      limitedBy =
        info.capacityTokens <= info.maxPositionEmbeddings
          ? `${info.role} worker ${url} KV pool (${info.numPages} pages × ${info.pageSize} tokens)`
          : `${info.role} worker ${url} max_position_embeddings`
    }
  }
  return { tokens, limitedBy }
}
