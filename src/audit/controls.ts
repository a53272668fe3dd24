/** The controls a finding maps to: the OWASP AISVS requirement it tests (5.5.5, "KV-cache
 *  partitioning by authenticated session/tenant identity", where the finding is about one
 *  tenant's KV-cache data reaching another) and the guards of kvfence's design (README: G1–G10)
 *  that would have stopped it. Told by the finding's source alone, so every engine's finding
 *  names the same controls. The guard table follows docs/threat-model.md.
 *  Knows findings' sources; knows nothing of HTTP. */
import type { FindingControls, FindingSource } from './types.js'

/** OWASP AISVS 5.5.5: KV-cache partitioning by authenticated session/tenant identity. */
export const aisvsKvPartitioning = '5.5.5'

const byProbe: Readonly<Record<FindingSource, FindingControls>> = {
  capacity: { aisvs: [], guards: ['G1'] },
  boundary: { aisvs: [], guards: ['G2', 'G3'] },
  canary: { aisvs: [aisvsKvPartitioning], guards: ['G1', 'G2', 'G3', 'G4', 'G5', 'G6'] },
  'abort-race': { aisvs: [aisvsKvPartitioning], guards: ['G5', 'G6', 'G7', 'G8'] },
  // G5: the prefix cache publishes only pages a completed prefill filled and sealed.
  'abort-retry': { aisvs: [aisvsKvPartitioning], guards: ['G5'] },
  concurrency: { aisvs: [aisvsKvPartitioning], guards: ['G4'] },
  // Races under continuous load: page identities checked on every load (G4), pages freed only
  // after every reader ended (G7).
  'race-load': { aisvs: [aisvsKvPartitioning], guards: ['G4', 'G7'] },
  queueing: { aisvs: [aisvsKvPartitioning], guards: ['G7'] },
  'page-leak': { aisvs: [], guards: ['G7', 'G8'] },
  determinism: { aisvs: [], guards: [] },
  // kvfence's prefix cache is keyed by a salt the server derives from the tenant: a design
  // property, not one of the numbered guards.
  'prefix-timing': { aisvs: [aisvsKvPartitioning], guards: [] },
  'cache-fields': { aisvs: [aisvsKvPartitioning], guards: [] },
  // A warm answer that is not the cold one: a cache entry served under the wrong key or a page
  // reused without its checks (G4: checksums and identities of every page loaded; G5: epochs).
  'warm-equals-cold': { aisvs: [aisvsKvPartitioning], guards: ['G4', 'G5'] },
  // After eviction: a page loaded back from an offload tier must be verified before use (G4).
  'evict-then-return': { aisvs: [aisvsKvPartitioning], guards: ['G4'] },
  'error-handling': { aisvs: [], guards: ['G2'] },
  // One admission check against the smallest limit of every worker (G1, G2).
  stall: { aisvs: [], guards: ['G1', 'G2'] },
  availability: { aisvs: [], guards: [] },
}

/** The controls findings of `source` map to. */
export function controlsOf(source: FindingSource): FindingControls {
  return byProbe[source]
}

/** One line for the console, JUnit and HTML: "AISVS 5.5.5; G7, G8", or "—" when none. */
export function formatControls(controls: FindingControls | undefined): string {
  if (controls === undefined) return '—'
  const parts = [
    ...controls.aisvs.map((id) => `AISVS ${id}`),
    ...(controls.guards.length > 0 ? [controls.guards.join(', ')] : []),
  ]
  return parts.length > 0 ? parts.join('; ') : '—'
}
