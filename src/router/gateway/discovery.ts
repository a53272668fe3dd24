/** Gateway mode's G1: what the engine can really hold (its model, KV pool and limits, read from
 *  its own endpoints) and the context window the router advertises over it.
 *  Knows the engines' discovery endpoints and the operator's wishes; knows nothing of requests. */
import type { Logger } from 'pino'
import { KvfenceError } from '../../common/errors.js'
import { type EngineHttp, asObject, json, messageOf, positive } from './engine-http.js'
import { type BackendKind, engines } from './engines.js'

/** What the engine said about itself. */
export interface BackendCapacity {
  /** KV pool in tokens: the smaller of what the engine reports and what the operator declared. */
  capacityTokens: number
  /** What the engine itself reported (null: nothing; the declaration stands alone). */
  reportedCapacityTokens: number | null
  /** Longest sequence the model allows (`context_length` / `max_model_len`), when reported. */
  maxModelLen: number | null
  /** Longest prompt the engine accepts (`max_req_input_len`), when reported. */
  maxInputTokens: number | null
}

/** One discovery's findings: the engine's model id and capacity. */
export interface Discovery {
  backendModel: string
  capacity: BackendCapacity
}

/** Reads the engine's model (`backendModel` when given, else the first of its `/v1/models`) and
 *  capacity. `declaredPoolTokens` is the KV capacity the operator declared (`backend.kvPoolTokens`):
 *  it stands in where the engine reports none and caps what it reports (the smaller wins: a
 *  declaration is a promise about the deployment, a report about the process).
 *  `localMaxModelLen` (the local tokenizer directory's `config.json` `max_position_embeddings`)
 *  stands in for a model length the engine does not report. Throws
 *  `worker_unavailable` when it lists no model or refuses the key (401/403), saying how
 *  `/v1/models` answered, or when neither the engine nor the operator gives a KV capacity. */
export async function discover(
  kind: BackendKind,
  http: EngineHttp,
  backendModel: string | null,
  declaredPoolTokens: number | null = null,
  localMaxModelLen: number | null = null,
): Promise<Discovery> {
  const models = await http.call('/v1/models', 'GET', null).catch((err: unknown) => err as Error)
  const listed =
    !(models instanceof Error) && models.status === 200
      ? asObject(json(models.body))?.data
      : undefined
  const entries = Array.isArray(listed) ? listed.map(asObject) : []
  const model =
    backendModel ?? (typeof entries[0]?.id === 'string' ? (entries[0].id as string) : null)
  const entry = entries.find((e) => e?.id === model)
  // A refused key is the cause even when backend.model makes the list unneeded: the capacity
  // read that follows is refused too, and "cannot read its KV capacity" hid why.
  const isKeyRefused = !(models instanceof Error) && [401, 403].includes(models.status)
  if (model === null || isKeyRefused) {
    throw new KvfenceError(
      'worker_unavailable',
      `${kind} backend ${http.base}: ${noModelReason(models)}`,
    )
  }
  const report = await engines[kind].readCapacity(http)
  const capacityTokens =
    report.capacityTokens === null
      ? declaredPoolTokens
      : Math.min(report.capacityTokens, declaredPoolTokens ?? Infinity)
  if (capacityTokens === null) {
    throw new KvfenceError(
      'worker_unavailable',
      `${kind} backend ${http.base}: cannot read its KV capacity (${engines[kind].capacitySource}); declare it with backend.kvPoolTokens`,
    )
  }
  return {
    backendModel: model,
    capacity: {
      capacityTokens,
      reportedCapacityTokens: report.capacityTokens,
      maxModelLen: report.maxModelLen ?? positive(entry?.max_model_len) ?? localMaxModelLen,
      maxInputTokens: report.maxInputTokens,
    },
  }
}

/** Why `/v1/models` gave no model id, with a hint for the usual causes: a 404 is most often a
 *  base URL with a path (`…/v1` is added by the router), a 401 or 403 a missing or wrong key. */
function noModelReason(models: { status: number } | Error): string {
  if (models instanceof Error) return `cannot read /v1/models: ${messageOf(models)}`
  const { status } = models
  if (status === 200) return 'no model listed at /v1/models (its data list is empty or not a list)'
  const hint =
    status >= 500
      ? ': the engine cannot list its models: set backend.model to the model id it serves'
      : status === 404
        ? ': is backend.url the engine’s base URL (http://host:port, without /v1)?'
        : status === 401 || status === 403
          ? ': the engine wants an API key: set backend.apiKeyEnv to the variable holding it (or check that key)'
          : ''
  return `GET /v1/models answered HTTP ${status}${hint}`
}

/** The operator's wishes for the window (see `GatewayOptions`). */
export interface WindowOptions {
  kind: BackendKind
  contextWindow?: number
  clampContext: boolean
  guardsEnabled: boolean
  log: Logger
}

/** G1 over the engine's numbers. At start an over-large window is refused (`guard_violation`,
 *  unless clamped); later the window follows the engine down (with a warning), never above the
 *  operator's wish. With guards off the wish stands, with a warning. */
export function decideWindow(
  c: BackendCapacity,
  isStart: boolean,
  base: string,
  options: WindowOptions,
): number {
  const effective = Math.min(c.capacityTokens, c.maxModelLen ?? Infinity)
  const requested = options.contextWindow
  if (requested === undefined || requested <= effective) return requested ?? effective
  const excess = `context window ${requested} exceeds what ${options.kind} backend ${base} holds: ${effective} tokens (KV pool ${c.capacityTokens}, max_model_len ${c.maxModelLen ?? 'unknown'})`
  if (!options.guardsEnabled) {
    options.log.warn(`UNSAFE: ${excess}; guards are disabled`)
    return requested
  }
  if (isStart && !options.clampContext) {
    throw new KvfenceError(
      'guard_violation',
      `G1: ${excess}; lower the context window to ${effective}, or clamp it: --clamp-context (router.clampContext: true in a cluster file)`,
    )
  }
  options.log.warn(`G1: ${excess}; clamped to ${effective}`)
  return effective
}
