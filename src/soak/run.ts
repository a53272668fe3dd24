/** The soak: K tenants send random prompts (tiny to over the context, streamed or not, each
 *  planting its own canaries) with random aborts and disconnects, for a bounded time and count.
 *  Every completed answer is checked against the single-process oracle and scanned for every other
 *  tenant's canaries; RSS and KV pool usage are sampled; at the end the pools must drain to 0.
 *  Knows the cluster's URLs and processes from outside (HTTP, /proc); knows nothing of its insides. */
import { setTimeout as sleep } from 'node:timers/promises'
import { findCanaries } from '../audit/canaries.js'
import { createRng } from '../audit/rng.js'
import { Oracle, type SoakRequest } from './oracle.js'
import { makePrompt, promptLength, sharedPrefix, tenantCanaries } from './prompts.js'
import { sendAndDisconnect, sendWithClient, type Target } from './requests.js'
import {
  heapAfterMajorGc,
  heapTrends,
  pagesUsed,
  sentinelCounts,
  sentinelWindowSeconds,
  rssBytes,
  rssGrowth,
  sumValues,
} from './sampler.js'
import {
  maxRssGrowthRatio,
  minRssJudgedMs,
  type Outcome,
  type RssSample,
  type SoakOptions,
  type SoakReport,
} from './types.js'

/** A running cluster as the soak sees it. */
export interface SoakTarget {
  routerUrl: string
  prefillUrl: string
  decodeUrl: string
  /** Process ids to sample RSS from, by part name (e.g. `{ prefill, decode, router }`). */
  pids: Record<string, number>
  /** The tenants' names and API keys (≥ 2). */
  tenants: readonly { name: string; key: string }[]
  /** The model directory the cluster serves (the oracle loads the same weights). */
  modelDir: string
  /** Tokens per page of the cluster's pools, and pages of the oracle's pool (≥ the context). */
  pageSize: number
  oraclePages: number
  /** A `kvfence watch` running against the router, when there is one: its cycles and findings
   *  so far. */
  watch?: { numCycles(): number; numFindings(): number }
}

/** Where a soak reports progress (one line at a time); default: nowhere. */
export type ProgressFn = (line: string) => void

const maxExamples = 5

/** Run a soak against `target`. Resolves with the report (never throws for what the cluster does;
 *  throws only when the router cannot be reached at the start). */
export async function runSoak(
  target: SoakTarget,
  options: SoakOptions,
  progress: ProgressFn = () => {},
): Promise<SoakReport> {
  if (target.tenants.length < 2) throw new RangeError('a soak needs at least 2 tenants')
  const { model, contextWindow } = await discover(target.routerUrl, target.tenants[0].key)
  const oracle = new Oracle(target.modelDir, target.oraclePages, target.pageSize)
  const canaries = tenantCanaries(createRng(options.seed, 'canaries'), target.tenants.length)
  const endpoint: Target = { routerUrl: target.routerUrl, model }

  const tally = newTally()
  const startMs = Date.now()
  const loadEndMs = startMs + options.durationMs
  let numStarted = 0

  // Sampling -----------------------------------------------------------------------------------
  const rss: RssSample[] = []
  const maxPages = { prefill: 0, decode: 0 }
  const sample = async () => {
    const bytes: Record<string, number> = {}
    for (const [name, pid] of Object.entries(target.pids)) bytes[name] = rssBytes(pid) ?? 0
    rss.push({ atMs: Date.now() - startMs, bytes })
    const [p, d] = await Promise.all(
      [target.prefillUrl, target.decodeUrl].map((u) => pagesUsed(u).catch(() => 0)),
    )
    maxPages.prefill = Math.max(maxPages.prefill, p)
    maxPages.decode = Math.max(maxPages.decode, d)
  }
  // The heap each process retains after major GCs, from its /metrics, every few samples (a
  // scrape costs more than a /proc read, and major GCs come seconds apart).
  const heap: RssSample[] = []
  const urls = { router: target.routerUrl, prefill: target.prefillUrl, decode: target.decodeUrl }
  const sampleHeap = async () => {
    const atMs = Date.now() - startMs
    const bytes: Record<string, number> = {}
    for (const [name, url] of Object.entries(urls)) {
      const value = await heapAfterMajorGc(url).catch(() => null)
      if (value !== null) bytes[name] = value
    }
    heap.push({ atMs, bytes })
  }
  const sampler = setInterval(() => void sample(), options.sampleEveryMs)
  const heapSampler = setInterval(() => void sampleHeap(), options.sampleEveryMs * 5)
  const reporter = setInterval(
    () =>
      progress(
        `soak: ${Math.round((Date.now() - startMs) / 1000)} s, ${numStarted} requests, ` +
          `${tally.completed} completed, ${tally.contaminated} contaminated, ${tally.mismatches} oracle mismatches`,
      ),
    10_000,
  )

  // Load ---------------------------------------------------------------------------------------
  const loop = async (tenantIndex: number, loopIndex: number) => {
    const rng = createRng(options.seed, `tenant-${tenantIndex}-loop-${loopIndex}`)
    const tenant = target.tenants[tenantIndex]
    const others = canaries.filter((_, i) => i !== tenantIndex).flat()
    while (Date.now() < loadEndMs && numStarted < options.maxRequests) {
      numStarted++
      const req: SoakRequest = {
        endpoint: rng.next() < 0.5 ? 'completion' : 'chat',
        prompt:
          sharedPrefix(rng, tenantIndex) +
          makePrompt(rng, canaries[tenantIndex], promptLength(rng, contextWindow)),
        maxTokens: rng.int(1, options.maxTokensUpTo),
      }
      const isOverContext = oracle.promptTokenIds(req).length + req.maxTokens > contextWindow
      const stream = rng.next() < options.streamProbability
      if (stream) tally.streamed++
      const r = rng.next()
      let outcome: Outcome
      if (r < options.disconnectProbability) {
        outcome = await sendAndDisconnect(endpoint, tenant.key, req, {
          stream,
          afterMs: rng.int(0, 300),
          partial: rng.next() < 0.3,
        })
      } else {
        const abortAfterMs =
          r < options.disconnectProbability + options.abortProbability ? rng.int(0, 400) : null
        outcome = await sendWithClient(endpoint, tenant.key, req, {
          stream,
          abortAfterMs,
          timeoutMs: options.requestTimeoutMs,
        })
      }
      check(tally, outcome, req, isOverContext, tenant.name, others, oracle)
    }
  }
  const loops: Promise<void>[] = []
  for (let t = 0; t < target.tenants.length; t++)
    for (let l = 0; l < options.loopsPerTenant; l++) loops.push(loop(t, l))
  await Promise.all(loops)
  const loadMs = Date.now() - startMs
  clearInterval(sampler)
  clearInterval(heapSampler)
  clearInterval(reporter)
  await sample()

  // Drain: every page must come back ------------------------------------------------------------
  const pagesAtEnd = await drain(target, options.drainTimeoutMs)
  const sentinel = await sentinelCounts(target.routerUrl).catch(() => null)

  const report = soakReport({
    target,
    options,
    tally,
    numStarted,
    loadMs,
    pagesAtEnd,
    maxPages,
    rss,
    heap,
    sentinel,
    sentinelWindow: await sentinelWindowSeconds(target.routerUrl).catch(() => null),
  })
  return report
}

/** What {@link soakReport} reads: the run's target and options and what it measured. */
interface Measured {
  target: SoakTarget
  options: SoakOptions
  tally: ReturnType<typeof newTally>
  numStarted: number
  loadMs: number
  pagesAtEnd: SoakReport['pages_used_at_end']
  maxPages: SoakReport['max_pages_used']
  rss: RssSample[]
  heap: RssSample[]
  sentinel: SoakReport['sentinel']
  sentinelWindow: SoakReport['sentinel_window_s']
}

/** The report of a soak from what it measured, with the invariants it breaks (`failures`, `ok`). */
function soakReport(f: Measured): SoakReport {
  const { target, options, tally, numStarted, loadMs, pagesAtEnd, maxPages, rss, heap, sentinel } =
    f
  // RSS growth after warm-up (a fitted line, see rssGrowth) ---------------------------------------------
  const growth = rssGrowth(rss, loadMs, options.warmupFraction)
  const total = (s: RssSample) => sumValues(s.bytes)
  const lastSample = rss.at(-1)

  const report: SoakReport = {
    ok: true,
    failures: [],
    seed: options.seed,
    duration_s: Math.round(loadMs / 100) / 10,
    tenants: target.tenants.length,
    requests: numStarted,
    completed: tally.completed,
    streamed: tally.streamed,
    rejected_over_context: tally.rejected,
    aborts: tally.aborts,
    errors: tally.errors,
    contaminated_responses: tally.contaminated,
    oracle_mismatches: tally.mismatches,
    over_context_accepted: tally.overContextAccepted,
    hung_requests: tally.errors.hung ?? 0,
    page_leaks: Math.max(0, pagesAtEnd.prefill) + Math.max(0, pagesAtEnd.decode),
    pages_used_at_end: pagesAtEnd,
    max_pages_used: maxPages,
    rss_growth_ratio: Math.round(growth.ratio * 1000) / 1000,
    rss_judged: loadMs >= minRssJudgedMs,
    rss_mb: {
      after_warmup: toMb(growth.fittedAfterWarmup),
      at_end: toMb(growth.fittedAtEnd),
      timeline: timeline(rss, total),
      per_process_at_end: Object.fromEntries(
        Object.entries(lastSample?.bytes ?? {}).map(([k, v]) => [k, toMb(v)]),
      ),
      per_process_slope_mb_per_min: mapValues(growth.slopePerMinute, toMb),
    },
    heap_after_gc_mb: mapValues(heapTrends(heap, loadMs, options.warmupFraction), (t) => ({
      collections: t.collections,
      after_warmup: toMb(t.fittedAfterWarmup),
      at_end: toMb(t.fittedAtEnd),
      slope_mb_per_min: toMb(t.slopePerMinute),
    })),
    sentinel,
    sentinel_window_s: f.sentinelWindow,
    watch:
      target.watch === undefined
        ? null
        : { cycles: target.watch.numCycles(), findings: target.watch.numFindings() },
    examples: tally.examples,
  }
  report.failures = failuresOf(report, growth.hasSamples)
  report.ok = report.failures.length === 0
  return report
}

/** The sentences saying which invariant a report breaks (empty when it breaks none). */
export function failuresOf(report: SoakReport, hasRss = true): string[] {
  const out: string[] = []
  if (report.contaminated_responses > 0)
    out.push(`${report.contaminated_responses} responses carried another tenant's canary`)
  if (report.oracle_mismatches > 0)
    out.push(`${report.oracle_mismatches} responses differ from the single-process engine`)
  if (report.over_context_accepted > 0)
    out.push(`${report.over_context_accepted} over-context prompts were answered`)
  if (report.hung_requests > 0) out.push(`${report.hung_requests} requests hung`)
  if (report.sentinel === null) out.push("the router's sentinel counts could not be read")
  else if (report.sentinel.suspected + report.sentinel.confirmed > 0)
    out.push(
      `the sentinel flagged ${report.sentinel.suspected} suspected and ${report.sentinel.confirmed} confirmed cross-tenant answers`,
    )
  if (report.watch !== null && report.watch.findings > 0)
    out.push(`kvfence watch announced ${report.watch.findings} findings`)
  if (report.page_leaks > 0)
    out.push(
      `${report.page_leaks} KV pages still in use after the drain (prefill ${report.pages_used_at_end.prefill}, decode ${report.pages_used_at_end.decode})`,
    )
  const { prefill, decode } = report.pages_used_at_end
  if (prefill < 0 || decode < 0)
    out.push('a worker did not report its pool after the load (pages_used_at_end -1)')
  if (!report.rss_judged) {
    // too short a load to tell heap warm-up from growth: reported, not judged
  } else if (!hasRss) out.push('no RSS samples after warm-up (run longer, or not on Linux)')
  else if (!(report.rss_growth_ratio < maxRssGrowthRatio))
    out.push(`RSS grew by a ratio of ${report.rss_growth_ratio} (limit ${maxRssGrowthRatio})`)
  if (report.completed === 0) out.push('no request completed: nothing was checked')
  return out
}

// ---------------------------------------------------------------------------------------------
// Checks

interface Tally {
  completed: number
  streamed: number
  rejected: number
  aborts: { client_abort: number; client_disconnect: number }
  errors: Record<string, number>
  contaminated: number
  mismatches: number
  overContextAccepted: number
  examples: string[]
}

function newTally(): Tally {
  return {
    completed: 0,
    streamed: 0,
    rejected: 0,
    aborts: { client_abort: 0, client_disconnect: 0 },
    errors: {},
    contaminated: 0,
    mismatches: 0,
    overContextAccepted: 0,
    examples: [],
  }
}

function note(tally: Tally, line: string): void {
  const kind = line.split(':')[0]
  if (tally.examples.filter((e) => e.startsWith(kind)).length < maxExamples)
    tally.examples.push(line)
}

/** Classify one outcome and run the checks on whatever text it carried. */
function check(
  tally: Tally,
  outcome: Outcome,
  req: SoakRequest,
  isOverContext: boolean,
  tenant: string,
  othersCanaries: readonly string[],
  oracle: Oracle,
): void {
  // Any text a tenant saw, even a partial stream, must hold no other tenant's canary.
  const seen = outcome.kind === 'completed' || outcome.kind === 'error' ? outcome.text : ''
  const leaks = findCanaries(seen, othersCanaries)
  if (leaks.length > 0) {
    tally.contaminated++
    note(
      tally,
      `contaminated: ${tenant} received "${leaks[0].fragment}" of another tenant's canary`,
    )
  }
  switch (outcome.kind) {
    case 'aborted':
      tally.aborts[outcome.how]++
      return
    case 'rejected':
      tally.rejected++
      return
    case 'error':
      if (isOverContext && outcome.errorKind === 'context_length_exceeded') {
        tally.rejected++
        return
      }
      tally.errors[outcome.errorKind] = (tally.errors[outcome.errorKind] ?? 0) + 1
      return
    case 'completed': {
      tally.completed++
      if (isOverContext) {
        tally.overContextAccepted++
        note(
          tally,
          `over_context: ${tenant}'s ${req.endpoint} prompt over the context got HTTP 200`,
        )
        return
      }
      const want = oracle.expected(req)
      const isSameText = outcome.text === want.text
      const isSameCount =
        outcome.completionTokens === null || outcome.completionTokens === want.numTokens
      if (!isSameText || !isSameCount) {
        tally.mismatches++
        let at = 0
        while (at < want.text.length && outcome.text[at] === want.text[at]) at++
        note(
          tally,
          `oracle: ${req.endpoint} max_tokens ${req.maxTokens}: differs at character ${at}; ` +
            `${outcome.completionTokens} tokens, oracle ${want.numTokens}`,
        )
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Discovery and drain

async function discover(routerUrl: string, key: string) {
  const res = await fetch(`${routerUrl}/v1/models`, {
    headers: { authorization: `Bearer ${key}` },
    signal: AbortSignal.timeout(10_000),
  })
  if (!res.ok) throw new Error(`${routerUrl}/v1/models: HTTP ${res.status}`)
  const body = (await res.json()) as { data: { id: string; max_model_len?: number }[] }
  const card = body.data[0]
  if (!card || typeof card.max_model_len !== 'number')
    throw new Error(`${routerUrl}/v1/models does not report max_model_len`)
  return { model: card.id, contextWindow: card.max_model_len }
}

/** Poll both workers until their pools are back to 0 pages or `timeoutMs` passed; the last
 *  reading counts (-1 for a worker that did not answer). */
async function drain(target: SoakTarget, timeoutMs: number) {
  const deadline = Date.now() + timeoutMs
  for (;;) {
    const [prefill, decode] = await Promise.all(
      [target.prefillUrl, target.decodeUrl].map((u) => pagesUsed(u).catch(() => -1)),
    )
    const isDrained = prefill === 0 && decode === 0
    if (isDrained || Date.now() >= deadline) return { prefill, decode }
    await sleep(250)
  }
}

function mapValues<T, U>(record: Record<string, T>, f: (v: T) => U): Record<string, U> {
  return Object.fromEntries(Object.entries(record).map(([k, v]) => [k, f(v)]))
}

/** About 12 points `[seconds, MB]` of the summed RSS over the run, for a reader to see a trend. */
function timeline(rss: readonly RssSample[], total: (s: RssSample) => number): [number, number][] {
  const step = Math.max(1, Math.ceil(rss.length / 12))
  return rss
    .filter((_, i) => i % step === 0 || i === rss.length - 1)
    .map((s) => [Math.round(s.atMs / 1000), toMb(total(s))])
}

function toMb(bytes: number): number {
  return Math.round((bytes / 1024 / 1024) * 10) / 10
}
