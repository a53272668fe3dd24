/** The controls a finding maps to: the OWASP AISVS requirement it tests (5.5.5, "KV-cache
 *  partitioning by authenticated session/tenant identity", where the finding is about one
 *  tenant's KV-cache data reaching another) and the guards of kvfence's design (README: G1–G10)
 *  that would have stopped it. Told by the finding's source alone, so every engine's finding
 *  names the same controls. The guard table follows docs/threat-model.md.
 *  Knows findings' sources; knows nothing of HTTP. */
import { probes } from './probes/index.js'
import type { FindingControls, FindingSource } from './types.js'

export { aisvsKvPartitioning } from './probe.js'

/** The controls findings of `source` map to: its probe's (the registry, probes/index.ts); none
 *  for `availability`, the audit's own check. */
export function controlsOf(source: FindingSource): FindingControls {
  return source === 'availability' ? { aisvs: [], guards: [] } : probes[source].controls
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
