/** Starts a router process: loads tenants and tokenizer, asks every worker (or, in gateway mode,
 *  the engine behind it) for its state, performs G1 (advertised context window ≤ effective
 *  capacity), builds the frozen config and listens.
 *  Used by `kvfence router` and `kvfence serve`.
 *  Knows how the router's parts fit together; knows nothing of request handling itself. */
import http from 'node:http'
import https from 'node:https'
import type { AddressInfo } from 'node:net'
import { setTimeout as sleep } from 'node:timers/promises'
import { pino, type Logger } from 'pino'
import { KvfenceError } from '../common/errors.js'
import { loadTokenizer } from '../model/tokenizer.js'
import { type WorkerReport, decideContextWindow } from './admission/capacity.js'
import { answerClientError, answerPlainHttpOnHttps } from './api/client-errors.js'
import type { Backend } from './backend.js'
import { type RouterConfig, buildRouterConfig, routerConfigDefaults } from './config.js'
import { createDrain } from './drain.js'
import { type GatewayOptions, startGateway } from './gateway/backend.js'
import { effectiveReservedSlots } from './admission/fair-queue.js'
import { answerExpectContinue } from './api/http.js'
import { type Limiter, createLimiter } from './admission/limits.js'
import { type QueueLimits, queueLimitDefaults } from './admission/queue-limits.js'
import { type RouterMetrics, createRouterMetrics } from './metrics/metrics.js'
import { type RedisLimitSettings, createRedisLimitStore } from './admission/redis-limits.js'
import { createNativeBackend } from './native/backend.js'
import { createCapacityMonitor, defaultCapacityRecheckMs } from './native/capacity-monitor.js'
import { createRouter } from './api/routes.js'
import { createRouterSentinel } from './sentinel/router-sentinel.js'
import type { SentinelSettings } from './sentinel/sentinel.js'
import { type StartTokenizer, createTokenizerPool } from './tokenize/tokenizer-pool.js'
import {
  type TenantRecord,
  type TenantsWatcher,
  createTenantRegistry,
  watchTenants,
} from './tenants/tenants.js'
import { type WorkerClient, createWorkerClient } from '../control/worker-client.js'
import { checkPlaintextLinks, clientPlaintextWarning, hostOfUrl } from '../link/plaintext.js'
import { certExpiryOf, tlsExpiries, watchCertExpiry } from '../link/cert-expiry.js'
import { loadCertPair, reloadCertOnChange, type TlsMaterial } from '../link/tls.js'
import { scrapeWorkerStats } from './metrics/worker-stats.js'

/** Gateway mode: the engine behind the router (see gateway/backend.ts). */
export type GatewayBackendOptions = Omit<
  GatewayOptions,
  'log' | 'servedModel' | 'clampContext' | 'guardsEnabled' | 'contextWindow'
>

/** Options of {@link startRouter}. */
export interface StartRouterOptions {
  /** Model directory holding `tokenizer.json` and `tokenizer_config.json`. */
  modelDir?: string
  /** Prefill workers' control base URLs, e.g. `http://127.0.0.1:8101`. */
  prefillUrls?: readonly string[]
  /** Decode workers' control base URLs; the transfer address is the worker's reported
   *  `transferHost` (default: this URL's host) and `transferPort`. */
  decodeUrls?: readonly string[]
  /** The tenants YAML file (`tenants: [{ name, keySha256 }]`), or its records. A file is
   *  re-read whenever it changes (see `watchTenants`); records are fixed. */
  tenants: string | readonly TenantRecord[]
  /** How often the tenants file's metadata is polled for changes, ms (default: `watchTenants`'). */
  tenantsPollMs?: number
  /** Reads the records out of the `tenants` file (default: it is a tenants file); e.g. the
   *  cluster config's reader when `tenants` is a cluster config file. Throws on a bad file. */
  tenantsReader?: (path: string) => readonly TenantRecord[]
  /** Gateway mode: proxy to this engine instead of kvfence workers (then `modelDir`,
   *  `prefillUrls` and `decodeUrls` are not used). */
  gateway?: GatewayBackendOptions
  /** Router-wide running and queue limits (defaults: `queueLimitDefaults`). */
  queue?: Partial<QueueLimits>
  /** Log prompts and completions (default false). */
  logContent?: boolean
  /** Interface to listen on (default 127.0.0.1). */
  host?: string
  /** Port to listen on (default 8000; 0 = any free port). */
  port?: number
  /** Served model name (default: the `model` every worker reports; in gateway mode, the
   *  engine's model id). */
  modelName?: string
  /** Advertised context window in tokens (default: the effective capacity). */
  contextWindow?: number
  /** G1: clamp an over-large context window instead of refusing to start (default false). */
  clampContext?: boolean
  /** False = the incident's configuration (`--unsafe-disable-guards`); default true. */
  guardsEnabled?: boolean
  /** Largest request body, in bytes (default `routerConfigDefaults.maxBodyBytes`). */
  maxBodyBytes?: number
  /** Longest silence from a decode worker during a request, in ms (default: the worker
   *  client's). */
  workerIdleTimeoutMs?: number
  /** How long to wait for workers to answer `/server_info` at start, in ms (default
   *  {@link defaultWorkerWaitMs}). */
  workerWaitMs?: number
  /** Interval of G1's re-check of the workers' capacity while running, in ms (default
   *  {@link defaultCapacityRecheckMs}). */
  capacityRecheckMs?: number
  /** The token the workers require on their control plane (`KVFENCE_CLUSTER_TOKEN`); null or
   *  absent sends none, which only workers bound to loopback without a token accept. */
  clusterToken?: string | null
  /** How long {@link RunningRouter.drain} lets running requests finish, seconds (default
   *  `routerConfigDefaults.drainSeconds`). */
  drainSeconds?: number
  /** The response sentinel's settings, over `sentinelDefaults` (src/router/sentinel/). */
  sentinel?: Partial<SentinelSettings>
  /** How the router starts each tokenizer of its pool (tokenize/tokenizer-pool.ts): `forkTokenizer`
   *  of tokenize/tokenizer-fork.ts (a child process, what `kvfence router` and `serve` pass).
   *  Required with workers; given here, not imported, so that a test can run the router with an
   *  in-process one and start no process. */
  startTokenizer?: StartTokenizer
  /** Processes tokenizing long prompts (default `defaultNumProcesses` of tokenize/tokenizer-pool.ts). */
  tokenizerProcesses?: number
  /** Start the tokenizer processes with the first long prompt rather than with the router
   *  (default false; tests, most of which send none, set it). */
  tokenizerProcessesOnDemand?: boolean
  /** The router's TLS files, read (src/link/tls.ts): the control plane to the workers runs over mutual
   *  TLS, to `https:` worker URLs. Default: plaintext. */
  workerTls?: TlsMaterial | null
  /** Without `workerTls`, dial `http:` workers beyond loopback anyway (`--allow-plaintext`,
   *  logged as a warning); default false: the router refuses to start (src/link/plaintext.ts). */
  allowPlaintext?: boolean
  /** Serve clients over HTTPS with this certificate and key (PEM files), reloaded when they
   *  change on disk. Default: plain HTTP. */
  https?: { cert: string; key: string }
  /** Logger (default: pino to stdout at info). */
  log?: Logger
  /** Count tenants' limits in Redis, shared by router replicas (admission/redis-limits.ts); default: in
   *  this process. */
  redisLimits?: RedisLimitSettings
}

/** A listening router. */
export interface RunningRouter {
  /** `http://host:port`. */
  readonly url: string
  readonly port: number
  readonly config: RouterConfig
  readonly server: http.Server | https.Server
  /** Stops listening, closes client and worker connections. */
  close(): Promise<void>
  /** Graceful stop: refuses new requests (503 `shutting_down`, `/health` 503), lets running
   *  ones finish for up to `config.drainSeconds`, ends the rest with an error (an SSE error
   *  event in a stream), then {@link close}s. */
  drain(): Promise<void>
  /** Stop now (a second stop signal): ends every running request at once with that error (an
   *  SSE error event in a stream: never a bare cut), then {@link close}s. */
  stopNow(): Promise<void>
}

/** Interval between polls of workers still coming up, ms. */
const workerPollMs = 200
/** How long start-up waits for the workers, ms. */
const defaultWorkerWaitMs = 10_000

/** Starts the router; rejects (with a one-line message) when a worker is unreachable or G1
 *  refuses the configuration. */
export async function startRouter(options: StartRouterOptions): Promise<RunningRouter> {
  const log = options.log ?? pino({ name: 'kvfence-router' })
  // The HTTPS pair is checked before any worker is dialled: waiting for workers first put off a
  // missing or mismatched file until the workers answered (or named them instead).
  if (options.https !== undefined) loadCertPair(options.https)
  const watcher =
    typeof options.tenants === 'string'
      ? watchTenants(options.tenants, {
          log,
          intervalMs: options.tenantsPollMs,
          read: options.tenantsReader,
        })
      : null
  try {
    return await startWithTenants(options, log, watcher)
  } catch (err) {
    watcher?.close()
    throw err
  }
}

/** {@link startRouter} once the tenants are loaded; stops `watcher` when the router closes. */
async function startWithTenants(
  options: StartRouterOptions,
  log: Logger,
  watcher: TenantsWatcher | null,
): Promise<RunningRouter> {
  const tenants = watcher?.registry ?? createTenantRegistry(options.tenants as TenantRecord[])
  const queue = { ...queueLimitDefaults, ...options.queue }
  const numReserved = effectiveReservedSlots(queue)
  if (numReserved < queue.reservedSlots) {
    // An automatic cut is said, never silent: one slot always stays open to every tenant.
    log.warn(
      `reservedSlots ${queue.reservedSlots} takes effect as ${numReserved}: of maxConcurrentRequests ${queue.maxConcurrentRequests}, one slot stays open to every tenant`,
    )
  }
  const store = options.redisLimits && (await createRedisLimitStore(options.redisLimits, log))
  const limiter = store
    ? createLimiter(queue, () => performance.now(), store)
    : createLimiter(queue)
  const started = await (
    options.gateway !== undefined
      ? startGatewayBackend(options, options.gateway, limiter, log)
      : startNativeBackend(options, limiter, log)
  ).catch((err: unknown) => {
    store?.close()
    throw err
  })
  const { backend } = started
  store?.registerMetrics(started.metrics.registry)
  try {
    const config = buildRouterConfig({
      ...started.config,
      guardsEnabled: options.guardsEnabled ?? true,
      maxBodyBytes: options.maxBodyBytes ?? routerConfigDefaults.maxBodyBytes,
      logContent: options.logContent ?? false,
      drainSeconds: options.drainSeconds ?? routerConfigDefaults.drainSeconds,
      sentinel: { ...routerConfigDefaults.sentinel, ...options.sentinel },
    })
    const sentinel = createRouterSentinel(
      config.sentinel,
      backend.sentinelUnit,
      started.metrics,
      log,
    )
    const deps = {
      tenants,
      backend,
      limiter,
      metrics: started.metrics,
      log,
      sentinel,
      operatorToken: options.clusterToken ?? null,
    }
    return await listenRouter(options, config, deps, async () => {
      watcher?.close()
      store?.close()
      await backend.close()
    })
  } catch (err) {
    store?.close()
    await backend.close()
    throw err
  }
}

/** A started backend, the deployment's numbers for the router's config, and the metrics the
 *  backend counts into. */
interface StartedBackend {
  backend: Backend
  config: Pick<RouterConfig, 'model' | 'contextWindow' | 'effectiveCapacityTokens' | 'pageSize'>
  metrics: RouterMetrics
}

/** Gateway mode: discovers the engine and decides the window (G1). */
async function startGatewayBackend(
  options: StartRouterOptions,
  gatewayOptions: GatewayBackendOptions,
  limiter: Limiter,
  log: Logger,
): Promise<StartedBackend> {
  const gateway = await startGateway({
    ...gatewayOptions,
    servedModel: options.modelName,
    contextWindow: options.contextWindow,
    clampContext: options.clampContext ?? false,
    guardsEnabled: options.guardsEnabled ?? true,
    log,
  })
  return {
    backend: gateway,
    config: {
      model: gateway.servedModel,
      contextWindow: gateway.contextWindow(),
      effectiveCapacityTokens: gateway.capacity().capacityTokens,
      pageSize: 1,
    },
    metrics: createRouterMetrics({
      queue: () => queueOf(limiter),
      isolation: () => gateway.lastSelfCheck()?.paths ?? [],
    }),
  }
}

/** kvfence workers: waits for them, checks them, decides the window (G1) and starts its
 *  re-check; knows before the first request whether the workers take the cluster token. */
async function startNativeBackend(
  options: StartRouterOptions,
  limiter: Limiter,
  log: Logger,
): Promise<StartedBackend> {
  if (options.modelDir === undefined || !options.prefillUrls || !options.decodeUrls) {
    throw new KvfenceError(
      'config_invalid',
      'a kvfence router needs a model directory, prefill worker URLs and decode worker URLs',
    )
  }
  if (options.startTokenizer === undefined)
    throw new KvfenceError('config_invalid', 'a kvfence router needs a way to start tokenizers')
  if (!options.workerTls)
    checkPlaintextLinks({
      part: 'router',
      links: [...options.prefillUrls, ...options.decodeUrls].map((url) => ({
        what: 'dials worker',
        host: hostOfUrl(url),
      })),
      allowPlaintext: options.allowPlaintext ?? false,
      tlsHint:
        '--cluster-tls-ca/--cluster-tls-cert/--cluster-tls-key (or tls: in the cluster file)',
      log,
    })
  const guardsEnabled = options.guardsEnabled ?? true
  const tokenizer = loadTokenizer(options.modelDir)
  const workers = createWorkerClient({
    prefillUrls: options.prefillUrls,
    decodeUrls: options.decodeUrls,
    idleTimeoutMs: options.workerIdleTimeoutMs,
    guardsEnabled,
    clusterToken: options.clusterToken ?? null,
    tls: options.workerTls ?? null,
  })
  let backend: Backend | null = null
  try {
    const reports = await waitForWorkers(workers, options.workerWaitMs ?? defaultWorkerWaitMs)
    const model = checkWorkers(reports, workers, guardsEnabled, log)
    const decision = decideContextWindow(reports, {
      contextWindow: options.contextWindow,
      clampContext: options.clampContext ?? false,
      guardsEnabled,
    })
    for (const warning of decision.warnings) log.warn(warning)
    if (!guardsEnabled) log.warn('UNSAFE: router guards are disabled')
    const pageSize = reports.find((r) => r.info.role === 'decode')!.info.pageSize
    const metrics = createRouterMetrics({
      queue: () => queueOf(limiter),
      workers: () => scrapeWorkerStats(workers),
    })
    const capacity = createCapacityMonitor({
      workers,
      initial: reports,
      contextWindow: options.contextWindow ?? decision.contextWindow,
      clampContext: options.clampContext ?? false,
      guardsEnabled,
      intervalMs: options.capacityRecheckMs ?? defaultCapacityRecheckMs,
      log,
    })
    backend = createNativeBackend({
      tokenizer,
      tokenizerPool: createTokenizerPool({
        modelDir: options.modelDir,
        startTokenizer: options.startTokenizer,
        tokenizer,
        ...(options.tokenizerProcesses === undefined
          ? {}
          : { numProcesses: options.tokenizerProcesses }),
        startNow: !(options.tokenizerProcessesOnDemand ?? false),
      }),
      workers,
      capacity,
      pageSize,
      guardsEnabled,
      limiter,
      metrics,
      log,
    })
    await capacity.recheck()
    const config = {
      model: options.modelName ?? model,
      contextWindow: decision.contextWindow,
      effectiveCapacityTokens: decision.effectiveCapacityTokens,
      pageSize,
    }
    return { backend, config, metrics }
  } catch (err) {
    // The backend, once made, holds the workers' client and the tokenizer processes.
    if (backend === null) workers.close()
    else await backend.close()
    throw err
  }
}

/** The limiter's queue, for the metrics. */
function queueOf(limiter: Limiter) {
  return {
    numRunning: limiter.numRunning,
    numQueued: limiter.numQueued,
    numWaitingForRoom: limiter.numWaitingForRoom,
  }
}

/** How long the router keeps an idle client connection open (ms), above the 60 s idle timeout
 *  common in load balancers, so that the balancer, not the router, ends an idle connection. */
export const routerKeepAliveTimeoutMs = 65_000

/** Listens with a router over `deps`; `closeBackend` runs on close. */
async function listenRouter(
  options: StartRouterOptions,
  config: RouterConfig,
  deps: Omit<Parameters<typeof createRouter>[0], 'config' | 'drain'>,
  closeBackend: () => Promise<void>,
): Promise<RunningRouter> {
  const { log } = deps
  const drain = createDrain()
  const handler = createRouter({ ...deps, config, drain })
  const httpsFiles = options.https
  let stopReloading = (): void => {}
  const workerTls = options.workerTls ?? null
  const expiry =
    httpsFiles !== undefined || workerTls?.files !== undefined
      ? watchCertExpiry({ log, registry: deps.metrics.registry })
      : null
  if (workerTls !== null) expiry?.set(tlsExpiries(workerTls))
  let server: http.Server | https.Server
  if (httpsFiles === undefined) server = http.createServer(handler)
  else {
    const pair = loadCertPair(httpsFiles)
    const httpsServer = https.createServer({ ...pair, minVersion: 'TLSv1.2' }, handler)
    const setHttpsExpiry = (cert: Buffer) => {
      const httpsExpiry = certExpiryOf(cert, httpsFiles.cert, 'https')
      if (httpsExpiry !== null) expiry?.set([httpsExpiry])
    }
    setHttpsExpiry(pair.cert)
    stopReloading = reloadCertOnChange(
      httpsServer,
      httpsFiles,
      { minVersion: 'TLSv1.2' },
      log,
      (installed) => setHttpsExpiry(installed.cert),
    )
    answerPlainHttpOnHttps(httpsServer, log)
    server = httpsServer
  }
  // Clients and load balancers reuse idle connections for longer than Node's 5 s default (AWS ALB:
  // 60 s; a client whose event loop was busy past its own idle timer): a request sent on a
  // connection the router is closing fails with a reset, never reaching it.
  server.keepAliveTimeout = routerKeepAliveTimeoutMs
  server.headersTimeout = routerKeepAliveTimeoutMs + 1_000
  // Every header counts, not Node's first 2,000: the rest were dropped unseen, a second
  // Authorization header with them (api/routes.ts refuses two). maxHeaderSize still bounds the head.
  server.maxHeadersCount = 0
  answerExpectContinue(server, handler, config.maxBodyBytes)
  // Node's refusals of unreadable requests get the OpenAI error body too (api/client-errors.ts).
  server.on('clientError', (err: NodeJS.ErrnoException, socket) =>
    answerClientError(err, socket, http.maxHeaderSize, log),
  )
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject)
    server.listen(options.port ?? 8000, options.host ?? '127.0.0.1', () => {
      server.off('error', reject)
      resolve()
    })
  })
  const address = server.address() as AddressInfo
  const host = address.family === 'IPv6' ? `[${address.address}]` : address.address
  const url = `${httpsFiles === undefined ? 'http' : 'https'}://${host}:${address.port}`
  log.info(
    {
      url,
      backend: deps.backend.name,
      model: config.model,
      contextWindow: config.contextWindow,
      effectiveCapacityTokens: config.effectiveCapacityTokens,
      guardsEnabled: config.guardsEnabled,
      numTenants: deps.tenants.names.length,
    },
    'router listening',
  )
  const plaintextWarning = clientPlaintextWarning(address.address, httpsFiles !== undefined)
  if (plaintextWarning !== null) log.warn(plaintextWarning)
  const close = async () => {
    stopReloading()
    expiry?.stop()
    await new Promise<void>((resolve) => {
      server.close(() => resolve())
      server.closeAllConnections()
    })
    await closeBackend()
  }
  return {
    url,
    port: address.port,
    config,
    server,
    close,
    async drain() {
      log.info(
        { numRunning: drain.numRunning, drainSeconds: config.drainSeconds },
        'draining: new requests are refused',
      )
      await drain.drain(config.drainSeconds)
      log.info({ numRunning: drain.numRunning }, 'drained; stopping')
      await close()
    },
    async stopNow() {
      await drain.endNow()
      await close()
    },
  }
}

/** Every worker's `/server_info`, retried while workers are still coming up. */
async function waitForWorkers(workers: WorkerClient, waitMs: number): Promise<WorkerReport[]> {
  const deadline = Date.now() + waitMs
  for (;;) {
    try {
      return await workers.serverInfoAll()
    } catch (err) {
      const isRetryable = err instanceof KvfenceError && err.code === 'worker_unavailable'
      if (!isRetryable || Date.now() + workerPollMs > deadline) throw err
      await sleep(workerPollMs)
    }
  }
}

/** Workers must have the roles they were configured with, serve one model, and (when the
 *  router's guards are on) have their guards on. Returns the model name. */
function checkWorkers(
  reports: readonly WorkerReport[],
  workers: WorkerClient,
  guardsEnabled: boolean,
  log: Logger,
): string {
  for (const { url, info } of reports) {
    const role = workers.prefillUrls.includes(url) ? 'prefill' : 'decode'
    if (info.role !== role) {
      throw new KvfenceError(
        'internal_error',
        `worker ${url} is a ${info.role} worker, configured as ${role}`,
      )
    }
    if (role === 'decode' && info.transferPort === undefined) {
      throw new KvfenceError('internal_error', `decode worker ${url} reports no transferPort`)
    }
    if (guardsEnabled && !info.guardsEnabled) {
      throw new KvfenceError(
        'guard_violation',
        `${info.role} worker ${url} runs with guards disabled while the router's are on; fix the worker or disable the router's guards too`,
      )
    }
    if (info.faults.length > 0) {
      log.warn({ worker: url, faults: info.faults }, 'worker runs with injected faults')
    }
  }
  const models = [...new Set(reports.map((r) => r.info.model))]
  if (models.length !== 1) {
    throw new KvfenceError('internal_error', `workers serve different models: ${models.join(', ')}`)
  }
  const pageSizes = [...new Set(reports.map((r) => r.info.pageSize))]
  if (pageSizes.length !== 1) {
    log.warn({ pageSizes }, 'workers report different page sizes')
  }
  return models[0]
}
