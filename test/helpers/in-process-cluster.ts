/** A whole cluster in the test's own process: the prefill and decode workers built as
 *  `kvfence prefill|decode` builds them (src/cli/worker.ts: the same pool, fault switches, prefix
 *  cache of a quarter of P's pool, D's transfer receiver with G4/G10 following D's guards and
 *  `lost-ack` dropping its ACKs), each behind its real control server (`/server_info`, `/metrics`,
 *  the control channel) on 127.0.0.1, and the router (`startRouter`, with an in-process tokenizer)
 *  in front of them. Every link is a real loopback socket; only the OS processes are missing, so
 *  a test that needs none (no worker killed, no signal, no exit) runs here instead of forking
 *  three. Not a test file itself. */
import type http from 'node:http'
import pino from 'pino'
import { DecodeWorker } from '../../src/engine/decode-worker.js'
import { buildFaultConfig } from '../../src/engine/faults.js'
import { PrefillWorker, type PrefillWorkerOptions } from '../../src/engine/prefill-worker.js'
import { createWorkerCore } from '../../src/engine/worker-core.js'
import { createWorkerServer, listen } from '../../src/engine/worker-server.js'
import type { Model } from '../../src/model/weights.js'
import { startRouter } from '../../src/router/start.js'
import { TransferServer } from '../../src/transfer/index.js'
import { inProcessTokenizer } from './in-process-tokenizer.js'

/** Options of {@link startInProcessCluster}: pools in pages of `pageSize` tokens. */
export interface InProcessClusterOptions {
  /** The model directory (tokenizer for the router) and its loaded weights (shared by both
   *  workers, as a pair in test/engine/pair.ts shares them). */
  modelDir: string
  model: Model
  pageSize: number
  prefillPages: number
  decodePages: number
  /** YAML tenants file for the router. */
  tenantsFile: string
  /** Faults per worker, allowed as KVFENCE_ALLOW_FAULTS=1 allows them. */
  prefillFaults?: readonly string[]
  decodeFaults?: readonly string[]
  /** Every guard off, in both workers and the router (`--unsafe-disable-guards`). */
  disableGuards?: boolean
  /** P's transfer timeout (`--transfer-timeout-ms` of the prefill worker), ms. */
  prefillTransferTimeoutMs?: number
  /** P's prefix cache as `kvfence prefill`'s `--prefix-cache-*` flags set it; unset fields keep
   *  the worker's defaults (a quarter of P's pool, partitioned by tenant, no offload tier). */
  prefixCache?: Pick<
    PrefillWorkerOptions,
    | 'prefixCachePages'
    | 'prefixCacheShared'
    | 'prefixCacheOffloadBytes'
    | 'prefixCacheOffloadDir'
    | 'prefixCacheOffloadDiskBytes'
  >
}

/** A running in-process cluster. */
export interface InProcessCluster {
  readonly routerUrl: string
  readonly prefillUrl: string
  readonly decodeUrl: string
  /** Closes the router, then both workers' servers and D's transfer receiver. */
  stop(): Promise<void>
}

const silent = pino({ level: 'silent' })

/** Starts the workers, then the router pointed at them; throws as `buildFaultConfig` does for
 *  an unknown fault, or as `startRouter` does (e.g. G1 refusing the pools). */
export async function startInProcessCluster(
  opts: InProcessClusterOptions,
): Promise<InProcessCluster> {
  const core = (numPages: number, faults: readonly string[] | undefined) =>
    createWorkerCore({
      model: opts.model,
      numPages,
      pageSize: opts.pageSize,
      faults: buildFaultConfig(faults ?? [], opts.disableGuards === true, {
        KVFENCE_ALLOW_FAULTS: '1',
      }),
    })
  const p = core(opts.prefillPages, opts.prefillFaults)
  const d = core(opts.decodePages, opts.decodeFaults)
  const decode = new DecodeWorker(d)
  const receiver = new TransferServer(decode.receiverHooks, {
    log: silent,
    verifyManifest: d.guards.G4,
    verifyAuth: d.guards.G10,
    dropAcks: d.hasFault('lost-ack'),
  })
  const transferPort = await listen(receiver, '127.0.0.1', 0)
  const prefill = new PrefillWorker(p, {
    transferTimeoutMs: opts.prefillTransferTimeoutMs,
    // The worker's default (src/cli/worker.ts): a quarter of the pool.
    prefixCachePages: Math.floor(opts.prefillPages / 4),
    ...opts.prefixCache,
  })
  const servers: http.Server[] = []
  const serve = async (server: http.Server) => {
    servers.push(server)
    return `http://127.0.0.1:${await listen(server, '127.0.0.1', 0)}`
  }
  const closeWorkers = async () => {
    prefill.close()
    await Promise.all(
      servers.map(
        (s) =>
          new Promise<void>((resolve) => {
            s.close(() => resolve())
            s.closeAllConnections()
          }),
      ),
    )
    await new Promise<void>((resolve) => receiver.close(() => resolve()))
  }
  try {
    const prefillUrl = await serve(
      createWorkerServer({ role: 'prefill', worker: prefill }, silent) as http.Server,
    )
    const decodeUrl = await serve(
      createWorkerServer(
        { role: 'decode', worker: decode, transferPort: () => transferPort },
        silent,
      ) as http.Server,
    )
    const router = await startRouter({
      modelDir: opts.modelDir,
      prefillUrls: [prefillUrl],
      decodeUrls: [decodeUrl],
      tenants: opts.tenantsFile,
      host: '127.0.0.1',
      port: 0,
      guardsEnabled: opts.disableGuards !== true,
      startTokenizer: inProcessTokenizer,
      tokenizerProcessesOnDemand: true,
      log: silent,
    })
    return {
      routerUrl: router.url,
      prefillUrl,
      decodeUrl,
      stop: async () => {
        await router.close()
        await closeWorkers()
      },
    }
  } catch (err) {
    await closeWorkers()
    throw err
  }
}
