/** Start a cluster on this host: one prefill worker, one decode worker and the router, each its own
 *  OS process (forked `kvfence prefill|decode|router`), and stop it again. Used by `kvfence serve`,
 *  `kvfence demo` and the end-to-end tests.
 *  Knows the parts' flags (forking and stopping them is processes.ts); knows nothing of requests. */
import { clusterTokenEnv, newClusterToken } from './cluster-token.js'
import type { ChildProcess } from 'node:child_process'
import { join } from 'node:path'
import { forkPart, type ReadyMessage, stopAll } from './processes.js'

/** Options of {@link startCluster}. */
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
  host?: string
  /** Folder for the parts' logs (stderr); default: inherit this process's stderr. */
  logDir?: string
  logLevel?: string
  env?: NodeJS.ProcessEnv
}

/** A running cluster. */
export interface Cluster {
  routerUrl: string
  prefillUrl: string
  decodeUrl: string
  /** The child processes, by part. */
  processes: { prefill: ChildProcess; decode: ChildProcess; router: ChildProcess }
  /** Stop every part (SIGTERM, then SIGKILL after 3 s) and wait for them to exit. */
  stop(): Promise<void>
}

/** How long a part may take to start (ms). */
const startTimeoutMs = 30_000

/** Fork one part and resolve with its ready message. Rejects (with the part's last log lines) if
 *  it exits or does not report ready within {@link startTimeoutMs}. */
function startPart(
  name: string,
  args: string[],
  opts: ClusterOptions,
  started: ChildProcess[],
): Promise<{ child: ChildProcess; ready: ReadyMessage }> {
  return forkPart(
    [name, ...args, '--log-level', opts.logLevel ?? 'info'],
    {
      env: { ...(opts.env ?? process.env) },
      logFile: opts.logDir === undefined ? undefined : join(opts.logDir, `${name}.log`),
      timeoutMs: startTimeoutMs,
      failure(why, last) {
        const reason =
          why.kind === 'timeout'
            ? `did not start within ${startTimeoutMs} ms`
            : `exited with code ${why.code}`
        return new Error(`kvfence ${name} ${reason}${last ? `: ${last}` : ''}`)
      },
    },
    started,
  )
}

/** Start P, D, then the router pointed at them. Throws (after stopping what started) when a part
 *  fails to start, e.g. the router refusing an advertised context larger than the pools (G1). */
export async function startCluster(options: ClusterOptions): Promise<Cluster> {
  // One control-plane token for the parts of this cluster, unless the caller's environment names one.
  const opts = {
    ...options,
    env: { [clusterTokenEnv]: newClusterToken(), ...(options.env ?? process.env) },
  }
  const host = opts.host ?? '127.0.0.1'
  const common = (faults: string[] = []) => [
    '--model',
    opts.modelDir,
    '--page-size',
    String(opts.pageSize),
    '--host',
    host,
    '--port',
    '0',
    ...faults.flatMap((f) => ['--inject-fault', f]),
    ...(opts.disableGuards ? ['--unsafe-disable-guards'] : []),
    ...(opts.disabledGuards ?? []).flatMap((id) => ['--unsafe-disable-guard', id]),
  ]
  const isRouterUnsafe = opts.disableGuards === true || (opts.disabledGuards ?? []).length > 0
  const started: ChildProcess[] = []
  try {
    const [prefill, decode] = await Promise.all([
      startPart(
        'prefill',
        [
          ...common(opts.prefillFaults),
          '--pages',
          String(opts.prefillPages),
          ...(opts.prefixCachePages === undefined
            ? []
            : ['--prefix-cache-pages', String(opts.prefixCachePages)]),
          ...(opts.prefillArgs ?? []),
        ],
        opts,
        started,
      ),
      startPart(
        'decode',
        [
          ...common(opts.decodeFaults),
          '--pages',
          String(opts.decodePages),
          '--transfer-host',
          host,
          '--transfer-port',
          '0',
          ...(opts.decodeArgs ?? []),
        ],
        opts,
        started,
      ),
    ])
    const prefillUrl = `http://${host}:${prefill.ready.port}`
    const decodeUrl = `http://${host}:${decode.ready.port}`
    const router = await startPart(
      'router',
      [
        '--model',
        opts.modelDir,
        '--prefill',
        prefillUrl,
        '--decode',
        decodeUrl,
        '--tenants',
        opts.tenantsFile,
        '--host',
        host,
        '--port',
        String(opts.routerPort ?? 0),
        ...(opts.contextWindow !== undefined
          ? ['--context-window', String(opts.contextWindow)]
          : []),
        ...(opts.clampContext ? ['--clamp-context'] : []),
        ...(isRouterUnsafe ? ['--unsafe-disable-guards'] : []),
        ...(opts.routerArgs ?? []),
      ],
      opts,
      started,
    )
    return {
      routerUrl: `http://${host}:${router.ready.port}`,
      prefillUrl,
      decodeUrl,
      processes: { prefill: prefill.child, decode: decode.child, router: router.child },
      stop: () => stopAll(started),
    }
  } catch (err) {
    await stopAll(started)
    throw err
  }
}
