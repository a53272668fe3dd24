/** Probe `operational-endpoints`: the endpoints an engine or gateway serves besides generation
 *  (llama.cpp's `/slots`, on by default and showing every slot's prompt; SGLang's `/server_info`,
 *  which serialized `api_key` and `admin_api_key`: sglang#30166; `/props`, `/metrics`, `/info`,
 *  …), read as the observer (second tenant) and with no key, after the victim (first tenant)
 *  planted canaries and again while a victim request is in flight. Only GETs of read-only paths
 *  are sent: never a mutating one (`/flush_cache`, `/update_weights*`), never `/start_profile`.
 *  A victim canary in a body is a `content-leak` naming the endpoint; a secret (a tenant key, a
 *  credential field with a value, a bearer token, a private key) is a `credential-exposure`
 *  naming the endpoint and the field, never the value. An endpoint is exercised only when it
 *  answered 200: the others are listed as not exercised, and with none read the probe is
 *  inconclusive.
 *  Knows the auditor's requests and secrets.ts; knows nothing of any engine's insides. */
import { findCanaries, makeCanaries } from '../canaries.js'
import type { Probe } from '../probe.js'
import { createRng } from '../rng.js'
import { findSecrets, type SecretHit } from '../secrets.js'
import type { CompletionResult, HttpResult, Target } from '../target.js'
import type { Finding, Tenant } from '../types.js'
import { materialPromptTokens } from '../plan.js'

/** Read-only operational paths of SGLang, vLLM, llama.cpp, TGI, transformers serve, LiteLLM-like
 *  gateways and kvfence. GET only; none of them changes the server's state. */
export const operationalPaths = [
  '/slots',
  '/props',
  '/server_info',
  '/get_server_info',
  '/get_model_info',
  '/model_info',
  '/get_load',
  '/metrics',
  '/health',
  '/v1/models',
  '/info',
  '/version',
  '/stats',
  '/debug/requests',
] as const

/** Tokens the victim's planting request may answer with. */
export const plantMaxTokens = 16
/** Long enough that the reads during it find it in flight on a streaming engine. */
export const inFlightMaxTokens = 64

/** One GET: which path, as whom, when. */
export interface Read {
  readonly path: string
  /** The tenant whose key was sent, or null (no key). */
  readonly reader: Tenant | null
  readonly phase: 'after-plant' | 'in-flight'
  readonly http: HttpResult
}

const leakRemediation =
  "Serve operational endpoints only to the operator (a separate admin key or a private port), never to tenants' keys or without a key; llama.cpp: start llama-server with --no-slots; strip prompts and outputs from every status body."
const secretRemediation =
  'Never serialize credentials into a status body: drop api_key, admin_api_key and password fields (SGLang: upgrade past sglang#30166 or block /server_info and /get_server_info at the gateway), rotate every key that was served, and serve these endpoints to the operator only.'

export const operationalEndpointsProbe: Probe = {
  name: 'operational-endpoints',
  class: 'content-leak',
  // Layers beside and in front of the engine: no KV page is involved, no guard applies.
  controls: { aisvs: [], guards: [] },
  description:
    "reads every read-only operational endpoint (/slots, /props, /server_info, /metrics, …) as tenant B and with no key, after and while tenant A's canary requests run: A's canary in a body is a content-leak, a served secret a credential-exposure (redacted)",
  plan: () => [
    {
      what: 'planting prompts of the victim',
      numRequests: 2,
      tokensEach: materialPromptTokens + inFlightMaxTokens,
    },
    {
      what: 'reads of operational endpoints',
      numRequests: operationalPaths.length * 3,
      tokensEach: 0,
    },
  ],
  async run(target, budget, context): Promise<Finding[]> {
    const [victim, observer] = target.tenants
    const rng = createRng(context.seed, 'operational-endpoints')
    // Short prompts (4 canaries, ~100 characters): they fit the smallest pool with their answer.
    const canaries = makeCanaries(rng, 8)
    const first = { prompt: canaries.slice(0, 4).join(' ') }
    const second = { prompt: canaries.slice(4).join(' ') }
    const reads: Read[] = []
    const plant = await target.complete({
      tenant: victim,
      prompt: first.prompt,
      maxTokens: plantMaxTokens,
      stream: false,
    })
    for (const path of operationalPaths)
      for (const reader of [observer, null]) {
        const http = await target.get(path, reader === null ? {} : { tenant: reader })
        reads.push({ path, reader, phase: 'after-plant', http })
      }
    const readable = new Set(reads.filter((r) => r.http.status === 200).map((r) => r.path))
    const inFlight = await readWhileInFlight(target, victim, observer, second.prompt, [...readable])
    reads.push(...inFlight.reads)
    context.log(`${readable.size} of ${operationalPaths.length} endpoints answered 200`)
    void budget
    return judgeReads(reads, canaries, target.tenants, victim, [plant, inFlight.result])
  },
}

/** Starts a streamed victim request and reads `paths` as the observer until all are read;
 *  returns the reads made while the request was still in flight, and the request's result. */
export async function readWhileInFlight(
  target: Target,
  victim: Tenant,
  observer: Tenant,
  prompt: string,
  paths: readonly string[],
): Promise<{ reads: Read[]; result: CompletionResult }> {
  let isDone = false
  const request = target
    .complete({ tenant: victim, prompt, maxTokens: inFlightMaxTokens, stream: true })
    .finally(() => {
      isDone = true
    })
  const reads: Read[] = []
  for (const path of paths) {
    if (isDone) break
    const http = await target.get(path, { tenant: observer })
    reads.push({ path, reader: observer, phase: 'in-flight', http })
  }
  return { reads, result: await request }
}

/** Findings from the reads: canaries of the victim → content-leak per endpoint; secrets →
 *  credential-exposure per endpoint and field; else clean (some endpoint read, the victim's
 *  requests answered) or inconclusive. */
export function judgeReads(
  reads: readonly Read[],
  canaries: readonly string[],
  tenants: readonly Tenant[],
  victim: Tenant,
  victimResults: readonly CompletionResult[],
): Finding[] {
  const ok = reads.filter((r) => r.http.status === 200)
  const exercised = [...new Set(ok.map((r) => r.path))]
  const notExercised = operationalPaths.filter((p) => !exercised.includes(p))
  const coverage = {
    endpointsRead: exercised,
    endpointsNotExercised: notExercised,
    readsWhileInFlight: reads.filter((r) => r.phase === 'in-flight' && r.http.status === 200)
      .length,
  }
  const findings: Finding[] = []
  const seen = new Set<string>()
  for (const read of ok) {
    const [match] = findCanaries(read.http.body, canaries)
    const who = read.reader === null ? 'no key' : `${read.reader.name}'s key`
    if (match && !seen.has(`leak ${read.path}`) && read.reader?.name !== victim.name) {
      seen.add(`leak ${read.path}`)
      findings.push({
        probe: 'operational-endpoints',
        verdict: 'leak',
        severity: 'critical',
        title: `GET ${read.path} with ${who} showed a canary ${victim.name} planted in its prompt (${read.phase === 'in-flight' ? 'while its request was in flight' : 'after its request ended'})`,
        evidence: {
          endpoint: read.path,
          reader: read.reader?.name ?? null,
          phase: read.phase,
          victimTenant: victim.name,
          canary: match.canary,
          matchedFragment: match.fragment,
          requestNumber: read.http.requestNumber,
          ...coverage,
        },
        remediation: leakRemediation,
      })
    }
    for (const path of unisolatedPaths(read)) {
      if (seen.has(`unisolated ${path.endpoint}`)) continue
      seen.add(`unisolated ${path.endpoint}`)
      findings.push(unisolatedFinding(read, path, coverage))
    }
    for (const hit of findSecrets(read.http.body, tenants)) {
      const key = `secret ${read.path} ${hit.field} ${hit.tenant ?? ''}`
      if (seen.has(key)) continue
      seen.add(key)
      findings.push(secretFinding(read, hit, who, coverage))
    }
  }
  if (findings.length > 0) return findings
  const isPlanted = victimResults.some(
    (r) => r.status !== null && r.status >= 200 && r.status < 300,
  )
  if (exercised.length === 0 || !isPlanted)
    return [
      {
        probe: 'operational-endpoints',
        verdict: 'inconclusive',
        severity: 'info',
        title:
          exercised.length === 0
            ? `no operational endpoint answered 200 (of ${operationalPaths.length} read with a tenant's key and with none): none was exercised`
            : `${victim.name}'s planting requests were not answered: the endpoints were read with nothing planted to find`,
        evidence: coverage,
        remediation:
          'Re-run with valid tenant keys; an endpoint that is not served cannot expose anything.',
      },
    ]
  return [
    {
      probe: 'operational-endpoints',
      verdict: 'clean',
      severity: 'info',
      title: `${exercised.length} operational endpoints read (${exercised.join(', ')}): no canary of ${victim.name} and no secret in any body${notExercised.length > 0 ? `; not exercised (no 200 with either key or none): ${notExercised.join(', ')}` : ''}`,
      evidence: coverage,
      remediation: 'None needed.',
    },
  ]
}

/** A path a gateway's published isolation self-check (kvfence's `/server_info`
 *  `isolationSelfCheck.paths`) found not isolated (`shared`: the engine ignores the tenant's
 *  salt; `salt-refused`: it refuses the field) and serves all the same. */
interface UnisolatedPath {
  readonly endpoint: string
  readonly result: string
  readonly detail: string
}

function unisolatedPaths(read: Read): UnisolatedPath[] {
  let value: unknown
  try {
    value = JSON.parse(read.http.body)
  } catch {
    return []
  }
  const paths = (value as { isolationSelfCheck?: { paths?: unknown } } | null)?.isolationSelfCheck
    ?.paths
  if (!Array.isArray(paths)) return []
  return paths
    .map((p) => p as Partial<Record<'endpoint' | 'result' | 'detail' | 'standing', unknown>>)
    .filter(
      (p) =>
        (p.result === 'shared' || p.result === 'salt-refused') &&
        p.standing !== 'refused' &&
        typeof p.endpoint === 'string',
    )
    .map((p) => ({
      endpoint: p.endpoint as string,
      result: p.result as string,
      detail: typeof p.detail === 'string' ? p.detail : '',
    }))
}

/** The layer's own report that a path shares the engine's prefix cache between tenants: a side
 *  channel (cache hits observable across tenants), stated by the layer itself. */
function unisolatedFinding(
  read: Read,
  path: UnisolatedPath,
  coverage: Record<string, unknown>,
): Finding {
  return {
    probe: 'operational-endpoints',
    verdict: 'warning',
    class: 'side-channel',
    severity: 'high',
    title: `GET ${read.path} reports that the engine behind it does not keep tenants' prefix caches apart on the ${path.endpoint} path (${path.result}: ${path.detail}), and the path is served`,
    evidence: {
      endpoint: read.path,
      path: path.endpoint,
      result: path.result,
      detail: path.detail,
      requestNumber: read.http.requestNumber,
      ...coverage,
    },
    remediation:
      "Run an engine that keys its prefix cache by the tenant's salt on every path (vLLM cache_salt, SGLang extra_key), or refuse the path: remove it from the gateway's allowUnsalted.",
  }
}

function secretFinding(
  read: Read,
  hit: SecretHit,
  who: string,
  coverage: Record<string, unknown>,
): Finding {
  const what =
    hit.kind === 'tenant-key'
      ? `${hit.tenant}'s API key`
      : hit.kind === 'credential-field'
        ? `a credential in field ${hit.field}`
        : hit.kind === 'bearer-token'
          ? 'a bearer token'
          : `a private key (${hit.field})`
  const isOwnKey = hit.kind === 'tenant-key' && hit.tenant === read.reader?.name
  return {
    probe: 'operational-endpoints',
    verdict: 'warning',
    class: 'credential-exposure',
    severity: isOwnKey ? 'medium' : 'critical',
    title: `GET ${read.path} with ${who} served ${what} (redacted, ${hit.length} characters)`,
    evidence: {
      endpoint: read.path,
      reader: read.reader?.name ?? null,
      field: hit.field,
      kind: hit.kind,
      secretOwner: hit.tenant ?? null,
      secret: `[redacted: ${hit.length} characters]`,
      requestNumber: read.http.requestNumber,
      ...coverage,
    },
    remediation: secretRemediation,
  }
}
