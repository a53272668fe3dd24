/** Starts what a cluster config describes: the workers it lists with `pages` as child processes
 *  (forked `kvfence prefill|decode`), and the router in this process in front of them, of the
 *  running workers it lists by `url`, or of the engine in `backend` (gateway mode).
 *  Knows how config fields map to the parts' options (forking and stopping them is
 *  engine/processes.ts); knows nothing of requests. */
import {
  clusterTokenEnv,
  clusterTokenFrom,
  isLoopbackHost,
  newClusterToken,
} from '../engine/cluster-token.js'
import type { ChildProcess } from 'node:child_process'
import { join } from 'node:path'
import type { Logger } from 'pino'
import { forkPart, stopAll } from '../engine/processes.js'
import { KvfenceError } from '../errors.js'
import { bundledModelDir } from '../paths.js'
import { loadTlsMaterial, type TlsFiles, type TlsMaterial } from '../tls.js'
import {
  type GatewayBackendOptions,
  type RunningRouter,
  type StartRouterOptions,
  startRouter,
} from '../router/start.js'
import { type ClusterConfig, loadClusterConfig } from './cluster.js'

/** A running cluster started from a config. */
export interface LaunchedCluster {
  readonly router: RunningRouter
  /** Worker processes started here. */
  readonly children: readonly ChildProcess[]
  /** Stops the router, then the workers started here. */
  stop(): Promise<void>
}

const startTimeoutMs = 30_000

/** Starts the cluster of `config`; on failure stops what it started and rethrows. With
 *  `configPath` (the file `config` was read from), the router re-reads that file's `tenants` list
 *  whenever the file changes, so key changes need no restart. */
export async function launchCluster(
  config: ClusterConfig,
  log: Logger,
  env: NodeJS.ProcessEnv = process.env,
  configPath?: string,
): Promise<LaunchedCluster> {
  // The workers started here and the router share one control-plane token (a fresh one unless the
  // environment names it; workers on other hosts must be given the same in their environment).
  const clusterToken = clusterTokenFrom(env) ?? newClusterToken()
  env = { ...env, [clusterTokenEnv]: clusterToken }
  const children: ChildProcess[] = []
  const modelDir = config.model ?? bundledModelDir
  const r = config.router
  const tlsOf = (part: 'prefill' | 'decode' | 'router') => tlsFilesOf(config, part)
  if (config.workers !== undefined && config.tls === undefined) {
    if (isLoopbackHost(r.host))
      log.info('control and data planes are plaintext on loopback; use tls: for other hosts')
    else
      log.warn(
        `control and data planes are plaintext on ${r.host}: KV pages cross the network unencrypted; use tls: (kvfence certs init)`,
      )
  }
  try {
    const common = {
      ...(configPath === undefined
        ? { tenants: config.tenants }
        : { tenants: configPath, tenantsReader: (f: string) => loadClusterConfig(f).tenants }),
      ...routerSectionOptions(r),
      clusterToken,
      workerTls: routerTlsMaterial(config),
      log,
    }
    let router: RunningRouter
    if (config.backend !== undefined) {
      const b = config.backend
      const apiKey = b.apiKeyEnv === undefined ? undefined : env[b.apiKeyEnv]
      if (b.apiKeyEnv !== undefined && !apiKey) {
        throw new KvfenceError('config_invalid', `backend.apiKeyEnv: ${b.apiKeyEnv} is not set`)
      }
      router = await startRouter({ ...common, gateway: gatewayOptions(b, apiKey) })
    } else {
      const workers = config.workers!
      const start = (
        role: 'prefill' | 'decode',
        entry: { pages: number; prefixCachePages?: number } | { url: string },
      ) =>
        'url' in entry
          ? Promise.resolve(entry.url)
          : startWorker(
              role,
              modelDir,
              entry,
              workers.pageSize,
              r.host,
              r.logLevel,
              env,
              children,
              tlsOf(role),
            )
      const [prefillUrls, decodeUrls] = await Promise.all([
        Promise.all(workers.prefill.map((e) => start('prefill', e))),
        Promise.all(workers.decode.map((e) => start('decode', e))),
      ])
      router = await startRouter({ ...common, modelDir, prefillUrls, decodeUrls })
    }
    return {
      router,
      children,
      async stop() {
        await router.close()
        await stopAll(children)
      },
    }
  } catch (err) {
    await stopAll(children)
    throw err
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
 *  name, context window, body limit, content logging and queue limits. Shared with
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
> {
  return {
    host: r.host,
    port: r.port,
    modelName: r.modelName,
    contextWindow: r.contextWindow,
    clampContext: r.clampContext,
    maxBodyBytes: r.maxBodyBytes,
    logContent: r.logContent,
    queue: {
      maxConcurrentRequests: r.maxConcurrentRequests,
      maxQueuedRequests: r.maxQueuedRequests,
      maxQueueWaitMs: r.maxQueueWaitMs,
    },
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
    apiKey,
  }
}

/** Forks one worker and resolves with its control URL once it reports ready. `pool.pages` is its
 *  KV pool; `pool.prefixCachePages`, if set, its prefix cache budget (prefill only: the schema
 *  allows it on prefill entries alone). */
function startWorker(
  role: 'prefill' | 'decode',
  modelDir: string,
  pool: { pages: number; prefixCachePages?: number },
  pageSize: number,
  host: string,
  logLevel: string,
  env: NodeJS.ProcessEnv,
  children: ChildProcess[],
  tls: TlsFiles | null,
): Promise<string> {
  const args = [
    role,
    '--model',
    modelDir,
    '--pages',
    String(pool.pages),
    '--page-size',
    String(pageSize),
  ]
  if (pool.prefixCachePages !== undefined)
    args.push('--prefix-cache-pages', String(pool.prefixCachePages))
  args.push('--host', host, '--port', '0', '--log-level', logLevel)
  if (role === 'decode') args.push('--transfer-host', host, '--transfer-port', '0')
  if (tls !== null) args.push('--tls-ca', tls.ca, '--tls-cert', tls.cert, '--tls-key', tls.key)
  return forkPart(
    args,
    {
      env,
      timeoutMs: startTimeoutMs,
      failure: (why) =>
        new KvfenceError(
          'worker_unavailable',
          why.kind === 'timeout'
            ? `${role} worker did not start in ${startTimeoutMs} ms`
            : `${role} worker exited with code ${why.code} while starting`,
        ),
    },
    children,
  ).then(
    ({ ready }) =>
      `${tls === null ? 'http' : 'https'}://${host.includes(':') ? `[${host}]` : host}:${ready.port}`,
  )
}
