/** `kvfence serve`: router + one prefill worker + one decode worker as child processes on this
 *  host, serving a model (the bundled one by default) until interrupted; or, with `--config FILE`
 *  (or `KVFENCE_CONFIG`), the whole cluster a config file describes (see src/config/cluster.ts),
 *  with `--host`, `--port`, `--log-content` and `--log-level` overriding the file. */
import { existsSync } from 'node:fs'
import { createServer } from 'node:net'
import { join } from 'node:path'
import { type Command, Option } from 'commander'
import { pino } from 'pino'
import { loadClusterConfig } from '../config/cluster.js'
import { type Cluster, clusterConfigPlan, launchCluster, startCluster } from '../config/launch.js'
import { buildFaultConfig } from '../engine/faults.js'
import { KvfenceError } from '../common/errors.js'
import { loadModelConfig } from '../model/config.js'
import { exitIfParentGoesDuringStart, reportReadyToParent } from './parent.js'
import { bundledModelDir } from '../common/paths.js'
import { queueLimitDefaults } from '../router/admission/queue-limits.js'
import { loadTenants } from '../router/tenants/tenants.js'
import { checkPlaintextLinks, isLoopbackHost } from '../link/plaintext.js'
import {
  collect,
  intOption,
  positiveIntOption,
  secondsOption,
  threadArgs,
  threadsHelp,
  threadsOption,
  logLevels,
  portOption,
} from './options.js'

interface ServeFlags {
  config?: string
  model: string
  tenants?: string
  host?: string
  port?: number
  logContent?: boolean
  maxConcurrent?: number
  maxQueued?: number
  reservedSlots?: number
  pageSize: number
  prefillPages: number
  decodePages: number
  prefixCachePages?: number
  contextWindow?: number
  clampContext: boolean
  injectFault: string[]
  unsafeDisableGuards: boolean
  logLevel?: string
  threads?: number
  drainSeconds?: number
  allowPlaintext: boolean
}

/** Register `kvfence serve`. */
export function registerServe(program: Command): void {
  program
    .command('serve')
    .description('run router + prefill worker + decode worker on this host')
    .addOption(
      new Option('--config <file>', 'cluster config YAML (router, workers, tenants)').env(
        'KVFENCE_CONFIG',
      ),
    )
    .option('--tenants <file>', 'tenants YAML file (create one with `kvfence keys add NAME`)')
    .option('--model <dir>', 'Hugging Face model directory', bundledModelDir)
    .addOption(
      new Option('--host <host>', 'address to bind (default 127.0.0.1)').env('KVFENCE_HOST'),
    )
    .addOption(
      new Option('--port <port>', 'router port (default 8000)')
        .argParser(portOption)
        .env('KVFENCE_PORT'),
    )
    .option('--log-content', 'log prompts and completions (off by default)')
    .option(
      '--max-concurrent <n>',
      `requests running at once; more wait in the queue (default ${queueLimitDefaults.maxConcurrentRequests}; with --config: overrides router.maxConcurrentRequests)`,
      positiveIntOption,
    )
    .option(
      '--max-queued <n>',
      `requests waiting at most; more get 503 (default ${queueLimitDefaults.maxQueuedRequests}; with --config: overrides router.maxQueuedRequests)`,
      intOption,
    )
    .option(
      '--reserved-slots <n>',
      `of the running slots, this many only for a tenant with none running, 0 = none; at most --max-concurrent − 1 take effect (default ${queueLimitDefaults.reservedSlots}; with --config: overrides router.reservedSlots)`,
      intOption,
    )
    .option('--page-size <n>', 'tokens per KV page', positiveIntOption, 16)
    .option('--prefill-pages <n>', 'pages in the prefill worker’s KV pool', positiveIntOption, 64)
    .option('--decode-pages <n>', 'pages in the decode worker’s KV pool', positiveIntOption, 64)
    .option(
      '--prefix-cache-pages <n>',
      'most of the prefill worker’s KV pages its prefix cache may hold, 0 = off (split between tenants by the tenants file: see docs/operators.md; default: a quarter of --prefill-pages); not with --config',
      intOption,
    )
    .option(
      '--context-window <n>',
      'advertised context window (default: the effective KV capacity)',
      positiveIntOption,
    )
    .option(
      '--clamp-context',
      'clamp an advertised context larger than the KV pools instead of refusing to start',
      false,
    )
    .option(
      '--inject-fault <name>',
      'inject a fault into the prefill worker (needs KVFENCE_ALLOW_FAULTS=1)',
      collect,
      [],
    )
    .option('--unsafe-disable-guards', 'turn every guard off (needs KVFENCE_ALLOW_FAULTS=1)', false)
    .option('--threads <n>', `${threadsHelp}; not with --config`, threadsOption)
    .option(
      '--drain-seconds <n>',
      'on SIGTERM, how long running requests may finish before they are ended (default 30; with --config: overrides router.drainSeconds)',
      secondsOption,
    )
    .option(
      '--allow-plaintext',
      'with --host beyond loopback, run the control and data planes in plaintext anyway (refused otherwise; with --config: like allowPlaintext: true)',
      false,
    )
    .addOption(
      new Option('--log-level <level>', 'log level of the parts (default info)')
        .choices(logLevels)
        .env('KVFENCE_LOG_LEVEL'),
    )
    .action(runServe)
}

/** `kvfence serve`: the cluster of `--config`, or one from the flags (`--tenants`) after what
 *  its parts would refuse is refused here, in one line; then supervised until stopped. */
async function runServe(flags: ServeFlags, command: Command): Promise<void> {
  exitIfParentGoesDuringStart()
  if (flags.config !== undefined) {
    refuseFlagsNotUsedWithConfig(command)
    return serveConfig(flags.config, flags)
  }
  if (flags.tenants === undefined) {
    throw new KvfenceError('config_invalid', 'give --config FILE or --tenants FILE')
  }
  // What the parts would refuse, refused before any of them starts (one line, no part's logs).
  loadTenants(flags.tenants)
  if (flags.prefixCachePages !== undefined && flags.prefixCachePages > flags.prefillPages) {
    throw new KvfenceError(
      'config_invalid',
      `--prefix-cache-pages ${flags.prefixCachePages} exceeds --prefill-pages ${flags.prefillPages}`,
    )
  }
  buildFaultConfig(flags.injectFault, flags.unsafeDisableGuards, process.env)
  const host = flags.host ?? '127.0.0.1'
  const plaintextArgs = servePlaintext(host, flags.allowPlaintext)
  checkModelDir(flags.model)
  await checkPortFree(flags.host ?? '127.0.0.1', flags.port ?? 8000)
  if (plaintextArgs.length === 0)
    process.stderr.write('kvfence: control and data planes are plaintext on loopback\n')
  const cluster = await startCluster({
    modelDir: flags.model,
    tenantsFile: flags.tenants,
    host,
    routerPort: flags.port ?? 8000,
    drainSeconds: flags.drainSeconds,
    pageSize: flags.pageSize,
    prefillPages: flags.prefillPages,
    decodePages: flags.decodePages,
    prefixCachePages: flags.prefixCachePages,
    contextWindow: flags.contextWindow,
    clampContext: flags.clampContext,
    prefillFaults: flags.injectFault,
    disableGuards: flags.unsafeDisableGuards,
    logLevel: flags.logLevel ?? 'info',
    ...withArgs(threadArgs(flags.threads), plaintextArgs, [
      ...(flags.logContent ? ['--log-content'] : []),
      ...queueArgs(flags),
    ]),
  })
  superviseCluster(cluster)
}

/** Says where `cluster` serves and supervises it: the first stop signal drains the router then
 *  stops it all, a second stops at once; a part that exits on its own stops the rest (exit 1). */
function superviseCluster(cluster: Cluster): void {
  process.stderr.write(`kvfence serving on ${cluster.routerUrl}/v1 (Ctrl-C stops)\n`)
  let isStopping = false
  let stopped: Promise<void> | undefined
  // Stopping the cluster drains the router first (running requests finish), bounded: SIGKILL
  // after its drain time and 5 s. A router that never exits (a trial SIGSTOPped it) once held
  // serve for ever, deaf to more signals.
  const stop = () => {
    isStopping = true
    stopped ??= cluster.stop().then(() => {
      // Said: its running requests were cut without the drain's error events.
      if (cluster.processes.router.signalCode === 'SIGKILL')
        process.stderr.write(
          'kvfence: the router did not exit in time (stopped or stuck?): killed, its running requests cut\n',
        )
      process.exit(0)
    })
  }
  // A second signal stops at once: passed on, the router's own second signal ends its running
  // streams with an error event and exits; one that does not within 2 s is killed.
  const drainThenStop = () => {
    if (stopped === undefined) return stop()
    process.stderr.write('kvfence: second stop signal: stopping now, not waiting for the drain\n')
    const { router } = cluster.processes
    router.kill('SIGTERM')
    setTimeout(() => router.kill('SIGKILL'), secondSignalGraceMs).unref()
  }
  process.on('SIGINT', drainThenStop)
  process.on('SIGTERM', drainThenStop)
  reportReadyToParent(
    { type: 'ready', role: 'router', port: Number(new URL(cluster.routerUrl).port) },
    stop,
  )
  for (const child of Object.values(cluster.processes)) {
    child.once('exit', (code, signal) => {
      if (isStopping) return
      isStopping = true
      process.stderr.write(`kvfence: a part of the cluster ${howEnded(code, signal)}; stopping\n`)
      void cluster.stop().then(() => process.exit(1))
    })
  }
}

/** How long a router given the second stop signal may take to end its streams and exit before
 *  SIGKILL (ms). */
const secondSignalGraceMs = 2000

/** The flags of `serve --tenants` that `serve --config` has no use for, each with where the
 *  cluster file says the same (or why it cannot). Given with --config they were once ignored
 *  without a word (a fresh-user trial's `--context-window 100` and `--tenants` served the file's
 *  window and tenants). */
const flagsNotUsedWithConfig: readonly (readonly [keyof ServeFlags, string, string])[] = [
  ['tenants', '--tenants', "the file's tenants: list is served"],
  ['model', '--model', 'set model: in the file'],
  ['pageSize', '--page-size', 'set workers.pageSize'],
  ['prefillPages', '--prefill-pages', 'set pages in workers.prefill'],
  ['decodePages', '--decode-pages', 'set pages in workers.decode'],
  ['prefixCachePages', '--prefix-cache-pages', 'set prefixCachePages in workers.prefill'],
  ['contextWindow', '--context-window', 'set router.contextWindow'],
  ['clampContext', '--clamp-context', 'set router.clampContext'],
  ['injectFault', '--inject-fault', 'faults are injected only without --config'],
  ['unsafeDisableGuards', '--unsafe-disable-guards', 'guards are off only without --config'],
  ['threads', '--threads', 'workers started from a file use the default'],
]

/** With `--config`, a flag the file's cluster would not use is refused (one line naming it and
 *  where the file sets it), never ignored. Reads where commander took each value from, so a
 *  default is not taken for a flag given. @throws KvfenceError `config_invalid`. */
function refuseFlagsNotUsedWithConfig(command: Command): void {
  for (const [key, flag, instead] of flagsNotUsedWithConfig) {
    const source = command.getOptionValueSource(key)
    if (source === 'cli' || source === 'env')
      throw new KvfenceError('config_invalid', `${flag} is not used with --config (${instead})`)
  }
}

/** `serve --config FILE`: the cluster of a config file, flags overriding its router fields. */
async function serveConfig(path: string, flags: ServeFlags): Promise<void> {
  const file = loadClusterConfig(path)
  const config = {
    ...file,
    router: {
      ...file.router,
      ...(flags.host === undefined ? {} : { host: flags.host }),
      ...(flags.port === undefined ? {} : { port: flags.port }),
      ...(flags.logContent ? { logContent: true } : {}),
      ...(flags.logLevel === undefined
        ? {}
        : { logLevel: flags.logLevel as typeof file.router.logLevel }),
      ...(flags.drainSeconds === undefined ? {} : { drainSeconds: flags.drainSeconds }),
      ...(flags.maxConcurrent === undefined ? {} : { maxConcurrentRequests: flags.maxConcurrent }),
      ...(flags.maxQueued === undefined ? {} : { maxQueuedRequests: flags.maxQueued }),
      ...(flags.reservedSlots === undefined ? {} : { reservedSlots: flags.reservedSlots }),
    },
    ...(flags.allowPlaintext ? { allowPlaintext: true } : {}),
  }
  const log = pino(
    { name: 'kvfence-router', level: config.router.logLevel },
    pino.destination({ dest: 2, sync: true }),
  )
  const cluster = await launchCluster(clusterConfigPlan(config, log, process.env, path))
  process.stderr.write(`kvfence serving on ${cluster.routerUrl}/v1 (Ctrl-C stops)\n`)
  let isStopping = false
  const stop = async (code: number) => {
    if (isStopping) return
    isStopping = true
    await cluster.stop()
    process.exit(code)
  }
  // The router drains first (running requests finish); a second signal stops at once.
  let isDraining = false
  const drainThenStop = () => {
    if (isDraining) {
      process.stderr.write('kvfence: second stop signal: stopping now, not waiting for the drain\n')
      return void stop(0)
    }
    isDraining = true
    void (cluster.router?.drain() ?? Promise.resolve()).then(() => stop(0))
  }
  process.on('SIGINT', drainThenStop)
  process.on('SIGTERM', drainThenStop)
  reportReadyToParent(
    { type: 'ready', role: 'router', port: Number(new URL(cluster.routerUrl).port) },
    () => void stop(0),
  )
  for (const child of cluster.children) {
    child.once('exit', (code, signal) => {
      if (isStopping) return
      process.stderr.write(`kvfence: a worker ${howEnded(code, signal)}; stopping\n`)
      void stop(1)
    })
  }
}

/** `serve` without --config has no TLS: beyond loopback it is refused (one line) unless
 *  `--allow-plaintext`, which every part is then given (and which warns). Returns the parts' extra
 *  flags. @throws KvfenceError `config_invalid`. */
function servePlaintext(host: string, allowPlaintext: boolean): string[] {
  const log = { warn: (msg: string) => process.stderr.write(`kvfence: warning: ${msg}\n`) }
  checkPlaintextLinks({
    part: 'kvfence serve',
    links: [{ what: 'binds its router and workers to', host }],
    allowPlaintext,
    tlsHint: 'kvfence serve --config with tls: { dir }',
    log,
  })
  return isLoopbackHost(host) ? [] : ['--allow-plaintext']
}

/** The router's `--max-concurrent` / `--max-queued` / `--reserved-slots`, passed on when given
 *  (else its defaults). */
function queueArgs(flags: ServeFlags): string[] {
  return [
    ...(flags.maxConcurrent === undefined ? [] : ['--max-concurrent', String(flags.maxConcurrent)]),
    ...(flags.maxQueued === undefined ? [] : ['--max-queued', String(flags.maxQueued)]),
    ...(flags.reservedSlots === undefined ? [] : ['--reserved-slots', String(flags.reservedSlots)]),
  ]
}

/** The workers' flags (`threads`) with `plaintext` added to every part, and `router` to the
 *  router. */
function withArgs(
  threads: { prefillArgs?: string[]; decodeArgs?: string[] },
  plaintext: readonly string[],
  router: readonly string[],
): { prefillArgs: string[]; decodeArgs: string[]; routerArgs: string[] } {
  return {
    prefillArgs: [...(threads.prefillArgs ?? []), ...plaintext],
    decodeArgs: [...(threads.decodeArgs ?? []), ...plaintext],
    routerArgs: [...router, ...plaintext],
  }
}

/** The model folder's config.json parses and its weights file is there: what a worker would
 *  otherwise find only after the others started. Throws `config_invalid` (one line). */
function checkModelDir(dir: string): void {
  try {
    loadModelConfig(dir)
  } catch (err) {
    throw new KvfenceError('config_invalid', (err as Error).message)
  }
  if (!existsSync(join(dir, 'model.safetensors')))
    throw new KvfenceError('config_invalid', `no model.safetensors in model directory ${dir}`)
}

/** Resolves when `host:port` can be listened on now (it is closed again at once); throws
 *  `config_invalid` naming the address otherwise. A port taken between this check and the
 *  router's start still fails, with the router's own line. */
async function checkPortFree(host: string, port: number): Promise<void> {
  const server = createServer()
  try {
    await new Promise<void>((resolve, reject) => {
      server.once('error', reject)
      server.listen(port, host, resolve)
    })
  } catch (err) {
    const code = (err as NodeJS.ErrnoException).code
    throw new KvfenceError(
      'config_invalid',
      code === 'EADDRINUSE'
        ? `${host}:${port} is already in use: give another --port`
        : `cannot listen on ${host}:${port}: ${(err as Error).message}`,
    )
  } finally {
    await new Promise((resolve) => server.close(resolve))
  }
}

/** `exited with code 3` or `was killed by SIGKILL`. */
function howEnded(code: number | null, signal: NodeJS.Signals | null): string {
  return signal !== null ? `was killed by ${signal}` : `exited with code ${code}`
}
