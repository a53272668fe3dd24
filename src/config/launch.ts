/** The one cluster launcher: forks the workers a plan lists with a KV pool (`kvfence
 *  prefill|decode`), takes the running ones it lists by URL, then starts the router in front of
 *  them, in this process or forked as `kvfence router`; and stops it all again. A plan comes from
 *  a cluster config ({@link clusterConfigPlan}: `kvfence serve --config`) or from the flags of one
 *  prefill and one decode worker ({@link startCluster}: `kvfence serve --tenants`, the demo, the
 *  soak, tests). Knows how plans map to the parts' flags and options (forking and stopping them is
 *  engine/processes.ts); knows nothing of requests. */
import type { ChildProcess } from 'node:child_process'
import { join } from 'node:path'
import type { Logger } from 'pino'
import { clusterTokenEnv, clusterTokenFrom, newClusterToken } from '../control/cluster-token.js'
import { checkPlaintextLinks, hostOfUrl, isLoopbackHost } from '../link/plaintext.js'
import { forkPart, stopAll } from '../engine/processes.js'
import { KvfenceError } from '../common/errors.js'
import { bundledModelDir } from '../common/paths.js'
import { loadTlsMaterial, type TlsFiles, type TlsMaterial } from '../link/tls.js'
import type { GatewayBackendOptions, RunningRouter, StartRouterOptions } from '../router/start.js'
import { type ClusterConfig, loadClusterConfig } from './cluster.js'
import { refuseNativeSaltSecretFile, saltSecretFrom } from '../router/tenants/salt-secret.js'
import {
  workerArgv,
  type WorkerFileEntry,
  type WorkerRole,
  type WorkerValues,
} from '../engine/worker-options.js'
import { routerConfigDefaults } from '../router/config.js'
import { forkTokenizer } from '../router/tokenize/tokenizer-fork.js'

/** A worker of role `R` in a plan: forked here with the options a worker entry of the cluster
 *  file sets (`pages` and, for prefill, its prefix cache: src/engine/worker-options.ts), or
 *  already running at `url`. */
export type WorkerPlan<R extends WorkerRole = WorkerRole> =
  | (WorkerFileEntry<R> & {
      /** Its mutual-TLS files (`--tls-ca/--tls-cert/--tls-key`); its URL is then `https:`.
       *  Default: plaintext. */
      tls?: TlsFiles | null
      /** Without `tls`, bind (and send KV pages to) addresses beyond loopback anyway
       *  (`--allow-plaintext`). */
      allowPlaintext?: boolean
      /** Faults to inject (`--inject-fault`; needs KVFENCE_ALLOW_FAULTS=1 in the plan's env). */
      faults?: readonly string[]
      /** Further flags, e.g. `['--transfer-timeout-ms', '1000']`. */
      args?: readonly string[]
    })
  | { url: string }

/** The router of a plan: started in this process with these {@link startRouter} options (the
 *  launcher adds the workers' URLs, the model, the host and the cluster token), or forked as
 *  `kvfence router` with these flags. */
export type RouterPlan =
  | {
      runs: 'here'
      options: Omit<
        StartRouterOptions,
        'modelDir' | 'prefillUrls' | 'decodeUrls' | 'host' | 'clusterToken'
      >
    }
  | {
      runs: 'forked'
      /** YAML tenants file. */
      tenantsFile: string
      /** Port (0 picks one). */
      port: number
      /** Advertised context window (tokens); default: the effective capacity. */
      contextWindow?: number
      /** Clamp an advertised context larger than the pools instead of refusing to start (G1). */
      clampContext?: boolean
      /** On SIGTERM, how long its running requests may finish (`--drain-seconds`), seconds;
       *  default: the router's (30). Stopping the cluster waits that long (and 5 s more) for the
       *  router before it is killed, and stops the workers only after it. */
      drainSeconds?: number
      /** Further flags, e.g. `['--log-content']`. */
      args?: readonly string[]
    }

/** What {@link launchCluster} starts. */
export interface LaunchPlan {
  modelDir: string
  /** Tokens per page, for every forked worker (unused when none is). */
  pageSize: number
  /** Address every part binds. */
  host: string
  /** Log level of the forked parts. */
  logLevel: string
  /** Folder for the forked parts' logs (`NAME.log`, stdout and stderr); default: they inherit
   *  this process's, and a failure to start names no log line. */
  logDir?: string
  /** The parts' environment (default: this process's). One control-plane token is shared by the
   *  parts: its `KVFENCE_CLUSTER_TOKEN`, or a fresh one. */
  env?: NodeJS.ProcessEnv
  /** Workers; both empty in gateway mode. */
  prefill: readonly WorkerPlan<'prefill'>[]
  decode: readonly WorkerPlan<'decode'>[]
  /** Every guard off in the forked parts (`--unsafe-disable-guards`; needs KVFENCE_ALLOW_FAULTS=1). */
  disableGuards?: boolean
  /** Guards off one by one in the forked workers (`--unsafe-disable-guard ID`); a forked router,
   *  which has no per-guard switch, then runs with its guards off. */
  disabledGuards?: readonly string[]
  router: RouterPlan
}

/** A running cluster. */
export interface LaunchedCluster {
  /** `http://host:port` of the router. */
  readonly routerUrl: string
  readonly prefillUrls: readonly string[]
  readonly decodeUrls: readonly string[]
  /** The router, when it runs in this process. */
  readonly router?: RunningRouter
  /** The processes forked here, by part: one per forked worker (in plan order), and the router
   *  when forked. */
  readonly processes: {
    readonly prefill: readonly ChildProcess[]
    readonly decode: readonly ChildProcess[]
    readonly router?: ChildProcess
  }
  /** Every process forked here. */
  readonly children: readonly ChildProcess[]
  /** Stops the router (a forked one drains first: SIGTERM, SIGKILL after its drain time and 5 s),
   *  then the other processes forked here (SIGTERM, then SIGKILL after 3 s), and waits for them
   *  to exit. */
  stop(): Promise<void>
}

/** How long a part may take to start (ms). */
const startTimeoutMs = 30_000

/** How long stopping a cluster waits for a forked router (it drains on SIGTERM) before SIGKILL,
 *  ms: its drain time and 5 s to close. */
function routerStopGraceMs(r: RouterPlan): number {
  const drainSeconds = r.runs === 'forked' ? r.drainSeconds : undefined
  return ((drainSeconds ?? routerConfigDefaults.drainSeconds) + 5) * 1000
}

/** `http://host:port`, with an IPv6 host in brackets. */
function urlOf(host: string, port: number, isTls = false): string {
  return `${isTls ? 'https' : 'http'}://${host.includes(':') ? `[${host}]` : host}:${port}`
}

/** Starts the cluster of `plan`: P and D workers at once, then the router pointed at them.
 *  Throws (after stopping what started) when a part fails to start, e.g. the router refusing an
 *  advertised context larger than the pools (G1), with the part's last log line when `logDir` is
 *  set; a forked part's failure is `worker_unavailable`. */
export async function launchCluster(plan: LaunchPlan): Promise<LaunchedCluster> {
  const clusterToken = clusterTokenFrom(plan.env ?? process.env) ?? newClusterToken()
  const env = { ...(plan.env ?? process.env), [clusterTokenEnv]: clusterToken }
  const children: ChildProcess[] = []
  const fork = async (name: string, args: readonly string[], tls: TlsFiles | null) => {
    const { child, ready } = await forkPart(
      [name, ...args, '--log-level', plan.logLevel],
      {
        env,
        logFile: plan.logDir === undefined ? undefined : join(plan.logDir, `${name}.log`),
        timeoutMs: startTimeoutMs,
        failure(why, last) {
          const reason =
            why.kind === 'timeout'
              ? `did not start within ${startTimeoutMs} ms`
              : `exited with code ${why.code} while starting`
          return new KvfenceError(
            'worker_unavailable',
            `kvfence ${name} ${reason}${last ? `: ${last}` : ''}`,
          )
        },
      },
      children,
    )
    return { child, url: urlOf(plan.host, ready.port, tls !== null) }
  }
  const startWorker = async (role: WorkerRole, worker: WorkerPlan) => {
    if ('url' in worker) return { url: worker.url, child: undefined }
    return fork(role, workerArgs(plan, role, worker), worker.tls ?? null)
  }
  let router: RunningRouter | undefined
  try {
    const [prefill, decode] = await Promise.all([
      Promise.all(plan.prefill.map((w) => startWorker('prefill', w))),
      Promise.all(plan.decode.map((w) => startWorker('decode', w))),
    ])
    const prefillUrls = prefill.map((w) => w.url)
    const decodeUrls = decode.map((w) => w.url)
    const forkedWorkers = (ws: typeof prefill) =>
      ws.flatMap((w) => (w.child === undefined ? [] : [w.child]))
    let routerUrl: string
    let routerProcess: ChildProcess | undefined
    const r = plan.router
    if (r.runs === 'here') {
      // Loaded only here: the router's modules cost a process ~0.4 s of CPU to load, and a
      // launcher that forks its router (`serve --tenants`, the demo, tests) never runs them.
      const { startRouter } = await import('../router/start.js')
      const workers = r.options.gateway
        ? {}
        : { modelDir: plan.modelDir, prefillUrls, decodeUrls, startTokenizer: forkTokenizer }
      router = await startRouter({ ...r.options, ...workers, host: plan.host, clusterToken })
      routerUrl = router.url
    } else {
      const isRouterUnsafe = plan.disableGuards === true || (plan.disabledGuards ?? []).length > 0
      const started = await fork(
        'router',
        [
          '--model',
          plan.modelDir,
          ...prefillUrls.flatMap((u) => ['--prefill', u]),
          ...decodeUrls.flatMap((u) => ['--decode', u]),
          '--tenants',
          r.tenantsFile,
          '--host',
          plan.host,
          '--port',
          String(r.port),
          ...(r.contextWindow !== undefined ? ['--context-window', String(r.contextWindow)] : []),
          ...(r.clampContext ? ['--clamp-context'] : []),
          ...(r.drainSeconds === undefined ? [] : ['--drain-seconds', String(r.drainSeconds)]),
          ...(isRouterUnsafe ? ['--unsafe-disable-guards'] : []),
          ...(r.args ?? []),
        ],
        null,
      )
      routerUrl = started.url
      routerProcess = started.child
    }
    const running = router
    return {
      routerUrl,
      prefillUrls,
      decodeUrls,
      router: running,
      processes: {
        prefill: forkedWorkers(prefill),
        decode: forkedWorkers(decode),
        router: routerProcess,
      },
      children,
      async stop() {
        await running?.close()
        // The router first, given its drain time: workers stopped beside it would cut the
        // requests it is letting finish.
        if (routerProcess !== undefined) await stopAll([routerProcess], routerStopGraceMs(r))
        await stopAll(children)
      },
    }
  } catch (err) {
    await stopAll(children)
    throw err
  }
}

/** The flags `kvfence prefill|decode` is forked with for `worker` of `plan` (all but
 *  `--log-level`, which every forked part gets): the plan's model, page size and address (ports
 *  0: the worker picks them), its faults, guards and TLS files, the options of its entry, then
 *  its further flags (a later flag wins). */
export function workerArgs(
  plan: LaunchPlan,
  role: WorkerRole,
  worker: Exclude<WorkerPlan, { url: string }>,
): string[] {
  const { tls, faults, args, allowPlaintext, ...entry } = worker
  const values: WorkerValues = {
    ...entry,
    model: plan.modelDir,
    pageSize: plan.pageSize,
    host: plan.host,
    port: 0,
    transferHost: plan.host,
    transferPort: 0,
    injectFault: [...(faults ?? [])],
    unsafeDisableGuards: plan.disableGuards,
    unsafeDisableGuard: [...(plan.disabledGuards ?? [])],
    ...(tls ? { tlsCa: tls.ca, tlsCert: tls.cert, tlsKey: tls.key } : {}),
    allowPlaintext,
  }
  return [...workerArgv(role, values), ...(args ?? [])]
}

/** The plan of a cluster config: its workers (forked with `pages`, or running at `url`) and the
 *  router in this process, in front of them or of the engine in `backend` (gateway mode). With
 *  `configPath` (the file `config` was read from), the router re-reads that file's `tenants`
 *  whenever it changes, so key changes need no restart. Throws `config_invalid` when the
 *  variable `backend.apiKeyEnv` names is not set in `env`. */
export function clusterConfigPlan(
  config: ClusterConfig,
  log: Logger,
  env: NodeJS.ProcessEnv = process.env,
  configPath?: string,
): LaunchPlan {
  const r = config.router
  const options = {
    ...(configPath === undefined
      ? { tenants: config.tenants }
      : { tenants: configPath, tenantsReader: (f: string) => loadClusterConfig(f).tenants }),
    ...routerSectionOptions(r),
    workerTls: routerTlsMaterial(config),
    ...(config.allowPlaintext ? { allowPlaintext: true } : {}),
    log,
  }
  const plan = {
    modelDir: config.model ?? bundledModelDir,
    host: r.host,
    logLevel: r.logLevel,
    env,
  }
  const b = config.backend
  if (b !== undefined) {
    const apiKey = b.apiKeyEnv === undefined ? undefined : env[b.apiKeyEnv]
    if (b.apiKeyEnv !== undefined && !apiKey) {
      throw new KvfenceError('config_invalid', `backend.apiKeyEnv: ${b.apiKeyEnv} is not set`)
    }
    return {
      ...plan,
      pageSize: 0,
      prefill: [],
      decode: [],
      router: {
        runs: 'here',
        options: {
          ...options,
          gateway: {
            ...gatewayOptions(b, apiKey),
            saltSecret: saltSecretFrom(env, r.saltSecretFile),
          },
        },
      },
    }
  }
  refuseNativeSaltSecretFile('router.saltSecretFile', r.saltSecretFile)
  const workers = config.workers!
  const allowPlaintext = config.tls === undefined && config.allowPlaintext === true
  if (config.tls === undefined) checkConfigPlaintext(config, log)
  const withTls =
    <R extends WorkerRole>(role: R) =>
    (w: WorkerPlan<R>): WorkerPlan<R> =>
      'url' in w
        ? w
        : { ...w, tls: tlsFilesOf(config, role), ...(allowPlaintext ? { allowPlaintext } : {}) }
  return {
    ...plan,
    pageSize: workers.pageSize,
    prefill: workers.prefill.map(withTls('prefill')),
    decode: workers.decode.map(withTls('decode')),
    router: { runs: 'here', options },
  }
}

/** A native cluster config without `tls:`: plaintext on loopback is said (info); beyond loopback
 *  (the parts' bind address, a worker's URL) it is refused in one line before anything starts,
 *  or warned about with `allowPlaintext: true` (src/link/plaintext.ts). */
function checkConfigPlaintext(config: ClusterConfig, log: Logger): void {
  const w = config.workers!
  const entries = [...w.prefill, ...w.decode]
  const links = [
    ...(entries.some((e) => !('url' in e))
      ? [{ what: 'binds its workers to', host: config.router.host }]
      : []),
    ...entries.flatMap((e) =>
      'url' in e ? [{ what: 'dials worker', host: hostOfUrl(e.url) }] : [],
    ),
  ]
  if (links.every((l) => isLoopbackHost(l.host)))
    log.info('control and data planes are plaintext on loopback; use tls: for other hosts')
  checkPlaintextLinks({
    part: 'the cluster',
    links,
    allowPlaintext: config.allowPlaintext === true,
    tlsHint: 'tls: { dir } in the cluster file',
    log,
  })
}

/** Options of {@link startCluster}: one prefill and one decode worker, and the router forked. */
export interface ClusterOptions {
  modelDir: string
  /** Tokens per page, for both pools. */
  pageSize: number
  prefillPages: number
  decodePages: number
  /** Most pool pages the prefill worker's prefix cache may hold (`--prefix-cache-pages`; 0 turns
   *  the cache off, see docs/threat-model.md); default: the worker's (a quarter of its pages). */
  prefixCachePages?: number
  /** Advertised context window (tokens); default: the effective capacity. */
  contextWindow?: number
  /** Clamp an advertised context larger than the pools instead of refusing to start (G1). */
  clampContext?: boolean
  /** Faults per part (needs KVFENCE_ALLOW_FAULTS=1 in `env`). */
  prefillFaults?: string[]
  decodeFaults?: string[]
  disableGuards?: boolean
  /** Guards to turn off one by one in both workers (`--unsafe-disable-guard ID`; needs
   *  KVFENCE_ALLOW_FAULTS=1). The router has no per-guard switch: it then runs with its guards off. */
  disabledGuards?: string[]
  /** Extra flags for the prefill / decode worker (e.g. `['--transfer-timeout-ms', '1000']`). */
  prefillArgs?: string[]
  decodeArgs?: string[]
  /** Extra flags for the router (e.g. `['--log-content']`). */
  routerArgs?: string[]
  /** YAML tenants file for the router. */
  tenantsFile: string
  /** Router port (0 picks one). */
  routerPort?: number
  /** The router's drain time on SIGTERM, seconds (`--drain-seconds`; default 30). */
  drainSeconds?: number
  /** Address every part binds (default 127.0.0.1). */
  host?: string
  /** Folder for the parts' logs (stdout and stderr); default: inherit this process's. */
  logDir?: string
  /** Log level of the parts (default info). */
  logLevel?: string
  env?: NodeJS.ProcessEnv
}

/** A running cluster of {@link startCluster}: one prefill worker, one decode worker and the
 *  router, each its own process. */
export interface Cluster {
  readonly routerUrl: string
  readonly prefillUrl: string
  readonly decodeUrl: string
  /** The child processes, by part. */
  readonly processes: { prefill: ChildProcess; decode: ChildProcess; router: ChildProcess }
  /** Stops the router (it drains first), then the workers, and waits for them to exit (as
   *  {@link LaunchedCluster.stop}). */
  stop(): Promise<void>
}

/** Launches one prefill worker, one decode worker and the router, each forked, as `options`
 *  say; throws as {@link launchCluster} does. */
export async function startCluster(options: ClusterOptions): Promise<Cluster> {
  const cluster = await launchCluster({
    modelDir: options.modelDir,
    pageSize: options.pageSize,
    host: options.host ?? '127.0.0.1',
    logLevel: options.logLevel ?? 'info',
    logDir: options.logDir,
    env: options.env,
    prefill: [
      {
        pages: options.prefillPages,
        prefixCachePages: options.prefixCachePages,
        faults: options.prefillFaults,
        args: options.prefillArgs,
      },
    ],
    decode: [
      { pages: options.decodePages, faults: options.decodeFaults, args: options.decodeArgs },
    ],
    disableGuards: options.disableGuards,
    disabledGuards: options.disabledGuards,
    router: {
      runs: 'forked',
      tenantsFile: options.tenantsFile,
      port: options.routerPort ?? 0,
      contextWindow: options.contextWindow,
      clampContext: options.clampContext,
      drainSeconds: options.drainSeconds,
      args: options.routerArgs,
    },
  })
  const { prefill, decode, router } = cluster.processes
  return {
    routerUrl: cluster.routerUrl,
    prefillUrl: cluster.prefillUrls[0],
    decodeUrl: cluster.decodeUrls[0],
    // A forked router and one forked worker of each role: the plan above.
    processes: { prefill: prefill[0], decode: decode[0], router: router! },
    stop: () => cluster.stop(),
  }
}

/** The TLS files of `part` in the config's `tls.dir` (as `kvfence certs init` names them), or null
 *  without a `tls:` section. Shared with `kvfence router --config`. */
export function tlsFilesOf(
  config: ClusterConfig,
  part: 'prefill' | 'decode' | 'router',
): TlsFiles | null {
  if (config.tls === undefined) return null
  const { dir } = config.tls
  return {
    ca: join(dir, 'ca.crt'),
    cert: join(dir, `${part}.crt`),
    key: join(dir, `${part}.key`),
  }
}

/** The router's TLS files of the config, read, or null without a `tls:` section. */
export function routerTlsMaterial(config: ClusterConfig): TlsMaterial | null {
  const files = tlsFilesOf(config, 'router')
  return files === null ? null : loadTlsMaterial(files)
}

/** The router section of a cluster config as {@link startRouter} options: bind address, served
 *  name, context window, body limit, content logging, queue limits and the clients' HTTPS pair
 *  (`router.tls`). Shared with
 *  `kvfence router --config`. */
export function routerSectionOptions(
  r: ClusterConfig['router'],
): Pick<
  StartRouterOptions,
  | 'host'
  | 'port'
  | 'modelName'
  | 'contextWindow'
  | 'clampContext'
  | 'maxBodyBytes'
  | 'logContent'
  | 'queue'
  | 'redisLimits'
  | 'sentinel'
  | 'drainSeconds'
  | 'https'
> {
  return {
    ...(r.tls === undefined ? {} : { https: { cert: r.tls.cert, key: r.tls.key } }),
    ...(r.drainSeconds === undefined ? {} : { drainSeconds: r.drainSeconds }),
    host: r.host,
    port: r.port,
    modelName: r.modelName,
    contextWindow: r.contextWindow,
    clampContext: r.clampContext,
    maxBodyBytes: r.maxBodyBytes,
    logContent: r.logContent,
    sentinel: r.sentinel,
    queue: {
      maxConcurrentRequests: r.maxConcurrentRequests,
      maxQueuedRequests: r.maxQueuedRequests,
      reservedSlots: r.reservedSlots,
      maxQueueWaitMs: r.maxQueueWaitMs,
    },
    ...(r.limits?.store === 'redis'
      ? {
          redisLimits: {
            url: r.limits.url!,
            keyPrefix: r.limits.keyPrefix,
            onUnavailable: r.limits.onUnavailable,
            leaseMs: r.limits.leaseSeconds * 1000,
          },
        }
      : {}),
  }
}

/** The backend section of a cluster config as gateway options of {@link startRouter}. `apiKey`
 *  is the value of the variable `b.apiKeyEnv` names (the caller reads it and decides whether a
 *  missing one is an error). Shared with `kvfence router --config`. */
export function gatewayOptions(
  b: NonNullable<ClusterConfig['backend']>,
  apiKey: string | undefined,
): GatewayBackendOptions {
  return {
    kind: b.kind,
    url: b.url,
    backendModel: b.model,
    tokenizerDir: b.tokenizerDir,
    discoveryIntervalMs: b.discoveryIntervalMs,
    ...(b.kvPoolTokens === undefined ? {} : { kvPoolTokens: b.kvPoolTokens }),
    ...(b.allowUnsalted === undefined ? {} : { allowUnsalted: b.allowUnsalted }),
    selfCheckIntervalMs: b.selfCheckIntervalMs,
    apiKey,
  }
}
