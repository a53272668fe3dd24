/** `kvfence prefill` and `kvfence decode`: start one worker of a disaggregated pair on its own
 *  (on this host or another). Each prints its bound ports once listening, and tells a parent
 *  process that forked it through the IPC channel. */
import { clusterTokenEnv, clusterTokenFrom, isLoopbackHost } from '../control/cluster-token.js'
import { Option, type Command } from 'commander'
import { pino, type Logger } from 'pino'
import { DecodeWorker } from '../engine/decode-worker.js'
import { buildFaultConfig, faultBanner } from '../engine/faults.js'
import { PrefillWorker } from '../engine/prefill-worker.js'
import { createWorkerCore, type WorkerCore } from '../engine/worker-core.js'
import { createWorkerServer, listen } from '../engine/worker-server.js'
import { defaultThreads, loadModel } from '../model/weights.js'
import { checkPlaintextLinks } from '../link/plaintext.js'
import { loadTlsMaterial, tlsFilesFrom, type TlsMaterial } from '../link/tls.js'
import { TransferServer } from '../transfer/index.js'
import {
  defaultOf,
  flagOf,
  optionsOf,
  type WorkerFlags,
  type WorkerOption,
  type WorkerRole,
} from '../engine/worker-options.js'
import { exitIfParentGoesDuringStart, onStopSignals, reportReadyToParent } from './parent.js'
import { collect, intRangeOption } from './options.js'

/** The flag of worker option `name` as commander takes it: its parser (the range check and its
 *  error), choices and default, for `role`. */
function commanderOption(name: string, o: WorkerOption, role: WorkerRole): Option {
  const option = new Option(
    o.kind === 'switch' ? flagOf(name) : `${flagOf(name)} <${o.arg ?? 'n'}>`,
    o.doc,
  )
  if (o.kind === 'int') option.argParser(intRangeOption(o.min, o.max, o.what))
  if (o.kind === 'list') option.argParser(collect)
  if (o.kind === 'text' && o.choices !== undefined) option.choices(o.choices)
  const value = defaultOf(o, role)
  if (value !== undefined) option.default(value)
  return option
}

/** Adds the flags of every option `role` takes (src/engine/worker-options.ts) to `cmd`. */
export function addWorkerOptions(cmd: Command, role: WorkerRole): Command {
  for (const [name, o] of optionsOf(role)) cmd.addOption(commanderOption(name, o, role))
  return cmd
}

/** Register `kvfence prefill` and `kvfence decode`. */
export function registerWorkers(program: Command): void {
  for (const role of ['prefill', 'decode'] as const) {
    const cmd = program
      .command(role)
      .description(
        `start a ${role} worker (control plane over HTTP${role === 'decode' ? ', KV transfer receiver over TCP' : ''})`,
      )
    addWorkerOptions(cmd, role).action(async (flags: WorkerFlags) => {
      exitIfParentGoesDuringStart()
      await startWorker(role, flags)
    })
  }
}

/** Exit code of a worker whose compute threads failed (EX_SOFTWARE, sysexits.h). */
const computeFailureExit = 70

/** Starts the worker `flags` describe: checks that need no model first (TLS files, the offload
 *  pair), then the model and pool, the link rules, the servers; reports ready and stops on a
 *  signal or when the parent is gone. */
async function startWorker(role: WorkerRole, flags: WorkerFlags): Promise<void> {
  // Sync: an async stream is flushed on exit by a loop that retries EPIPE for ever, so a part whose
  // parent (the reader of its stderr) was killed hung in process.exit, deaf to SIGTERM.
  const log = pino(
    { name: `kvfence-${role}`, level: flags.logLevel },
    pino.destination({ dest: 2, sync: true }),
  )
  // Bad TLS files are a one-line error before anything slow (the model) is loaded.
  const tlsFiles = tlsFilesFrom(flags)
  const tls: TlsMaterial | null = tlsFiles === null ? null : loadTlsMaterial(tlsFiles)
  if (
    (flags.prefixCacheOffloadDir === undefined) !==
    (flags.prefixCacheOffloadDiskBytes === undefined)
  )
    throw new Error(
      flags.prefixCacheOffloadDir === undefined
        ? '--prefix-cache-offload-disk-bytes needs --prefix-cache-offload-dir'
        : '--prefix-cache-offload-dir needs --prefix-cache-offload-disk-bytes',
    )
  const core = createCore(role, flags, log)
  const clusterToken = checkLinks(role, flags, tls, log)
  const { server, transferPort } =
    role === 'decode'
      ? await serveDecode(core, flags, tls, log, clusterToken)
      : servePrefill(core, flags, tls, log, clusterToken)
  const port = await listen(server, flags.host, flags.port)
  const ready = {
    type: 'ready',
    role,
    port,
    tls: tls !== null,
    transferPort,
    capacityTokens: core.pool.capacityTokens,
  }
  log.info(ready, `${role} worker listening`)
  const shutdown = () => {
    server.close()
    process.exit(0)
  }
  onStopSignals(shutdown)
  reportReadyToParent(ready, () => {
    log.warn('the process that started this worker is gone; stopping')
    shutdown()
  })
}

/** The worker's model, pool and faults (the fault banner printed when any is on). */
function createCore(role: WorkerRole, flags: WorkerFlags, log: Logger): WorkerCore {
  const faults = buildFaultConfig(
    flags.injectFault,
    flags.unsafeDisableGuards,
    process.env,
    flags.unsafeDisableGuard,
  )
  const banner = faultBanner(`kvfence ${role}`, faults)
  if (banner) process.stderr.write(`${banner}\n`)
  return createWorkerCore({
    model: loadModel(flags.model, {
      threads: flags.threads ?? defaultThreads(),
      // A helper thread that failed or stopped may still be writing the shared memory: no later
      // result can be trusted. Let the failed step's requests get their errors, then exit so that
      // the supervisor (serve, systemd, Kubernetes) starts a fresh worker.
      onComputeFailure: (err) => {
        log.fatal(
          { err: err.message },
          `compute threads failed; exiting with code ${computeFailureExit}`,
        )
        setTimeout(() => process.exit(computeFailureExit), 200).unref()
        process.exitCode = computeFailureExit
      },
    }),
    numPages: flags.pages,
    pageSize: flags.pageSize,
    faults,
  })
}

/** The control plane's cluster token (null: none set, allowed on loopback only, with a warning)
 *  after the plaintext rule for the addresses the worker binds (src/plaintext.ts). Throws when a
 *  rule refuses. */
function checkLinks(
  role: WorkerRole,
  flags: WorkerFlags,
  tls: TlsMaterial | null,
  log: Logger,
): string | null {
  const clusterToken = clusterTokenFrom(process.env)
  if (clusterToken === null) {
    if (!isLoopbackHost(flags.host)) {
      throw new Error(
        `${clusterTokenEnv} is not set: a ${role} worker bound to ${flags.host} would accept control requests naming any tenant from anyone who reaches it`,
      )
    }
    log.warn(`${clusterTokenEnv} is not set: the control plane accepts any local process`)
  }
  if (tls === null)
    checkPlaintextLinks({
      part: `${role} worker`,
      links: [
        { what: 'binds its control plane to', host: flags.host },
        ...(role === 'decode'
          ? [{ what: 'binds its KV transfer receiver to', host: flags.transferHost }]
          : []),
      ],
      allowPlaintext: flags.allowPlaintext,
      tlsHint: '--tls-ca/--tls-cert/--tls-key',
      log,
    })
  return clusterToken
}

/** A decode worker: its KV transfer receiver, listening, and its control server (not yet). */
async function serveDecode(
  core: WorkerCore,
  flags: WorkerFlags<'decode'>,
  tls: TlsMaterial | null,
  log: Logger,
  clusterToken: string | null,
) {
  const worker = new DecodeWorker(core, { maxBatch: flags.maxBatch })
  const receiver = new TransferServer(worker.receiverHooks, {
    ...(tls === null ? {} : { tls }),
    // Refused connections (a failed TLS handshake) and refused transfers are logged here.
    log,
    verifyManifest: core.guards.G4,
    verifyAuth: core.guards.G10,
    dropAcks: core.hasFault('lost-ack'),
    ...(flags.transferTimeoutMs === undefined ? {} : { stallTimeoutMs: flags.transferTimeoutMs }),
  })
  const transferPort = await listen(receiver, flags.transferHost, flags.transferPort)
  const server = createWorkerServer(
    { role: 'decode', worker, transferPort: () => transferPort },
    log,
    clusterToken,
    tls,
  )
  return { server, transferPort }
}

/** A prefill worker with its prefix cache (a quarter of the pool by default) and its control
 *  server (not yet listening). Throws for a cache larger than the pool. */
function servePrefill(
  core: WorkerCore,
  flags: WorkerFlags<'prefill'>,
  tls: TlsMaterial | null,
  log: Logger,
  clusterToken: string | null,
) {
  const prefixCachePages = flags.prefixCachePages ?? Math.floor(flags.pages / 4)
  if (prefixCachePages > flags.pages)
    throw new Error(`--prefix-cache-pages ${prefixCachePages} exceeds --pages ${flags.pages}`)
  warnIfShared(log, flags, prefixCachePages)
  const worker = new PrefillWorker(core, {
    transferTimeoutMs: flags.transferTimeoutMs,
    prefixCachePages,
    prefixCachePagesPerTenant: flags.prefixCachePagesPerTenant,
    prefixCacheShared: flags.prefixCacheShared === true,
    prefixCacheOffloadBytes: flags.prefixCacheOffloadBytes,
    prefixCacheOffloadDir: flags.prefixCacheOffloadDir,
    prefixCacheOffloadDiskBytes: flags.prefixCacheOffloadDiskBytes,
    transferTls: tls,
    allowPlaintext: flags.allowPlaintext,
  })
  const server = createWorkerServer({ role: 'prefill', worker }, log, clusterToken, tls)
  return { server, transferPort: undefined }
}

/** Warn at start when the prefix cache is shared by all tenants (`--prefix-cache-shared`, its
 *  offload tiers with it): one tenant's traffic then changes another's hits. By default each
 *  tenant has its own partition of the cache and its share of each offload tier, and nothing is
 *  warned. Throws for `--prefix-cache-shared` with `--prefix-cache-pages-per-tenant` (a partition
 *  size for a cache without partitions). */
function warnIfShared(
  log: { warn: (msg: string) => void },
  flags: WorkerFlags<'prefill'>,
  prefixCachePages: number,
): void {
  if (flags.prefixCacheShared === true && flags.prefixCachePagesPerTenant !== undefined)
    throw new Error(
      '--prefix-cache-pages-per-tenant sizes partitions: not with --prefix-cache-shared',
    )
  if (prefixCachePages === 0 || flags.prefixCacheShared !== true) return
  const tiers =
    (flags.prefixCacheOffloadBytes ?? 0) > 0 || flags.prefixCacheOffloadDir !== undefined
      ? ' and its offload tier'
      : ''
  log.warn(
    `prefix cache${tiers} shared by all tenants (--prefix-cache-shared): one tenant’s traffic evicts another’s cached pages, a side channel on its load (docs/threat-model.md); use it with a single tenant only`,
  )
}
