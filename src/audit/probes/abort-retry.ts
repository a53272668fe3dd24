/** Probe `abort-retry`: a prompt longer than one prefill chunk is cut while it is being prefilled
 *  (before its first token), and the same prompt is sent again at once by the same tenant and by
 *  another; at temperature 0 both answers must equal the cold answer of that prompt. Catches an
 *  engine that publishes an aborted prefill's pages to its prefix cache, the pages it never wrote
 *  included (sglang#38319; vLLM fixed the like in PR #56525): the retry reuses them.
 *
 *  One attempt, on a prompt no one sent before (its first word is fresh, so no prefix cache holds
 *  any of it):
 *  1. the reference tenant (a third tenant when there is one, else the second) sends it whole and
 *     streamed: the cold answer, and the cold time to first token (TTFT) that times the cut;
 *  2. the second tenant sends a prompt of the same shape holding its own canaries, so that pages
 *     freed since hold its words at the same positions;
 *  3. the first tenant sends the prompt streamed and disconnects at a fraction of the cold TTFT;
 *     the cut landed during prefill when nothing of the answer had arrived;
 *  4. the first tenant, then the second, send it again, whole.
 *  The prompt is the request's own filler (random single letters, attributable to it) over more
 *  than one chunk (the size the endpoint reports: kvfence's
 *  `prefillChunkTokens`, SGLang's `chunked_prefill_size`; else {@link defaultChunkTokens}), then
 *  canaries, then the start of the first canary again, so that a model that copies (the bundled
 *  echo model) answers from the pages past the first chunk: the ones an aborted prefill leaves
 *  unwritten.
 *  Verdicts: a retry's (or the cold) answer holding another request's canary, or a run of its
 *  filler, is a leak naming whose; a retry
 *  answer that differs from the cold one is a warning (half-written pages reused); no cut that
 *  landed during prefill, or no answer to compare, is inconclusive with the reason.
 *  Knows the audit's probes' shared material and the target; nothing of any engine inside. */
import { BudgetExhaustedError, runUntilExhausted } from '../budget.js'
import { makeCanaries } from '../canaries.js'
import type { PlanInput } from '../plan.js'
import type { Probe, ProbeContext } from '../probe.js'
import { aisvsKvPartitioning, inconclusiveRemediation } from '../probe.js'
import { createRng, type Rng } from '../rng.js'
import { firstCeilingTokens, unknownLimitTokens } from '../prompt-ceiling.js'
import type { PromptSizer } from '../sizer.js'
import { isAnsweredWhole, type CompletionResult, type Target } from '../target.js'
import type { Finding, Tenant } from '../types.js'
import {
  crossingRemediation,
  findCrossings,
  keyedFiller,
  leakFindings,
  requestLog,
  type Observed,
  type Planted,
} from './material.js'

const maxTokens = 16
/** Where the cut falls, as fractions of the cold TTFT, attempt by attempt, when the endpoint
 *  reports no `cached_tokens` to steer by ({@link nextCutFraction}): spread, since how much of
 *  the TTFT is prefill (rather than queueing, transfer, the first decode step) differs between
 *  engines, mostly early: on kvfence (one prefill and one decode worker on a busy 2-core
 *  machine, an 870-token prompt, cold TTFT about 370 ms), of 11 cuts from 5 to 100 ms those at
 *  50 and 100 ms were seen to land during prefill (counted by G5 trips with publish-partial). */
const cutFractions = [0.15, 0.3, 0.5, 0.08, 0.22, 0.4] as const
const numAttempts = cutFractions.length
/** Requests per attempt: cold, priming, cut, retry by the same tenant, retry by another. */
const requestsPerAttempt = 5
/** Chunked-prefill size assumed when the endpoint reports none (tokens): generous, so that a
 *  prompt over it is over the chunk of common deployments (vLLM's `max_num_batched_tokens`,
 *  SGLang's `chunked_prefill_size`, commonly 2,048 or more), bounded by the pool and the
 *  context. */
export const defaultChunkTokens = 2048
/** Tokens kept free beside the prompt and `max_tokens` (BOS, chat wrapping). */
const marginTokens = 8
/** Characters of the first canary repeated at the prompt's end (a canary fragment counts from 8
 *  characters). */
const cueChars = 8

const remediation =
  'Never publish a prefill that did not complete to the prefix cache: insert pages only after ' +
  'the prefill that wrote them finished, and check each page is written (filled and sealed) ' +
  'before it is shared; on abort, free the pages instead. SGLang: take the fix for ' +
  'sglang#38319; vLLM: PR #56525. Until then, treat answers after client disconnects as ' +
  'possibly built on stale KV.'

/** The prompt's size: filler tokens over one chunk, and whether the chunk size was reported. */
interface Sizing {
  readonly chunkTokens: number
  readonly isChunkReported: boolean
  /** Filler tokens wanted before the canaries: past the chunk by three times as much (at most
   *  2,048 tokens, at least a quarter of it), so the cut has several prefill steps to land in. */
  readonly headTokens: number
  /** The largest prompt (tokens) the endpoint says it can hold with `max_tokens`, or, where it
   *  says nothing, what the prompt ceiling allows now (prompt-ceiling.ts); null: no bound. */
  readonly roomTokens: number | null
  /** True when `roomTokens` is the prompt ceiling's, not a limit the endpoint or operator gave. */
  readonly isCeiling: boolean
}

/** Upper bound of the tokens beyond the filler (ASCII costs at most one token a character): the
 *  fresh first word (a canary of at most 24 characters and a space) and the tail
 *  ` key: C1 C2. key: ` (13 characters and two canaries) with the cue. */
export const tailUpperTokens = 25 + 13 + 2 * 24 + cueChars + 2

/** `ceilingTokens`: a request's tokens at most where the endpoint reports no limit (the prompt
 *  ceiling's, or null for none). */
function sizing(
  input: Pick<PlanInput, 'poolTokens' | 'contextTokens' | 'inputLimitTokens'> & {
    readonly chunkedPrefillTokens?: number | null
  },
  ceilingTokens: number | null,
): Sizing {
  const reported = input.chunkedPrefillTokens ?? null
  const chunkTokens = reported ?? defaultChunkTokens
  const limits = [input.poolTokens, input.contextTokens, input.inputLimitTokens].filter(
    (n): n is number => n !== null,
  )
  const limit = limits.length > 0 ? Math.min(...limits) : ceilingTokens
  const roomTokens = limit === null ? null : limit - maxTokens - marginTokens
  const wanted = chunkTokens + Math.max(Math.ceil(chunkTokens / 4), Math.min(3 * chunkTokens, 2048))
  const headTokens = roomTokens === null ? wanted : Math.min(wanted, roomTokens - tailUpperTokens)
  return {
    chunkTokens,
    isChunkReported: reported !== null,
    headTokens,
    roomTokens,
    isCeiling: limits.length === 0 && ceilingTokens !== null,
  }
}

export const abortRetryProbe: Probe = {
  name: 'abort-retry',
  description:
    'a prompt over one prefill chunk is cut during prefill, then sent again at once by the same tenant and another; temperature-0 answers must equal the cold answer and carry no other request’s canary',
  class: 'content-leak',
  // G5: the prefix cache publishes only pages a completed prefill filled and sealed.
  controls: { aisvs: [aisvsKvPartitioning], guards: ['G5'] },
  isSizing: true,
  plan: (input) => {
    // With no limit known, the prompts grow from answered ones up to the ceiling's cap at most.
    const { headTokens } = sizing(input, input.isAggressive ? null : unknownLimitTokens)
    return [
      {
        what: 'attempts: cold, priming, cut during prefill, two retries',
        numRequests: numAttempts * requestsPerAttempt,
        tokensEach: Math.max(1, headTokens) + tailUpperTokens + maxTokens,
      },
    ]
  },
  async run(target, budget, context): Promise<Finding[]> {
    const ceiling = () => context.ceiling?.maxRequestTokens() ?? firstCeilingTokens
    const size = sizing(context.discovery, ceiling())
    if (size.isChunkReported && size.headTokens <= size.chunkTokens) {
      return [
        inconclusive(
          `the endpoint holds at most ${size.roomTokens} prompt tokens, not a prompt over one prefill chunk (${size.chunkTokens} tokens) with room to answer: an abort cannot land between prefill steps`,
          { ...size },
        ),
      ]
    }
    const sizer = await context.sizer().catch((err: unknown) => {
      if (err instanceof BudgetExhaustedError) return null
      throw err
    })
    if (sizer === null) {
      return [
        inconclusive(
          'the endpoint gave no token counts (usage or /tokenize), so no prompt could be sized over a prefill chunk',
          { ...size },
        ),
      ]
    }
    const rng = createRng(context.seed, 'abort-retry')
    const attempts: Attempt[] = []
    let control: Observed | null = null
    const stoppedBy = await runUntilExhausted(async () => {
      for (let i = 0; i < numAttempts; i++) {
        // Where no limit is known, each attempt's prompt is as large as answers so far allow.
        const now = sizing(context.discovery, ceiling())
        if (now.headTokens < 1) break
        const attempt = plantAttempt(target.tenants, sizer, now, rng, i, nextCutFraction(attempts))
        // Recorded before it is sent: what a budget stop leaves half done is still judged.
        attempts.push(attempt)
        await runAttempt(target, context, attempt)
        if (isDecisive(attempt)) return
      }
      control = await sendCacheControl(target, attempts)
    })
    const evidenceSize = { ...size, ceiling: context.ceiling?.describe() ?? null }
    return judge(attempts, evidenceSize, stoppedBy, control)
  },
}

/** One attempt, filled in as its requests end. */
interface Attempt {
  readonly index: number
  readonly cutFraction: number
  readonly subject: Planted
  readonly priming: Planted
  /** The tenants: the one cut, another, and the one that sends the cold answer (a third tenant
   *  when there is one). */
  readonly roles: { readonly cut: Tenant; readonly other: Tenant; readonly reference: Tenant }
  readonly observed: Observed[]
  /** The prompt's estimated tokens (filler and the tail's upper bound). */
  readonly promptTokens: number
  cold: Observed | null
  cutRun: Observed | null
  cutAfterMs: number | null
  readonly retries: Observed[]
}

/** A request's material: its own filler ({@link keyedFiller}) of `headTokens` tokens behind a
 *  fresh first word, then the canaries, then the first canary's start again. The filler costs
 *  the sizer's tokens per word (the prompt lands where filler of the sizer's own would), and is
 *  the request's: an answer that repeats it elsewhere names whose it was. */
export function plantRequest(
  rng: Rng,
  sizer: PromptSizer,
  headTokens: number,
  id: string,
  tenant: Tenant,
): Planted {
  const canaries = makeCanaries(rng, 3)
  const [nonce, first, second] = canaries
  const filler = keyedFiller(rng, Math.max(1, sizer.wordsFor(headTokens, 'up') - 1))
  const prompt = `${nonce} ${filler} key: ${first} ${second}. key: ${first.slice(0, cueChars)}`
  return { id, tenant, canaries, prompt, filler }
}

function plantAttempt(
  tenants: readonly Tenant[],
  sizer: PromptSizer,
  size: Sizing,
  rng: Rng,
  index: number,
  cutFraction: number,
): Attempt {
  const roles = { cut: tenants[0], other: tenants[1], reference: tenants[2] ?? tenants[1] }
  return {
    index,
    cutFraction,
    subject: plantRequest(rng, sizer, size.headTokens, `a${index}`, roles.cut),
    priming: plantRequest(rng, sizer, size.headTokens, `p${index}`, roles.other),
    roles,
    observed: [],
    promptTokens: size.headTokens + tailUpperTokens,
    cold: null,
    cutRun: null,
    cutAfterMs: null,
    retries: [],
  }
}

/** The next cut's fraction of the cold TTFT. Steered by the same tenant's retry, when the
 *  endpoint reports `cached_tokens`: a retry that found nothing cached after a cut before the
 *  answer began means the cut came before the prefill published anything (too early, or during
 *  the prefill of an engine that publishes only completed prefills): cut later; one that found
 *  the prompt cached means the prefill had published (it had completed: too late; or the bug):
 *  cut earlier. The cuts then close in on the moment the prefill ends, the last stretch of
 *  prefill, on either kind of engine. Without `cached_tokens`, {@link cutFractions} in turn. */
function nextCutFraction(done: readonly Attempt[]): number {
  let lo = 0
  let hi = 1
  for (const a of done) {
    if (a.cutRun === null || a.retries.length === 0) continue
    const cached = a.retries[0].result.cachedTokens
    if (cached === null) return cutFractions[done.length % cutFractions.length]
    if (!isCutInPrefill(a) || cached > 0) hi = Math.min(hi, a.cutFraction)
    else lo = Math.max(lo, a.cutFraction)
  }
  if (lo === 0 && hi === 1) return cutFractions[0]
  // Past a stale bound (the TTFT moves between attempts): start the bisection again around it.
  if (lo >= hi) return lo === 0 ? hi / 2 : Math.min(0.9, (lo + hi) / 2)
  return hi === 1 ? Math.min(0.9, 2 * lo) : (lo + hi) / 2
}

/** Cold, priming, cut, then the two retries; stops after the cold run when it was not answered
 *  whole with a first-token time (nothing to time the cut by, nothing to compare with). */
async function runAttempt(target: Target, context: ProbeContext, attempt: Attempt): Promise<void> {
  const { subject, priming, roles } = attempt
  const as = (tenant: Tenant): Planted => ({ ...subject, tenant })
  // Streamed where the first token's time matters; the retries whole, for their usage's
  // `cached_tokens` (what the prefix cache gave them).
  const send = async (
    p: Planted,
    label: string,
    stream: boolean,
    abortAfterMs?: number,
  ): Promise<Observed> => {
    const result = await target.complete({
      tenant: p.tenant,
      prompt: p.prompt,
      maxTokens,
      stream,
      estimatedPromptTokens: attempt.promptTokens,
      ...(abortAfterMs === undefined ? {} : { abortAfterMs }),
    })
    const o = { planted: p, label, stream, result }
    attempt.observed.push(o)
    return o
  }
  const cold = (attempt.cold = await send(as(roles.reference), 'cold', true))
  if (!isAnsweredWhole(cold.result) || cold.result.ttftMs === null) return
  await send(priming, 'priming (same shape)', false)
  const cutAfterMs = Math.max(1, Math.round(cold.result.ttftMs * attempt.cutFraction))
  attempt.cutAfterMs = cutAfterMs
  attempt.cutRun = await send(subject, `cut after ${cutAfterMs} ms`, true, cutAfterMs)
  attempt.retries.push(await send(subject, 'retry (same tenant, right after the cut)', false))
  attempt.retries.push(
    await send(as(roles.other), 'retry (another tenant, right after the cut)', false),
  )
  const { differing, compared } = comparison(attempt)
  context.log(
    `attempt ${attempt.index}: cold TTFT ${Math.round(cold.result.ttftMs)} ms, cut at ${cutAfterMs} ms ${isCutInPrefill(attempt) ? 'during prefill' : 'after the answer began'}; ${differing.length} of ${compared.length} retries differ`,
  )
}

/** The positive control: the prompt of the last attempt whose same-tenant retry was answered
 *  whole (and so prefilled to its end) is sent once more by that tenant, which a prefix cache
 *  must then serve from cache (`cached_tokens` above 0). Without a hit seen, no retry showed the
 *  cache at work, and "the retries equal the cold answer" proves nothing about reused pages.
 *  Null when no attempt had such a retry. */
async function sendCacheControl(
  target: Target,
  attempts: readonly Attempt[],
): Promise<Observed | null> {
  const last = [...attempts].reverse().find((a) => a.retries.some((o) => isAnsweredWhole(o.result)))
  if (last === undefined) return null
  const result = await target.complete({
    tenant: last.subject.tenant,
    prompt: last.subject.prompt,
    maxTokens,
    stream: false,
    estimatedPromptTokens: last.promptTokens,
  })
  const o: Observed = {
    planted: last.subject,
    label: 'control (same tenant, prompt answered whole before)',
    stream: false,
    result,
  }
  last.observed.push(o)
  return o
}

/** The retries answered whole, and those whose text is not the cold answer's. */
function comparison(attempt: Attempt): { compared: Observed[]; differing: Observed[] } {
  const cold = attempt.cold
  if (cold === null || !isAnsweredWhole(cold.result)) return { compared: [], differing: [] }
  const compared = attempt.retries.filter((o) => isAnsweredWhole(o.result))
  return { compared, differing: compared.filter((o) => o.result.text !== cold.result.text) }
}

/** A difference or a crossing was seen, or the cold run was refused (the next attempt's would
 *  be too): later attempts add nothing. */
function isDecisive(attempt: Attempt): boolean {
  const status = attempt.cold?.result.status ?? null
  return (
    (status !== null && status >= 400 && status < 500) ||
    comparison(attempt).differing.length > 0 ||
    findCrossings(attempt.observed, [attempt.subject, attempt.priming]).length > 0
  )
}

function isCutInPrefill(attempt: Attempt): boolean {
  return attempt.cutRun !== null && isCutBeforeAnswer(attempt.cutRun.result)
}

/** True when the auditor's cut ended the request before any of its answer arrived. */
function isCutBeforeAnswer(result: CompletionResult): boolean {
  return result.failure === 'aborted' && result.ttftMs === null && result.text === ''
}

function judge(
  attempts: readonly Attempt[],
  size: Sizing & { readonly ceiling: string | null },
  stoppedBy: string | null,
  control: Observed | null,
): Finding[] {
  const planted = attempts.flatMap((a) => [a.subject, a.priming])
  const observed = attempts.flatMap((a) => a.observed)
  const summary = {
    chunkTokens: size.chunkTokens,
    isChunkReported: size.isChunkReported,
    promptTokens: observed.find((o) => o.result.promptTokens !== null)?.result.promptTokens ?? null,
    attempts: attempts.map((a) => ({
      cutFraction: a.cutFraction,
      coldTtftMs: a.cold?.result.ttftMs == null ? null : Math.round(a.cold.result.ttftMs),
      cutAfterMs: a.cutAfterMs,
      isCutInPrefill: isCutInPrefill(a),
      numCompared: comparison(a).compared.length,
      numDiffering: comparison(a).differing.length,
      cachedTokens: a.observed.map((o) => o.result.cachedTokens),
    })),
    stoppedBy,
    ceiling: size.ceiling,
    cacheControl:
      control === null
        ? null
        : { cachedTokens: control.result.cachedTokens, status: control.result.status },
    requests: requestLog(observed),
  }
  const crossings = findCrossings(observed, planted)
  if (crossings.length > 0) {
    return leakFindings(
      'abort-retry',
      crossings,
      planted,
      summary,
      `${remediation} ${crossingRemediation}`,
    )
  }
  const differing = attempts.flatMap((a) => comparison(a).differing)
  if (differing.length > 0) return [differenceFinding(differing, summary)]
  const inPrefill = attempts.filter(isCutInPrefill)
  const numCompared = inPrefill.reduce((n, a) => n + comparison(a).compared.length, 0)
  if (inPrefill.length === 0 || numCompared === 0) {
    const timed = attempts.filter((a) => a.cutRun !== null)
    const reason =
      attempts.length === 0
        ? 'no attempt could start'
        : timed.length === 0
          ? `the cold run of the prompt was not answered whole with a first token (${describe(attempts[0].cold?.result)}), so no cut could be timed`
          : inPrefill.length === 0
            ? `no cut landed during prefill: each of ${timed.length} cuts came after the answer began, or the request failed first`
            : 'no retry after a cut during prefill was answered whole, so none could be compared'
    return [inconclusive(stoppedBy === null ? reason : `${reason} (${stoppedBy})`, summary)]
  }
  const mostCached = Math.max(0, ...observed.map((o) => o.result.cachedTokens ?? 0))
  if (mostCached === 0) {
    const isReported = observed.some((o) => o.result.cachedTokens !== null)
    return [
      inconclusive(
        `${inPrefill.length} prompts cut during prefill and ${numCompared} retries answered the cold answer, but no request was seen served from a prefix cache (cached_tokens ${isReported ? 'always 0' : 'not reported'}, the control included): reuse of an aborted prefill's pages was not exercised`,
        summary,
      ),
    ]
  }
  return [
    {
      probe: 'abort-retry',
      verdict: 'clean',
      severity: 'info',
      title: `${inPrefill.length} prompts cut during prefill; ${numCompared} retries by the same and another tenant answered exactly the cold answer (positive control: the prefix cache served ${mostCached} cached tokens)`,
      evidence: summary,
      remediation: 'None needed.',
    },
  ]
}

/** The warning for retries that answered other text than the cold answer, no canary crossed. */
function differenceFinding(
  differing: readonly Observed[],
  summary: Record<string, unknown>,
): Finding {
  const first = differing.reduce((a, b) =>
    a.result.requestNumber <= b.result.requestNumber ? a : b,
  )
  const n = differing.length
  return {
    probe: 'abort-retry',
    verdict: 'warning',
    class: 'integrity',
    severity: 'high',
    title: `after a cut, ${n} temperature-0 retr${n === 1 ? 'y' : 'ies'} answered other text than the cold answer (first: ${first.planted.tenant.name}'s ${first.label}), with no other request's canary: an aborted prefill's half-written pages were likely reused`,
    evidence: {
      requestNumber: first.result.requestNumber,
      atMs: first.result.atMs,
      differing: differing.map((o) => ({
        tenant: o.planted.tenant.name,
        label: o.label,
        requestNumber: o.result.requestNumber,
        cachedTokens: o.result.cachedTokens,
      })),
      ...summary,
    },
    remediation,
  }
}

function describe(result: CompletionResult | undefined): string {
  if (result === undefined) return 'not sent'
  if (result.status !== null && result.status !== 200) return `HTTP ${result.status}`
  return result.failure ?? (result.ttftMs === null ? 'no first-token time' : 'answered')
}

function inconclusive(title: string, evidence: Record<string, unknown>): Finding {
  return {
    probe: 'abort-retry',
    verdict: 'inconclusive',
    severity: 'medium',
    title,
    evidence,
    remediation: inconclusiveRemediation,
  }
}
