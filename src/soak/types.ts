/** The soak's options and its JSON report: the shapes `kvfence soak --json` writes and the CI test
 *  reads. Knows nothing of HTTP or processes. */

/** What one soak run does. Every count and duration is bounded. */
export interface SoakOptions {
  /** How long load is sent, in ms (the drain and the final checks come after). */
  durationMs: number
  /** Number of tenants, each with its own key and canaries (≥ 2, so a leak has somewhere to go). */
  numTenants: number
  /** Concurrent request loops per tenant. */
  loopsPerTenant: number
  /** Stop after this many requests even if time is left. */
  maxRequests: number
  /** Seed of every random choice (prompts, canaries, aborts), so a run can be replayed. */
  seed: number
  /** Share of the load window, from its start, whose RSS samples are ignored (warm-up), 0..1. */
  warmupFraction: number
  /** Client-side deadline of one request, ms: a request still open then is counted as hung. */
  requestTimeoutMs: number
  /** How long the pools may take to return to 0 pages after the load drained, ms. */
  drainTimeoutMs: number
  /** RSS and pool usage are sampled this often, ms. */
  sampleEveryMs: number
  /** Probability that a request is aborted by its client (AbortController) at a random time. */
  abortProbability: number
  /** Probability that a request is sent on a raw socket that is destroyed mid-request. */
  disconnectProbability: number
  /** Probability that a request streams (SSE). */
  streamProbability: number
  /** Largest `max_tokens` asked for. */
  maxTokensUpTo: number
}

/** Defaults of {@link SoakOptions}, each beside its field's meaning above. */
export const soakDefaults: SoakOptions = Object.freeze({
  durationMs: 60_000,
  numTenants: 3,
  loopsPerTenant: 2,
  maxRequests: 100_000,
  seed: 1,
  warmupFraction: 0.25,
  requestTimeoutMs: 60_000,
  drainTimeoutMs: 40_000,
  sampleEveryMs: 1_000,
  abortProbability: 0.15,
  disconnectProbability: 0.1,
  streamProbability: 0.5,
  maxTokensUpTo: 48,
})

/** How one request ended, as the soak classifies it. */
export type Outcome =
  | { kind: 'completed'; text: string; completionTokens: number | null }
  /** 400 context_length_exceeded for a prompt the soak knew was over the context: the right answer. */
  | { kind: 'rejected' }
  /** Ended by the soak itself (abort or socket destroyed). */
  | { kind: 'aborted'; how: 'client_abort' | 'client_disconnect' }
  /** Anything else: an HTTP error, an in-stream error, a connection error or a hang. */
  | { kind: 'error'; errorKind: string; hadOutput: boolean; text: string }

/** A memory sample: resident set size of each cluster process, bytes. */
export interface RssSample {
  atMs: number
  bytes: Record<string, number>
}

/** The JSON report (snake_case keys: it is read by scripts and CI). */
export interface SoakReport {
  /** True when every must-be-0 figure is 0 and the RSS growth is under its limit. */
  ok: boolean
  /** Why `ok` is false, one sentence each. */
  failures: string[]
  seed: number
  duration_s: number
  tenants: number
  /** Requests started (every kind). */
  requests: number
  completed: number
  streamed: number
  /** Over-context prompts correctly refused with 400 context_length_exceeded. */
  rejected_over_context: number
  aborts: { client_abort: number; client_disconnect: number }
  /** Errors by kind (the OpenAI error code, `stream_error:<code>`, `connection`, `hung`, ...). */
  errors: Record<string, number>
  /** Must be 0: a response that carried another tenant's canary (≥ 8 characters). */
  contaminated_responses: number
  /** Must be 0: a completed response whose tokens differ from the single-process engine's. */
  oracle_mismatches: number
  /** Must be 0: a prompt over the context answered with anything but 400 context_length_exceeded. */
  over_context_accepted: number
  /** Must be 0: requests still open at the client deadline. */
  hung_requests: number
  /** Must be 0: KV pages still in use on P and D once the load drained. */
  page_leaks: number
  /** Pages in use per worker at the end (after the drain); -1 when a worker did not answer. */
  pages_used_at_end: { prefill: number; decode: number }
  /** Most pages seen in use at once, per worker. */
  max_pages_used: { prefill: number; decode: number }
  /** Must stay < {@link maxRssGrowthRatio}: a least-squares line through the cluster's summed
   *  RSS after warm-up, its value at the end of the load ÷ its value at the end of warm-up (a line
   *  through several GC cycles, not two short windows: GC sawtooth is not growth). */
  rss_growth_ratio: number
  /** Whether `rss_growth_ratio` was judged: only for loads of at least {@link minRssJudgedMs}
   *  (the processes' V8 heaps grow for the first ~50 s of load before they settle). */
  rss_judged: boolean
  rss_mb: {
    /** The fitted summed RSS at the end of warm-up (the ratio's denominator). */
    after_warmup: number
    /** The fitted summed RSS at the end of the load (the ratio's numerator). */
    at_end: number
    /** About 12 points `[seconds since start, MB]` of the summed RSS. */
    timeline: [number, number][]
    per_process_at_end: Record<string, number>
    /** Per process, the fitted RSS slope after warm-up, MB per minute. */
    per_process_slope_mb_per_min: Record<string, number>
  }
  /** Per process, the V8 heap retained after major GCs (`kvfence_heap_used_after_major_gc_bytes`)
   *  after warm-up, MB: a line through one value per collection. Reported, not judged: it tells a
   *  leak (a rising floor) from V8 growing its heap when RSS rises. */
  heap_after_gc_mb: Record<
    string,
    { collections: number; after_warmup: number; at_end: number; slope_mb_per_min: number }
  >
  /** Must be 0 and 0: the router's response sentinel (observe) events over the run,
   *  `kvfence_sentinel_suspected_total` and `kvfence_sentinel_confirmed_total` from its
   *  `/metrics` after the drain (tenants share a long system prompt and two send the same licence
   *  paragraph, so a sentinel that flags shared text fails here); null when unreadable. */
  sentinel: { suspected: number; confirmed: number } | null
  /** The window the router's sentinel keeps fingerprints for, seconds, read from its `/metrics`
   *  (`soakSentinelWindowSeconds` when the soak started the router); null when unreadable. */
  sentinel_window_s: number | null
  /** Must be 0 findings: the `kvfence watch` run beside the load (two canary tenants, its default
   *  cycle), its completed cycles and announced findings; null when no watch ran. */
  watch: { cycles: number; findings: number } | null
  /** At most 5 examples per problem kind, redacted to the canary found or the first differing
   *  token position (no prompt text). */
  examples: string[]
}

/** The sentinel window a soak gives the router, seconds: its warm-up, from 30 s to the router's
 *  default 600 s. The sentinel keeps fingerprints in two generations and drops the older every
 *  half window, so its memory grows for one whole window and then saws; with the default 10-minute
 *  window a 10-minute soak judged RSS growth over the window filling (bounded memory, read as a
 *  leak: 1.051 on 2026-12-02, the router's heap +1.5 MB/min). With the window inside the warm-up,
 *  the growth judged after it is what is not bounded. 30 s covers a watch cycle's plant and read. */
export function soakSentinelWindowSeconds(durationMs: number, warmupFraction: number): number {
  return Math.min(600, Math.max(30, Math.floor((durationMs * warmupFraction) / 1000)))
}

/** Shortest load whose RSS growth is judged, ms. */
export const minRssJudgedMs = 180_000

/** The RSS growth a soak tolerates after warm-up. */
export const maxRssGrowthRatio = 1.05
