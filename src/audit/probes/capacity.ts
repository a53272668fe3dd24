/** Probe `capacity`: compares the advertised context window with the smallest KV capacity the
 *  endpoint reports. Advertising more context than the KV pool holds is the incident's
 *  misconfiguration: prompts between the two sizes take the rejection path that leaked.
 *  Sends no request of its own: it judges what discovery read. */
import type { Probe } from '../probe.js'
import { inconclusiveRemediation } from '../probe.js'
import type { Finding } from '../types.js'

export const capacityProbe: Probe = {
  name: 'capacity',
  description:
    'advertised context window versus the smallest KV pool the endpoint reports (no request of its own); a context the pool cannot hold is a warning',
  plan: () => [],
  async run(_target, _budget, { discovery }): Promise<Finding[]> {
    const { contextTokens, poolTokens, advertised, pools, endpoints } = discovery
    const evidence = {
      advertisedContextTokens: contextTokens,
      effectivePoolTokens: poolTokens,
      advertisedSources: advertised,
      poolSources: pools,
      endpoints,
    }
    if (contextTokens === null || poolTokens === null) {
      const missing = [
        contextTokens === null ? 'advertised context window' : null,
        poolTokens === null ? 'KV pool capacity' : null,
      ].filter((s) => s !== null)
      return [
        {
          probe: 'capacity',
          verdict: 'inconclusive',
          severity: 'medium',
          title: `could not read the ${missing.join(' or the ')} from the endpoint`,
          evidence,
          remediation:
            'Expose the KV capacity (vLLM /metrics cache_config_info, SGLang /server_info ' +
            'max_total_num_tokens, kvfence /server_info) and max_model_len in /v1/models to the ' +
            'auditor, or check it by hand. ' +
            inconclusiveRemediation,
        },
      ]
    }
    if (contextTokens > poolTokens) {
      return [
        {
          probe: 'capacity',
          verdict: 'warning',
          severity: 'high',
          title: `advertised context ${contextTokens} tokens > effective KV pool ${poolTokens} tokens`,
          evidence,
          remediation:
            `Lower the advertised context window (max_model_len / context length) to at most ` +
            `${poolTokens} tokens, or enlarge the KV pool of every prefill and decode worker to ` +
            `at least ${contextTokens} tokens; prompts between the two sizes take the rejection ` +
            `path that leaked other tenants' data in the incident.`,
        },
      ]
    }
    return [
      {
        probe: 'capacity',
        verdict: 'clean',
        severity: 'info',
        title: `advertised context ${contextTokens} tokens fits the KV pool of ${poolTokens} tokens`,
        evidence,
        remediation: 'None needed. Keep the context window at or below the KV pool after changes.',
      },
    ]
  },
}
