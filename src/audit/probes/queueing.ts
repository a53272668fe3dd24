/** Probe `queueing`: fills the endpoint with long generations from the victim (every slot but
 *  one the budget allows), then sends short requests from the other tenants that must wait behind
 *  them. A streamed request counts as queued when its time to first token is over 3× the
 *  unloaded streamed one (+ 20 ms): streamed against streamed, since a non-streamed answer's
 *  first byte comes after its whole generation. Queued answers are checked like `concurrency`'s: only their own material. Catches
 *  queue, lease and timeout paths that hand a waiting request pages or results that expired or
 *  belonged to another request (vllm#52234).
 *  The verdict rests only on what the HTTP answers say. Clean needs either requests seen waiting,
 *  or the endpoint itself refusing for capacity (a 503 whose error code says so, e.g.
 *  `capacity_exhausted`, `queue_full`) while the victim's generations were still running: a
 *  bounded queue doing its job. A 429, or any error code that names a rate limit, is the waiting
 *  tenant's own limit, not a full endpoint: that, or any other refusal, leaves the probe
 *  inconclusive, since no request was made to queue behind another tenant's. */
import { materialPromptTokens } from '../plan.js'
import { runUntilExhausted } from '../budget.js'
import type { Probe } from '../probe.js'
import { aisvsKvPartitioning, inconclusiveRemediation } from '../probe.js'
import { createRng } from '../rng.js'
import { isAnsweredWhole, outcomeOf, type Target } from '../target.js'
import { median } from '../stats.js'
import type { Finding, Tenant } from '../types.js'
import {
  crossingRemediation,
  findCrossings,
  leakFindings,
  plantMaterial,
  requestLog,
  type Observed,
  type Planted,
} from './material.js'

/** Why a waiting request was refused: its own tenant's limit, the endpoint being full, or a
 *  reason the answer does not give. */
type RefusalKind = 'tenant limit' | 'capacity' | 'unexplained'

/** Error codes (OpenAI `error.code`, or `type`) that name a per-tenant rate limit or quota. */
const tenantLimitCode = /rate.?limit|quota|too.?many.?requests|per.?(minute|second|day)/i
/** Error codes that say the endpoint (not the tenant) is out of room. */
// Not `unavailable`: a 503 `worker_unavailable` or `service_unavailable` is an outage, not a full
// endpoint.
const capacityCode = /capacity|queue|overload|busy|full|exhausted|no.?room/i

const holderMaxTokens = 256
const waiterMaxTokens = 16
const numBaseline = 2
const numWaiters = 4

export const queueingProbe: Probe = {
  name: 'queueing',
  description:
    'long generations fill the batch, short requests of other tenants wait behind them; queued answers must carry only their own material',
  class: 'content-leak',
  controls: { aisvs: [aisvsKvPartitioning], guards: ['G7'] },
  plan: ({ limits }) => [
    {
      what: 'unloaded baseline',
      numRequests: numBaseline,
      tokensEach: materialPromptTokens + waiterMaxTokens,
    },
    {
      what: 'long generations holding the batch',
      numRequests: Math.max(1, limits.concurrency - 1),
      tokensEach: materialPromptTokens + holderMaxTokens,
    },
    {
      what: 'queued requests',
      numRequests: numWaiters,
      tokensEach: materialPromptTokens + waiterMaxTokens,
    },
  ],
  async run(target, budget, context): Promise<Finding[]> {
    const traffic = plantTraffic(target.tenants, budget.limits.concurrency, context.seed)
    const stoppedBy = await sendTraffic(target, traffic, context.discovery.contextTokens)
    const reading = readWaits(traffic, stoppedBy)
    const { unloadedMs, queuedTtftMs, refusals } = reading
    const ms = (n: number) => n.toFixed(1)
    context.log(
      `unloaded TTFT ${unloadedMs === null ? 'unknown (none answered)' : `${ms(unloadedMs)} ms`}; ` +
        `waiting requests' TTFT ${queuedTtftMs.length > 0 ? `${queuedTtftMs.map(ms).join(', ')} ms` : 'none (none answered)'}` +
        (refusals.length > 0 ? `; refused: ${describeRefusals(refusals)}` : ''),
    )
    return judge(traffic, reading, budget.limits.concurrency)
  },
}

/** The probe's requests: an unloaded baseline and the waiters from the other tenants, the
 *  holders from the victim, each with its own material; `observed` fills as they are answered. */
interface Traffic {
  readonly victim: Tenant
  readonly others: readonly Tenant[]
  readonly baseline: readonly Planted[]
  readonly holders: readonly Planted[]
  readonly waiters: readonly Planted[]
  readonly planted: readonly Planted[]
  readonly observed: Observed[]
}

function plantTraffic(tenants: readonly Tenant[], concurrency: number, seed: number): Traffic {
  const [victim, ...others] = tenants
  const numHolders = Math.max(1, concurrency - 1)
  const rng = createRng(seed, 'queueing')
  const baseline = plantMaterial(rng, others, ['base0', 'base1'].slice(0, numBaseline))
  const holders = plantMaterial(
    rng,
    [victim],
    Array.from({ length: numHolders }, (_, i) => `hold${i}`),
  )
  const waiters = plantMaterial(
    rng,
    others,
    Array.from({ length: numWaiters }, (_, i) => `wait${i}`),
  )
  const planted = [...baseline, ...holders, ...waiters]
  return { victim, others, baseline, holders, waiters, planted, observed: [] }
}

/** A holder's `max_tokens`: {@link holderMaxTokens}, less where the advertised context
 *  (`contextTokens`, null: unknown) leaves no room for that many after its prompt — a holder
 *  refused for its length holds nothing. The prompt's tokens are estimated from the baseline's
 *  reported tokens per character (+10 %), never above one token per character (the material is
 *  ASCII: every token covers at least a byte), plus 8 for the template's special tokens. */
export function holderMaxTokensFor(
  prompt: string,
  contextTokens: number | null,
  baseline: readonly { promptChars: number; promptTokens: number | null }[],
): number {
  if (contextTokens === null) return holderMaxTokens
  const ratios = baseline
    .filter((b) => b.promptTokens !== null && b.promptChars > 0)
    .map((b) => (b.promptTokens as number) / b.promptChars)
  const perChar = ratios.length === 0 ? 1 : Math.min(1, Math.max(...ratios) * 1.1)
  const promptTokens = Math.ceil(prompt.length * perChar) + 8
  return Math.max(1, Math.min(holderMaxTokens, contextTokens - promptTokens))
}

/** Sends the baseline one by one, then the holders, and once they reached the server the
 *  waiters; returns why the budget stopped it, or null. */
async function sendTraffic(
  target: Target,
  traffic: Traffic,
  contextTokens: number | null,
): Promise<string | null> {
  const { baseline, holders, waiters, planted, observed } = traffic
  const send = async (i: number, label: string, maxTokens: number, stream: boolean) => {
    const p = planted[i]
    const result = await target.complete({ tenant: p.tenant, prompt: p.prompt, maxTokens, stream })
    observed.push({ planted: p, label, stream, result })
  }
  return runUntilExhausted(async () => {
    for (let i = 0; i < baseline.length; i++) await send(i, 'unloaded', waiterMaxTokens, true)
    const measured = observed.map((o) => ({
      promptChars: o.planted.prompt.length,
      promptTokens: o.result.promptTokens,
    }))
    const holding = holders.map((h, i) =>
      send(
        baseline.length + i,
        'holding the batch',
        holderMaxTokensFor(h.prompt, contextTokens, measured),
        true,
      ),
    )
    // Handled now: a holder that fails (the budget running out) during the pause below would
    // otherwise be an unhandled rejection, which ends the process; Promise.all still sees it.
    for (const h of holding) h.catch(() => undefined)
    // Let the holders reach the server before the waiters queue up behind them.
    await new Promise((r) => setTimeout(r, 20))
    const waiting = waiters.map((_, i) =>
      send(baseline.length + holders.length + i, 'queued', waiterMaxTokens, i % 2 === 0),
    )
    await Promise.all([...holding, ...waiting])
  })
}

/** What the answers say of waiting: times to the first token, who waited, what was refused. */
function readWaits(traffic: Traffic, stoppedBy: string | null) {
  const { observed } = traffic
  // Like with like: only streamed requests' first bytes are times to the first token (a
  // non-streamed answer's first byte comes after its whole generation), and the unloaded
  // baseline is streamed.
  const ttft = (label: string) =>
    observed
      .filter(
        (o) =>
          o.label === label &&
          o.stream &&
          o.result.ttftMs !== null &&
          outcomeOf(o.result) === 'accepted',
      )
      .map((o) => o.result.ttftMs as number)
  const unloadedMs = median(ttft('unloaded'))
  const waited = unloadedMs === null ? [] : ttft('queued').filter((t) => t > 3 * unloadedMs + 20)
  // The victim's generations that were answered end at `atMs`: a refusal before the last of
  // them came while the endpoint held them.
  const holdersAnswered = observed.filter(
    (o) => o.label === 'holding the batch' && outcomeOf(o.result) === 'accepted',
  )
  const heldUntilMs = Math.max(-Infinity, ...holdersAnswered.map((o) => o.result.atMs))
  const refusals = observed
    .filter((o) => o.label === 'queued' && (o.result.status === 429 || o.result.status === 503))
    .map((o) => ({
      status: o.result.status as number,
      errorCode: o.result.errorCode,
      kind: refusalKind(o.result.status as number, o.result.errorCode, o.result.atMs < heldUntilMs),
    }))
  const queuedTtftMs = ttft('queued')
  const summary = {
    holders: traffic.holders.length,
    holdersAnswered: holdersAnswered.length,
    unloadedTtftMs: unloadedMs,
    queuedTtftMs,
    numQueued: waited.length,
    numShed: refusals.length,
    refusals,
    stoppedBy,
    requests: requestLog(observed),
  }
  return { unloadedMs, waited, holdersAnswered, refusals, queuedTtftMs, summary }
}

type Reading = ReturnType<typeof readWaits>

/** Another tenant's material in an answer is a leak. Clean when requests were seen waiting, or
 *  when the full endpoint refused them for capacity instead; otherwise inconclusive, saying why
 *  nothing queued. */
function judge(traffic: Traffic, reading: Reading, concurrency: number): Finding[] {
  const { victim, others, waiters, observed, planted } = traffic
  const { unloadedMs, waited, holdersAnswered, refusals, summary } = reading
  const numRefused = (kind: RefusalKind) => refusals.filter((r) => r.kind === kind).length
  const crossings = findCrossings(observed, planted)
  if (crossings.length > 0) {
    return leakFindings('queueing', crossings, planted, summary, crossingRemediation)
  }
  const numWaitersAnswered = observed.filter(
    (o) => o.label === 'queued' && isAnsweredWhole(o.result),
  ).length
  const numForCapacity = numRefused('capacity')
  if (
    waited.length === 0 &&
    numForCapacity > 0 &&
    numForCapacity + numWaitersAnswered === waiters.length
  ) {
    // A full endpoint that refuses instead of queueing has no queue path to get wrong.
    return [
      {
        probe: 'queueing',
        verdict: 'clean',
        severity: 'info',
        title: `the full endpoint refused ${numForCapacity} requests for capacity (${describeRefusals(refusals)}) while ${holdersAnswered.length} of ${victim.name}'s generations held it, instead of queueing them; the ${numWaitersAnswered} it answered carried only their own material`,
        evidence: summary,
        remediation: 'None needed.',
      },
    ]
  }
  if (waited.length === 0 && refusals.length > 0) {
    const numTenantLimit = numRefused('tenant limit')
    const why =
      numTenantLimit > 0
        ? `${numTenantLimit} were refused by their own tenant's rate limit, which says nothing of a full endpoint`
        : `the refusals do not say the endpoint was full while ${victim.name}'s generations ran`
    return [
      {
        probe: 'queueing',
        verdict: 'inconclusive',
        severity: 'low',
        title: `no request could be made to queue behind another tenant's: of ${waiters.length} waiting requests ${numWaitersAnswered} were answered without waiting and ${refusals.length} refused (${describeRefusals(refusals)}); ${why}`,
        evidence: summary,
        remediation:
          (numTenantLimit > 0
            ? `Give the observing tenants (${others.map((t) => t.name).join(', ')}) room under their rate limits for the audit (tokens and requests per minute), or run this probe alone or after their limits refill. `
            : '') +
          `To make the endpoint queue, re-run with a --concurrency above its batch size. ${inconclusiveRemediation}`,
      },
    ]
  }
  if (waited.length === 0) {
    return [
      {
        probe: 'queueing',
        verdict: 'inconclusive',
        severity: 'low',
        title:
          unloadedMs === null
            ? `no unloaded request was answered, so no wait could be measured`
            : `no request was seen waiting (time to first byte never over 3× the unloaded ${unloadedMs.toFixed(1)} ms)`,
        evidence: summary,
        remediation: `The endpoint's batch is larger than --concurrency ${concurrency}: re-run with a higher --concurrency to exercise its queue. ${inconclusiveRemediation}`,
      },
    ]
  }
  return [
    {
      probe: 'queueing',
      verdict: 'clean',
      severity: 'info',
      title: `${waited.length} requests waited behind a full batch and were answered with only their own material`,
      evidence: summary,
      remediation: 'None needed.',
    },
  ]
}

/** A waiting request's 429/503, read from its status and error code: a 429 or a rate-limit code
 *  is the tenant's own limit; a 503 with a capacity code while the victim's generations were
 *  running (`isWhileHeld`) is the endpoint being full; anything else tells nothing. */
function refusalKind(status: number, errorCode: string | null, isWhileHeld: boolean): RefusalKind {
  if (status === 429 || (errorCode !== null && tenantLimitCode.test(errorCode))) {
    return 'tenant limit'
  }
  if (status === 503 && errorCode !== null && capacityCode.test(errorCode) && isWhileHeld) {
    return 'capacity'
  }
  return 'unexplained'
}

/** `3 × 429 rate_limited, 1 × 503 (no code)`: refusals grouped by status and code. */
function describeRefusals(
  refusals: readonly { status: number; errorCode: string | null }[],
): string {
  const counts = new Map<string, number>()
  for (const r of refusals) {
    const key = `${r.status} ${r.errorCode ?? '(no code)'}`
    counts.set(key, (counts.get(key) ?? 0) + 1)
  }
  return [...counts].map(([key, n]) => `${n} × ${key}`).join(', ')
}
