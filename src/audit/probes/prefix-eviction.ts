/** The `prefix-timing` probe's eviction arm: does one tenant's traffic change another tenant's
 *  prefix-cache hits? A cache whose space all tenants share (least recently used across them)
 *  lets a tenant measure how much others send: its own cached prefix is evicted by their load
 *  and its `cached_tokens` (and TTFT) drop. Per round the observer sends a fresh prefix twice
 *  (the second reports what its own reuse is served), once more after a pause with no traffic
 *  (the quiet control), then the other tenant sends `numFlood` distinct prefixes of the same size
 *  and the observer sends its prefix a fourth time. Decided by `cached_tokens` only: a drop after
 *  the flood in every round, with the quiet control equal to the reuse, is the channel; no drop
 *  in any round is clean; no reported caching, too few rounds or a mixed picture: nothing said
 *  (null), the membership arms' finding stands alone.
 *
 *  Knows HTTP completions through the target; knows nothing of the engine. */
import { outcomeOf, type CompletionResult } from '../target.js'
import type { Finding, Tenant } from '../types.js'

/** Rounds of the arm, at most. */
export const evictionRounds = 2

/** The other tenant's distinct prefixes per round: enough tokens to pass through a whole pool
 *  `poolTokens` large twice over (8 when the pool's size is unknown). */
export function floodSize(poolTokens: number | null, prefixTokens: number): number {
  if (poolTokens === null) return 8
  return Math.max(2, Math.ceil((2 * poolTokens) / Math.max(1, prefixTokens)))
}

/** What one round saw: the observer's `cached_tokens` on its reuse, after the quiet pause and
 *  after the other tenant's flood (null: not reported or not answered). */
export interface EvictionRound {
  readonly reuse: number | null
  readonly quiet: number | null
  readonly flooded: number | null
}

/** Runs the arm (see the module's header) and returns its rounds; stops early at `maxRounds` or
 *  when `canRun(requestsNeeded)` says the budget has no room for one more round. `prefix(tenant)`
 *  makes a fresh prefix of that tenant's (its material: the caller records whose it is), `send`
 *  sends one, `label` saying which request of the round it is. */
export async function runEvictionArm<P>(options: {
  observer: Tenant
  other: Tenant
  numFlood: number
  maxRounds: number
  prefix: (tenant: Tenant) => P
  send: (tenant: Tenant, prefix: P, label: string) => Promise<CompletionResult>
  canRun: (numRequests: number) => boolean
}): Promise<EvictionRound[]> {
  const { observer, other, send } = options
  const cached = (r: CompletionResult) => (outcomeOf(r) === 'accepted' ? r.cachedTokens : null)
  const rounds: EvictionRound[] = []
  for (let i = 0; i < options.maxRounds && options.canRun(4 + options.numFlood); i++) {
    const own = options.prefix(observer)
    const ask = async (label: string) =>
      cached(await send(observer, own, `eviction round ${i}, ${label}`))
    await ask('first')
    const reuse = await ask('reuse')
    const quiet = await ask('after a quiet pause')
    for (let j = 0; j < options.numFlood; j++) {
      await send(other, options.prefix(other), `eviction round ${i}, flood ${j}`)
    }
    rounds.push({ reuse, quiet, flooded: await ask('after the flood') })
  }
  return rounds
}

/** The arm's finding: a load side channel when, in every round of at least two, the observer's
 *  reuse was served cached tokens, the quiet control was served as many, and after the other
 *  tenant's flood fewer; null otherwise (clean or unknown: the membership arms decide). */
export function evictionFinding(
  rounds: readonly EvictionRound[],
  observer: Tenant,
  other: Tenant,
  numFlood: number,
): Finding | null {
  const isDropped = (r: EvictionRound) =>
    r.reuse !== null &&
    r.reuse > 0 &&
    r.quiet === r.reuse &&
    r.flooded !== null &&
    r.flooded < r.reuse
  if (rounds.length < 2 || !rounds.every(isDropped)) return null
  const pairs = rounds.map((r) => `${r.reuse} → ${r.flooded}`).join(', ')
  return {
    probe: 'prefix-timing',
    verdict: 'warning',
    severity: 'medium',
    title: `load side channel: ${other.name}'s ${numFlood} distinct prefixes evicted ${observer.name}'s cached prefix (its cached_tokens ${pairs}; unchanged without them)`,
    evidence: { observerTenant: observer.name, otherTenant: other.name, numFlood, rounds },
    remediation:
      "Give each tenant its own share of the prefix cache's space (per-tenant partitions or " +
      'quotas, eviction only within a tenant); kvfence: the default, not --prefix-cache-shared. ' +
      'Otherwise any tenant can measure how much another sends.',
  }
}
