/** G1 kept true while the router runs: re-reads every worker's `/server_info` every few seconds
 *  and soon after a worker failure, because a worker restarted with a smaller KV pool makes the
 *  window decided at start a promise the pool can no longer keep. When the effective capacity
 *  drops below the advertised window it shrinks the window (`--clamp-context`) or refuses new
 *  requests with 503 (guards on) until the workers can hold it again; with guards off it only
 *  warns (the incident's configuration). Each check also asks every worker whether it takes the
 *  router's cluster token: while one refuses it, new requests fail with 503 `worker_unavailable`
 *  (the operator's misconfiguration, not the tenant's key) and `/health` is 503. Each read is
 *  also one of the worker client's probes: new requests pass over a worker that does not answer
 *  until it answers one (worker-client.ts).
 *  Knows workers' `ServerInfo`s and the operator's wishes; knows nothing of HTTP or requests. */
import type { Logger } from 'pino'
import { KvfenceError } from '../../common/errors.js'
import type { ServerInfo } from '../../control/messages.js'
import { type WorkerReport, decideContextWindow, effectiveCapacity } from '../admission/capacity.js'
import { ClusterTokenRefusedError, type WorkerClient } from '../../control/worker-client.js'

/** The window the router admits against now. */
export interface CapacityState {
  /** Advertised context window now, in tokens. */
  readonly contextWindow: number
  /** Effective capacity at the last check, in tokens (min over workers, as in G1). */
  readonly effectiveCapacityTokens: number
  /** Set while the workers cannot hold the advertised window and guards refuse it (the message
   *  names both numbers), or while a worker refuses the router's cluster token (the message names
   *  the workers): every new request fails with this (`worker_unavailable`, 503). */
  readonly refusal: KvfenceError | null
  /** Why `refusal` is set: G1 (the window), or `cluster_token` (a worker refuses the router's
   *  token; this wins over G1). Null when serving. */
  readonly refusalReason: 'G1' | 'cluster_token' | null
}

/** The running check. */
export interface CapacityMonitor {
  current(): CapacityState
  /** Ask for a re-check soon (after a worker failure); calls while one runs are coalesced. */
  recheckSoon(): void
  /** Re-read every worker now and update the state; resolves when done (never rejects: a worker
   *  that does not answer keeps its last report). */
  recheck(): Promise<void>
  /** Stops the timer. */
  close(): void
}

/** Options of {@link createCapacityMonitor}. */
export interface CapacityMonitorOptions {
  workers: WorkerClient
  /** The reports G1 decided on at start (prefill first, then decode, as `serverInfoAll`). */
  initial: readonly WorkerReport[]
  /** The window promised at start: the operator's `--context-window`, else the window G1
   *  decided then. Never grown past. */
  contextWindow: number
  clampContext: boolean
  guardsEnabled: boolean
  /** Interval between checks, ms (default {@link defaultCapacityRecheckMs}). */
  intervalMs?: number
  log: Logger
}

/** Interval of the periodic re-check, ms. */
export const defaultCapacityRecheckMs = 5_000

/** Starts the periodic check (its timer does not keep the process alive). */
export function createCapacityMonitor(options: CapacityMonitorOptions): CapacityMonitor {
  const { workers, log } = options
  const latest = new Map<string, ServerInfo>(options.initial.map((r) => [r.url, r.info]))
  const urls = options.initial.map((r) => r.url)
  const tokens = createTokenCheck(urls, workers, log)
  let state = decide(options.initial, options)
  let running: Promise<void> | null = null
  let isWanted = false

  async function readAll(): Promise<void> {
    const results = await Promise.allSettled(urls.map((url) => workers.serverInfo(url)))
    // After, not alongside: one pooled connection per worker serves both.
    await tokens.check()
    results.forEach((result, i) => {
      if (result.status === 'fulfilled') latest.set(urls[i], result.value)
    })
    const previous = state
    state = decide(
      urls.map((url) => ({ url, info: latest.get(url)! })),
      options,
    )
    report(previous, state, options)
  }

  /** Re-reads until no re-check is wanted any more; calls while one runs join it. */
  function recheck(): Promise<void> {
    isWanted = true
    running ??= (async () => {
      try {
        while (isWanted) {
          isWanted = false
          await readAll()
        }
      } catch (err) {
        log.error(
          { detail: err instanceof Error ? err.message : String(err) },
          'G1 re-check failed',
        )
      } finally {
        running = null
      }
    })()
    return running
  }

  const timer = setInterval(() => void recheck(), options.intervalMs ?? defaultCapacityRecheckMs)
  timer.unref()

  return Object.freeze({
    current: (): CapacityState => {
      const refusal = tokens.refusal()
      return refusal === null ? state : { ...state, refusal, refusalReason: 'cluster_token' }
    },
    recheckSoon: () => void recheck(),
    recheck,
    close: () => clearInterval(timer),
  })
}

/** G1 over the latest reports, against the window promised at start: a window the workers
 *  cannot hold (guards on, no clamping) becomes a refusal naming both numbers. */
function decide(reports: readonly WorkerReport[], options: CapacityMonitorOptions): CapacityState {
  const effective = effectiveCapacity(reports)
  try {
    const decision = decideContextWindow(reports, {
      contextWindow: options.contextWindow,
      clampContext: options.clampContext,
      guardsEnabled: options.guardsEnabled,
    })
    return {
      contextWindow: decision.contextWindow,
      effectiveCapacityTokens: decision.effectiveCapacityTokens,
      refusal: null,
      refusalReason: null,
    }
  } catch (err) {
    if (!(err instanceof KvfenceError) || err.code !== 'guard_violation') throw err
    return {
      contextWindow: options.contextWindow,
      effectiveCapacityTokens: effective.tokens,
      refusal: new KvfenceError(
        'worker_unavailable',
        `G1: the advertised context window ${options.contextWindow} exceeds the effective KV capacity ${effective.tokens} tokens (limited by ${effective.limitedBy}); refusing new requests until the workers can hold it`,
      ),
      refusalReason: 'G1',
    }
  }
}

/** Logs what changed between two states: a refusal starting or ending (error / info), a clamped
 *  window (warn), and with guards off a capacity below the window (warn). */
function report(
  previous: CapacityState,
  next: CapacityState,
  options: CapacityMonitorOptions,
): void {
  const { log } = options
  const numbers = {
    contextWindow: options.contextWindow,
    effectiveCapacityTokens: next.effectiveCapacityTokens,
  }
  if (next.refusal !== null && previous.refusal === null) {
    log.error(numbers, next.refusal.message)
  } else if (next.refusal === null && previous.refusal !== null) {
    log.info(numbers, `G1: the workers hold the context window again; serving`)
  }
  if (next.contextWindow !== previous.contextWindow) {
    log.warn(
      { ...numbers, advertised: next.contextWindow },
      `G1: effective KV capacity is ${next.effectiveCapacityTokens} tokens; context window now ${next.contextWindow} (--clamp-context)`,
    )
  }
  if (
    !options.guardsEnabled &&
    next.effectiveCapacityTokens < options.contextWindow &&
    previous.effectiveCapacityTokens !== next.effectiveCapacityTokens
  ) {
    log.warn(
      numbers,
      `UNSAFE: context window ${options.contextWindow} exceeds the effective KV capacity ${next.effectiveCapacityTokens} tokens; guards are disabled, so it stays`,
    )
  }
}

/** Whether every worker takes the router's cluster token: `check` probes them all (a worker that
 *  does not answer keeps its last result) and logs changes at error / info; `refusal` is the
 *  error every request fails with while one refuses, else null. */
function createTokenCheck(urls: readonly string[], workers: WorkerClient, log: Logger) {
  /** Workers that refused the cluster token at their last probe. */
  const refusingToken = new Set<string>()
  let tokenRefusal: KvfenceError | null = null
  return {
    refusal: () => tokenRefusal,
    async check(): Promise<void> {
      const results = await Promise.allSettled(urls.map((url) => workers.acceptsClusterToken(url)))
      results.forEach((result, i) => {
        if (result.status !== 'fulfilled') return
        if (result.value) refusingToken.delete(urls[i])
        else refusingToken.add(urls[i])
      })
      const previous = tokenRefusal
      const refusing = urls.filter((url) => refusingToken.has(url))
      if (refusing.length === 0) {
        tokenRefusal = null
        if (previous !== null)
          log.info("the workers take the router's cluster token again; serving")
        return
      }
      tokenRefusal = new ClusterTokenRefusedError(`worker ${refusing.join(', ')}`, undefined)
      if (previous?.message !== tokenRefusal.message) {
        log.error(
          { workers: refusing },
          `${tokenRefusal.message}; every request fails with 503 until the tokens match`,
        )
      }
    },
  }
}
