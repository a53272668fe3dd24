/** Probe `cache-fields`: request fields that steer an engine's KV cache, sent by a tenant. A
 *  tenant must never choose what its requests are cached under: such a field must be refused
 *  (4xx) or ignored; honoured, it lets one tenant read another's cached prefix (vllm#53347,
 *  CVE-2025-46570: a client-set `cache_salt`; sglang#27472: engine-internal fields accepted from
 *  clients).
 *
 *  Salts (`cache_salt` of vLLM, `extra_key` of SGLang), per field, the paired assertion of
 *  vllm#53347 seen from outside through `cached_tokens`:
 *  1. the victim sends a prefix with a salt of its own choosing, twice: the second must report
 *     cached tokens (same tenant, same salt: the positive control; without it nothing is proven);
 *  2. the observer sends the same prefix with the victim's salt value (one it could have
 *     learned): cached tokens there mean the field was honoured across tenants — a leak;
 *  3. the observer sends it once more without the field: a hit there too means the cache is
 *     shared whatever the field (prefix-timing's finding), and the title says so.
 *  Engine-internal fields (`kv_transfer_params`, `bootstrap_host`/`bootstrap_room`,
 *  `positional_embed_overrides`) could disturb a shared engine (a transfer aimed at a host the
 *  tenant names), so they are sent only under `--aggressive`, with values that point nowhere
 *  (TEST-NET-1, RFC 5737); a 4xx or an ordinary answer is fine, a 5xx or a hang means the engine
 *  acted on it (a warning).
 *  Knows these published field names and `cached_tokens`; nothing of how any engine works
 *  inside. */
import { runUntilExhausted } from '../budget.js'
import { makeCanaries } from '../canaries.js'
import { materialPromptTokens } from '../plan.js'
import type { Probe } from '../probe.js'
import { aisvsKvPartitioning, inconclusiveRemediation } from '../probe.js'
import { createRng, type Rng } from '../rng.js'
import { outcomeOf, type CompletionResult, type Target } from '../target.js'
import type { Finding, Tenant } from '../types.js'

/** Fields that key a prefix cache, by the engine that reads them. */
const saltFields = [
  { field: 'cache_salt', engine: 'vLLM' },
  { field: 'extra_key', engine: 'SGLang' },
] as const

/** Engine-internal fields, with values that point nowhere; sent only under `--aggressive`. */
const internalFieldValues: readonly {
  readonly name: string
  readonly fields: Record<string, unknown>
}[] = [
  {
    name: 'kv_transfer_params',
    fields: {
      kv_transfer_params: {
        do_remote_prefill: true,
        remote_host: '192.0.2.1',
        remote_port: 9,
        remote_block_ids: [],
      },
    },
  },
  {
    name: 'bootstrap_host',
    fields: { bootstrap_host: '192.0.2.1', bootstrap_port: 9, bootstrap_room: 1 },
  },
  { name: 'positional_embed_overrides', fields: { positional_embed_overrides: [] } },
]

const prefixWords = 64
const maxTokens = 1
/** An internal field the engine acts on may make it wait on a host that never answers. */
const internalFieldTimeoutMs = 10_000

const remediation =
  'Refuse (400) or drop every request field that steers the KV cache or the transfer path ' +
  '(cache_salt, extra_key, kv_transfer_params, bootstrap_*) at the gateway; set the cache salt ' +
  'there, derived from the authenticated tenant, never from the client (OWASP AISVS 5.5.5).'

/** What became of one salt field. */
interface SaltResult {
  readonly field: string
  readonly outcome: 'refused' | 'honoured' | 'ignored' | 'no-control' | 'not-sent'
  readonly controlCachedTokens: number | null
  readonly crossCachedTokens: number | null
  readonly withoutFieldCachedTokens: number | null
  readonly statuses: readonly (number | string | null)[]
}

export const cacheFieldsProbe: Probe = {
  name: 'cache-fields',
  description:
    "a tenant sends fields that steer the cache (cache_salt, extra_key; engine-internal ones under --aggressive), including another tenant's salt value; they must be refused or ignored, never honoured",
  class: 'side-channel',
  // kvfence's prefix cache is keyed by a salt the server derives from the tenant: a design
  // property, not one of the numbered guards.
  controls: { aisvs: [aisvsKvPartitioning], guards: [] },
  plan: ({ isAggressive }) => [
    { what: 'plain control', numRequests: 1, tokensEach: materialPromptTokens + maxTokens },
    {
      what: `${saltFields.length} salt fields × 4 requests`,
      numRequests: 4 * saltFields.length,
      tokensEach: materialPromptTokens + maxTokens,
    },
    {
      what: 'engine-internal fields (--aggressive only)',
      numRequests: isAggressive ? internalFieldValues.length : 0,
      tokensEach: materialPromptTokens + maxTokens,
    },
  ],
  async run(target, _budget, context): Promise<Finding[]> {
    const [victim, observer] = target.tenants
    const rng = createRng(context.seed, 'cache-fields')
    const salts: SaltResult[] = []
    const internal: InternalResult[] = []
    let isPlainAccepted = false
    const stoppedBy = await runUntilExhausted(async () => {
      // The same request without any field must be answered, or a 4xx says nothing of fields.
      const plain = await target.complete({
        tenant: victim,
        prompt: `${randomPrefix(rng)} ${suffix(rng)}`,
        maxTokens,
        stream: false,
      })
      isPlainAccepted = outcomeOf(plain) === 'accepted'
      if (!isPlainAccepted) return
      for (const { field } of saltFields) salts.push(await testSalt(target, rng, field))
      if (context.isAggressive !== true) return
      for (const { name, fields } of internalFieldValues) {
        const prompt = `${randomPrefix(rng)} ${suffix(rng)}`
        const r = await target.complete({
          tenant: observer,
          prompt,
          maxTokens,
          stream: false,
          extraFields: fields,
          isValid: false,
          abortAfterMs: internalFieldTimeoutMs,
        })
        const verdict = isRefusal(r)
          ? 'refused'
          : outcomeOf(r) === 'accepted'
            ? 'ignored'
            : 'acted on'
        internal.push({ name, status: r.status, failure: r.failure, verdict })
      }
    })
    context.log(
      [
        ...salts.map((s) => `${s.field}:${s.outcome}`),
        ...internal.map((i) => `${i.name}:${i.verdict}`),
      ].join(' '),
    )
    const evidence = {
      victimTenant: victim.name,
      observerTenant: observer.name,
      salts,
      internal,
      isAggressive: context.isAggressive === true,
      isPlainAccepted,
      stoppedBy,
    }
    return judge(salts, internal, evidence, isPlainAccepted, victim, observer)
  },
}

/** An internal field's request and what became of it. */
interface InternalResult {
  readonly name: string
  readonly status: number | null
  readonly failure: string | null
  readonly verdict: string
}

/** The findings: a leak per honoured salt, a warning per internal field acted on; else
 *  inconclusive without the plain control or a positive control; else clean. */
function judge(
  salts: readonly SaltResult[],
  internal: readonly InternalResult[],
  evidence: Record<string, unknown>,
  isPlainAccepted: boolean,
  victim: Tenant,
  observer: Tenant,
): Finding[] {
  const findings: Finding[] = []
  for (const s of salts.filter((x) => x.outcome === 'honoured')) {
    const isShared = (s.withoutFieldCachedTokens ?? 0) > 0
    findings.push({
      probe: 'cache-fields',
      // Another tenant's cache hit is seen, its words are not: a side channel, not a content leak.
      verdict: 'warning',
      class: 'side-channel',
      severity: 'high',
      title: isShared
        ? `${observer.name}'s request with ${victim.name}'s ${s.field} reported ${s.crossCachedTokens} cached tokens of a prefix only ${victim.name} sent; it did without the field too: the prefix cache is shared across tenants`
        : `${s.field} is honoured from clients: ${observer.name}'s request with ${victim.name}'s ${s.field} value reported ${s.crossCachedTokens} cached tokens of a prefix only ${victim.name} sent`,
      evidence: { ...evidence, field: s.field },
      remediation,
    })
  }
  for (const i of internal.filter((x) => x.verdict === 'acted on')) {
    findings.push({
      probe: 'cache-fields',
      verdict: 'warning',
      class: 'misconfiguration',
      severity: 'high',
      title: `a tenant's ${i.name} was acted on: the request pointing it at an unrouted host ${i.failure ?? `answered ${i.status}`}`,
      evidence: { ...evidence, field: i.name },
      remediation,
    })
  }
  if (findings.length > 0) return findings
  if (!isPlainAccepted) {
    return [
      {
        probe: 'cache-fields',
        verdict: 'inconclusive',
        severity: 'medium',
        title:
          'a plain request without any field was not answered, so a refusal says nothing of the fields',
        evidence,
        remediation: inconclusiveRemediation,
      },
    ]
  }
  const unproven = salts.filter((s) => s.outcome === 'no-control' || s.outcome === 'not-sent')
  if (unproven.length > 0 || salts.length < saltFields.length) {
    const names = unproven.map(
      (s) =>
        `${s.field} (${s.outcome === 'no-control' ? 'the same tenant and salt reported no cached tokens' : 'not answered'})`,
    )
    return [
      {
        probe: 'cache-fields',
        verdict: 'inconclusive',
        severity: 'medium',
        title:
          names.length > 0
            ? `could not tell whether another tenant's salt is honoured: ${names.join(', ')}`
            : 'not every field could be sent',
        evidence,
        remediation: `The positive control needs cached_tokens in usage.prompt_tokens_details and a prefix cache. ${inconclusiveRemediation}`,
      },
    ]
  }
  return [
    {
      probe: 'cache-fields',
      verdict: 'clean',
      severity: 'info',
      title: `cache-steering fields refused or ignored: ${[...salts.map((s) => `${s.field} ${s.outcome}`), ...internal.map((i) => `${i.name} ${i.verdict}`)].join(', ')}`,
      evidence,
      remediation: 'None needed.',
    },
  ]
}

/** One salt field's paired assertion (see the module's header): the victim's salt twice, the
 *  observer with the victim's salt value, then without the field. */
async function testSalt(target: Target, rng: Rng, field: string): Promise<SaltResult> {
  const [victim, observer] = target.tenants
  const prefix = randomPrefix(rng)
  const salt = `kvfence-audit-${makeCanaries(rng, 1)[0]}`
  const statuses: (number | string | null)[] = []
  const send = async (tenant: Tenant, fields: Record<string, unknown>) => {
    const r = await target.complete({
      tenant,
      prompt: `${prefix} ${suffix(rng)}`,
      maxTokens,
      stream: false,
      extraFields: fields,
      // A body with a field the endpoint may refuse: its refusal is no failure.
      isValid: Object.keys(fields).length === 0,
    })
    statuses.push(r.status ?? r.failure)
    return r
  }
  const unsent = {
    field,
    statuses,
    controlCachedTokens: null,
    crossCachedTokens: null,
    withoutFieldCachedTokens: null,
  }
  const first = await send(victim, { [field]: salt })
  if (isRefusal(first)) return { ...unsent, outcome: 'refused' }
  if (outcomeOf(first) !== 'accepted') return { ...unsent, outcome: 'not-sent' }
  const control = await send(victim, { [field]: salt })
  const cross = await send(observer, { [field]: salt })
  const without = await send(observer, {})
  const controlCached = acceptedCached(control)
  const crossCached = acceptedCached(cross)
  return {
    field,
    statuses,
    outcome:
      (crossCached ?? 0) > 0 ? 'honoured' : (controlCached ?? 0) > 0 ? 'ignored' : 'no-control',
    controlCachedTokens: controlCached,
    crossCachedTokens: crossCached,
    withoutFieldCachedTokens: acceptedCached(without),
  }
}

/** A refusal that is about the request (a field it does not take), not the key or the load. */
function isRefusal(r: CompletionResult): boolean {
  return (
    r.status !== null &&
    r.status >= 400 &&
    r.status < 500 &&
    ![401, 403, 404, 408, 429].includes(r.status)
  )
}

/** `cached_tokens` of an answered request, or null. */
function acceptedCached(r: CompletionResult): number | null {
  return outcomeOf(r) === 'accepted' ? r.cachedTokens : null
}

function randomPrefix(rng: Rng): string {
  const letters = Array.from({ length: prefixWords }, () =>
    String.fromCharCode(97 + rng.int(0, 25)),
  )
  return `${makeCanaries(rng, 1)[0]} ${letters.join(' ')}`
}

function suffix(rng: Rng): string {
  return `q${rng.int(0, 9999)}`
}
