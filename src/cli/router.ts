/** `kvfence router`: start the OpenAI-compatible router in front of prefill and decode workers
 *  that run elsewhere (or on this host), from flags or from a cluster config file
 *  (`--config FILE`: its router, tenants, and workers given by `url` or its gateway backend).
 *  Tells a parent process that forked it, once listening. */
import { clusterTokenFrom } from '../control/cluster-token.js'
import { Option, type Command } from 'commander'
import { pino } from 'pino'
import { type ClusterConfig, loadClusterConfig } from '../config/cluster.js'
import { loadTlsMaterial, type TlsMaterial } from '../link/tls.js'
import { gatewayOptions, routerSectionOptions, routerTlsMaterial } from '../config/launch.js'
import { buildFaultConfig, faultBanner } from '../engine/faults.js'
import { KvfenceError } from '../common/errors.js'
import { bundledModelDir } from '../common/paths.js'
import { type StartRouterOptions, startRouter } from '../router/index.js'
import { forkTokenizer } from '../router/tokenize/tokenizer-fork.js'
import { redactedUrl, type UnavailablePolicy } from '../router/admission/redis-limits.js'
import { refuseNativeSaltSecretFile, saltSecretFrom } from '../router/tenants/salt-secret.js'
import type { SentinelMode } from '../router/sentinel/sentinel.js'
import {
  collectUrl,
  intOption,
  intRangeOption,
  logLevels,
  portOption,
  positiveIntOption,
  secondsOption,
} from './options.js'
import { exitIfParentGoesDuringStart, onStopSignals, reportReadyToParent } from './parent.js'

interface RouterFlags {
  config?: string
  logContent: boolean
  maxConcurrent?: number
  maxQueued?: number
  reservedSlots?: number
  model: string
  prefill: string[]
  decode: string[]
  tenants?: string
  host: string
  port: number
  contextWindow?: number
  drainSeconds?: number
  sentinel?: SentinelMode
  sentinelWindowSeconds?: number
  clampContext: boolean
  unsafeDisableGuards: boolean
  logLevel: string
  tlsCert?: string
  tlsKey?: string
  saltSecretFile?: string
  limitsRedis?: string
  limitsOnUnavailable?: UnavailablePolicy
  clusterTlsCa?: string
  clusterTlsCert?: string
  clusterTlsKey?: string
  allowPlaintext: boolean
}

/** Register `kvfence router`. */
export function registerRouter(program: Command): void {
  program
    .command('router')
    .description('start the OpenAI-compatible router in front of prefill and decode workers')
    .option('--config <file>', 'cluster config YAML (router, tenants, worker URLs or backend)')
    .option('--prefill <url>', 'a prefill worker’s control URL; repeatable', collectUrl, [])
    .option('--decode <url>', 'a decode worker’s control URL; repeatable', collectUrl, [])
    .option('--tenants <file>', 'tenants YAML file (create one with `kvfence keys add NAME`)')
    .option(
      '--max-concurrent <n>',
      'requests running at once; more wait in the queue',
      positiveIntOption,
    )
    .option('--max-queued <n>', 'requests waiting at most; more get 503', intOption)
    .option(
      '--reserved-slots <n>',
      'of the running slots, this many only for a tenant with none running, 0 = none; at most --max-concurrent − 1 take effect (default 1)',
      intOption,
    )
    .option('--log-content', 'log prompts and completions (off by default)', false)
    .option(
      '--model <dir>',
      'model directory (for its tokenizer and chat template)',
      bundledModelDir,
    )
    .option('--host <host>', 'address to bind', '127.0.0.1')
    .option('--port <port>', 'port (0 picks one)', portOption, 8000)
    .option(
      '--context-window <n>',
      'advertised context window (default: the effective KV capacity)',
      positiveIntOption,
    )
    .option(
      '--drain-seconds <n>',
      'on SIGTERM, how long running requests may finish before they are ended (default 30)',
      secondsOption,
    )
    .addOption(
      new Option(
        '--sentinel <mode>',
        'the response sentinel: off, observe (default) or block',
      ).choices(['off', 'observe', 'block']),
    )
    .option(
      '--sentinel-window-seconds <n>',
      'how long the sentinel remembers a prompt’s fingerprints and a canary (default 600)',
      windowSecondsOption,
    )
    .option(
      '--clamp-context',
      'clamp an advertised context larger than the KV pools instead of refusing to start',
      false,
    )
    .option(
      '--unsafe-disable-guards',
      'turn the router’s guards off (needs KVFENCE_ALLOW_FAULTS=1)',
      false,
    )
    .addOption(
      new Option('--log-level <level>', 'pino log level').choices(logLevels).default('info'),
    )
    .option(
      '--tls-cert <file>',
      'serve clients over HTTPS with this certificate (reloaded on change; with --config: these or its router.tls, not both)',
    )
    .option('--tls-key <file>', 'the private key of --tls-cert')
    .option(
      '--salt-secret-file <file>',
      'secret of the cache salts, shared by replicas (≥ 32 bytes)',
    )
    .option('--limits-redis <url>', 'count tenants’ limits in Redis, shared by replicas')
    .addOption(
      new Option(
        '--limits-on-unavailable <policy>',
        'while Redis is unreachable (default fail-closed)',
      ).choices(['fail-closed', 'local']),
    )
    .option(
      '--cluster-tls-ca <file>',
      'cluster CA certificate: with --cluster-tls-cert/--cluster-tls-key, the router reaches its workers (https: URLs) over mutual TLS 1.3 (kvfence certs init; with --config: these or its tls:, not both)',
    )
    .option('--cluster-tls-cert <file>', 'the router’s certificate, signed by the cluster CA')
    .option('--cluster-tls-key <file>', 'the router’s private key of --cluster-tls-cert')
    .option(
      '--allow-plaintext',
      'without cluster TLS, reach workers beyond loopback anyway (logged as a warning): refused otherwise',
      false,
    )
    .action(runRouter)
}

/** Starts the router `flags` (or the file of `--config`) describe, reports ready to a parent,
 *  drains on the first stop signal and stops on the second. */
async function runRouter(flags: RouterFlags, command: Command): Promise<void> {
  exitIfParentGoesDuringStart()
  if (flags.config !== undefined) refuseFlagsTheFileGives(command)
  const faults = buildFaultConfig([], flags.unsafeDisableGuards, process.env)
  const banner = faultBanner('kvfence router', faults)
  if (banner) process.stderr.write(`${banner}\n`)
  if (flags.limitsOnUnavailable !== undefined && flags.limitsRedis === undefined)
    throw new KvfenceError(
      'config_invalid',
      '--limits-on-unavailable needs --limits-redis (it is the policy while Redis is unreachable)',
    )
  // Sync: an async stream is flushed on exit by a loop that retries EPIPE for ever, so a part whose
  // parent (the reader of its stderr) was killed hung in process.exit, deaf to SIGTERM.
  const log = pino(
    { name: 'kvfence-router', level: routerLogLevel(flags, command) },
    pino.destination({ dest: 2, sync: true }),
  )
  const source = flags.config === undefined ? fromFlags(flags) : fromConfig(flags.config, flags)
  const router = await startRouter({
    host: flags.host,
    port: flags.port,
    contextWindow: flags.contextWindow,
    clampContext: flags.clampContext,
    ...(flags.drainSeconds === undefined ? {} : { drainSeconds: flags.drainSeconds }),
    ...source,
    // With --config, the flags given override the file's router section (as serve --config).
    ...(flags.config === undefined ? {} : routerFlagsOverFile(flags, command, source.queue)),
    ...redisLimitsFlags(flags),
    ...(flags.allowPlaintext ? { allowPlaintext: true } : {}),
    guardsEnabled: faults.guardsEnabled,
    ...(flags.logContent ? { logContent: true } : {}),
    // The flags win over the file's `sentinel.mode` and `windowSeconds`, keeping its other settings.
    ...sentinelFlags(flags, source.sentinel),
    clusterToken: clusterTokenFrom(process.env),
    ...httpsOption(flags),
    startTokenizer: forkTokenizer,
    log,
  })
  // The first SIGTERM (or SIGINT from a shell) drains (running requests finish, up to
  // --drain-seconds); a second one stops at once.
  let isDraining = false
  const shutdown = () => {
    if (isDraining) {
      // Said, since it ends what the drain was still letting finish.
      log.warn('second stop signal: stopping now, not waiting for the drain')
      return void router.stopNow().then(() => process.exit(0))
    }
    isDraining = true
    void router.drain().then(() => process.exit(0))
  }
  onStopSignals(shutdown)
  reportReadyToParent(
    {
      type: 'ready',
      role: 'router',
      port: router.port,
      contextWindow: router.config.contextWindow,
    },
    () => {
      log.warn('the process that started this router is gone; stopping')
      shutdown()
    },
  )
}

/** Whether the user gave flag `key` (on the command line or by its environment variable), not
 *  its default. */
function isGiven(command: Command, key: string): boolean {
  const source = command.getOptionValueSource(key)
  return source === 'cli' || source === 'env'
}

/** `--log-level` when given (or without `--config`), else the file's `router.logLevel` (which
 *  `router --config` once ignored, logging at info whatever the file said). */
function routerLogLevel(flags: RouterFlags, command: Command): string {
  if (flags.config === undefined || isGiven(command, 'logLevel')) return flags.logLevel
  return loadClusterConfig(flags.config).router.logLevel
}

/** With `--config`, the flags that name what the file gives are refused (one line), never
 *  ignored: they once were, without a word. @throws KvfenceError `config_invalid`. */
function refuseFlagsTheFileGives(command: Command): void {
  const fileGives: readonly (readonly [string, string, string])[] = [
    ['prefill', '--prefill', 'give the URLs in workers.prefill'],
    ['decode', '--decode', 'give the URLs in workers.decode'],
    ['tenants', '--tenants', "the file's tenants: list is served"],
    ['model', '--model', 'set model: in the file'],
  ]
  for (const [key, flag, instead] of fileGives)
    if (isGiven(command, key))
      throw new KvfenceError('config_invalid', `${flag} is not used with --config (${instead})`)
}

/** The router flags given beside `--config`, over the file's router section: `--host`,
 *  `--port`, `--context-window`, `--clamp-context`, `--drain-seconds`, `--max-concurrent`,
 *  `--max-queued`, `--reserved-slots` (the file's value stays for a flag not given; a trial's `--port` lost to the
 *  file's default 8000). */
function routerFlagsOverFile(
  flags: RouterFlags,
  command: Command,
  fileQueue: StartRouterOptions['queue'],
): Partial<StartRouterOptions> {
  const given = (key: string) => isGiven(command, key)
  return {
    ...(given('host') ? { host: flags.host } : {}),
    ...(given('port') ? { port: flags.port } : {}),
    ...(given('contextWindow') ? { contextWindow: flags.contextWindow } : {}),
    ...(given('clampContext') ? { clampContext: true } : {}),
    ...(given('drainSeconds') ? { drainSeconds: flags.drainSeconds } : {}),
    queue: {
      ...fileQueue,
      ...(given('maxConcurrent') ? { maxConcurrentRequests: flags.maxConcurrent } : {}),
      ...(given('maxQueued') ? { maxQueuedRequests: flags.maxQueued } : {}),
      ...(given('reservedSlots') ? { reservedSlots: flags.reservedSlots } : {}),
    },
  }
}

/** `--sentinel-window-seconds`: whole seconds, 1 s to a day (fingerprints are kept by clock, and
 *  the memory cap bounds them whatever the window). */
const windowSecondsOption = intRangeOption(1, 86_400)

/** `--sentinel` and `--sentinel-window-seconds` over the file's `sentinel:` (its other settings
 *  kept), or nothing when neither flag is given. */
function sentinelFlags(
  flags: RouterFlags,
  fromSource: StartRouterOptions['sentinel'],
): Pick<StartRouterOptions, 'sentinel'> {
  if (flags.sentinel === undefined && flags.sentinelWindowSeconds === undefined) return {}
  return {
    sentinel: {
      ...fromSource,
      ...(flags.sentinel === undefined ? {} : { mode: flags.sentinel }),
      ...(flags.sentinelWindowSeconds === undefined
        ? {}
        : { windowSeconds: flags.sentinelWindowSeconds }),
    },
  }
}

function fromFlags(
  flags: RouterFlags,
): Partial<StartRouterOptions> & Pick<StartRouterOptions, 'tenants'> {
  if (flags.prefill.length === 0 || flags.decode.length === 0 || flags.tenants === undefined) {
    throw new KvfenceError(
      'config_invalid',
      'give --config FILE, or --prefill, --decode and --tenants',
    )
  }
  refuseNativeSaltSecretFile('--salt-secret-file', flags.saltSecretFile)
  return {
    modelDir: flags.model,
    prefillUrls: flags.prefill,
    decodeUrls: flags.decode,
    tenants: flags.tenants,
    workerTls: clusterTlsFlags(flags),
    queue: {
      ...(flags.maxConcurrent === undefined ? {} : { maxConcurrentRequests: flags.maxConcurrent }),
      ...(flags.maxQueued === undefined ? {} : { maxQueuedRequests: flags.maxQueued }),
      ...(flags.reservedSlots === undefined ? {} : { reservedSlots: flags.reservedSlots }),
    },
  }
}

/** The router's part of a cluster config: workers must be given by URL (none started here). */
function fromConfig(
  path: string,
  flags: RouterFlags,
): Partial<StartRouterOptions> & Pick<StartRouterOptions, 'tenants'> {
  const config = loadClusterConfig(path)
  const saltSecretFile = config.router.saltSecretFile ?? flags.saltSecretFile
  if (config.backend === undefined)
    refuseNativeSaltSecretFile(
      config.router.saltSecretFile === undefined ? '--salt-secret-file' : 'router.saltSecretFile',
      saltSecretFile,
    )
  const b = config.backend
  const urls = (entries: readonly ({ pages: number } | { url: string })[]) =>
    entries.map((e, i) => {
      if ('url' in e) return e.url
      throw new KvfenceError(
        'config_invalid',
        `${path}: workers: kvfence router starts no workers; give worker ${i} a url (or use kvfence serve)`,
      )
    })
  return {
    // The router re-reads the tenants list from this file when it changes (`keys add/remove`).
    tenants: path,
    tenantsReader: (file) => loadClusterConfig(file).tenants,
    modelDir: config.model ?? bundledModelDir,
    ...(config.workers === undefined
      ? {}
      : { prefillUrls: urls(config.workers.prefill), decodeUrls: urls(config.workers.decode) }),
    ...(b === undefined
      ? {}
      : {
          gateway: {
            ...gatewayOptions(b, backendApiKey(b.apiKeyEnv)),
            saltSecret: saltSecretFrom(process.env, saltSecretFile),
          },
        }),
    ...routerSectionOptions(config.router),
    ...(config.allowPlaintext || flags.allowPlaintext ? { allowPlaintext: true } : {}),
    workerTls: configTls(path, config, flags),
  }
}

/** `--cluster-tls-ca/--cluster-tls-cert/--cluster-tls-key`, read, or null when none is given.
 *  @throws KvfenceError `config_invalid` when only some are given or a file does not fit. */
function clusterTlsFlags(flags: RouterFlags): TlsMaterial | null {
  const { clusterTlsCa, clusterTlsCert, clusterTlsKey } = flags
  if (clusterTlsCa === undefined && clusterTlsCert === undefined && clusterTlsKey === undefined)
    return null
  if (clusterTlsCa === undefined || clusterTlsCert === undefined || clusterTlsKey === undefined)
    throw new KvfenceError(
      'config_invalid',
      'cluster TLS needs all three of --cluster-tls-ca, --cluster-tls-cert and --cluster-tls-key (see kvfence certs init)',
    )
  return loadTlsMaterial({ ca: clusterTlsCa, cert: clusterTlsCert, key: clusterTlsKey })
}

/** The router's cluster TLS with `--config`: the file's `tls:` section or the flags, not both. */
function configTls(path: string, config: ClusterConfig, flags: RouterFlags): TlsMaterial | null {
  const fromFlags = clusterTlsFlags(flags)
  if (fromFlags !== null && config.tls !== undefined)
    throw new KvfenceError(
      'config_invalid',
      `${path} has a tls: section: give it or --cluster-tls-ca/--cluster-tls-cert/--cluster-tls-key, not both`,
    )
  return fromFlags ?? routerTlsMaterial(config)
}

/** The backend's API key from the variable `apiKeyEnv` names; an unset or empty variable is an
 *  error (sending no key instead would be a silent substitution), as in `kvfence serve --config`. */
function backendApiKey(apiKeyEnv: string | undefined): string | undefined {
  if (apiKeyEnv === undefined) return undefined
  const key = process.env[apiKeyEnv]
  if (!key) throw new KvfenceError('config_invalid', `backend.apiKeyEnv: ${apiKeyEnv} is not set`)
  return key
}

/** `--tls-cert` and `--tls-key`, which go together, and not beside a config file's `router.tls`.
 *  @throws KvfenceError `config_invalid`. */
function httpsOption(flags: RouterFlags): Pick<StartRouterOptions, 'https'> {
  if (flags.tlsCert === undefined && flags.tlsKey === undefined) return {}
  if (flags.tlsCert === undefined || flags.tlsKey === undefined)
    throw new KvfenceError('config_invalid', '--tls-cert and --tls-key go together')
  if (flags.config !== undefined && loadClusterConfig(flags.config).router.tls !== undefined)
    throw new KvfenceError(
      'config_invalid',
      `${flags.config} has router.tls: give it or --tls-cert/--tls-key, not both`,
    )
  return { https: { cert: flags.tlsCert, key: flags.tlsKey } }
}

/** Redis-backed limits from the flags; the config file's `router.limits`, when set, wins. */
function redisLimitsFlags(flags: RouterFlags): Pick<StartRouterOptions, 'redisLimits'> {
  if (flags.limitsRedis === undefined) return {}
  if (flags.config !== undefined && loadClusterConfig(flags.config).router.limits !== undefined)
    return {}
  // As the config file's router.limits.url is checked; never echoed with its password.
  let protocol = ''
  try {
    protocol = new URL(flags.limitsRedis).protocol
  } catch {
    // Not a URL: refused below.
  }
  if (protocol !== 'redis:' && protocol !== 'rediss:')
    throw new KvfenceError(
      'config_invalid',
      `--limits-redis: must be a redis:// or rediss:// URL, got ${redactedUrl(flags.limitsRedis)}`,
    )
  return { redisLimits: { url: flags.limitsRedis, onUnavailable: flags.limitsOnUnavailable } }
}
