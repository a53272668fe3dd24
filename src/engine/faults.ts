/** Fault injection (DESIGN.md §5): the named bug classes a worker can be told to reproduce, which
 *  guards are switched off, and the gate that refuses both unless the operator opted in with
 *  KVFENCE_ALLOW_FAULTS=1.
 *  Knows fault names, guard ids and the opt-in rule; each fault is acted on where its bug would live
 *  (see docs/faults.md for fault → where it acts → the guard that stops it → its test). */
import { guardIds, type GuardId, type Guards } from '../kv/guards.js'

/** Every injectable fault, with the real bug class it models. */
export const faultDescriptions = {
  'placeholder-forward':
    'prefill swaps an over-capacity prompt for a one-token placeholder and reports the transfer complete (the incident)',
  'early-release':
    'decode frees a request’s pages as soon as its transfer begins, while the transfer still writes into them',
  'skip-scrub': 'return freed pages to the free list without scrubbing them',
  'drop-abort':
    'ignore aborts from the router (the worker keeps working for a request that is gone)',
  'stale-epoch': 'reuse a page without bumping its epoch',
  'corrupt-transfer': 'flip bits in transferred page payloads',
  'truncate-transfer': 'send fewer pages than the manifest claims',
  'lost-ack': 'drop the decode worker’s acknowledgement of a transfer before it reaches prefill',
  'publish-partial':
    'prefill inserts an aborted or failed prompt’s pages into the prefix cache as if its prefill had completed',
  'offload-load-as-hit':
    'a prefix-cache page loaded back from the offload tier is used although its verification failed (a failed load counted as a hit)',
  'offload-key-without-tenant':
    'the offload tier keys prefix-cache pages by their tokens alone, leaving out the tenant’s salt',
  'delay-begin':
    'prefill holds the start of each transfer (its BEGIN) for a fixed delay after the prefill, as a slow transfer handshake would',
} as const

/** How long `delay-begin` holds each transfer's BEGIN, ms: far longer than the router takes to
 *  reserve on D and pass a client's cut on, so that a cut in the first few milliseconds of a
 *  request always lands before BEGIN (an abort then never races the transfer). An abort during
 *  the delay ends it at once. */
export const delayBeginMs = 300

/** The name of an injectable fault. */
export type FaultName = keyof typeof faultDescriptions

/** Faults that the workers implement: all of DESIGN.md §5, and the prefix cache's:
 *  `publish-partial` (sglang#38319), `offload-load-as-hit` (dynamo#15079, LMCache#4385, #5151),
 *  `offload-key-without-tenant` (lmdeploy#4930). */
export const implementedFaults: readonly FaultName[] = Object.keys(faultDescriptions) as FaultName[]

/** What a process was told to break. Frozen once built. */
export interface FaultConfig {
  faults: ReadonlySet<FaultName>
  /** Guards switched off (all of them with `--unsafe-disable-guards`). */
  disabledGuards: ReadonlySet<GuardId>
  /** True when no guard is off (the shipped configuration). */
  guardsEnabled: boolean
  /** Which guards are on, per guard. */
  guards: Guards
}

/** Validate `--inject-fault` names, `--unsafe-disable-guards` (all off) and
 *  `--unsafe-disable-guard ID` (one guard off; repeatable) against the opt-in variable.
 *  Throws an Error with a one-line message for an unknown fault or guard id, or when faults or
 *  disabled guards are asked for without KVFENCE_ALLOW_FAULTS=1. */
export function buildFaultConfig(
  names: readonly string[],
  disableGuards: boolean,
  env: NodeJS.ProcessEnv,
  disableGuardIds: readonly string[] = [],
): FaultConfig {
  const faults = new Set<FaultName>()
  for (const name of names) {
    if (!Object.hasOwn(faultDescriptions, name)) {
      throw new Error(
        `unknown fault "${name}"; known faults: ${Object.keys(faultDescriptions).join(', ')}`,
      )
    }
    faults.add(name as FaultName)
  }
  const disabled = new Set<GuardId>(disableGuards ? guardIds : [])
  for (const id of disableGuardIds) {
    const upper = id.toUpperCase()
    if (!(guardIds as readonly string[]).includes(upper)) {
      throw new Error(`unknown guard "${id}"; known guards: ${guardIds.join(', ')}`)
    }
    disabled.add(upper as GuardId)
  }
  if ((faults.size > 0 || disabled.size > 0) && env.KVFENCE_ALLOW_FAULTS !== '1') {
    throw new Error(
      '--inject-fault and --unsafe-disable-guard(s) are refused unless KVFENCE_ALLOW_FAULTS=1 is set',
    )
  }
  const guards = Object.freeze(
    Object.fromEntries(guardIds.map((id) => [id, !disabled.has(id)])) as Record<GuardId, boolean>,
  )
  return Object.freeze({
    faults,
    disabledGuards: disabled,
    guardsEnabled: disabled.size === 0,
    guards,
  })
}

/** The loud banner printed (to stderr) by any process running with faults or guards off, or null. */
export function faultBanner(role: string, config: FaultConfig): string | null {
  if (config.faults.size === 0 && config.guardsEnabled) return null
  const off = [...config.disabledGuards]
  const lines = [
    `${role}: UNSAFE CONFIGURATION — FOR TESTS AND DEMOS ONLY`,
    ...[...config.faults].map((f) => `  fault injected: ${f} (${faultDescriptions[f]})`),
    off.length === 0
      ? '  guards: on'
      : off.length === guardIds.length
        ? '  guards: OFF (--unsafe-disable-guards): cross-tenant leaks are possible'
        : `  guards OFF: ${off.join(', ')} (--unsafe-disable-guard): cross-tenant leaks are possible`,
  ]
  const width = Math.max(...lines.map((l) => l.length)) + 4
  const bar = '!'.repeat(width)
  return [bar, ...lines.map((l) => `!! ${l}`), bar].join('\n')
}
