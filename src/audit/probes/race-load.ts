/** Probe `race-load`: continuous load that finds races. Requests arrive as a Poisson process
 *  (seeded) at a rate that keeps, by Little's law, `level` requests in flight for the latency
 *  measured alone; `level` is ramped 2 → 4 → 8 → 16 up to the endpoint's own limit (what it
 *  reports: SGLang `max_running_requests`, llama.cpp `total_slots`) and `--max-concurrency`, and
 *  arrivals stop at the first 429, 503 or other 5xx (never past a 5xx). Long prompts (many
 *  pages: transfers in flight) are mixed with short ones, structured-output requests
 *  (`response_format: json_object`, where the endpoint accepts it) with plain ones, streamed
 *  with whole, from every tenant, each prompt made only of its own canaries.
 *  Judged: an answer (or stream) carrying another request's material is a `content-leak`; an
 *  answer that breaks its requested structure only under load, or differs from its greedy twin
 *  sent alone, is `integrity`. Clean only when the load reached the level aimed at (measured);
 *  otherwise inconclusive, saying how many were in flight.
 *  Races of this kind need long prompts in flight and continuous arrivals (SGLang PR #37505:
 *  about 31 % of requests corrupted at 512 in flight; sglang#17259: first tokens crossed under
 *  load in PD disaggregation); bursts alone (`concurrency`) do not open them.
 *  Knows canaries, the budget and the endpoint's public reports; knows nothing of any engine. */
import { BudgetExhaustedError, runUntilExhausted } from '../budget.js'
import type { Probe, ProbeContext } from '../probe.js'
import { aisvsKvPartitioning, inconclusiveRemediation } from '../probe.js'
import { createRng, type Rng } from '../rng.js'
import { isAnsweredWhole, tryJson, type CompletionResult, type Target } from '../target.js'
import type { Finding, Tenant } from '../types.js'
import { rampLevels } from './concurrency.js'
import {
  crossingRemediation,
  denseMaterial,
  findCrossings,
  leakFindings,
  requestLog,
  type Observed,
  type Planted,
} from './material.js'
import { promptLimit } from './sized-material.js'

/** `max_tokens` of every request: enough for a fragment of a canary to show. */
export const raceMaxTokens = 32
/** Characters of a short prompt's canaries (about 80 tokens). */
const shortChars = 160
/** A long prompt's tokens at most under the default options, and with `--aggressive`. */
export const defaultLongTokens = 2048
export const aggressiveLongTokens = 8192
/** Arrivals per level, per request the level keeps in flight: the levels below the top are the
 *  ramp (grown only while answers stay 2xx), the top is where the load is held. */
export const arrivalsPerSlot = 2
export const rampArrivalsPerSlot = 1
/** Requests sent alone before the load: one to see whether structured output is accepted, and
 *  greedy twins of that many requests of the load. */
export const numTwins = 3
/** Reads of the endpoint's own limit (server info, llama.cpp props). */
export const numLimitReads = 2
/** Arrivals come this much faster than Little's law needs, so that the level is reached even
 *  when answers come faster under load than alone (at 1.5, one seed in three stayed a request
 *  short of 8 in flight against the stand-in); those that find every slot busy wait for one. */
const arrivalBoost = 3

const structuredFormat = { response_format: { type: 'json_object' } } as const

/** One request of the load. */
export interface RaceRequest {
  readonly planted: Planted
  readonly isLong: boolean
  readonly isStructured: boolean
  readonly stream: boolean
  /** Sent alone too, before the load: its greedy twin. */
  readonly hasTwin: boolean
}

/** One level of the ramp: requests it keeps in flight, and its arrivals in order. */
export interface PlannedLevel {
  readonly level: number
  readonly arrivals: readonly RaceRequest[]
}

/** The endpoint's own limit on requests in flight, and where it was read; null when none. */
export interface EndpointLimit {
  readonly limit: number | null
  readonly source: string | null
}

/** The largest in-flight level the load aims at: `--max-concurrency` (the budget's ceiling),
 *  lowered to the endpoint's own limit where it reports one. */
export function topLevel(ceiling: number, endpoint: number | null): number {
  return endpoint === null ? ceiling : Math.max(1, Math.min(ceiling, endpoint))
}

/** Tokens of a long prompt: as many pages as fit `longTokens` cap, the prompt limit the endpoint
 *  reports, and half the pool shared among `top` requests in flight (so the load itself never
 *  asks more than the pool); null when nothing at all is known (then the prompt ceiling's size
 *  is used). */
export function longPromptTokens(
  limits: {
    readonly poolTokens: number | null
    readonly contextTokens: number | null
    readonly inputLimitTokens: number | null
  },
  top: number,
  isAggressive: boolean,
  ceilingTokens: number,
): number {
  const cap = isAggressive ? aggressiveLongTokens : defaultLongTokens
  const bounds = [cap, ceilingTokens - raceMaxTokens]
  const limit = promptLimit(limits, raceMaxTokens)
  if (limit !== null) bounds.push(limit)
  if (limits.poolTokens !== null)
    bounds.push(Math.floor(limits.poolTokens / (isAggressive ? top : 2 * top)))
  return Math.max(shortChars, Math.min(...bounds))
}

/** Requests the probe sends at most for a ramp to `top`: the arrivals of every level, the
 *  twins, and the structured-output check. */
export function raceRequestCount(top: number): number {
  const levels = rampLevels(Math.max(2, top)).filter((n) => n >= 2)
  return levels.reduce((s, n) => s + arrivalsAt(n, levels), 0) + numTwins + 1
}

/** Arrivals at `level` of a ramp through `levels`. */
export function arrivalsAt(level: number, levels: readonly number[]): number {
  return (level === levels[levels.length - 1] ? arrivalsPerSlot : rampArrivalsPerSlot) * level
}

/** Plans the load's requests for `levels` (seeded): half long, a third structured where
 *  accepted, half streamed (never a structured one: its JSON is judged whole), tenants in turn;
 *  {@link numTwins} of the top level (where a race is likeliest), once its load is full, get a twin. A long prompt's characters never exceed its token
 *  bound (a token is at least one byte), so it fits wherever the bound does. */
export function planRace(
  rng: Rng,
  tenants: readonly Tenant[],
  levels: readonly number[],
  longTokens: number,
  isStructuredAccepted: boolean,
): PlannedLevel[] {
  const material = denseMaterial(rng, [])
  let n = 0
  // The twins: the top level's arrivals right after its first `top` ones, when its load is full.
  const top = levels[levels.length - 1]
  const firstTwin = levels.reduce((s, level) => s + arrivalsAt(level, levels), 0) - top
  return levels.map((level) => ({
    level,
    arrivals: Array.from({ length: arrivalsAt(level, levels) }, (): RaceRequest => {
      const i = n++
      const isLong = rng.next() < 0.5
      // Every draw is made whatever is accepted, so that a plan made before and after the
      // structured check holds the same prompts (the twins are sent from the first).
      const isStructured = rng.next() < 1 / 3 && isStructuredAccepted
      const isStreamed = rng.next() < 0.5
      const { canaries, prompt } = material.next(isLong ? longTokens - 4 : shortChars)
      return {
        planted: { id: `race${level}r${i}`, tenant: tenants[i % tenants.length], canaries, prompt },
        isLong,
        isStructured,
        stream: !isStructured && isStreamed,
        hasTwin: i >= firstTwin && i < firstTwin + numTwins,
      }
    }),
  }))
}

/** The endpoint's own limit on requests in flight, from its public reports. */
export async function readEndpointLimit(target: Target): Promise<EndpointLimit> {
  const reads: [string, string][] = [
    ['/server_info', 'max_running_requests'],
    ['/props', 'total_slots'],
  ]
  for (const [path, field] of reads) {
    const res = await target.get(path, { tenant: target.tenants[0] })
    if (res.status !== 200) continue
    const json = tryJson(res.body)
    const value =
      typeof json === 'object' && json !== null ? (json as Record<string, unknown>)[field] : null
    if (typeof value === 'number' && Number.isInteger(value) && value > 0)
      return { limit: value, source: `${path} ${field}` }
  }
  return { limit: null, source: null }
}

/** Is `text` a JSON object (what `json_object` asks for)? */
export function isJsonObject(text: string): boolean {
  const json = tryJson(text.trim())
  return typeof json === 'object' && json !== null && !Array.isArray(json)
}

function send(target: Target, r: RaceRequest): Promise<CompletionResult> {
  return target.complete({
    tenant: r.planted.tenant,
    prompt: r.planted.prompt,
    maxTokens: raceMaxTokens,
    stream: r.stream,
    estimatedPromptTokens: Buffer.byteLength(r.planted.prompt) + 4,
    ...(r.isStructured ? { extraFields: structuredFormat } : {}),
  })
}

/** What the requests sent alone showed: whether structured output is accepted, the twins'
 *  answers, and the latency alone (ms, the mean of the answered ones; null: none answered). */
export interface Alone {
  readonly isStructuredAccepted: boolean
  /** The structured check alone answered a JSON object. */
  readonly isStructureKeptAlone: boolean
  readonly twins: Map<string, CompletionResult>
  readonly latencyMs: number | null
  readonly observed: Observed[]
}

/** Sends the structured-output check, then each twin alone, one after another. */
async function sendAlone(target: Target, twins: readonly RaceRequest[]): Promise<Alone> {
  const observed: Observed[] = []
  const times: number[] = []
  const timed = async (r: RaceRequest, label: string): Promise<CompletionResult> => {
    const startedAt = performance.now()
    const result = await send(target, r)
    if (isAnsweredWhole(result)) times.push(performance.now() - startedAt)
    observed.push({ planted: r.planted, label, stream: r.stream, result })
    return result
  }
  const [first] = twins
  const check = await timed({ ...first, isStructured: true, stream: false }, 'structured, alone')
  const isStructuredAccepted = isAnsweredWhole(check) && check.status === 200
  const map = new Map<string, CompletionResult>()
  for (const r of twins) {
    const twin = { ...r, isStructured: r.isStructured && isStructuredAccepted }
    map.set(r.planted.id, await timed(twin, 'greedy twin, alone'))
  }
  const latencyMs = times.length === 0 ? null : times.reduce((a, b) => a + b, 0) / times.length
  const isStructureKeptAlone = isStructuredAccepted && isJsonObject(check.text)
  return { isStructuredAccepted, isStructureKeptAlone, twins: map, latencyMs, observed }
}

/** One request of the load as it ended. */
export interface LoadObserved extends Observed {
  readonly request: RaceRequest
  readonly level: number
}

/** What the load did. */
export interface LoadRun {
  readonly observed: LoadObserved[]
  readonly maxInFlight: number
  /** Per level: its arrivals sent, answered whole, and the most in flight. */
  readonly levels: { level: number; numSent: number; numAnswered: number; maxInFlight: number }[]
  /** Why arrivals stopped before the plan's end (a status, or the budget), or null. */
  readonly stoppedBy: string | null
}

/** One level's row of {@link LoadRun.levels}. */
export interface LevelRow {
  level: number
  numSent: number
  numAnswered: number
  maxInFlight: number
}

/** Sends the levels' arrivals in turn; stops at the first 429, 503 or other 5xx (arrivals after
 *  it are not sent, nor any higher level), or when the budget ends. */
async function sendLoad(
  target: Target,
  context: ProbeContext,
  budget: Parameters<Probe['run']>[1],
  plan: readonly PlannedLevel[],
  latencyMs: number,
  rng: Rng,
): Promise<LoadRun> {
  const observed: LoadObserved[] = []
  const levels: LevelRow[] = []
  const stop: { by: string | null } = { by: null }
  for (const { level, arrivals } of plan) {
    if (stop.by !== null) break
    const row: LevelRow = { level, numSent: 0, numAnswered: 0, maxInFlight: 0 }
    levels.push(row)
    await budget.withInFlightLimit(level, () =>
      sendLevel(target, arrivals, row, latencyMs / (arrivalBoost * level), rng, stop, observed),
    )
    context.log(
      `race-load: level ${level}: ${row.numAnswered}/${row.numSent} answered, ${row.maxInFlight} in flight at most`,
    )
  }
  const maxInFlight = Math.max(0, ...levels.map((l) => l.maxInFlight))
  return { observed, maxInFlight, levels, stoppedBy: stop.by }
}

/** One level: arrivals as a seeded Poisson process of mean gap `meanGapMs`, never more than
 *  `row.level` in flight (an arrival that finds them all busy waits for the first to end, so the
 *  count measured is what the endpoint has in flight). Every request's end is caught where it is
 *  sent (a budget that ends mid-level stops arrivals, it is no rejection left unhandled). */
async function sendLevel(
  target: Target,
  arrivals: readonly RaceRequest[],
  row: LevelRow,
  meanGapMs: number,
  rng: Rng,
  stop: { by: string | null },
  observed: LoadObserved[],
): Promise<void> {
  const { level } = row
  let inFlight = 0
  let dueMs = 0
  const levelStart = performance.now()
  const freed: (() => void)[] = []
  const running: Promise<void>[] = []
  let failure: unknown = null
  for (const r of arrivals) {
    // Due times on one clock from the level's start: a timer that fires late (a busy machine)
    // makes the next arrivals due at once, so lateness does not thin the load.
    dueMs += -Math.log(1 - rng.next()) * meanGapMs
    await sleep(dueMs - (performance.now() - levelStart))
    while (inFlight >= level) await new Promise<void>((resolve) => freed.push(resolve))
    if (stop.by !== null) break
    inFlight++
    row.numSent++
    row.maxInFlight = Math.max(row.maxInFlight, inFlight)
    const ended = send(target, r).then((result) => {
      observed.push({
        planted: r.planted,
        label: `${level} in flight`,
        stream: r.stream,
        result,
        request: r,
        level,
      })
      if (isAnsweredWhole(result)) row.numAnswered++
      const status = result.status
      if (status !== null && (status === 429 || status >= 500))
        stop.by ??= `HTTP ${status} at ${inFlight} in flight`
    })
    running.push(
      ended
        .catch((err: unknown) => {
          if (err instanceof BudgetExhaustedError) stop.by ??= err.message
          else failure ??= err
        })
        .finally(() => {
          inFlight--
          freed.shift()?.()
        }),
    )
  }
  await Promise.all(running)
  if (failure !== null) throw failure
}

function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, Math.max(0, ms)))
}

/** Answers that break the structure their request asked for under load while their twin alone
 *  kept it, and answers that differ from their greedy twin alone. */
export function integrityBreaks(
  load: readonly LoadObserved[],
  twins: ReadonlyMap<string, CompletionResult>,
  isStructureKeptAlone: boolean,
): { id: string; why: 'structure' | 'twin'; level: number }[] {
  const out: { id: string; why: 'structure' | 'twin'; level: number }[] = []
  for (const o of load) {
    if (!isAnsweredWhole(o.result) || o.result.failure !== null) continue
    const twin = twins.get(o.planted.id)
    const isTwinWhole = twin !== undefined && isAnsweredWhole(twin) && twin.failure === null
    if (o.request.isStructured && !isJsonObject(o.result.text)) {
      // Only against its own twin: a model may cut another prompt's JSON at max_tokens alone too.
      if (isStructureKeptAlone && isTwinWhole && isJsonObject(twin.text))
        out.push({ id: o.planted.id, why: 'structure', level: o.level })
      continue
    }
    if (isTwinWhole && twin.text !== o.result.text)
      out.push({ id: o.planted.id, why: 'twin', level: o.level })
  }
  return out
}

/** The verdict on what the alone and load requests showed. */
export function judgeRace(
  alone: Alone,
  load: LoadRun,
  aimed: number,
  summary: Record<string, unknown>,
): Finding[] {
  const all = [...alone.observed, ...load.observed]
  const planted = [...new Map(all.map((o) => [o.planted.id, o.planted])).values()]
  const evidence = {
    ...summary,
    maxInFlight: load.maxInFlight,
    levels: load.levels,
    stoppedBy: load.stoppedBy,
    requests: requestLog(load.observed),
  }
  const crossings = findCrossings(all, planted)
  if (crossings.length > 0)
    return leakFindings('race-load', crossings, planted, evidence, crossingRemediation)
  const breaks = integrityBreaks(load.observed, alone.twins, alone.isStructureKeptAlone)
  if (breaks.length > 0) {
    const isStructure = breaks.some((b) => b.why === 'structure')
    return [
      {
        probe: 'race-load',
        verdict: 'warning',
        class: 'integrity',
        severity: isStructure ? 'high' : 'medium',
        title: `${breaks.length} answer(s) changed under load (up to ${load.maxInFlight} in flight): ${isStructure ? 'a structured answer broke the JSON its twin alone kept' : 'a temperature-0 answer differs from its twin sent alone'}, without another request's material showing`,
        evidence: { ...evidence, breaks },
        remediation:
          'Another request changed this answer: look for a race between requests in flight ' +
          '(KV transfer, batch slots, grammar state shared across requests). Engines without ' +
          'batch-invariant kernels may change wording under load (SGLang ' +
          '--enable-deterministic-inference, vLLM VLLM_BATCH_INVARIANT=1 rule that out).',
      },
    ]
  }
  const answered = load.observed.filter((o) => isAnsweredWhole(o.result)).length
  if (load.maxInFlight < aimed || answered === 0)
    return [
      {
        probe: 'race-load',
        verdict: 'inconclusive',
        severity: 'medium',
        title: `the load reached ${load.maxInFlight} in flight of the ${aimed} aimed at (${answered} answered${load.stoppedBy === null ? '' : `; stopped: ${load.stoppedBy}`})`,
        evidence,
        remediation: `Re-run with a larger budget or --max-concurrency. ${inconclusiveRemediation}`,
      },
    ]
  const numLong = load.observed.filter((o) => o.request.isLong && isAnsweredWhole(o.result)).length
  const numStructured = load.observed.filter((o) => o.request.isStructured).length
  return [
    {
      probe: 'race-load',
      verdict: 'clean',
      severity: 'info',
      title: `${answered} answers under Poisson arrivals, up to ${load.maxInFlight} in flight (${numLong} long prompts answered, ${numStructured} structured), carried only their own material and matched their twins alone`,
      evidence,
      remediation: 'None needed.',
    },
  ]
}

export const raceLoadProbe: Probe = {
  name: 'race-load',
  class: 'content-leak',
  // Races under continuous load: page identities checked on every load (G4), pages freed only
  // after every reader ended (G7).
  controls: { aisvs: [aisvsKvPartitioning], guards: ['G4', 'G7'] },
  description:
    "Poisson arrivals ramped to the endpoint's own limit, long prompts beside short, structured beside plain; any foreign material is a leak, an answer changed under load an integrity warning",
  plan: (input) => {
    const top = Math.max(input.limits.concurrency, input.limits.maxConcurrency ?? 0)
    const longTokens = longPromptTokens(input, top, input.isAggressive, Infinity)
    const numLoad = raceRequestCount(top) - numTwins - 1
    return [
      { what: "reads of the endpoint's limit", numRequests: numLimitReads, tokensEach: 0 },
      {
        what: `alone: a structured check and ${numTwins} twins`,
        numRequests: numTwins + 1,
        tokensEach: longTokens + raceMaxTokens,
      },
      {
        what: `Poisson arrivals up to ${top} in flight, half long (${longTokens} tokens)`,
        numRequests: numLoad,
        tokensEach: Math.ceil((longTokens + shortChars) / 2) + raceMaxTokens,
      },
    ]
  },
  async run(target, budget, context): Promise<Finding[]> {
    const rng = createRng(context.seed, 'race-load')
    const inconclusive = (title: string, evidence: Record<string, unknown>): Finding[] => [
      {
        probe: 'race-load',
        verdict: 'inconclusive',
        severity: 'medium',
        title,
        evidence,
        remediation: `Re-run with a larger budget or --max-concurrency 8 or more. ${inconclusiveRemediation}`,
      },
    ]
    let endpoint: EndpointLimit = { limit: null, source: null }
    let alone: Alone | null = null
    let load: LoadRun | null = null
    let top = 0
    let levels: number[] = []
    let longTokens = 0
    const stopped = await runUntilExhausted(async () => {
      endpoint = await readEndpointLimit(target)
      top = topLevel(budget.maxInFlightLimit, endpoint.limit)
      levels = rampLevels(top).filter((n) => n >= 2)
      if (levels.length === 0) return
      const ceiling = context.ceiling?.maxRequestTokens() ?? 256
      longTokens = longPromptTokens(context.discovery, top, context.isAggressive ?? false, ceiling)
      const twinPlan = planRace(
        createRng(context.seed, 'race-load plan'),
        target.tenants,
        levels,
        longTokens,
        true,
      )
      alone = await sendAlone(
        target,
        twinPlan.flatMap((l) => l.arrivals).filter((r) => r.hasTwin),
      )
      const plan = planRace(
        createRng(context.seed, 'race-load plan'),
        target.tenants,
        levels,
        longTokens,
        alone.isStructuredAccepted,
      )
      load = await sendLoad(target, context, budget, plan, Math.max(1, alone.latencyMs ?? 50), rng)
    })
    const summary = {
      endpointLimit: endpoint.limit,
      endpointLimitSource: endpoint.source,
      top,
      levels,
      longPromptTokens: longTokens,
      structuredAccepted: (alone as Alone | null)?.isStructuredAccepted ?? null,
    }
    if (levels.length === 0)
      return inconclusive(
        `--max-concurrency ${budget.maxInFlightLimit} (or the endpoint's limit) allows no two requests in flight`,
        summary,
      )
    if (alone === null || load === null)
      return inconclusive(
        `the budget ended before the load: ${stopped ?? 'nothing answered alone'}`,
        summary,
      )
    const run: LoadRun = load
    const shed = run.stoppedBy !== null && /^HTTP (429|503)/.test(run.stoppedBy)
    const aimed = shed ? 2 : levels[levels.length - 1]
    return judgeRace(alone, run, aimed, summary)
  },
}
