/** The router's probes of its workers, over HTTP/1.1 on one keep-alive agent (`node:http`, or
 *  `node:https` with mutual TLS 1.3 against the cluster CA, src/link/tls.ts, for `https:` worker URLs):
 *  `GET /server_info` (whether a worker answers, and what it is), `GET /metrics`, and
 *  `POST /internal/cluster_token_check`; and what the probes found: which workers are unreachable
 *  (new requests go to the others) and each decode worker's transfer address. A request's steps
 *  never go here: they take the control channel (worker-client.ts).
 *  Knows worker URLs, HTTP status codes and pooled connections; knows nothing of a request's
 *  steps, text, API keys or OpenAI shapes. */
import http from 'node:http'
import https from 'node:https'
import { KvfenceError } from '../common/errors.js'
import { readReplyText } from '../common/reply-text.js'
import { clientTlsOptions, type TlsMaterial } from '../link/tls.js'
import { untilAborted } from './abort.js'
import { clusterTokenHeader } from './cluster-token.js'
import { describeError, issueText } from './error-text.js'
import type { ReservedEvent, TransferAddress } from './handoff.js'
import { ServerInfo } from './messages.js'

/** A worker's `/server_info`, tagged with its URL (for messages). */
export interface WorkerReport {
  url: string
  info: ServerInfo
}

/** The workers of one role a request may go to, and where its round-robin pick starts. */
export interface Candidates {
  readonly role: 'prefill' | 'decode'
  readonly urls: readonly string[]
  readonly start: number
}

/** The probes of one router's workers, and what they found. */
export interface WorkerProbe {
  /** Deadline of a `/server_info`, `/metrics` or token-check call, ms. */
  readonly infoTimeoutMs: number
  /** `GET {url}/server_info`, parsed; throws `worker_unavailable` (no answer within
   *  {@link infoTimeoutMs} or before `signal` aborts, or a reply that is not a worker's). Every
   *  call is a probe: an answer makes the worker reachable again, a failure unreachable. A decode
   *  worker's transfer address is cached from it. */
  serverInfo(url: string, signal?: AbortSignal): Promise<ServerInfo>
  /** `GET {url}/metrics` (Prometheus text); throws `worker_unavailable`. */
  metricsText(url: string, signal?: AbortSignal): Promise<string>
  /** Whether the worker at `url` takes the cluster token: true unless it answers
   *  `POST /internal/cluster_token_check` with 401/403. Throws `worker_unavailable` when it does
   *  not answer. */
  acceptsClusterToken(url: string, signal?: AbortSignal): Promise<boolean>
  /** The first worker of `candidates` from its start on whose last probe did not fail, or null. */
  pickReachable(candidates: Candidates): string | null
  /** {@link pickReachable}, but with none reachable every worker of the role is probed again
   *  first (one probe of {@link requestProbeTimeoutMs} per worker, shared by the requests
   *  waiting). Throws `worker_unavailable` when none answers, `request_aborted` when `signal`
   *  aborts first. */
  pickAfterProbe(candidates: Candidates, rid: string, signal: AbortSignal): Promise<string>
  /** The decode worker's transfer address: as its `reserved` event names it (current even right
   *  after a restart on another port), else as its `/server_info` reported it (cached). */
  transferAddress(
    decodeUrl: string,
    reserved: ReservedEvent,
    signal: AbortSignal,
  ): Promise<TransferAddress>
  /** Drops the cached transfer address of a decode worker that may have restarted elsewhere. */
  forgetTransferAddress(decodeUrl: string): void
  /** Closes pooled connections. */
  close(): void
}

/** Options of {@link createWorkerProbe}. */
export interface WorkerProbeOptions {
  /** The decode workers' base URLs (their `/server_info` fills the transfer address cache). */
  decodeUrls: readonly string[]
  /** Deadline of a probe, ms (default 5 000). */
  infoTimeoutMs?: number
  /** Idle time after which a pooled connection is closed, ms (default
   *  {@link freeSocketTimeoutMs}); must stay below the workers' `keepAliveTimeout`. */
  freeSocketTimeoutMs?: number
  /** Sent with the token check (header `x-kvfence-cluster-token`); null = none. */
  clusterToken: string | null
  /** The router's TLS files, read, for `https:` worker URLs; null = plaintext. */
  tls: TlsMaterial | null
}

const defaultInfoTimeoutMs = 5_000
/** How long a pooled connection may sit idle before the router closes it, ms. Below the workers'
 *  `server.keepAliveTimeout` (65 000 ms), so the router, not the worker, ends an idle connection
 *  and never sends a probe on one the worker is closing at that moment. */
export const freeSocketTimeoutMs = 30_000
/** How long a new request waits for an unreachable worker to answer a probe again when no worker
 *  of its role is reachable, ms: one restarted or resumed serves it; one still silent refuses it
 *  this soon. */
export const requestProbeTimeoutMs = 1_000
/** Longest reply read from a worker, bytes. */
const maxReplyBytes = 1024 * 1024

/** What every probe of one router shares. */
interface Probes {
  readonly agent: http.Agent
  readonly infoTimeoutMs: number
  /** Sent with the token check. */
  readonly tokenHeaders: http.OutgoingHttpHeaders
  readonly decodeUrls: readonly string[]
  /** Decode worker URL → its transfer address from its `/server_info`: the fallback for a
   *  decode worker whose `reserved` event does not name it. Refreshed by every `/server_info`
   *  read, dropped on any failure of a request on that worker. */
  readonly transferAddresses: Map<string, Promise<TransferAddress>>
  /** URL → its request options, parsed once (the keys are the workers' few routes). */
  readonly targets: Map<string, http.RequestOptions>
  /** Worker URL → why its last finished probe got no answer (absent: it answered, or was never
   *  probed). Only {@link probe} writes it. */
  readonly unreachable: Map<string, string>
  /** Worker URL → the probe new requests wait on while no worker of its role is reachable. */
  readonly requestProbes: Map<string, Promise<unknown>>
}

/** The {@link WorkerProbe} of one router. */
export function createWorkerProbe(options: WorkerProbeOptions): WorkerProbe {
  // `timeout` closes a pooled connection that sat idle that long.
  const agentOptions = {
    keepAlive: true,
    timeout: options.freeSocketTimeoutMs ?? freeSocketTimeoutMs,
  }
  const p: Probes = {
    agent:
      options.tls === null
        ? new http.Agent(agentOptions)
        : // The server name each request checks is its URL's host (Node passes it per request).
          new https.Agent({ ...agentOptions, ...clientTlsOptions(options.tls) }),
    infoTimeoutMs: options.infoTimeoutMs ?? defaultInfoTimeoutMs,
    tokenHeaders:
      options.clusterToken === null ? {} : { [clusterTokenHeader]: options.clusterToken },
    decodeUrls: options.decodeUrls,
    transferAddresses: new Map(),
    targets: new Map(),
    unreachable: new Map(),
    requestProbes: new Map(),
  }
  return Object.freeze({
    infoTimeoutMs: p.infoTimeoutMs,
    serverInfo: (url: string, signal?: AbortSignal) => probe(p, url, signal),
    metricsText: (url: string, signal?: AbortSignal) => metricsText(p, url, signal),
    acceptsClusterToken: (url: string, signal?: AbortSignal) => acceptsClusterToken(p, url, signal),
    pickReachable: (candidates: Candidates) => pickReachable(p, candidates),
    pickAfterProbe: (candidates: Candidates, rid: string, signal: AbortSignal) =>
      pickAfterProbe(p, candidates, rid, signal),
    transferAddress: (decodeUrl: string, reserved: ReservedEvent, signal: AbortSignal) =>
      transferAddress(p, decodeUrl, reserved, signal),
    forgetTransferAddress: (decodeUrl: string) => void p.transferAddresses.delete(decodeUrl),
    close: () => p.agent.destroy(),
  })
}

// ---------------------------------------------------------------------------------------------
// Reachability: what the probes found, and the pick of a worker for a new request

/** {@link serverInfo} as a probe: an answer makes the worker at `url` reachable again, a failure
 *  unreachable (the last probe to finish decides, whatever its deadline: a slow answer to an
 *  earlier probe is still an answer now). */
async function probe(p: Probes, url: string, signal?: AbortSignal): Promise<ServerInfo> {
  try {
    const info = await serverInfo(p, url, signal)
    p.unreachable.delete(url)
    return info
  } catch (err) {
    p.unreachable.set(url, err instanceof Error ? err.message : String(err))
    throw err
  }
}

function pickReachable(p: Probes, { urls, start }: Candidates): string | null {
  for (let i = 0; i < urls.length; i++) {
    const url = urls[(start + i) % urls.length]
    if (!p.unreachable.has(url)) return url
  }
  return null
}

async function pickAfterProbe(
  p: Probes,
  candidates: Candidates,
  rid: string,
  signal: AbortSignal,
): Promise<string> {
  const { role, urls } = candidates
  const found = pickReachable(p, candidates)
  if (found !== null) return found
  try {
    await untilAborted(Promise.all(urls.map((url) => requestProbe(p, url))), signal)
  } catch {
    // Only the abort rejects: a probe's failure is in `p.unreachable`.
    throw new KvfenceError(
      'request_aborted',
      `request ${rid} was aborted while its ${role} workers were probed`,
    )
  }
  const url = pickReachable(p, candidates)
  if (url !== null) return url
  const why = urls.map((u) => p.unreachable.get(u)).join('; ')
  throw new KvfenceError('worker_unavailable', `no ${role} worker answered a probe: ${why}`)
}

/** The probe of the worker at `url` that new requests wait on; settles (never rejects) once its
 *  outcome is in `p.unreachable`. */
function requestProbe(p: Probes, url: string): Promise<unknown> {
  let probing = p.requestProbes.get(url)
  if (probing === undefined) {
    const settled = () => p.requestProbes.delete(url)
    probing = probe(p, url, AbortSignal.timeout(requestProbeTimeoutMs)).then(settled, settled)
    p.requestProbes.set(url, probing)
  }
  return probing
}

// ---------------------------------------------------------------------------------------------
// The probes

/** `signal` bounded by the probes' deadline. */
function infoSignal(p: Probes, signal: AbortSignal | undefined): AbortSignal {
  const deadline = AbortSignal.timeout(p.infoTimeoutMs)
  return signal === undefined ? deadline : AbortSignal.any([signal, deadline])
}

/** `GET {url}/server_info`, parsed; a decode worker's transfer address is cached from it. */
async function serverInfo(p: Probes, url: string, signal?: AbortSignal): Promise<ServerInfo> {
  let res: http.IncomingMessage
  let body: unknown
  const bounded = infoSignal(p, signal)
  try {
    res = await sendIdempotent(p, `${url}/server_info`, bounded)
    body = await readJson(res)
  } catch (err) {
    // A deadline met says so: "ABORT_ERR The operation was aborted" read as the router's doing.
    const why =
      bounded.reason instanceof DOMException && bounded.reason.name === 'TimeoutError'
        ? 'no answer before the deadline (a stopped, stuck or overloaded worker)'
        : describeError(err)
    throw new KvfenceError('worker_unavailable', `worker ${url}/server_info: ${why}`)
  }
  if (res.statusCode !== 200) {
    throw new KvfenceError(
      'worker_unavailable',
      `worker ${url}/server_info: HTTP ${res.statusCode}`,
    )
  }
  const parsed = ServerInfo.safeParse(body)
  if (!parsed.success) {
    throw new KvfenceError(
      'worker_unavailable',
      `worker ${url}/server_info: unexpected reply (${issueText(parsed.error.issues[0])})`,
    )
  }
  const info = parsed.data
  if (info.role === 'decode' && info.transferPort !== undefined && p.decodeUrls.includes(url)) {
    const address = { host: info.transferHost ?? hostOf(url), port: info.transferPort }
    p.transferAddresses.set(url, Promise.resolve(address))
  }
  return info
}

async function metricsText(p: Probes, url: string, signal?: AbortSignal): Promise<string> {
  try {
    const res = await sendIdempotent(p, `${url}/metrics`, infoSignal(p, signal))
    const text = await readReplyText(res, maxReplyBytes)
    if (res.statusCode !== 200) throw new Error(`HTTP ${res.statusCode}`)
    return text
  } catch (err) {
    throw new KvfenceError('worker_unavailable', `worker ${url}/metrics: ${describeError(err)}`)
  }
}

async function acceptsClusterToken(p: Probes, url: string, signal?: AbortSignal): Promise<boolean> {
  try {
    const res = await send(p, `${url}/internal/cluster_token_check`, 'POST', '{}', {
      signal: infoSignal(p, signal),
      headers: p.tokenHeaders,
    })
    await readReplyText(res, maxReplyBytes) // drained, so the connection goes back to the pool
    return res.statusCode !== 401 && res.statusCode !== 403
  } catch (err) {
    throw new KvfenceError('worker_unavailable', `worker ${url} token check: ${describeError(err)}`)
  }
}

function transferAddress(
  p: Probes,
  decodeUrl: string,
  reserved: ReservedEvent,
  signal: AbortSignal,
): Promise<TransferAddress> {
  if (reserved.transferPort !== undefined) {
    return Promise.resolve({
      host: reserved.transferHost ?? hostOf(decodeUrl),
      port: reserved.transferPort,
    })
  }
  let address = p.transferAddresses.get(decodeUrl)
  if (address === undefined) {
    address = serverInfo(p, decodeUrl, signal).then((info) => {
      if (info.role !== 'decode' || info.transferPort === undefined) {
        throw new KvfenceError(
          'worker_unavailable',
          `worker ${decodeUrl} is not a decode worker with a transfer port (role ${info.role})`,
        )
      }
      return { host: info.transferHost ?? hostOf(decodeUrl), port: info.transferPort }
    })
    address.catch(() => p.transferAddresses.delete(decodeUrl))
    p.transferAddresses.set(decodeUrl, address)
  }
  return address
}

// ---------------------------------------------------------------------------------------------
// HTTP plumbing

/** A GET that is safe to repeat: sent once more, on a new connection, when a reused keep-alive
 *  connection was reset before any reply (the worker closed it as the request went out). POSTs
 *  are never repeated: a worker may have acted on one. */
async function sendIdempotent(
  p: Probes,
  url: string,
  signal: AbortSignal,
): Promise<http.IncomingMessage> {
  try {
    return await send(p, url, 'GET', null, { signal })
  } catch (err) {
    if (!(err instanceof ReusedSocketReset)) throw err
    // A connection of its own, never a pooled one.
    return send(p, url, 'GET', null, { signal, isPooled: false })
  }
}

/** A request on a reused keep-alive connection was reset before its reply began. */
class ReusedSocketReset extends Error {
  readonly code = 'ECONNRESET'
  constructor(cause: Error) {
    super(cause.message, { cause })
  }
}

/** Sends one request; its reply once it began. Aborting `signal` destroys the request. */
function send(
  p: Probes,
  url: string,
  method: 'GET' | 'POST',
  body: string | null,
  how: { signal: AbortSignal; headers?: http.OutgoingHttpHeaders; isPooled?: boolean },
): Promise<http.IncomingMessage> {
  const agent = (how.isPooled ?? true) ? p.agent : false
  return new Promise((resolve, reject) => {
    const headers: http.OutgoingHttpHeaders = { accept: 'application/json', ...how.headers }
    if (body !== null) {
      headers['content-type'] = 'application/json'
      headers['content-length'] = Buffer.byteLength(body)
    }
    const request = url.startsWith('https:') ? https.request : http.request
    const req = request(
      { ...targetOf(p, url), method, agent, headers, signal: how.signal },
      resolve,
    )
    req.on('error', (err: NodeJS.ErrnoException) =>
      reject(req.reusedSocket && err.code === 'ECONNRESET' ? new ReusedSocketReset(err) : err),
    )
    req.end(body ?? undefined)
  })
}

/** `url`'s request options (protocol, host, port, path), parsed on first use. */
function targetOf(p: Probes, url: string): http.RequestOptions {
  let target = p.targets.get(url)
  if (target === undefined) {
    const parsed = new URL(url)
    target = {
      protocol: parsed.protocol,
      hostname: hostOf(url),
      port: parsed.port,
      path: `${parsed.pathname}${parsed.search}`,
    }
    p.targets.set(url, target)
  }
  return target
}

async function readJson(res: http.IncomingMessage): Promise<unknown> {
  const text = await readReplyText(res, maxReplyBytes)
  try {
    return JSON.parse(text)
  } catch {
    throw new Error(`reply is not JSON (HTTP ${res.statusCode})`)
  }
}

/** The host of a worker's base URL, without an IPv6 address's brackets; parsed once per URL. */
export function hostOf(baseUrl: string): string {
  let host = hostsOfUrls.get(baseUrl)
  if (host === undefined) {
    host = new URL(baseUrl).hostname.replace(/^\[(.*)\]$/, '$1')
    hostsOfUrls.set(baseUrl, host)
  }
  return host
}

/** Worker URL → its host. The keys are the configured workers' URLs, so the map stays small. */
const hostsOfUrls = new Map<string, string>()
