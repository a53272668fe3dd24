/** Probe `capacity`: compares the advertised context window with the smallest KV capacity the
 *  endpoint reports. Advertising more context than the KV pool holds is the incident's
 *  misconfiguration: prompts between the two sizes take the rejection path that leaked.
 *  Each engine's own derivation of its input limit is taken as it is (discovery.ts): SGLang's
 *  6-token reserve under the smaller of context and pool is normal, not a warning; only a pool
 *  that cannot hold the advertised context is.
 *  Sends no request of its own: it judges what discovery read. */
import type { Probe } from '../probe.js'
import { inconclusiveRemediation } from '../probe.js'
import { sglangInputReserveTokens, type Discovery } from '../discovery.js'
import type { Finding } from '../types.js'

/** For SGLang, what its input limit says beside a clean verdict: the normal reserve, or how far
 *  under the smaller of context and pool it is. */
function sglangNote(discovery: Discovery): string {
  const { engine, inputLimits, contextTokens, poolTokens } = discovery
  if (engine !== 'sglang' || inputLimits.length === 0) return ''
  const reported = Math.min(...inputLimits.map((s) => s.tokens))
  const reserve = Math.min(contextTokens ?? Infinity, poolTokens ?? Infinity) - reported
  return reserve === sglangInputReserveTokens
    ? ` (SGLang's input limit ${reported} keeps its normal ${reserve}-token reserve)`
    : ` (SGLang's input limit ${reported} is ${reserve} tokens under it)`
}

/** The published rule by which llama.cpp and TGI size one request against their KV cache. */
const surfaceRules: Record<string, string> = {
  llamacpp:
    "one slot's n_ctx is both the context and the KV one request may hold; a prompt of n_ctx tokens or more is refused",
  tgi: 'prompt ≤ max_input_tokens and prompt + max_tokens ≤ max_total_tokens, within max_batch_total_tokens for the whole batch',
}

/** How the engine derives its largest accepted input, and what it reported of it. */
function inputRule(discovery: Discovery): Record<string, unknown> {
  const { engine, inputLimits, contextTokens, poolTokens } = discovery
  if (engine !== null && engine in surfaceRules) {
    return {
      engine,
      rule: surfaceRules[engine],
      largestInputTokens: discovery.inputLimitTokens,
      inputLimitSources: inputLimits,
    }
  }
  if (engine !== 'sglang' || inputLimits.length === 0) return { engine }
  const reported = Math.min(...inputLimits.map((s) => s.tokens))
  const known = [contextTokens, poolTokens].filter((n) => n !== null)
  return {
    engine,
    rule: 'max_req_input_len = min(context − 1, max_total_num_tokens − 1) − 5',
    reportedInputLimitTokens: reported,
    expectedInputLimitTokens:
      known.length === 0 ? null : Math.min(...known) - sglangInputReserveTokens,
    inputLimitSources: inputLimits,
  }
}

/** Where the operator's `--context-window` or `--kv-pool-tokens` was used over a size the
 *  endpoint reported otherwise: said in the title, since the verdict rests on the flag. */
function givenNote(discovery: Discovery): string {
  const notes = (discovery.givenDisagreements ?? []).map(
    (d) =>
      `${d.flag} ${d.givenTokens} used where the endpoint reports ${d.reported.map((s) => `${s.tokens} (${s.endpoint} ${s.field})`).join(', ')}`,
  )
  return notes.length === 0 ? '' : ` (${notes.join('; ')})`
}

/** `/v1/models 200, /props 404, …`: what discovery asked and got. */
function askedOf(endpoints: Discovery['endpoints']): string {
  return endpoints.length === 0
    ? 'nothing was asked'
    : endpoints.map((e) => `${e.endpoint} ${e.status}`).join(', ')
}

export const capacityProbe: Probe = {
  name: 'capacity',
  description:
    'advertised context window versus the smallest KV pool the endpoint reports (no request of its own); a context the pool cannot hold is a warning',
  class: 'misconfiguration',
  controls: { aisvs: [], guards: ['G1'] },
  plan: () => [],
  async run(_target, _budget, { discovery }): Promise<Finding[]> {
    const { contextTokens, poolTokens, advertised, pools, endpoints } = discovery
    const evidence = {
      advertisedContextTokens: contextTokens,
      effectivePoolTokens: poolTokens,
      advertisedSources: advertised,
      poolSources: pools,
      endpoints,
      inputRule: inputRule(discovery),
      ...(discovery.givenDisagreements === undefined
        ? {}
        : { givenDisagreements: discovery.givenDisagreements }),
    }
    const given = givenNote(discovery)
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
          title:
            `could not read the ${missing.join(' or the ')} from the endpoint ` +
            `(${askedOf(endpoints)}): whether a prompt over the KV pool is refused cannot be ` +
            `tested without it; give --context-window and --kv-pool-tokens`,
          evidence,
          remediation:
            'Give the sizes you know with --context-window and --kv-pool-tokens, or expose them ' +
            'to the auditor (vLLM /metrics cache_config_info and max_model_len in /v1/models, ' +
            'SGLang /server_info max_total_num_tokens, llama.cpp /props, TGI /info, kvfence ' +
            '/server_info). ' +
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
          title: `advertised context ${contextTokens} tokens > effective KV pool ${poolTokens} tokens${given}`,
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
        title:
          `advertised context ${contextTokens} tokens fits the KV pool of ${poolTokens} tokens` +
          sglangNote(discovery) +
          given,
        evidence,
        remediation: 'None needed. Keep the context window at or below the KV pool after changes.',
      },
    ]
  },
}
