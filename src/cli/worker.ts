/** `kvfence prefill` and `kvfence decode`: start one worker of a disaggregated pair on its own
 *  (on this host or another). Each prints its bound ports once listening, and tells a parent
 *  process that forked it through the IPC channel. */
import { clusterTokenEnv, clusterTokenFrom, isLoopbackHost } from '../engine/cluster-token.js'
import { Option, type Command } from 'commander'
import { pino } from 'pino'
import { DecodeWorker } from '../engine/decode-worker.js'
import { defaultMaxBatch } from '../engine/decode-scheduler.js'
import { buildFaultConfig, faultBanner } from '../engine/faults.js'
import { PrefillWorker } from '../engine/prefill-worker.js'
import { createWorkerCore } from '../engine/worker-core.js'
import { createWorkerServer, listen } from '../engine/worker-server.js'
import { defaultThreads, loadModel } from '../model/weights.js'
import { bundledModelDir } from '../common/paths.js'
import { checkPlaintextLinks } from '../link/plaintext.js'
import { loadTlsMaterial, tlsFilesFrom, type TlsMaterial } from '../link/tls.js'
import { TransferServer } from '../transfer/index.js'
import { exitIfParentGoesDuringStart, onStopSignals, reportReadyToParent } from './parent.js'
import {
  intOption,
  intRangeOption,
  collect,
  msOption,
  positiveIntOption,
  threadsHelp,
  threadsOption,
  logLevels,
  portOption,
} from './options.js'

interface WorkerFlags {
  model: string
  pages: number
  pageSize: number
  host: string
  port: number
  transferHost: string
  transferPort: number
  /** Decode only: most sequences per decode step. */
  maxBatch: number
  /** Prefill only: most pool pages the prefix cache may hold (default: a quarter of `pages`). */
  prefixCachePages?: number
  /** Prefill only: the most pages of a tenant's default prefix-cache share (default: an equal
   *  share of what the tenants file does not give by name). */
  prefixCachePagesPerTenant?: number
  /** Prefill only: one prefix-cache budget shared by all tenants (default: partitions). */
  prefixCacheShared?: boolean
  /** Prefill only: host-memory bytes of the prefix cache's offload tier (default 0: none). */
  prefixCacheOffloadBytes?: number
  /** Prefill only: directory of the offload tier's disk part (mode 0700; default: none). */
  prefixCacheOffloadDir?: string
  /** Prefill only: most bytes of files in that directory. */
  prefixCacheOffloadDiskBytes?: number
  injectFault: string[]
  unsafeDisableGuards: boolean
  unsafeDisableGuard: string[]
  transferTimeoutMs?: number
  logLevel: string
  threads?: number
  tlsCa?: string
  tlsCert?: string
  tlsKey?: string
  allowPlaintext: boolean
}

/** Register `kvfence prefill` and `kvfence decode`. */
export function registerWorkers(program: Command): void {
  for (const role of ['prefill', 'decode'] as const) {
    const cmd = program
      .command(role)
      .description(
        `start a ${role} worker (control plane over HTTP${role === 'decode' ? ', KV transfer receiver over TCP' : ''})`,
      )
      .option('--model <dir>', 'Hugging Face model directory', bundledModelDir)
      .option('--pages <n>', 'pages in this worker’s KV pool', positiveIntOption, 64)
      .option('--page-size <n>', 'tokens per page', positiveIntOption, 16)
      .option('--host <host>', 'control-plane address to bind', '127.0.0.1')
      .option(
        '--port <port>',
        'control-plane port (0 picks one)',
        portOption,
        role === 'prefill' ? 8101 : 8102,
      )
      .option(
        '--inject-fault <name>',
        'inject a fault (needs KVFENCE_ALLOW_FAULTS=1); repeatable',
        collect,
        [],
      )
      .option(
        '--unsafe-disable-guards',
        'turn every safety guard off (needs KVFENCE_ALLOW_FAULTS=1)',
        false,
      )
      .option(
        '--unsafe-disable-guard <id>',
        'turn one safety guard off, e.g. G7 (needs KVFENCE_ALLOW_FAULTS=1); repeatable',
        collect,
        [],
      )
      .option(
        '--transfer-timeout-ms <ms>',
        'a KV transfer with no progress (or no ACK) for this long fails (default 30000)',
        msOption,
      )
      .addOption(
        new Option('--log-level <level>', 'pino log level').choices(logLevels).default('info'),
      )
      .option('--threads <n>', threadsHelp, threadsOption)
      .option(
        '--tls-ca <file>',
        'cluster CA certificate: with --tls-cert/--tls-key, the control plane and KV transfers run over mutual TLS 1.3 (kvfence certs init)',
      )
      .option('--tls-cert <file>', 'this worker’s certificate, signed by the cluster CA')
      .option('--tls-key <file>', 'this worker’s private key')
      .option(
        '--allow-plaintext',
        `without TLS, bind (and, prefill, send KV pages to) addresses beyond loopback anyway: refused otherwise`,
        false,
      )
    if (role === 'prefill') {
      cmd.option(
        '--prefix-cache-pages <n>',
        'most KV pool pages the prefix cache may hold, split between tenants as the router’s tenants file says (each tenant its own partition), 0 = off (default: a quarter of --pages)',
        intOption,
      )
      cmd.option(
        '--prefix-cache-pages-per-tenant <n>',
        'the most pages of a tenant’s default share of the prefix cache (default: an equal share of the pages the tenants file does not give by name)',
        positiveIntOption,
      )
      cmd.option(
        '--prefix-cache-shared',
        'one prefix-cache budget shared by all tenants: one tenant’s traffic then changes another’s hits (the load side channel of docs/threat-model.md); for a single tenant only',
      )
      cmd.option(
        '--prefix-cache-offload-bytes <n>',
        'host memory for pages evicted from the prefix cache, loaded back (verified) on a hit; each tenant has its partition’s share of it unless --prefix-cache-shared (default 0: none)',
        intOption,
      )
      cmd.option(
        '--prefix-cache-offload-dir <dir>',
        'a directory (existing, mode 0700) for pages dropped from the host offload tier (or evicted from the cache, without --prefix-cache-offload-bytes), loaded back (verified) on a hit; needs --prefix-cache-offload-disk-bytes',
      )
      cmd.option(
        '--prefix-cache-offload-disk-bytes <n>',
        'most bytes of files in --prefix-cache-offload-dir (> 0), split between tenants as --prefix-cache-offload-bytes',
        positiveIntOption,
      )
    }
    if (role === 'decode') {
      cmd
        .option('--transfer-host <host>', 'KV transfer receiver address to bind', '127.0.0.1')
        .option(
          '--transfer-port <port>',
          'KV transfer receiver port (0 picks one)',
          portOption,
          8103,
        )
        .option(
          '--max-batch <n>',
          'most sequences per decode step (continuous batching)',
          intRangeOption(1, Number.MAX_SAFE_INTEGER, 'an integer ≥ 1'),
          defaultMaxBatch,
        )
    }
    cmd.action(async (flags: WorkerFlags) => {
      exitIfParentGoesDuringStart()
      await startWorker(role, flags)
    })
  }
}

/** Exit code of a worker whose compute threads failed (EX_SOFTWARE, sysexits.h). */
const computeFailureExit = 70

async function startWorker(role: 'prefill' | 'decode', flags: WorkerFlags): Promise<void> {
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
  const faults = buildFaultConfig(
    flags.injectFault,
    flags.unsafeDisableGuards,
    process.env,
    flags.unsafeDisableGuard,
  )
  const banner = faultBanner(`kvfence ${role}`, faults)
  if (banner) process.stderr.write(`${banner}\n`)
  const core = createWorkerCore({
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
  let transferPort: number | undefined
  let server
  if (role === 'decode') {
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
    transferPort = await listen(receiver, flags.transferHost, flags.transferPort)
    server = createWorkerServer(
      { role, worker, transferPort: () => transferPort! },
      log,
      clusterToken,
      tls,
    )
  } else {
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
    server = createWorkerServer({ role, worker }, log, clusterToken, tls)
  }
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

/** Warn at start when the prefix cache is shared by all tenants (`--prefix-cache-shared`, its
 *  offload tiers with it): one tenant's traffic then changes another's hits. By default each
 *  tenant has its own partition of the cache and its share of each offload tier, and nothing is
 *  warned. Throws for `--prefix-cache-shared` with `--prefix-cache-pages-per-tenant` (a partition
 *  size for a cache without partitions). */
function warnIfShared(
  log: { warn: (msg: string) => void },
  flags: WorkerFlags,
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
