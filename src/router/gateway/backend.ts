/** Gateway mode: the router in front of another engine's OpenAI API (SGLang, vLLM), adding what
 *  the engine may lack — the safe rejection path. At start and periodically it discovers what the
 *  engine can really hold and advertises no more (G1, discovery.ts), counts each prompt with the
 *  engine's own tokenizer so that the router refuses over-capacity prompts with 400 before they
 *  reach the engine (G2, prompt-count.ts), and relays admitted requests under the router's own
 *  request id, with the prefix cache keyed by tenant and aborts on the engine (G8, relay.ts).
 *  What differs per engine is in engines.ts.
 *  Knows the engines' HTTP APIs and OpenAI bodies; knows nothing of tenants' keys or kvfence's
 *  workers. */
import { readFileSync } from 'node:fs'
import { join } from 'node:path'
import type { Logger } from 'pino'
import { KvfenceError } from '../../common/errors.js'
import { loadTokenizer } from '../../model/tokenizer.js'
import type { Backend } from '../backend.js'
import {
  type EngineHttp,
  asObject,
  createEngineHttp,
  json,
  messageOf,
  positive,
} from './engine-http.js'
import { type BackendCapacity, decideWindow, discover } from './discovery.js'
import { type BackendKind, engines } from './engines.js'
import { countPromptTokens } from './prompt-count.js'
import { createCacheSalts, relay } from './relay.js'
import { relayText } from './relay-text.js'
import {
  type GuardedSelfCheckReport,
  type PathIsolationGuard,
  createPathIsolationGuard,
} from './isolation.js'
import { type SelfCheckContext, runSelfCheck } from './self-check.js'
import type { Endpoint } from '../api/schemas.js'

export type { BackendKind } from './engines.js'
export type { BackendCapacity } from './discovery.js'

/** Options of {@link startGateway}. */
export interface GatewayOptions {
  kind: BackendKind
  /** The engine's base URL, e.g. `http://10.0.0.5:30000`. */
  url: string
  /** The model id the engine serves (sent as `model`); default: the first of its `/v1/models`. */
  backendModel?: string
  /** Served model name (in `/v1/models` and responses); default: the engine's model id, so that
   *  clients keep the name they used against the engine. */
  servedModel?: string
  /** A directory with the engine's `tokenizer.json` (+ `tokenizer_config.json`); default: the
   *  engine's `/tokenize`. */
  tokenizerDir?: string
  /** Advertised context window; default: what the engine can hold. */
  contextWindow?: number
  /** The engine's KV capacity in tokens as the operator declares it (`backend.kvPoolTokens`):
   *  required for an engine that reports none (`openai`); elsewhere it caps the report. */
  kvPoolTokens?: number
  /** Clamp an over-large window instead of refusing to start (G1). */
  clampContext: boolean
  /** False = allow advertising more than the engine holds (the incident's configuration). */
  guardsEnabled: boolean
  /** How often to re-discover capacity, ms (default {@link defaultIntervalMs}; 0 = only at
   *  start). */
  discoveryIntervalMs?: number
  /** Bearer key for the engine's API, if it wants one (never a tenant's key). */
  apiKey?: string
  /** Deadline of discovery and tokenize calls, ms (default {@link defaultTimeoutMs}). */
  timeoutMs?: number
  log: Logger
  /** Paths served even where the isolation self-check finds that the engine does not keep
   *  tenants' prefix caches apart (`shared`) or refuses the salt (`salt-refused`: then sent
   *  without it). Default: none (such a path is refused). */
  allowUnsalted?: readonly Endpoint[]
  /** How often to run the isolation self-check again, ms (default
   *  {@link defaultSelfCheckIntervalMs}; 0 = only at start). */
  selfCheckIntervalMs?: number
  /** The secret of the tenants' `cache_salt`s (../tenants/salt-secret.ts); null or absent: one drawn per
   *  process (logged as such). */
  saltSecret?: Uint8Array | null
}

/** A running gateway: a {@link Backend} and what the router's start needs of it. */
export interface Gateway extends Backend {
  readonly kind: BackendKind
  /** The engine's base URL. */
  readonly url: string
  /** The model name clients use: the configured one, or the engine's model id. */
  readonly servedModel: string
  /** What the engine reported at the last discovery. */
  capacity(): BackendCapacity
  /** Re-reads the engine's capacity now (also done every `discoveryIntervalMs`). */
  rediscover(): Promise<void>
  /** Runs the isolation self-check now (also at start and every `selfCheckIntervalMs`; after the
   *  run under way, if any) and applies it; resolves with its report, each path's standing in it. */
  selfCheck(): Promise<GuardedSelfCheckReport>
  /** The last self-check's report, each path's standing in it. */
  lastSelfCheck(): GuardedSelfCheckReport | null
}

/** Interval of the periodic re-discovery, ms. */
const defaultIntervalMs = 30_000
/** Deadline of discovery and tokenize calls, ms. */
const defaultTimeoutMs = 5_000
/** Interval of the periodic isolation self-check, ms: an engine redeployed without salt support
 *  is caught within it. */
const defaultSelfCheckIntervalMs = 10 * 60_000
/** The paths the gateway proxies, each checked by the self-check. */
const proxiedEndpoints: readonly Endpoint[] = ['chat', 'completion']

/** Discovers the engine's capacity, decides the window (G1) and returns the gateway. Throws
 *  `config_invalid` for a URL that is not http(s), `worker_unavailable` when the engine does not
 *  answer or reports no capacity, and `guard_violation` when `contextWindow` exceeds what it
 *  holds (without clamping). */
export async function startGateway(options: GatewayOptions): Promise<Gateway> {
  const http = createEngineHttp(options.url, options.apiKey, options.timeoutMs ?? defaultTimeoutMs)
  const tokenizer = options.tokenizerDir === undefined ? null : loadTokenizer(options.tokenizerDir)
  if (tokenizer === null && engines[options.kind].tokenize === null) {
    throw new KvfenceError(
      'config_invalid',
      `${options.kind} backend: the engine cannot count prompts (no /tokenize); set backend.tokenizerDir to a directory with its tokenizer.json, so that G2 can count them`,
    )
  }
  const found = await discoverEngine(options, http, options.backendModel ?? null)
  const { backendModel } = found
  logCapacitySource(options, found.capacity)
  let capacity = found.capacity
  let window = decideWindow(capacity, true, http.base, options)
  const servedModel = options.servedModel ?? backendModel

  async function rediscover(): Promise<void> {
    const next = await rediscovered(options, http, backendModel)
    if (next === null) return
    if (next.window !== window || next.capacity.capacityTokens !== capacity.capacityTokens) {
      options.log.info(
        { capacityTokens: next.capacity.capacityTokens, contextWindow: next.window },
        'backend capacity changed',
      )
    }
    ;({ capacity, window } = next)
  }
  const intervalMs = options.discoveryIntervalMs ?? defaultIntervalMs
  const timer = intervalMs > 0 ? setInterval(() => void rediscover(), intervalMs) : null
  timer?.unref()

  let checks: SelfChecks
  try {
    checks = await startSelfChecks(options, () => ({
      http,
      backendModel,
      contextWindow: window,
      nameRequest: engines[options.kind].nameRequest,
    }))
  } catch (err) {
    if (timer !== null) clearInterval(timer)
    http.close()
    throw err
  }
  const { isolation } = checks

  if (options.saltSecret == null) {
    options.log.info(
      'cache salts: a random secret of this process (replicas differ; set KVFENCE_SALT_SECRET or router.saltSecretFile to share them)',
    )
  }
  const relayContext = {
    http,
    engine: engines[options.kind],
    backendModel,
    cacheSaltOf: createCacheSalts(options.saltSecret ?? null),
    isSalted: (endpoint: Endpoint) => isolation.isSalted(endpoint),
  }
  return {
    name: options.kind,
    kind: options.kind,
    url: http.base,
    servedModel,
    capacity: () => capacity,
    rediscover,
    selfCheck: () => checks.run(),
    lastSelfCheck: () => isolation.last(),
    contextWindow: () => window,
    refusal: () => null,
    unavailableReason: () => engineHealth(http),
    serverInfo: () =>
      Promise.resolve({
        effectiveCapacityTokens: capacity.capacityTokens,
        guardsEnabled: options.guardsEnabled,
        backend: { kind: options.kind, url: http.base, contextWindow: window, ...capacity },
        isolationSelfCheck: isolation.last(),
      }),
    maxTokenChars: null,
    // Answers arrive as text: the sentinel matches characters, converted with the prompts' own
    // characters per token (counted by the tokenizer, local or the engine's).
    sentinelUnit: 'character',
    runIsolationSelfCheck: () => checks.run(),
    detokenize: tokenizer === null ? null : (ids) => tokenizer.decode(ids),
    async preparePrompt(parsed, _tenant, signal) {
      const context = {
        http,
        tokenizer,
        backendModel,
        guardsEnabled: options.guardsEnabled,
        engineTokenize: engines[options.kind].tokenize,
      }
      const numPromptTokens = await countPromptTokens(
        { ...context, maxInputTokens: capacity.maxInputTokens },
        parsed,
        signal,
      )
      return { numPromptTokens, tokenIds: null }
    },
    generate(job) {
      isolation.checkServed(job.parsed.endpoint)
      const { writer } = job
      if (writer !== undefined) {
        return writer.write(job, (onText) => relayText(relayContext, job, onText))
      }
      return relay(relayContext, job)
    },
    noteFailure() {},
    async close() {
      if (timer !== null) clearInterval(timer)
      checks.stop()
      http.close()
    },
  }
}

/** The capacity and window after a re-discovery, or null when the engine did not answer
 *  (logged: the caller keeps the last). */
async function rediscovered(
  options: GatewayOptions,
  http: EngineHttp,
  backendModel: string,
): Promise<{ capacity: BackendCapacity; window: number } | null> {
  try {
    const capacity = (await discoverEngine(options, http, backendModel)).capacity
    return { capacity, window: decideWindow(capacity, false, http.base, options) }
  } catch (err) {
    options.log.warn(
      { detail: messageOf(err) },
      'backend capacity discovery failed; keeping the last',
    )
    return null
  }
}

/** Says at start where the KV capacity that G1 holds the window to came from: the engine's own
 *  report, the operator's declaration alone (G1 then rests on it), or the smaller of the two. */
function logCapacitySource(options: GatewayOptions, c: BackendCapacity): void {
  const { kind, log } = options
  const declared = options.kvPoolTokens
  if (c.maxModelLen === null) {
    log.warn(
      `${kind} backend reports no model length and tokenizerDir has no config.json max_position_embeddings: the window rests on the KV capacity alone; set contextWindow to the model's length`,
    )
  }
  if (c.reportedCapacityTokens === null) {
    log.warn(
      { capacityTokens: c.capacityTokens },
      `${kind} backend reports no KV capacity: G1 rests on the declared backend.kvPoolTokens (${declared} tokens); check it against the engine's own configuration`,
    )
  } else if (declared !== undefined && declared !== c.reportedCapacityTokens) {
    log.warn(
      { reported: c.reportedCapacityTokens, declared, capacityTokens: c.capacityTokens },
      `${kind} backend reports ${c.reportedCapacityTokens} tokens of KV, backend.kvPoolTokens declares ${declared}: the smaller holds`,
    )
  }
}

/** The isolation self-checks of a gateway: the guard they feed, a run now, and the timer. */
interface SelfChecks {
  readonly isolation: PathIsolationGuard
  run(): Promise<GuardedSelfCheckReport>
  stop(): void
}

/** Runs the isolation self-check once (throwing `guard_violation` for a path that must be
 *  refused at start) and every `selfCheckIntervalMs` after; `context` gives the engine and the
 *  window at each run. */
async function startSelfChecks(
  options: GatewayOptions,
  context: () => SelfCheckContext,
): Promise<SelfChecks> {
  const isolation = createPathIsolationGuard({
    allowUnsalted: options.allowUnsalted ?? [],
    guardsEnabled: options.guardsEnabled,
    kind: options.kind,
    log: options.log,
  })
  const runOnce = async (isStart: boolean) => {
    const report = await runSelfCheck(context(), proxiedEndpoints)
    options.log.info(
      { numRequests: report.numRequests, numTokens: report.numTokens, ms: report.durationMs },
      'isolation self-check done',
    )
    isolation.apply(report, isStart)
    return isolation.last()!
  }
  // One run at a time (the engine serves tenants meanwhile): a run asked for while another is
  // under way starts after it, so that its result is of the engine as it is after the request.
  let previous: Promise<unknown> = Promise.resolve()
  const run = (): Promise<GuardedSelfCheckReport> => {
    const next = previous.then(() => runOnce(false))
    previous = next.catch(() => undefined)
    return next
  }
  await runOnce(true)
  const everyMs = options.selfCheckIntervalMs ?? defaultSelfCheckIntervalMs
  const timer = everyMs > 0 ? setInterval(() => void run(), everyMs) : null
  timer?.unref()
  return {
    isolation,
    run,
    stop: () => {
      if (timer !== null) clearInterval(timer)
    },
  }
}

/** Deadline of the engine's `/health` read behind the router's own, ms. */
const healthTimeoutMs = 2_000

/** Why the engine cannot serve now, from its own `GET /health` (every engine fronted has one:
 *  SGLang, vLLM, llama.cpp, TGI, `transformers serve`), or null when it answers 2xx; an engine
 *  without the endpoint (404) is taken as serving. */
async function engineHealth(http: EngineHttp): Promise<string | null> {
  const res = await http
    .call('/health', 'GET', null, AbortSignal.timeout(healthTimeoutMs))
    .catch((err: unknown) => messageOf(err))
  if (typeof res === 'string') return `the engine at ${http.base} does not answer: ${res}`
  if ((res.status >= 200 && res.status < 300) || res.status === 404) return null
  return `the engine at ${http.base} answered /health with HTTP ${res.status}`
}

/** {@link discover} with what the operator declared and the local model's length. */
function discoverEngine(
  options: GatewayOptions,
  http: EngineHttp,
  backendModel: string | null,
): ReturnType<typeof discover> {
  const declared = options.kvPoolTokens ?? null
  const localMaxModelLen = localModelLength(options.tokenizerDir)
  return discover(options.kind, http, backendModel, declared, localMaxModelLen)
}

/** `max_position_embeddings` of the `config.json` beside the local tokenizer, when there is one
 *  (a Hugging Face model directory): the model's length where the engine does not say it. */
function localModelLength(tokenizerDir: string | undefined): number | null {
  if (tokenizerDir === undefined) return null
  try {
    const config = asObject(json(readFileSync(join(tokenizerDir, 'config.json'), 'utf8')))
    return positive(config?.max_position_embeddings)
  } catch {
    return null
  }
}
