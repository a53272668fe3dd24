/** Probe `prefix-timing`: can one tenant tell, from time to first token, that another tenant sent
 *  a given prompt prefix? (Gu et al., "Auditing Prompt Caching in Language Model APIs", ICML
 *  2025.) The victim sends a fresh prefix; the observer then sends the same prefix ("hit") and
 *  a fresh one of the same size ("miss"); the two TTFT samples are compared with a two-sample
 *  Kolmogorov–Smirnov test. A positive control does the same within one tenant (the victim's own
 *  reuse): only when the control shows a difference is "no cross-tenant difference" believed,
 *  else the result is inconclusive. `usage.prompt_tokens_details.cached_tokens`, when reported,
 *  is read as a direct signal. Prefixes are random single letters (the sizer's filler shape, so
 *  their token count is known) behind a canary. Requests are non-streamed with `max_tokens: 1`,
 *  so time to the first body byte is prefill plus one token; the victim's priming request
 *  generates {@link primeMaxTokens}, so that an engine that shares pages only after a second
 *  generated token caches it too. Then the eviction arm
 *  (prefix-eviction.ts): whether another tenant's traffic lowers one's own hits, a side channel
 *  on its load; a second finding only when it finds that channel. */
import { BudgetExhaustedError, runUntilExhausted } from '../budget.js'
import { makeCanaries } from '../canaries.js'
import type { Budget } from '../budget.js'
import type { Probe, ProbeContext } from '../probe.js'
import { aisvsKvPartitioning, inconclusiveRemediation } from '../probe.js'
import { createRng, type Rng } from '../rng.js'
import { firstCeilingTokens } from '../prompt-ceiling.js'
import { ksTwoSample, median, type KsResult } from '../stats.js'
import { outcomeOf, type CompletionResult, type Target } from '../target.js'
import {
  evictionFinding,
  evictionRounds,
  floodSize,
  runEvictionArm,
  type EvictionRound,
} from './prefix-eviction.js'
import type { Finding, Tenant } from '../types.js'
import {
  crossingRemediation,
  findCrossings,
  leakFindings,
  requestLog,
  type Observed,
  type Planted,
} from './material.js'

/** Pairs (hit, miss) per arm, at most: a two-sample KS test of 12 against 12 reaches p < 0.001
 *  on a clean separation even with a few samples lost to noise. */
const maxSamples = 12
/** Tokens the victim's priming request generates: more than one, since an engine may share a
 *  request's pages only once it has generated a second token (`transformers serve` with
 *  continuous batching does not share the pages of a request that stopped at its first). */
export const primeMaxTokens = 4
const minSamples = 5
/** p below this with hits faster: a difference. */
const alpha = 0.01
/** p at or above this: no difference. In between: inconclusive. */
const noDifferenceP = 0.05
/** KS p-value under which TTFT alone outweighs a server's cached_tokens of 0 (a warning). */
const strongAlpha = 0.001
const maxPrefixTokens = 512
const defaultPrefixWords = 200
/** Tokens of a prompt beyond its prefix, at most: the canary heading it and the suffix. */
const suffixTokens = 16

/** One arm of the protocol (control or cross-tenant): TTFT samples (ms) and reported
 *  `cached_tokens` of its hit and miss requests, in the order sent. */
export interface TimingArm {
  readonly hitMs: number[]
  readonly missMs: number[]
  readonly hitCachedTokens: (number | null)[]
  readonly missCachedTokens: (number | null)[]
}

export const prefixTimingProbe: Probe = {
  name: 'prefix-timing',
  description:
    "TTFT of another tenant's prefix (hit) vs a fresh one (miss), two-sample Kolmogorov–Smirnov test with the same tenant's reuse as positive control; cached_tokens read as a direct signal; and whether another tenant's flood of prefixes evicts one's own (cached_tokens)",
  class: 'side-channel',
  // kvfence's prefix cache is keyed by a salt the server derives from the tenant: a design
  // property, not one of the numbered guards.
  controls: { aisvs: [aisvsKvPartitioning], guards: [] },
  isSizing: true,
  plan: ({ limits, poolTokens, contextTokens }) => {
    const sizes = [poolTokens, contextTokens].filter((n) => n !== null)
    const prefixTokens = Math.min(
      maxPrefixTokens,
      ...sizes.map((n) => Math.floor(n / 2)),
      sizes.length === 0 ? defaultPrefixWords : Infinity,
    )
    // Per sample and arm: the victim primes, the reader sends a hit and a miss.
    return [
      {
        what: `${maxSamples} samples × 2 arms × 3 prompts of a ${prefixTokens}-token prefix`,
        numRequests: 6 * Math.min(maxSamples, Math.floor(limits.maxRequests / 6)),
        tokensEach: prefixTokens + suffixTokens + primeMaxTokens,
      },
      {
        what: `${evictionRounds} eviction rounds × (4 of the observer's + ${floodSize(poolTokens, prefixTokens)} of the other tenant's) prompts`,
        numRequests: evictionRounds * (4 + floodSize(poolTokens, prefixTokens)),
        tokensEach: prefixTokens + suffixTokens + 1,
      },
    ]
  },
  async run(target, budget, context): Promise<Finding[]> {
    const traffic: Traffic = { planted: [], observed: [] }
    const findings = await runMembership(target, budget, context, traffic)
    const eviction = await runEviction(target, budget, context, traffic)
    const leaks = trafficLeaks(traffic)
    if (eviction.finding !== null) return [...leaks, ...findings, eviction.finding]
    // Quiet: what the arm saw goes with the membership finding, for the report's reader.
    const [first, ...rest] = findings
    const { numFlood, rounds } = eviction
    return [
      ...leaks,
      { ...first, evidence: { ...first.evidence, eviction: { numFlood, rounds } } },
      ...rest,
    ]
  },
}

/** Every prefix the probe sent, as the material of the tenant that made it, and every answer:
 *  membership and eviction traffic alike. */
interface Traffic {
  readonly planted: Planted[]
  readonly observed: Observed[]
}

/** A fresh prefix of `tenant`'s, recorded in `traffic`: a canary, then `words` random single
 *  letters (unique, sized like the sizer's filler, and the prefix's own: an answer repeating
 *  them names whose they were). */
function plantPrefix(traffic: Traffic, rng: Rng, words: number, tenant: Tenant): Planted {
  const [canary] = makeCanaries(rng, 1)
  const letters = Array.from({ length: words }, () => String.fromCharCode(97 + rng.int(0, 25)))
  const filler = letters.join(' ')
  const planted = {
    id: `t${traffic.planted.length}`,
    tenant,
    canaries: [canary],
    prompt: `${canary} ${filler}`,
    filler,
  }
  traffic.planted.push(planted)
  return planted
}

/** Sends `prefix` (with a fresh suffix) as `tenant`, who may be another tenant than the one that
 *  made it (the reader of a hit: it sends that prefix as its own request), and records the
 *  answer. */
async function sendPrefix(
  target: Target,
  traffic: Traffic,
  rng: Rng,
  request: { tenant: Tenant; prefix: Planted; label: string; maxTokens?: number },
): Promise<CompletionResult> {
  const { tenant, prefix, label } = request
  const result = await target.complete({
    tenant,
    prompt: `${prefix.prompt} ${suffix(rng)}`,
    maxTokens: request.maxTokens ?? 1,
    stream: false,
  })
  traffic.observed.push({ planted: { ...prefix, tenant }, label, stream: false, result })
  return result
}

/** Leak findings for answers that carried another request's canary or letters (none: []). */
function trafficLeaks(traffic: Traffic): Finding[] {
  const crossings = findCrossings(traffic.observed, traffic.planted)
  if (crossings.length === 0) return []
  const summary = { numSent: traffic.observed.length, requests: requestLog(traffic.observed) }
  return leakFindings('prefix-timing', crossings, traffic.planted, summary, crossingRemediation)
}

/** The eviction arm (prefix-eviction.ts) with the membership arms' prefix size: its rounds, and
 *  a finding when another tenant's traffic evicted the observer's cached prefix (else null). */
async function runEviction(
  target: Target,
  budget: Budget,
  context: ProbeContext,
  traffic: Traffic,
): Promise<{ finding: Finding | null; numFlood: number; rounds: EvictionRound[] }> {
  const [victim, observer] = target.tenants
  const rng = createRng(context.seed, 'prefix-eviction')
  const sizer = await context.sizer().catch(() => null)
  const { poolTokens } = context.discovery
  const prefixTokens = prefixTokensFor(context)
  const prefixWords = sizer === null ? defaultPrefixWords : sizer.wordsFor(prefixTokens, 'down')
  const numFlood = floodSize(poolTokens, sizer === null ? defaultPrefixWords : prefixTokens)
  let rounds: EvictionRound[] = []
  await runUntilExhausted(async () => {
    rounds = await runEvictionArm({
      observer,
      other: victim,
      numFlood,
      maxRounds: evictionRounds,
      prefix: (tenant) => plantPrefix(traffic, rng, prefixWords, tenant),
      send: (tenant, prefix, label) => sendPrefix(target, traffic, rng, { tenant, prefix, label }),
      canRun: (n) => budget.remainingRequests >= n,
    })
  })
  context.log(
    `eviction arm: ${rounds.map((r) => `${r.reuse}/${r.quiet}/${r.flooded}`).join(', ') || 'no round'} (reuse/quiet/flooded cached_tokens)`,
  )
  return { finding: evictionFinding(rounds, observer, victim, numFlood), numFlood, rounds }
}

/** The prefixes' tokens: half the smallest limit known, at most {@link maxPrefixTokens}; with no
 *  limit known, within what the prompt ceiling allows (prompt-ceiling.ts). */
function prefixTokensFor(context: ProbeContext): number {
  const { poolTokens, contextTokens } = context.discovery
  const limits = [poolTokens, contextTokens].filter((n) => n !== null)
  const ceiling =
    limits.length > 0
      ? Infinity
      : (context.ceiling?.maxRequestTokens() ?? firstCeilingTokens) - suffixTokens - primeMaxTokens
  return Math.max(1, Math.min(maxPrefixTokens, ceiling, ...limits.map((n) => Math.floor(n / 2))))
}

/** The membership arms (the module's header): sends, then judges. */
async function runMembership(
  target: Target,
  budget: Budget,
  context: ProbeContext,
  traffic: Traffic,
): Promise<Finding[]> {
  const [victim, observer] = target.tenants
  const sizer = await context.sizer().catch((err: unknown) => {
    if (err instanceof BudgetExhaustedError) return null
    throw err
  })
  const prefixTokens = prefixTokensFor(context)
  const prefixWords = sizer === null ? defaultPrefixWords : sizer.wordsFor(prefixTokens, 'down')
  const numSamples = Math.min(maxSamples, Math.floor(budget.remainingRequests / 6))
  const rng = createRng(context.seed, 'prefix-timing')
  const { control, cross, stoppedBy } = await sendMembership(
    target,
    { rng, traffic },
    prefixWords,
    numSamples,
  )
  const controlTest = compare(control)
  const crossTest = compare(cross)
  const evidence = {
    victimTenant: victim.name,
    observerTenant: observer.name,
    prefixWords,
    prefixTokensEstimate: sizer?.estimate(prefixWords) ?? null,
    numSamples,
    alpha,
    control: {
      ...controlTest,
      ttftMs: { hit: control.hitMs, miss: control.missMs },
      cachedTokens: control.hitCachedTokens,
    },
    cross: {
      ...crossTest,
      ttftMs: { hit: cross.hitMs, miss: cross.missMs },
      cachedTokens: cross.hitCachedTokens,
    },
    stoppedBy,
  }
  context.log(
    `control p=${fmt(controlTest.p)} (hit ${fmt(controlTest.medianHitMs)} ms, miss ${fmt(controlTest.medianMissMs)} ms); ` +
      `cross p=${fmt(crossTest.p)} (hit ${fmt(crossTest.medianHitMs)} ms, miss ${fmt(crossTest.medianMissMs)} ms)`,
  )
  return judgeMembership(
    { victim, observer, control, cross, controlTest, crossTest, numSamples },
    evidence,
  )
}

/** Per sample, for each arm (the victim's own reuse: the control; the observer's: the cross
 *  arm), the victim primes a prefix, then the arm's reader sends it (a hit) and a fresh one (a
 *  miss), in alternating order. */
async function sendMembership(
  target: Target,
  { rng, traffic }: { rng: Rng; traffic: Traffic },
  prefixWords: number,
  numSamples: number,
): Promise<{ control: TimingArm; cross: TimingArm; stoppedBy: string | null }> {
  const [victim, observer] = target.tenants
  const control: TimingArm = { hitMs: [], missMs: [], hitCachedTokens: [], missCachedTokens: [] }
  const cross: TimingArm = { hitMs: [], missMs: [], hitCachedTokens: [], missCachedTokens: [] }
  const send = (tenant: Tenant, prefix: Planted, label: string, maxTokens = 1) =>
    sendPrefix(target, traffic, rng, { tenant, prefix, label, maxTokens })
  const record = (arm: TimingArm, kind: 'hit' | 'miss', r: CompletionResult): void => {
    if (outcomeOf(r) !== 'accepted' || r.ttftMs === null) return
    arm[kind === 'hit' ? 'hitMs' : 'missMs'].push(r.ttftMs)
    arm[kind === 'hit' ? 'hitCachedTokens' : 'missCachedTokens'].push(r.cachedTokens)
  }
  const stoppedBy = await runUntilExhausted(async () => {
    for (let i = 0; i < numSamples; i++) {
      for (const [arm, reader, name] of [
        [control, victim, 'control'],
        [cross, observer, 'cross'],
      ] as const) {
        const primed = plantPrefix(traffic, rng, prefixWords, victim)
        const fresh = plantPrefix(traffic, rng, prefixWords, reader)
        await send(victim, primed, `${name} sample ${i}, priming`, primeMaxTokens)
        // Alternate the order of hit and miss so that drift in load affects both alike.
        const hitFirst = i % 2 === 0
        const hit = () => send(reader, primed, `${name} sample ${i}, hit`)
        const miss = () => send(reader, fresh, `${name} sample ${i}, miss`)
        if (hitFirst) {
          record(arm, 'hit', await hit())
          record(arm, 'miss', await miss())
        } else {
          record(arm, 'miss', await miss())
          record(arm, 'hit', await hit())
        }
      }
    }
  })
  return { control, cross, stoppedBy }
}

const sharedRemediation =
  'Key the prefix (KV) cache by tenant: vLLM: set a per-tenant cache_salt in the gateway (never ' +
  'from the client, see CVE-2025-46570); SGLang and others: isolate the radix/prefix cache per ' +
  'tenant or disable cross-tenant prefix sharing. Otherwise any tenant can test whether another ' +
  'tenant sent a given prompt prefix (Gu et al., ICML 2025).'

/** What the membership arms measured. */
interface Membership {
  readonly victim: Tenant
  readonly observer: Tenant
  readonly control: TimingArm
  readonly cross: TimingArm
  readonly controlTest: Comparison
  readonly crossTest: Comparison
  readonly numSamples: number
}

/** cached_tokens first (a hit another tenant's prefix was served is the side channel), then
 *  TTFT; clean only when the control showed caching (its positive control) and the cross arm
 *  did not. */
function judgeMembership(m: Membership, evidence: Record<string, unknown>): Finding[] {
  const { victim, observer, control, cross, controlTest, crossTest, numSamples } = m
  const cachedHit = Math.max(0, ...cross.hitCachedTokens.map((n) => n ?? 0))
  const cachedMiss = Math.max(0, ...cross.missCachedTokens.map((n) => n ?? 0))
  const isCachedReported = [...control.hitCachedTokens, ...cross.hitCachedTokens].some(
    (n) => n !== null,
  )
  if (cachedHit > cachedMiss) {
    return [
      {
        probe: 'prefix-timing',
        verdict: 'warning',
        severity: 'high',
        title: `${observer.name}'s requests were served ${cachedHit} cached tokens of prefixes only ${victim.name} had sent (cached_tokens)`,
        evidence: {
          ...evidence,
          directSignal: { cachedTokensHit: cachedHit, cachedTokensMiss: cachedMiss },
        },
        remediation: sharedRemediation,
      },
    ]
  }
  const controlCached = Math.max(0, ...control.hitCachedTokens.map((n) => n ?? 0))
  // cached_tokens decides when it answers: the server counted cache hits for the same tenant's
  // reuse, and reported a count (0) for every one of another tenant's requests for those
  // prefixes. TTFT is then only corroboration: on a busy host its KS test errs (a noise
  // "faster" at p < 0.01 about one run in 200, a missed control more often), and a verdict
  // must not hang on that when the server said what its cache did.
  const isDirectlyUnshared =
    controlCached > 0 &&
    cross.hitCachedTokens.length >= minSamples &&
    cross.hitCachedTokens.every((n) => n === 0)
  const isCrossFaster = crossTest.test !== null && crossTest.test.p < alpha && isFaster(crossTest)
  if (
    isCrossFaster &&
    isDirectlyUnshared &&
    crossTest.test !== null &&
    crossTest.test.p < strongAlpha
  ) {
    // cached_tokens says unshared, but the timing says otherwise, strongly (noise gets here about
    // one run in 1,000): a cache layer that cached_tokens does not count (an external KV store
    // keyed by tokens alone, sglang#37160) looks exactly like this. Not clean, not proven.
    return [
      {
        probe: 'prefix-timing',
        verdict: 'warning',
        severity: 'medium',
        title: `${observer.name}'s TTFT is shorter for prefixes ${victim.name} sent (median ${fmt(crossTest.medianHitMs)} vs ${fmt(crossTest.medianMissMs)} ms, KS p=${fmt(crossTest.p)}) although the server reported 0 cached tokens for them: a cache layer that cached_tokens does not count may be shared`,
        evidence,
        remediation: `Check every cache layer (radix tree, host or external KV stores) for a per-tenant key; re-run to tell a real difference from noise. ${sharedRemediation}`,
      },
    ]
  }
  if (isCrossFaster && !isDirectlyUnshared) {
    return [
      {
        probe: 'prefix-timing',
        verdict: 'warning',
        severity: 'high',
        title: `timing side channel: ${observer.name}'s TTFT is shorter for prefixes ${victim.name} sent (median ${fmt(crossTest.medianHitMs)} vs ${fmt(crossTest.medianMissMs)} ms, KS p=${fmt(crossTest.p)})`,
        evidence,
        remediation: sharedRemediation,
      },
    ]
  }
  const isControlFaster =
    controlTest.test !== null && controlTest.test.p < alpha && isFaster(controlTest)
  const isControlSeen = isControlFaster || controlCached > 0
  if (!isControlSeen || crossTest.test === null) {
    return [
      {
        probe: 'prefix-timing',
        verdict: 'inconclusive',
        severity: 'low',
        title:
          numSamples < minSamples || crossTest.test === null
            ? `too few timing samples (${cross.hitMs.length} of ${numSamples}) to compare`
            : `no prefix caching observable even for the same tenant's reuse (control KS p=${fmt(controlTest.p)}${isCachedReported ? '' : ', no cached_tokens reported'}): a cross-tenant difference could not be seen either way`,
        evidence,
        remediation:
          'Nothing to fix if the endpoint has no prefix cache. Otherwise re-run with a larger ' +
          `budget on an idle endpoint. ${inconclusiveRemediation}`,
      },
    ]
  }
  // One-sided from here: a cache hit can only make a request faster, so another tenant's
  // prefixes answered slower are no sign of sharing. And cached_tokens, where it answers (see
  // isDirectlyUnshared), outweighs any TTFT difference.
  if (crossTest.test.p >= noDifferenceP || !isFaster(crossTest) || isDirectlyUnshared) {
    return [
      {
        probe: 'prefix-timing',
        verdict: 'clean',
        severity: 'info',
        title: cleanTitle({
          controlCached,
          isControlFaster,
          controlP: controlTest.p,
          crossCached: cross.hitCachedTokens.some((n) => n !== null) ? cachedHit : null,
          crossP: crossTest.test.p,
          isCrossFaster,
        }),
        evidence,
        remediation: 'None needed.',
      },
    ]
  }
  return [
    {
      probe: 'prefix-timing',
      verdict: 'inconclusive',
      severity: 'medium',
      title: `borderline cross-tenant timing difference (KS p=${fmt(crossTest.test.p)}): re-run with more samples`,
      evidence,
      remediation: inconclusiveRemediation,
    },
  ]
}

/** The clean finding's title, naming the signal that showed the control's caching (reported
 *  `cached_tokens`, TTFT, or both) so that a KS p near 1 is never presented as "faster".
 *  `controlCached`/`crossCached`: most `cached_tokens` reported by the victim's own reuse / by the
 *  observer's requests for the victim's prefixes (`crossCached` null when none reported any);
 *  `isControlFaster`: the control's KS test found its hits faster at α; p values as computed. */
export function cleanTitle(s: {
  controlCached: number
  isControlFaster: boolean
  controlP: number | null
  crossCached: number | null
  crossP: number
  /** Another tenant's TTFT looked faster at α although it reported no cached token (noise). */
  isCrossFaster?: boolean
}): string {
  const head = 'the prefix cache is not shared across tenants'
  const isCached = s.controlCached > 0
  if (!isCached) {
    return `${head} (decided by TTFT): own reuse is faster (KS p=${fmt(s.controlP)}), another tenant's prefix is not (KS p=${fmt(s.crossP)})`
  }
  const crossCached =
    s.crossCached === null ? 'reported no cached_tokens' : `reported ${s.crossCached}`
  const crossTiming = s.isCrossFaster
    ? `looks faster by TTFT (KS p=${fmt(s.crossP)}) with no cached token: timing noise, not a cache hit`
    : `is not faster (KS p=${fmt(s.crossP)})`
  if (s.isControlFaster) {
    return `${head} (decided by cached_tokens and TTFT): own reuse reported ${s.controlCached} cached tokens and is faster (KS p=${fmt(s.controlP)}), another tenant's prefix ${crossCached} and ${crossTiming}`
  }
  if (s.isCrossFaster) {
    return `${head} (decided by cached_tokens): own reuse reported ${s.controlCached} cached tokens, another tenant's prefix ${crossCached}; TTFT did not show the caching (own reuse KS p=${fmt(s.controlP)}) and another tenant's ${crossTiming}`
  }
  return `${head} (decided by cached_tokens): own reuse reported ${s.controlCached} cached tokens, another tenant's prefix ${crossCached}; TTFT did not show the caching (own reuse KS p=${fmt(s.controlP)}, another tenant's KS p=${fmt(s.crossP)})`
}

interface Comparison {
  readonly test: KsResult | null
  readonly p: number | null
  readonly medianHitMs: number | null
  readonly medianMissMs: number | null
}

function compare(arm: TimingArm): Comparison {
  const isEnough = arm.hitMs.length >= minSamples && arm.missMs.length >= minSamples
  const test = isEnough ? ksTwoSample(arm.hitMs, arm.missMs) : null
  return {
    test,
    p: test?.p ?? null,
    medianHitMs: median(arm.hitMs),
    medianMissMs: median(arm.missMs),
  }
}

function isFaster(c: Comparison): boolean {
  return c.medianHitMs !== null && c.medianMissMs !== null && c.medianHitMs < c.medianMissMs
}

function suffix(rng: Rng): string {
  return `q${rng.int(0, 9999)}`
}

function fmt(n: number | null): string {
  if (n === null) return '?'
  return n < 0.001 ? n.toExponential(1) : String(Math.round(n * 1000) / 1000)
}
