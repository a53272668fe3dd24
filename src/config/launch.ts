/** Starts what a cluster config describes: the workers it lists with `pages` as child processes
 *  (forked `kvfence prefill|decode`), and the router in this process in front of them, of the
 *  running workers it lists by `url`, or of the engine in `backend` (gateway mode).
 *  Knows process management and how config fields map to the parts' options; knows nothing of
 *  requests. */
import { fork, type ChildProcess } from 'node:child_process'
import type { Logger } from 'pino'
import { KvfenceError } from '../errors.js'
import { bundledModelDir, cliEntry } from '../paths.js'
import { type RunningRouter, startRouter } from '../router/start.js'
import type { ClusterConfig } from './cluster.js'

/** A running cluster started from a config. */
export interface LaunchedCluster {
  readonly router: RunningRouter
  /** Worker processes started here. */
  readonly children: readonly ChildProcess[]
  /** Stops the router, then the workers started here. */
  stop(): Promise<void>
}

const startTimeoutMs = 30_000

/** Starts the cluster of `config`; on failure stops what it started and rethrows. */
export async function launchCluster(
  config: ClusterConfig,
  log: Logger,
  env: NodeJS.ProcessEnv = process.env,
): Promise<LaunchedCluster> {
  const children: ChildProcess[] = []
  const modelDir = config.model ?? bundledModelDir
  const r = config.router
  try {
    const common = {
      tenants: config.tenants,
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
      log,
    }
    let router: RunningRouter
    if (config.backend !== undefined) {
      const b = config.backend
      const apiKey = b.apiKeyEnv === undefined ? undefined : env[b.apiKeyEnv]
      if (b.apiKeyEnv !== undefined && !apiKey) {
        throw new KvfenceError('config_invalid', `backend.apiKeyEnv: ${b.apiKeyEnv} is not set`)
      }
      router = await startRouter({
        ...common,
        gateway: {
          kind: b.kind,
          url: b.url,
          backendModel: b.model,
          tokenizerDir: b.tokenizerDir,
          discoveryIntervalMs: b.discoveryIntervalMs,
          apiKey,
        },
      })
    } else {
      const workers = config.workers!
      const start = (role: 'prefill' | 'decode', entry: { pages: number } | { url: string }) =>
        'url' in entry
          ? Promise.resolve(entry.url)
          : startWorker(
              role,
              modelDir,
              entry.pages,
              workers.pageSize,
              r.host,
              r.logLevel,
              env,
              children,
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

/** Forks one worker and resolves with its control URL once it reports ready. */
function startWorker(
  role: 'prefill' | 'decode',
  modelDir: string,
  pages: number,
  pageSize: number,
  host: string,
  logLevel: string,
  env: NodeJS.ProcessEnv,
  children: ChildProcess[],
): Promise<string> {
  const args = [
    role,
    '--model',
    modelDir,
    '--pages',
    String(pages),
    '--page-size',
    String(pageSize),
  ]
  args.push('--host', host, '--port', '0', '--log-level', logLevel)
  if (role === 'decode') args.push('--transfer-host', host, '--transfer-port', '0')
  const child = fork(cliEntry, args, { env, stdio: ['ignore', 'inherit', 'inherit', 'ipc'] })
  children.push(child)
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => {
      reject(
        new KvfenceError(
          'worker_unavailable',
          `${role} worker did not start in ${startTimeoutMs} ms`,
        ),
      )
    }, startTimeoutMs)
    child.once('exit', (code) => {
      clearTimeout(timer)
      reject(
        new KvfenceError(
          'worker_unavailable',
          `${role} worker exited with code ${code} while starting`,
        ),
      )
    })
    child.on('message', (msg: { type?: string; port?: number }) => {
      if (msg?.type !== 'ready' || msg.port === undefined) return
      clearTimeout(timer)
      child.removeAllListeners('exit')
      resolve(`http://${host.includes(':') ? `[${host}]` : host}:${msg.port}`)
    })
  })
}

/** SIGTERM, then SIGKILL after 3 s; resolves when every child has exited. */
async function stopAll(children: readonly ChildProcess[]): Promise<void> {
  await Promise.all(
    children.map(
      (child) =>
        new Promise<void>((resolve) => {
          if (child.exitCode !== null || child.signalCode !== null) return resolve()
          const timer = setTimeout(() => child.kill('SIGKILL'), 3_000)
          child.once('exit', () => {
            clearTimeout(timer)
            resolve()
          })
          child.kill('SIGTERM')
        }),
    ),
  )
}
