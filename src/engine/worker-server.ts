/** The control server of one worker: the control channel (`GET /internal/channel` upgraded,
 *  src/control/channel-server.ts), which carries every request step (prefill on a prefill worker,
 *  generate on a decode worker; messages: src/control/messages.ts), plus the HTTP routes probes
 *  and operators read: `GET /server_info`, `GET /health`, `GET /metrics`, and the router's token
 *  probe `POST /internal/cluster_token_check`. A stream's `cancel`, or its channel closing, aborts
 *  its request (G8); with G8 on, a decode request whose stream is closed also fails at its next
 *  event, so even a worker that dropped the abort (fault `drop-abort`) stops working for a client
 *  that left. With TLS material it serves HTTPS with mutual TLS 1.3 against the cluster CA
 *  (src/link/tls.ts): a client without a certificate from the CA is refused in the handshake, before
 *  any request is read.
 *  Knows HTTP, TLS and the control messages; the engine work is the workers'. */
import http from 'node:http'
import https from 'node:https'
import type { AddressInfo } from 'node:net'
import type { Logger } from 'pino'
import { Gauge, type Registry } from 'prom-client'
import { KvfenceError } from '../common/errors.js'
import { metricsText } from '../common/process-metrics.js'
import { tlsExpiries, watchCertExpiry } from '../link/cert-expiry.js'
import { logRefusedHandshakes, serverTlsOptions, type TlsMaterial } from '../link/tls.js'
import { clusterTokenHeader, isClusterTokenValid } from '../control/cluster-token.js'
import {
  acceptChannels,
  asKvfenceError,
  type ChannelService,
  type EventSink,
} from '../control/channel-server.js'
import type {
  GenerateRequest,
  PrefillRequest,
  DecodeEvent,
  PrefillResult,
  ServerInfo,
} from '../control/messages.js'
import type { DecodeWorker } from './decode-worker.js'
import { prefillChunkTokens, type PrefillWorker } from './prefill-worker.js'
import type { WorkerCore } from './worker-core.js'

/** How long an idle HTTP connection (a probe's) stays open (ms); the router's agent must time out
 *  sooner. */
export const workerKeepAliveTimeoutMs = 65_000

/** What {@link createWorkerServer} serves. */
export type WorkerRole =
  | { role: 'prefill'; worker: PrefillWorker }
  | { role: 'decode'; worker: DecodeWorker; transferPort: () => number }

/** What every route of one worker's server shares. */
interface ServerContext {
  role: WorkerRole
  core: WorkerCore
  log: Logger
  clusterToken: string | null
  registry: Registry
  /** Pages the prefix cache holds (0 on a decode worker). */
  numPagesCached: () => number
}

/** Build the HTTP server of a worker (not yet listening); HTTPS with mutual TLS when `tls` is
 *  given. */
export function createWorkerServer(
  role: WorkerRole,
  log: Logger,
  clusterToken: string | null = null,
  tls: TlsMaterial | null = null,
): http.Server | https.Server {
  const core: WorkerCore = role.worker.core
  // Prefix-cache pages are evicted on demand: they count as neither used by requests nor leaked.
  const numPagesCached = () => (role.role === 'prefill' ? role.worker.numPagesCached : 0)
  const registry = makeMetrics(role.role, core, numPagesCached)
  const ctx: ServerContext = { role, core, log, clusterToken, registry, numPagesCached }
  const onRequest = (req: http.IncomingMessage, res: http.ServerResponse) =>
    void handle(ctx, req, res)
  let server: http.Server | https.Server
  if (tls === null) server = http.createServer(onRequest)
  else {
    const httpsServer = https.createServer(serverTlsOptions(tls), onRequest)
    logRefusedHandshakes(httpsServer, 'control connection', log)
    server = httpsServer
    const expiry = watchCertExpiry({ log, registry })
    expiry.set(tlsExpiries(tls))
    server.once('close', expiry.stop)
  }
  // Keep idle connections open longer than the router's probe agent does (its free-socket timeout
  // is shorter), so the router never reuses a connection this server is closing (ECONNRESET race).
  server.keepAliveTimeout = workerKeepAliveTimeoutMs
  server.headersTimeout = workerKeepAliveTimeoutMs + 1_000
  const channels = acceptChannels(server, channelService(ctx), {
    clusterToken,
    onConnectionError: (err) => {
      // A reset is how a router that stopped (or was killed) leaves: its streams end here as for
      // any close (G8). Anything else (a malformed frame, a TLS failure) is worth a warning.
      const code = (err as NodeJS.ErrnoException).code
      if (code === 'ECONNRESET' || code === 'EPIPE') {
        log.info({ err: err.message }, 'control channel closed by the router')
      } else log.warn({ err: err.message }, 'control channel failed')
    },
  })
  new Gauge({
    name: 'kvfence_control_channels',
    help: 'Control channel connections open (GET /internal/channel upgraded; normally one per router)',
    registers: [registry],
    collect() {
      this.set(channels.numOpen)
    },
  })
  return server
}

/** This worker's work as the control channel serves it (src/control/channel-server.ts). */
function channelService(ctx: ServerContext): ChannelService {
  const { role } = ctx
  return role.role === 'decode'
    ? { generate: (body, closed, sink) => runGenerate(ctx, role, body, closed, sink) }
    : { prefill: (body, closed) => runPrefill(ctx, role.worker, body, closed) }
}

/** This worker's `/server_info`. */
function serverInfo(ctx: ServerContext): ServerInfo {
  const { role, core, numPagesCached } = ctx
  return {
    role: role.role,
    model: core.model.name,
    pageSize: core.pool.shape.pageSize,
    numPages: core.pool.shape.numPages,
    capacityTokens: core.pool.capacityTokens,
    numPagesFree: core.pool.numFree,
    numPagesUsed: core.pool.numUsed - numPagesCached(),
    ...(role.role === 'prefill' ? { numPagesCached: numPagesCached(), prefillChunkTokens } : {}),
    maxPositionEmbeddings: core.model.config.maxPositionEmbeddings,
    guardsEnabled: Object.values(core.guards).every(Boolean),
    faults: core.faultNames(),
    ...(role.role === 'decode' ? { transferPort: role.transferPort() } : {}),
  }
}

/** Route one HTTP request; every error becomes a JSON error answer. */
async function handle(
  ctx: ServerContext,
  req: http.IncomingMessage,
  res: http.ServerResponse,
): Promise<void> {
  const route = `${req.method} ${(req.url ?? '/').split('?')[0]}`
  try {
    if (route === 'GET /health') return sendJson(res, 200, { status: 'ok' })
    if (route === 'GET /server_info') return sendJson(res, 200, serverInfo(ctx))
    if (route === 'GET /metrics') {
      res.writeHead(200, { 'content-type': ctx.registry.contentType })
      res.end(await metricsText(ctx.registry))
      return
    }
    // The control plane names tenants and issues transfer secrets: only the router may use it
    // (the channel's upgrade is checked alike, in channel-server.ts).
    if (
      route.startsWith('POST /internal/') &&
      ctx.clusterToken !== null &&
      !isClusterTokenValid(ctx.clusterToken, req.headers[clusterTokenHeader])
    ) {
      throw new KvfenceError('invalid_api_key', 'control-plane request without the cluster token')
    }
    // The router's probe of its cluster token: reached only past the check above.
    if (route === 'POST /internal/cluster_token_check') {
      req.resume()
      return sendJson(res, 200, { ok: true })
    }
    throw new KvfenceError('not_found', `no route ${route}`)
  } catch (err) {
    const e = asKvfenceError(err)
    if (e.code === 'internal_error') ctx.log.error({ err }, 'worker request failed')
    if (!res.headersSent) sendJson(res, e.status, { error: { code: e.code, message: e.message } })
    else res.end()
  }
}

/** The prefill worker's work on one request: `closed` aborts when the router cancelled the stream
 *  or its channel closed (G8; fault `drop-abort`: ignored). */
async function runPrefill(
  ctx: ServerContext,
  worker: PrefillWorker,
  body: PrefillRequest,
  closed: AbortSignal,
): Promise<PrefillResult> {
  const { core } = ctx
  const signal = core.hasFault('drop-abort') ? new AbortController().signal : closed
  const result = await worker.prefill(body, signal).catch((err: unknown) => {
    core.metrics.requests.inc({ outcome: asKvfenceError(err).code })
    throw err
  })
  core.metrics.requests.inc({ outcome: 'ok' })
  ctx.log.info(
    { requestId: body.requestId, tenant: body.tenant, numTokens: result.numTokens },
    'prefill done',
  )
  return result
}

/** The decode worker's work on one request: its events to `sink`; a throw before the first event
 *  is a refusal, a failure after it the last event (`error`). `closed` aborts when the router
 *  cancelled the stream or its channel closed (G8; fault `drop-abort`: ignored); with G8 on, an event for a closed sink also ends the request, so even a worker that
 *  dropped the abort stops working for a client that left. */
async function runGenerate(
  ctx: ServerContext,
  role: Extract<WorkerRole, { role: 'decode' }>,
  body: GenerateRequest,
  closed: AbortSignal,
  sink: EventSink,
): Promise<void> {
  const { core, log } = ctx
  const signal = core.hasFault('drop-abort') ? new AbortController().signal : closed
  let isStreaming = false
  const emit = (e: DecodeEvent) => {
    if (!sink.isOpen) {
      // The router is gone. G8: stop here even if the abort itself was lost.
      if (core.guards.G8 && e.type !== 'error')
        throw new KvfenceError('request_aborted', 'the router closed the request')
      return
    }
    isStreaming = true
    // `reserved` names this worker's transfer port, so a router never sends prefill to a
    // port a restarted decode worker no longer listens on.
    sink.write(e.type === 'reserved' ? { ...e, transferPort: role.transferPort() } : e)
  }
  try {
    await role.worker.generate(body, signal, emit)
    core.metrics.requests.inc({ outcome: 'ok' })
  } catch (err) {
    core.metrics.requests.inc({ outcome: asKvfenceError(err).code })
    if (!isStreaming) throw err
    const e = asKvfenceError(err)
    // The router ending a request (its client left, or a stop string ended the text) is
    // normal traffic (info); anything else deserves a warning.
    const isAbort = e.code === 'request_aborted'
    log[isAbort ? 'info' : 'warn'](
      { requestId: body.requestId, tenant: body.tenant, code: e.code },
      isAbort ? 'generate ended by the router' : 'generate failed',
    )
    emit({ type: 'error', code: e.code, message: e.message })
  }
}

/** Listen on host:port (port 0 picks one) and resolve with the bound port. */
export function listen(
  server: http.Server | https.Server | import('node:net').Server,
  host: string,
  port: number,
): Promise<number> {
  return new Promise((resolve, reject) => {
    server.once('error', reject)
    server.listen(port, host, () => {
      server.off('error', reject)
      resolve((server.address() as AddressInfo).port)
    })
  })
}

function sendJson(res: http.ServerResponse, status: number, body: unknown): void {
  res.writeHead(status, { 'content-type': 'application/json' })
  res.end(JSON.stringify(body))
}

/** Prometheus metrics of a worker: its counters (guard trips, transfers; see worker-core.ts) plus
 *  gauges over the pool (pages by state, capacity, and whether its invariant holds right now). */
function makeMetrics(role: string, core: WorkerCore, numPagesCached: () => number): Registry {
  const registry = core.metrics.registry
  registry.setDefaultLabels({ role })
  new Gauge({
    name: 'kvfence_kv_pages_used',
    help: 'KV pool pages owned by requests',
    registers: [registry],
    collect() {
      this.set(core.pool.numUsed - numPagesCached())
    },
  })
  new Gauge({
    name: 'kvfence_kv_pages_free',
    help: 'KV pool pages on the free list',
    registers: [registry],
    collect() {
      this.set(core.pool.numFree)
    },
  })
  new Gauge({
    name: 'kvfence_kv_capacity_tokens',
    help: 'Effective KV capacity of this worker in tokens (numPages x pageSize)',
    registers: [registry],
    collect() {
      this.set(core.pool.capacityTokens)
    },
  })
  new Gauge({
    name: 'kvfence_kv_pool_consistent',
    help: 'Whether the KV pool invariant (pool.check()) holds: 1 yes, 0 no (pages leaked, double-freed, or freed while pinned or filled)',
    registers: [registry],
    collect() {
      this.set(isPoolConsistent(core) ? 1 : 0)
    },
  })
  return registry
}

/** Whether the pool's invariant holds now (never throws). */
export function isPoolConsistent(core: WorkerCore): boolean {
  try {
    core.pool.check()
    return true
  } catch {
    return false
  }
}
