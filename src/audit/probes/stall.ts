/** Probe `stall`: a request that never answers at a size the endpoint advertises. Prompts grow
 *  (doubling, one at a time) from a small size to the largest the endpoint says it takes (the
 *  smallest of its context, its KV pool and its input limit, less `max_tokens`); each is given a
 *  bound derived from the latencies of the smaller ones answered, and one that gets no first
 *  byte, or no end, within it is an `availability` finding naming the size. Then what it left
 *  reserved is read: KV pool usage or requests running that do not return to what they were
 *  before it is a `resource-leak` (CWE-772, CWE-400).
 *  The case it models: prefill and decode started with different limits (InferenceX PR #2257:
 *  decode takes a prompt prefill refuses, reserves its pages and waits for a transfer that never
 *  comes; sglang PR #31664). Never larger than advertised, never past a 5xx, one at a time.
 *  Knows the sizer, pool usage and the endpoint's reports; knows nothing of any engine. */
import { runUntilExhausted } from '../budget.js'
import { makeCanaries } from '../canaries.js'
import type { Probe } from '../probe.js'
import { inconclusiveRemediation } from '../probe.js'
import { readPoolUsage, readRunning, type PoolUsage } from '../pool-usage.js'
import { createRng } from '../rng.js'
import type { PromptSizer } from '../sizer.js'
import { isAnsweredWhole, type CompletionResult, type Target } from '../target.js'
import type { Finding } from '../types.js'
import { boundedPrompt, promptLimit, sizerOrNull } from './sized-material.js'

export const stallMaxTokens = 8
/** The ladder's first size (tokens), or a quarter of the top where that is smaller: the top is
 *  never the first size, so that its bound comes from a measured answer. */
export const firstStallTokens = 512
/** A size's bound: this many times the latency the answered ones predict for it, and never less
 *  than {@link minBoundMs} (a loaded engine's jitter), never more than the request timeout. */
export const boundFactor = 4
export const minBoundMs = 10_000
/** After a stall: reads of pool usage and running requests (one each), this far apart, until they
 *  are back where they were. */
export const numSettleReads = 2
const settleGapMs = 1000
/** Reads before the ladder: pool usage (up to three endpoints tried) and requests running. */
const numBaselineReads = 4
/** The largest prompt sent under the default options (tokens); `--aggressive` goes up to the
 *  advertised limit itself. Enough for the reported case (a 9,217-token prefill limit under a
 *  decode that took ~10^6) without sending a pool-sized prompt to a production engine. */
export const defaultStallCapTokens = 32_768

/** The largest size the ladder sends for an advertised `top`. */
export function testedTop(top: number, isAggressive: boolean): number {
  return isAggressive ? top : Math.min(top, defaultStallCapTokens)
}

/** The sizes (tokens) the ladder sends, smallest first: doubling from {@link firstStallTokens}
 *  (or a quarter of `top`, 16 at least), the last one `top` itself. */
export function stallSizes(top: number): number[] {
  const sizes: number[] = []
  const first = Math.min(firstStallTokens, Math.max(16, Math.floor(top / 4)))
  for (let n = first; n < top; n *= 2) sizes.push(n)
  if (top >= 16) sizes.push(top)
  return sizes
}

/** The bound (ms) for a prompt of `tokens` from the answered ones' (tokens, ms): the slowest
 *  rate per token seen, times the size, plus the slowest fixed cost, times {@link boundFactor}. */
export function stallBoundMs(
  answered: readonly { tokens: number; ms: number }[],
  tokens: number,
  timeoutMs: number,
): number {
  const predicted = Math.max(
    0,
    ...answered.map((a) => (a.ms * Math.max(tokens, a.tokens)) / a.tokens),
  )
  return Math.min(timeoutMs, Math.max(minBoundMs, boundFactor * predicted))
}

/** One rung of the ladder as it ended. */
export interface Rung {
  readonly tokens: number
  readonly boundMs: number
  readonly ms: number
  readonly status: number | null
  /** `answered`, `refused` (4xx), `server-error` (5xx), `no-first-byte` or `no-end` (cut at its
   *  bound), `unknown` (cut by the budget's deadline, a broken connection: tells nothing). */
  readonly fate: 'answered' | 'refused' | 'server-error' | 'no-first-byte' | 'no-end' | 'unknown'
}

function fateOf(result: CompletionResult): Rung['fate'] {
  if (result.failure === 'aborted') return result.ttftMs === null ? 'no-first-byte' : 'no-end'
  if (isAnsweredWhole(result)) return 'answered'
  if (result.status !== null && result.status >= 500) return 'server-error'
  if (result.status !== null && result.status >= 400) return 'refused'
  return 'unknown'
}

/** What was reserved before and after a stall. */
export interface Reserved {
  readonly usage: PoolUsage | null
  readonly running: number | null
}

async function readReserved(target: Target, endpoint?: string): Promise<Reserved> {
  const usage = await readPoolUsage(target, endpoint)
  const running = await readRunning(target)
  return { usage, running }
}

/** Sends the ladder one rung at a time; stops at the first rung not answered. */
async function sendLadder(
  target: Target,
  sizer: PromptSizer,
  sizes: readonly number[],
  timeoutMs: () => number,
  canary: string,
  seed: number,
): Promise<Rung[]> {
  const rng = createRng(seed, 'stall prompts')
  const rungs: Rung[] = []
  for (const tokens of sizes) {
    const answered = rungs.map((r) => ({ tokens: r.tokens, ms: r.ms }))
    const boundMs = stallBoundMs(answered, tokens, Number.MAX_SAFE_INTEGER)
    // A bound the budget cannot wait for tells nothing: stop (inconclusive) rather than let the
    // deadline cut it and call that a stall.
    if (boundMs + settleGapMs * numSettleReads > timeoutMs()) break
    const startedAt = performance.now()
    const result = await target.complete({
      tenant: target.tenants[0],
      prompt: boundedPrompt(rng, sizer, tokens, canary),
      maxTokens: stallMaxTokens,
      stream: true,
      abortAfterMs: boundMs,
      estimatedPromptTokens: tokens,
    })
    const rung: Rung = {
      tokens,
      boundMs,
      ms: Math.round(performance.now() - startedAt),
      status: result.status,
      fate: fateOf(result),
    }
    rungs.push(rung)
    if (rung.fate !== 'answered') break
  }
  return rungs
}

/** After a stall: reads until usage and running are back at `before`, at most
 *  {@link numSettleReads} times; the last reading. */
async function settle(target: Target, before: Reserved): Promise<Reserved> {
  let after = before
  for (let i = 0; i < numSettleReads; i++) {
    await new Promise((r) => setTimeout(r, settleGapMs))
    after = await readReserved(target, before.usage?.endpoint)
    if (!isHeld(before, after)) break
  }
  return after
}

/** Does `after` hold more than `before` (pool usage up by more than rounding, or more running)? */
export function isHeld(before: Reserved, after: Reserved): boolean {
  const usageUp =
    before.usage !== null &&
    after.usage !== null &&
    after.usage.used > before.usage.used + (before.usage.unit === 'fraction' ? 0.001 : 0)
  const runningUp =
    before.running !== null && after.running !== null && after.running > before.running
  return usageUp || runningUp
}

/** The verdicts on the ladder and on what a stall left reserved. */
export function judgeStall(
  rungs: readonly Rung[],
  top: number,
  tested: number,
  before: Reserved | null,
  after: Reserved | null,
  evidence: Record<string, unknown>,
): Finding[] {
  const stalled = rungs.find((r) => r.fate === 'no-first-byte' || r.fate === 'no-end')
  const all = { ...evidence, rungs, before, after }
  if (stalled !== undefined) {
    const what = stalled.fate === 'no-first-byte' ? 'no first byte' : 'no end'
    const findings: Finding[] = [
      {
        probe: 'stall',
        verdict: 'warning',
        class: 'availability',
        severity: 'high',
        title: `a ${stalled.tokens}-token prompt, within the ${top} tokens the endpoint advertises, got ${what} within ${stalled.boundMs} ms (smaller ones answered in ${
          rungs
            .filter((r) => r.fate === 'answered')
            .map((r) => `${r.ms} ms`)
            .join(', ') || 'none'
        })`,
        evidence: all,
        remediation:
          'Start every prefill and decode worker with the same context and input limits, and ' +
          'reject at admission what any of them cannot take (InferenceX PR #2257, sglang PR ' +
          '#31664); give a decode worker a deadline for the transfer it waits for.',
      },
    ]
    if (before !== null && after !== null && isHeld(before, after))
      findings.push({
        probe: 'stall',
        verdict: 'warning',
        class: 'resource-leak',
        severity: 'high',
        title: `after the ${stalled.tokens}-token request was cut, ${after.usage !== null && before.usage !== null && after.usage.used > before.usage.used ? `KV pool usage stayed at ${after.usage.used} ${after.usage.unit} (${before.usage.used} before)` : `${after.running} requests stayed running (${before.running} before)`}`,
        evidence: all,
        remediation:
          'Free what a request holds when its client leaves or its transfer never comes: ' +
          'repeated, each stalled request shrinks the pool until the endpoint serves nobody.',
      })
    return findings
  }
  const last = rungs[rungs.length - 1]
  if (last === undefined || last.fate !== 'answered' || last.tokens < tested)
    return [
      {
        probe: 'stall',
        verdict: 'inconclusive',
        severity: 'medium',
        title:
          last === undefined
            ? 'no prompt of the ladder was sent'
            : `the ladder stopped at ${last.tokens} tokens (${last.fate}${last.status === null ? '' : `, HTTP ${last.status}`}) before ${tested} (the endpoint advertises ${top})`,
        evidence: all,
        remediation: inconclusiveRemediation,
      },
    ]
  return [
    {
      probe: 'stall',
      verdict: 'clean',
      severity: 'info',
      title:
        `prompts of ${rungs.map((r) => r.tokens).join(', ')} tokens were each answered within their bound` +
        (tested < top
          ? `; not tried: sizes over ${tested} up to the ${top} advertised (--aggressive)`
          : ` (the ${top} advertised)`),
      evidence: all,
      remediation: 'None needed.',
    },
  ]
}

export const stallProbe: Probe = {
  name: 'stall',
  class: 'availability',
  // One admission check against the smallest limit of every worker (G1, G2).
  controls: { aisvs: [], guards: ['G1', 'G2'] },
  isSizing: true,
  description:
    'prompts doubling up to the size the endpoint advertises, one at a time: one that never answers is an availability finding naming its size, what it leaves reserved a resource leak',
  plan: (input) => {
    const top = promptLimit(input, stallMaxTokens)
    if (top === null) return []
    const tested = testedTop(top, input.isAggressive)
    const sizes = stallSizes(tested)
    return [
      {
        what: `prompts of ${sizes[0]} to ${tested} tokens, one at a time`,
        numRequests: sizes.length,
        tokensEach: tested + stallMaxTokens,
      },
      {
        what: 'reads of pool usage and running requests',
        numRequests: numBaselineReads + 2 * numSettleReads,
        tokensEach: 0,
      },
    ]
  },
  async run(target, budget, context): Promise<Finding[]> {
    const top = promptLimit(context.discovery, stallMaxTokens)
    const inconclusive = (title: string): Finding[] => [
      {
        probe: 'stall',
        verdict: 'inconclusive',
        severity: 'medium',
        title,
        evidence: { top },
        remediation: `Give --context-window or --kv-pool-tokens. ${inconclusiveRemediation}`,
      },
    ]
    if (top === null || top < 16)
      return inconclusive(
        'the endpoint advertises no context, pool or input limit: no size to test',
      )
    const sizer = await sizerOrNull(() => context.sizer())
    if (sizer === null) return inconclusive('no token counts: prompts cannot be sized')
    const [canary] = makeCanaries(createRng(context.seed, 'stall'), 1)
    let before: Reserved | null = null
    let after: Reserved | null = null
    let rungs: Rung[] = []
    const stopped = await runUntilExhausted(async () => {
      before = await readReserved(target)
      rungs = await sendLadder(
        target,
        sizer,
        stallSizes(testedTop(top, context.isAggressive ?? false)),
        () => budget.remainingMs,
        canary,
        context.seed,
      )
      const last = rungs[rungs.length - 1]
      if (last !== undefined && (last.fate === 'no-first-byte' || last.fate === 'no-end'))
        after = await settle(target, before)
    })
    context.log(`stall: ${rungs.map((r) => `${r.tokens}:${r.fate}`).join(' ')}`)
    return judgeStall(rungs, top, testedTop(top, context.isAggressive ?? false), before, after, {
      top,
      stoppedBy: stopped,
      remainingMs: budget.remainingMs,
    })
  },
}
