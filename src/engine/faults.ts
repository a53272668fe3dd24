/** Fault injection (DESIGN.md §5): the named bug classes a worker can be told to reproduce, and the
 *  gate that refuses them unless the operator opted in with KVFENCE_ALLOW_FAULTS=1.
 *  Knows fault names and the opt-in rule; each fault is acted on where its bug would live. */

/** Every injectable fault, with the real bug class it models. */
export const faultDescriptions = {
  'placeholder-forward':
    'prefill swaps an over-capacity prompt for a one-token placeholder and reports the transfer complete (the incident)',
  'early-release': 'free pages while a transfer still writes into them',
  'skip-scrub': 'return freed pages to the free list without scrubbing them',
  'drop-abort': 'ignore aborts from the router',
  'stale-epoch': 'reuse a page without bumping its epoch',
  'corrupt-transfer': 'flip bits in transferred page payloads',
  'truncate-transfer': 'send fewer pages than the manifest claims',
  'lost-ack': 'drop the decode worker’s acknowledgement of a transfer',
} as const

export type FaultName = keyof typeof faultDescriptions

/** Faults that are implemented by the workers today. */
export const implementedFaults: readonly FaultName[] = [
  'placeholder-forward',
  'skip-scrub',
  'stale-epoch',
  'corrupt-transfer',
  'truncate-transfer',
]

/** What a worker was told to break. Frozen once built. */
export interface FaultConfig {
  faults: ReadonlySet<FaultName>
  guardsEnabled: boolean
}

/** Validate `--inject-fault` names and `--unsafe-disable-guards` against the opt-in variable.
 *  Throws an Error with a one-line message for an unknown or unimplemented fault, or when
 *  faults or disabled guards are asked for without KVFENCE_ALLOW_FAULTS=1. */
export function buildFaultConfig(
  names: readonly string[],
  disableGuards: boolean,
  env: NodeJS.ProcessEnv,
): FaultConfig {
  const faults = new Set<FaultName>()
  for (const name of names) {
    if (!Object.hasOwn(faultDescriptions, name)) {
      throw new Error(
        `unknown fault "${name}"; known faults: ${Object.keys(faultDescriptions).join(', ')}`,
      )
    }
    if (!implementedFaults.includes(name as FaultName)) {
      throw new Error(
        `fault "${name}" is not implemented yet; implemented: ${implementedFaults.join(', ')}`,
      )
    }
    faults.add(name as FaultName)
  }
  if ((faults.size > 0 || disableGuards) && env.KVFENCE_ALLOW_FAULTS !== '1') {
    throw new Error(
      '--inject-fault and --unsafe-disable-guards are refused unless KVFENCE_ALLOW_FAULTS=1 is set',
    )
  }
  return Object.freeze({ faults, guardsEnabled: !disableGuards })
}

/** The loud banner printed (to stderr) by any process running with faults or guards off. */
export function faultBanner(role: string, config: FaultConfig): string | null {
  if (config.faults.size === 0 && config.guardsEnabled) return null
  const lines = [
    `${role}: UNSAFE CONFIGURATION — FOR TESTS AND DEMOS ONLY`,
    ...[...config.faults].map((f) => `  fault injected: ${f} (${faultDescriptions[f]})`),
    config.guardsEnabled
      ? '  guards: on'
      : '  guards: OFF (--unsafe-disable-guards): cross-tenant leaks are possible',
  ]
  const width = Math.max(...lines.map((l) => l.length)) + 4
  const bar = '!'.repeat(width)
  return [bar, ...lines.map((l) => `!! ${l}`), bar].join('\n')
}
