/** The router's transport of the control plane (see `src/engine/control.ts`): HTTP/1.1 + JSON
 *  (NDJSON for the decode worker's stream) over one keep-alive agent (`node:http`, or `node:https`
 *  with mutual TLS 1.3 against the cluster CA, src/link/tls.ts, for `https:` worker URLs), or, with
 *  `controlChannel`, the control channel (control-channel.ts: one multiplexed connection per
 *  worker over the same TLS, HTTP kept for a worker without it and for `/server_info`, `/metrics`
 *  and the token probe), with the workers' replies parsed at this boundary. One request's steps across the two workers, and the
 *  checks before any token leaves, are `src/engine/handoff.ts`'s: this file gives it the two
 *  workers as sides, picked round-robin among those whose last probe (`serverInfo`) answered.
 *  Knows worker URLs, HTTP status codes, connections and request ids; knows nothing of text, API
 *  keys or OpenAI shapes. */
import { clusterTokenHeader } from '../engine/cluster-token.js'
import http from 'node:http'
import https from 'node:https'
import { z } from 'zod'
import {
  DecodeEvent,
  type GenerateRequest,
  type PrefillRequest,
  PrefillResult,
  ServerInfo,
} from '../engine/control.js'
import {
  handOff,
  WorkerReportedError,
  type DecodeSide,
  type GenerationEvent,
  type HandoffOptions,
  type PrefillSide,
  type ReservedEvent,
  type TransferAddress,
} from '../engine/handoff.js'
import { KvfenceError, isErrorCode } from '../common/errors.js'
import { clientTlsOptions, describeTlsError, type TlsMaterial } from '../link/tls.js'
import type { WorkerReport } from './admission/capacity.js'
import {
  abortError,
  channelUnsupported,
  openChannel,
  type ControlChannel,
} from './control-channel.js'
import { readReplyText } from './api/http.js'
import { ndjsonLines } from './ndjson-lines.js'

export { WorkerReportedError, type GenerationEvent }

/** A worker refused a request with `capacity_exhausted` (its KV pool is momentarily full) before
 *  any token was produced: the decode worker outright (nothing reserved), or the prefill worker
 *  (the decode worker's reservation is then closed before this is thrown). The request may be
 *  tried again, under a fresh request id and transfer secret. */
export class PoolFullError extends KvfenceError {
  constructor(message: string) {
    super('capacity_exhausted', message)
    this.name = 'PoolFullError'
  }
}

/** A worker answered a control-plane request with 401/403: it does not take the router's cluster
 *  token. That is the operator's misconfiguration (the router's `KVFENCE_CLUSTER_TOKEN` differs
 *  from the workers'), never the tenant's, so it is `worker_unavailable` (503), not the worker's
 *  `invalid_api_key`. The message names the worker, never the token. */
export class ClusterTokenRefusedError extends KvfenceError {
  /** `worker` names it, e.g. `prefill worker http://127.0.0.1:8101`; `status` is its reply's. */
  constructor(worker: string, status: number | undefined) {
    super(
      'worker_unavailable',
      `${worker} refused the router's cluster token${status === undefined ? '' : ` (HTTP ${status})`}: the router's KVFENCE_CLUSTER_TOKEN differs from the workers'`,
    )
    this.name = 'ClusterTokenRefusedError'
  }
}

/** The control plane as the router uses it. */
export interface WorkerClient {
  /** Base URLs of the prefill workers (e.g. `http://127.0.0.1:8101`). */
  readonly prefillUrls: readonly string[]
  /** Base URLs of the decode workers. */
  readonly decodeUrls: readonly string[]
  /** `GET {url}/server_info` of one worker; throws `worker_unavailable` (no answer within the
   *  client's info deadline or before `signal` aborts, or a reply that is not a worker's). Every
   *  call is a probe: until another one answers, a worker it failed on gets no new requests. */
  serverInfo(url: string, signal?: AbortSignal): Promise<ServerInfo>
  /** `GET {url}/metrics` of one worker (Prometheus text); throws `worker_unavailable`. */
  metricsText(url: string, signal?: AbortSignal): Promise<string>
  /** Whether the worker at `url` takes the router's cluster token: true unless it answers a
   *  control-plane probe (`POST /internal/cluster_token_check`) with 401/403 (a worker that takes
   *  the token answers 200; one from before that route, 404). Throws `worker_unavailable` when it
   *  does not answer. */
  acceptsClusterToken(url: string, signal?: AbortSignal): Promise<boolean>
  /** `/server_info` of every worker (prefill first), each a probe as with `serverInfo`; throws
   *  `worker_unavailable` if any fails. */
  serverInfoAll(signal?: AbortSignal): Promise<WorkerReport[]>
  /** Runs one request on a decode and a prefill worker through `handOff` (engine/handoff.ts),
   *  each picked round-robin among the workers of its role not found unreachable by their last
   *  probe. Yields the decode worker's tokens — the first only after the prefill worker's result
   *  was checked against it — and a final `done`; throws a {@link KvfenceError} on any failure
   *  (never a normal `done` after one). When no worker of a role is reachable, each is probed
   *  again (for up to 1 s) before any is asked to run it: `worker_unavailable` at the first pull
   *  when none answers. Aborting `signal`, or leaving the iteration early, closes both worker
   *  requests (over the channel: a `cancel` frame for each stream), which aborts the request on
   *  both workers (G8). */
  generate(request: GenerateRequest, signal: AbortSignal): AsyncGenerator<GenerationEvent, void>
  /** Closes pooled connections. */
  close(): void
}

/** Options of {@link createWorkerClient}. */
export interface WorkerClientOptions {
  prefillUrls: readonly string[]
  decodeUrls: readonly string[]
  /** Longest silence from the decode worker during a request before it fails, in ms. */
  idleTimeoutMs?: number
  /** Deadline of a `/server_info` call, in ms. */
  infoTimeoutMs?: number
  /** Idle time after which a pooled connection is closed, in ms (default
   *  {@link freeSocketTimeoutMs}); must stay below the workers' `keepAliveTimeout`. */
  freeSocketTimeoutMs?: number
  /** Cross-check the workers' reports (prompt length, first token, counts) before any output
   *  leaves; false only in the incident's configuration. Default true. */
  guardsEnabled?: boolean
  /** The cluster token the workers require on `POST /internal/*` (see engine/cluster-token.ts). */
  clusterToken?: string | null
  /** The router's TLS files, read: required for `https:` worker URLs, refused with `http:` ones
   *  (every worker of a client speaks the same). Default: none (plaintext). */
  tls?: TlsMaterial | null
  /** Run requests over the control channel (one multiplexed connection per worker, see
   *  control-channel.ts) rather than one HTTP request per step; a worker that does not serve it
   *  (404 to the upgrade) gets HTTP. Default false (opt-in: see docs/operators.md). */
  controlChannel?: boolean
}

/** How long the router keeps to HTTP with a worker that answered the channel's upgrade 404 before
 *  it asks again (the worker may have been upgraded since), ms. */
export const channelRetryMs = 60_000

const defaultIdleTimeoutMs = 120_000
const defaultInfoTimeoutMs = 5_000
/** How long a pooled connection may sit idle before the router closes it, ms. Below the workers'
 *  `server.keepAliveTimeout` (65 000 ms), so the router, not the worker, ends an idle connection
 *  and never sends a request on one the worker is closing at that moment. */
export const freeSocketTimeoutMs = 30_000
const maxLineBytes = 1024 * 1024 // longest NDJSON line or JSON reply accepted from a worker

// ---------------------------------------------------------------------------------------------
// Parsers for what workers send (the boundary: parsed once, trusted inside): the shared schemas
// of control.ts, and the error body.

const WorkerErrorSchema = z.object({
  error: z.object({ code: z.string(), message: z.string() }),
})

// ---------------------------------------------------------------------------------------------
// The client

/** What every call of one client shares. */
interface Transport {
  readonly agent: http.Agent
  /** Sent on every `POST /internal/*`: workers take control requests only from the holder of
   *  the cluster token. */
  readonly controlHeaders: http.OutgoingHttpHeaders
  /** Deadline of a `/server_info`, `/metrics` or token-check call, ms. */
  readonly infoTimeoutMs: number
  readonly decodeUrls: readonly string[]
  /** Decode worker URL → its transfer (data-plane) address, from its `/server_info`: the fallback
   *  for a decode worker whose `reserved` event does not name it. Refreshed by every
   *  `/server_info` read, dropped on any failure of a request on that worker. */
  readonly transferAddresses: Map<string, Promise<TransferAddress>>
  /** URL → its request options, parsed once (a URL string costs every request a parse). The
   *  keys are the workers' few routes, so it stays small. */
  readonly targets: Map<string, http.RequestOptions>
  readonly tls: TlsMaterial | null
  readonly clusterToken: string | null
  /** Worker URL → its control channel (being opened, open, or found unsupported at `since`). */
  readonly channels: Map<string, ChannelEntry>
  /** Worker URL → why its last finished probe got no answer (absent: it answered, or was never
   *  probed). New requests go to the other workers of its role. Only {@link probe} writes it. */
  readonly unreachable: Map<string, string>
  /** Worker URL → the probe new requests wait on while no worker of its role is reachable. */
  readonly requestProbes: Map<string, Promise<unknown>>
}

/** A worker's control channel as the client holds it. */
interface ChannelEntry {
  readonly opening: Promise<ControlChannel | typeof channelUnsupported>
  /** Once opened: the channel, or `channelUnsupported`. */
  value?: ControlChannel | typeof channelUnsupported
  /** When it was asked for, `performance.now()` ms. */
  readonly since: number
}

/** A {@link WorkerClient} over `node:http` with one keep-alive agent. */
export function createWorkerClient(options: WorkerClientOptions): WorkerClient {
  if (options.prefillUrls.length === 0 || options.decodeUrls.length === 0) {
    throw new KvfenceError('internal_error', 'need at least one prefill and one decode worker URL')
  }
  const tls = options.tls ?? null
  const protocol = tls === null ? 'http:' : 'https:'
  const prefillUrls = Object.freeze(options.prefillUrls.map((u) => normalizeBaseUrl(u, protocol)))
  const decodeUrls = Object.freeze(options.decodeUrls.map((u) => normalizeBaseUrl(u, protocol)))
  // `timeout` closes a pooled connection that sat idle that long (an in-use one only gets a
  // 'timeout' event, which nothing here listens to: long silences are `idleTimeoutMs`'s job).
  const agentOptions = {
    keepAlive: true,
    timeout: options.freeSocketTimeoutMs ?? freeSocketTimeoutMs,
  }
  const transport: Transport = {
    agent:
      tls === null
        ? new http.Agent(agentOptions)
        : // The server name each request checks is its URL's host (Node passes it per request).
          new https.Agent({ ...agentOptions, ...clientTlsOptions(tls) }),
    controlHeaders:
      options.clusterToken == null ? {} : { [clusterTokenHeader]: options.clusterToken },
    infoTimeoutMs: options.infoTimeoutMs ?? defaultInfoTimeoutMs,
    decodeUrls,
    transferAddresses: new Map(),
    targets: new Map(),
    tls,
    clusterToken: options.clusterToken ?? null,
    channels: new Map(),
    unreachable: new Map(),
    requestProbes: new Map(),
  }
  const isChannelUsed = options.controlChannel ?? false
  const idleTimeoutMs = options.idleTimeoutMs ?? defaultIdleTimeoutMs
  const guardsEnabled = options.guardsEnabled ?? true
  let nextPrefill = 0
  let nextDecode = 0

  // Not itself a generator: each layer of `yield*` costs every token a few more promises. What
  // the router built is not parsed again here: the workers parse every request at their boundary.
  function generate(
    request: GenerateRequest,
    signal: AbortSignal,
  ): AsyncGenerator<GenerationEvent, void> {
    const decode = { role: 'decode', urls: decodeUrls, start: nextDecode++ } as const
    const prefill = { role: 'prefill', urls: prefillUrls, start: nextPrefill++ } as const
    const options = { signal, guardsEnabled, idleTimeoutMs }
    const decodeUrl = pickReachable(transport, decode)
    const prefillUrl = pickReachable(transport, prefill)
    if (decodeUrl !== null && prefillUrl !== null)
      return generateOn(transport, decodeUrl, prefillUrl, isChannelUsed, request, options)
    // A stopped worker keeps its connections open and answers nothing: sent there, the request
    // would wait out `idleTimeoutMs`. Probed again first, a restarted or resumed one serves it
    // (a generator layer of its own only on this path).
    return (async function* () {
      const [d, p] = await Promise.all([
        pickAfterProbe(transport, decode, request.requestId, signal),
        pickAfterProbe(transport, prefill, request.requestId, signal),
      ])
      yield* generateOn(transport, d, p, isChannelUsed, request, options)
    })()
  }

  return Object.freeze({
    prefillUrls,
    decodeUrls,
    serverInfo: (url: string, signal?: AbortSignal) => probe(transport, url, signal),
    metricsText: (url: string, signal?: AbortSignal) => metricsText(transport, url, signal),
    acceptsClusterToken: (url: string, signal?: AbortSignal) =>
      acceptsClusterToken(transport, url, signal),
    async serverInfoAll(signal?: AbortSignal): Promise<WorkerReport[]> {
      const urls = [...prefillUrls, ...decodeUrls]
      const infos = await Promise.all(urls.map((url) => probe(transport, url, signal)))
      return urls.map((url, i) => ({ url, info: infos[i] }))
    },
    generate,
    close(): void {
      transport.agent.destroy()
      for (const entry of transport.channels.values()) {
        void entry.opening.then(
          (c) => c !== channelUnsupported && c.close(),
          () => {},
        )
      }
      transport.channels.clear()
    },
  })
}

// ---------------------------------------------------------------------------------------------
// Reachability: what the probes found, and the pick of a worker for a new request

/** {@link serverInfo} as a probe: an answer makes the worker at `url` reachable again, a failure
 *  unreachable (the last probe to finish decides, whatever its deadline: a slow answer to an
 *  earlier probe is still an answer now). */
async function probe(t: Transport, url: string, signal?: AbortSignal): Promise<ServerInfo> {
  try {
    const info = await serverInfo(t, url, signal)
    t.unreachable.delete(url)
    return info
  } catch (err) {
    t.unreachable.set(url, err instanceof Error ? err.message : String(err))
    throw err
  }
}

/** The workers of one role a request may go to, and where its round-robin pick starts. */
interface Candidates {
  readonly role: 'prefill' | 'decode'
  readonly urls: readonly string[]
  readonly start: number
}

/** How long a new request waits for an unreachable worker to answer a probe again when no worker
 *  of its role is reachable, ms: one restarted or resumed serves it; one still silent refuses it
 *  this soon. */
const requestProbeTimeoutMs = 1_000

/** The first worker from `start` on that is not unreachable, or null when none is. */
function pickReachable(t: Transport, { urls, start }: Candidates): string | null {
  for (let i = 0; i < urls.length; i++) {
    const url = urls[(start + i) % urls.length]
    if (!t.unreachable.has(url)) return url
  }
  return null
}

/** {@link pickReachable}, but with none reachable every worker of the role is probed again first
 *  (one probe of {@link requestProbeTimeoutMs} per worker, shared by the requests waiting).
 *  Throws `worker_unavailable` when none answers, `request_aborted` when `signal` aborts first. */
async function pickAfterProbe(
  t: Transport,
  candidates: Candidates,
  rid: string,
  signal: AbortSignal,
): Promise<string> {
  const { role, urls } = candidates
  const found = pickReachable(t, candidates)
  if (found !== null) return found
  try {
    await untilAborted(Promise.all(urls.map((url) => requestProbe(t, url))), signal)
  } catch {
    // Only the abort rejects: a probe's failure is in `t.unreachable`.
    throw new KvfenceError(
      'request_aborted',
      `request ${rid} was aborted while its ${role} workers were probed`,
    )
  }
  const url = pickReachable(t, candidates)
  if (url !== null) return url
  const why = urls.map((u) => t.unreachable.get(u)).join('; ')
  throw new KvfenceError('worker_unavailable', `no ${role} worker answered a probe: ${why}`)
}

/** The probe of the worker at `url` that new requests wait on; settles (never rejects) once its
 *  outcome is in `t.unreachable`. */
function requestProbe(t: Transport, url: string): Promise<unknown> {
  let probing = t.requestProbes.get(url)
  if (probing === undefined) {
    const settled = () => t.requestProbes.delete(url)
    probing = probe(t, url, AbortSignal.timeout(requestProbeTimeoutMs)).then(settled, settled)
    t.requestProbes.set(url, probing)
  }
  return probing
}

/** `signal` bounded by the client's info deadline. */
function infoSignal(t: Transport, signal: AbortSignal | undefined): AbortSignal {
  const deadline = AbortSignal.timeout(t.infoTimeoutMs)
  return signal === undefined ? deadline : AbortSignal.any([signal, deadline])
}

/** `GET {url}/server_info`, parsed; a decode worker's transfer address is cached from it. */
async function serverInfo(t: Transport, url: string, signal?: AbortSignal): Promise<ServerInfo> {
  let res: http.IncomingMessage
  let body: unknown
  const bounded = infoSignal(t, signal)
  try {
    res = await sendIdempotent(t, `${url}/server_info`, bounded)
    body = await readJson(res)
  } catch (err) {
    // A deadline met says so: "ABORT_ERR The operation was aborted" read as the router's doing.
    const why =
      bounded.reason instanceof DOMException && bounded.reason.name === 'TimeoutError'
        ? 'no answer before the deadline (a stopped, stuck or overloaded worker)'
        : describe(err)
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
  if (info.role === 'decode' && info.transferPort !== undefined && t.decodeUrls.includes(url)) {
    const address = { host: info.transferHost ?? hostOf(url), port: info.transferPort }
    t.transferAddresses.set(url, Promise.resolve(address))
  }
  return info
}

async function metricsText(t: Transport, url: string, signal?: AbortSignal): Promise<string> {
  try {
    const res = await sendIdempotent(t, `${url}/metrics`, infoSignal(t, signal))
    const text = await readReplyText(res, maxLineBytes)
    if (res.statusCode !== 200) throw new Error(`HTTP ${res.statusCode}`)
    return text
  } catch (err) {
    throw new KvfenceError('worker_unavailable', `worker ${url}/metrics: ${describe(err)}`)
  }
}

async function acceptsClusterToken(
  t: Transport,
  url: string,
  signal?: AbortSignal,
): Promise<boolean> {
  try {
    const res = await send(
      t,
      `${url}/internal/cluster_token_check`,
      'POST',
      '{}',
      infoSignal(t, signal),
      t.controlHeaders,
    )
    await readReplyText(res, maxLineBytes) // drained, so the connection goes back to the pool
    return res.statusCode !== 401 && res.statusCode !== 403
  } catch (err) {
    throw new KvfenceError('worker_unavailable', `worker ${url} token check: ${describe(err)}`)
  }
}

/** The decode worker's transfer address: as its `reserved` event names it (current even right
 *  after a restart on another port), else as its `/server_info` reported it (cached). */
function transferAddress(
  t: Transport,
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
  let address = t.transferAddresses.get(decodeUrl)
  if (address === undefined) {
    address = serverInfo(t, decodeUrl, signal).then((info) => {
      if (info.role !== 'decode' || info.transferPort === undefined) {
        throw new KvfenceError(
          'worker_unavailable',
          `worker ${decodeUrl} is not a decode worker with a transfer port (role ${info.role})`,
        )
      }
      return { host: info.transferHost ?? hostOf(decodeUrl), port: info.transferPort }
    })
    address.catch(() => t.transferAddresses.delete(decodeUrl))
    t.transferAddresses.set(decodeUrl, address)
  }
  return address
}

// ---------------------------------------------------------------------------------------------
// One request: the two workers as the hand-off's sides

/** {@link handOff} on one decode and one prefill worker. Any failure but the client's own abort
 *  or a full pool may mean the decode worker restarted elsewhere: its cached transfer address is
 *  then dropped, to be read afresh next time. */
function generateOn(
  t: Transport,
  decodeUrl: string,
  prefillUrl: string,
  isChannelUsed: boolean,
  request: GenerateRequest,
  options: HandoffOptions,
): AsyncGenerator<GenerationEvent, void> {
  const onFailure = (err: KvfenceError) => {
    const isClientAbort = err.code === 'request_aborted'
    if (!isClientAbort && !(err instanceof PoolFullError)) t.transferAddresses.delete(decodeUrl)
  }
  const decode = isChannelUsed ? channelDecodeSide(t, decodeUrl) : decodeSide(t, decodeUrl)
  const prefill = isChannelUsed ? channelPrefillSide(t, prefillUrl) : prefillSide(t, prefillUrl)
  return handOff(request, decode, prefill, { ...options, onFailure })
}

/** The decode worker at `url` for one request: `POST /internal/generate`, its NDJSON events.
 *  A refusal with `capacity_exhausted` is a {@link PoolFullError}; every failure a KvfenceError. */
function decodeSide(t: Transport, url: string): DecodeSide {
  let isReusedSocket = false
  return {
    name: url,
    // Not a generator: the reply's lines go straight to the hand-off (see ndjson-lines.ts).
    generate(request, signal) {
      // The request goes out on the first pull.
      return lazyIterator(() =>
        startGenerate(t, url, request, signal).then((started) => {
          isReusedSocket = started.isReusedSocket
          return ndjsonLines(started.res, {
            parse: (line) => parseEvent(line, url),
            maxLineChars: maxLineBytes,
            tooLong: () =>
              new KvfenceError(
                'internal_error',
                `decode worker ${url} sent a line over ${maxLineBytes} bytes`,
              ),
            asError: (err) => asKvfenceError(err, `decode worker ${url}`),
          })
        }),
      )
    },
    transferAddress(reserved, signal) {
      // A new connection may be to a decode worker restarted since its address was cached.
      if (!isReusedSocket && reserved.transferPort === undefined) t.transferAddresses.delete(url)
      return transferAddress(t, url, reserved, signal)
    },
  }
}

/** An iterator over what `start` gives, called on the first pull (never, if the consumer leaves
 *  before). Not a generator: its layer would cost every token a few more promises. */
function lazyIterator<T>(start: () => Promise<AsyncIterator<T>>): AsyncIterableIterator<T> {
  let inner: AsyncIterator<T> | null = null
  let ready: Promise<void> | null = null
  const iterator: AsyncIterableIterator<T> = {
    next: () =>
      inner !== null
        ? inner.next()
        : (ready ??= start().then((started) => void (inner = started))).then(() => inner!.next()),
    return: () =>
      inner !== null ? inner.return!() : Promise.resolve({ value: undefined, done: true }),
    [Symbol.asyncIterator]: () => iterator,
  }
  return iterator
}

/** `POST /internal/generate` on the decode worker at `url`, its reply begun with 200. Throws
 *  `worker_unavailable` when it cannot be sent, and the worker's refusal otherwise (a
 *  {@link PoolFullError} for `capacity_exhausted`). */
async function startGenerate(
  t: Transport,
  url: string,
  request: GenerateRequest,
  signal: AbortSignal,
): Promise<{ res: http.IncomingMessage; isReusedSocket: boolean }> {
  let sent: { res: http.IncomingMessage; isReusedSocket: boolean }
  try {
    sent = await sendOn(
      t,
      `${url}/internal/generate`,
      'POST',
      JSON.stringify(request),
      signal,
      t.controlHeaders,
    )
  } catch (err) {
    throw new KvfenceError('worker_unavailable', `decode worker ${url}: ${describe(err)}`)
  }
  if (sent.res.statusCode !== 200) {
    const body = await readJson(sent.res).catch(() => null)
    const error = workerError('decode', url, sent.res.statusCode, body)
    throw error.code === 'capacity_exhausted' ? new PoolFullError(error.message) : error
  }
  return sent
}

/** The prefill worker at `url`: `POST /internal/prefill`, its parsed result. A refusal with
 *  `capacity_exhausted` is a {@link PoolFullError}; every failure a KvfenceError. */
function prefillSide(t: Transport, url: string): PrefillSide {
  return {
    name: url,
    prefill: (request, signal) =>
      prefill(t, url, request, signal).catch((err: unknown) => {
        throw asKvfenceError(err, `prefill worker ${url}`)
      }),
  }
}

async function prefill(
  t: Transport,
  url: string,
  request: PrefillRequest,
  signal: AbortSignal,
): Promise<PrefillResult> {
  const res = await send(
    t,
    `${url}/internal/prefill`,
    'POST',
    JSON.stringify(request),
    signal,
    t.controlHeaders,
  )
  const body = await readJson(res)
  if (res.statusCode !== 200) {
    const error = workerError('prefill', url, res.statusCode, body)
    throw error.code === 'capacity_exhausted' ? new PoolFullError(error.message) : error
  }
  const parsed = PrefillResult.safeParse(body)
  if (!parsed.success) {
    throw new KvfenceError(
      'internal_error',
      `prefill worker ${url}: unexpected reply (${issueText(parsed.error.issues[0])})`,
    )
  }
  return parsed.data
}

// ---------------------------------------------------------------------------------------------
// The two workers over the control channel

/** The channel to the worker at `url`: the open one, one being opened, or a new one; or
 *  `channelUnsupported` (HTTP) for a worker that answered 404 less than {@link channelRetryMs}
 *  ago. Throws `worker_unavailable` when it cannot connect, {@link ClusterTokenRefusedError} when
 *  the worker refuses the token. */
function channelTo(
  t: Transport,
  url: string,
  role: 'prefill' | 'decode',
): Promise<ControlChannel | typeof channelUnsupported> {
  const held = t.channels.get(url)
  if (held !== undefined) {
    const { value } = held
    if (value === undefined) return held.opening
    if (value === channelUnsupported && performance.now() - held.since < channelRetryMs)
      return held.opening
    if (value !== channelUnsupported && value.isOpen) return held.opening
  }
  const where = `${role} worker ${url}`
  // A new connection may be to a decode worker restarted since its address was cached.
  if (role === 'decode') t.transferAddresses.delete(url)
  const opening = openChannel({
    url,
    role,
    tls: t.tls,
    clusterToken: t.clusterToken,
    connectTimeoutMs: t.infoTimeoutMs,
    refusal: (status, body) => {
      const error = workerError(role, url, status, body)
      return error.code === 'capacity_exhausted' ? new PoolFullError(error.message) : error
    },
  }).catch((err: unknown) => {
    if (t.channels.get(url) === entry) t.channels.delete(url)
    if (err instanceof KvfenceError) throw err
    throw new KvfenceError('worker_unavailable', `${where}: ${describe(err)}`)
  })
  const entry: ChannelEntry = { opening, since: performance.now() }
  void opening.then(
    (value) => (entry.value = value),
    () => {},
  )
  t.channels.set(url, entry)
  return opening
}

/** The decode worker at `url` over its channel (HTTP when it has none). */
function channelDecodeSide(t: Transport, url: string): DecodeSide {
  const overHttp = decodeSide(t, url)
  let isOverHttp = false
  return {
    name: url,
    generate(request, signal) {
      // The stream opens on the first pull.
      return lazyIterator(() =>
        untilAborted(channelTo(t, url, 'decode'), signal).then((channel) => {
          if (channel !== channelUnsupported) return channel.generate(request, signal)
          isOverHttp = true
          return overHttp.generate(request, signal)[Symbol.asyncIterator]()
        }),
      )
    },
    // Every worker that serves the channel names its transfer port in `reserved`; for one that
    // does not, the cached address stands while the channel does (a restarted worker closes it,
    // and any failure drops the cache: see generateOn).
    transferAddress: (reserved, signal) =>
      isOverHttp
        ? overHttp.transferAddress(reserved, signal)
        : transferAddress(t, url, reserved, signal),
  }
}

/** `opening` (a channel shared by every request to its worker), or the request's own abort
 *  error as soon as `signal` fires: a request must not wait out a connection to a worker that
 *  does not answer (a stopped one) once its client has gone or the drain's deadline has passed;
 *  the opening goes on for the requests after it. */
function untilAborted<T>(opening: Promise<T>, signal: AbortSignal): Promise<T> {
  if (signal.aborted) return Promise.reject(abortError(signal))
  return new Promise<T>((resolve, reject) => {
    const onAbort = () => reject(abortError(signal))
    signal.addEventListener('abort', onAbort, { once: true })
    opening.then(
      (value) => {
        signal.removeEventListener('abort', onAbort)
        resolve(value)
      },
      (err: unknown) => {
        signal.removeEventListener('abort', onAbort)
        reject(err as Error)
      },
    )
  })
}

/** The prefill worker at `url` over its channel (HTTP when it has none). */
function channelPrefillSide(t: Transport, url: string): PrefillSide {
  const overHttp = prefillSide(t, url)
  return {
    name: url,
    prefill: (request, signal) =>
      untilAborted(channelTo(t, url, 'prefill'), signal)
        .then((channel) =>
          channel === channelUnsupported
            ? overHttp.prefill(request, signal)
            : channel.prefill(request, signal),
        )
        .catch((err: unknown) => {
          throw asKvfenceError(err, `prefill worker ${url}`)
        }),
  }
}

// ---------------------------------------------------------------------------------------------
// HTTP plumbing

/** A GET that is safe to repeat: sent once more, on a new connection, when a reused keep-alive
 *  connection was reset before any reply (the worker closed it as the request went out). POSTs
 *  are never repeated: a worker may have acted on one. */
async function sendIdempotent(
  t: Transport,
  url: string,
  signal: AbortSignal,
): Promise<http.IncomingMessage> {
  try {
    return await send(t, url, 'GET', null, signal)
  } catch (err) {
    if (!(err instanceof ReusedSocketReset)) throw err
    // A connection of its own, never a pooled one.
    return send(t, url, 'GET', null, signal, {}, false)
  }
}

/** A request on a reused keep-alive connection was reset before its reply began. */
class ReusedSocketReset extends Error {
  readonly code = 'ECONNRESET'
  constructor(cause: Error) {
    super(cause.message, { cause })
  }
}

function send(
  t: Transport,
  url: string,
  method: 'GET' | 'POST',
  body: string | null,
  signal: AbortSignal,
  extraHeaders: http.OutgoingHttpHeaders = {},
  isPooled = true,
): Promise<http.IncomingMessage> {
  return sendOn(t, url, method, body, signal, extraHeaders, isPooled).then((sent) => sent.res)
}

/** {@link send}, also telling whether the request went out on a reused keep-alive connection. */
function sendOn(
  t: Transport,
  url: string,
  method: 'GET' | 'POST',
  body: string | null,
  signal: AbortSignal,
  extraHeaders: http.OutgoingHttpHeaders = {},
  isPooled = true,
): Promise<{ res: http.IncomingMessage; isReusedSocket: boolean }> {
  const agent = isPooled ? t.agent : false
  const target = targetOf(t, url)
  return new Promise((resolve, reject) => {
    const headers: http.OutgoingHttpHeaders = { accept: 'application/json', ...extraHeaders }
    if (body !== null) {
      headers['content-type'] = 'application/json'
      headers['content-length'] = Buffer.byteLength(body)
    }
    const request = url.startsWith('https:') ? https.request : http.request
    const req = request({ ...target, method, agent, headers }, (res) =>
      resolve({ res, isReusedSocket: req.reusedSocket }),
    )
    req.on('error', (err: NodeJS.ErrnoException) =>
      reject(req.reusedSocket && err.code === 'ECONNRESET' ? new ReusedSocketReset(err) : err),
    )
    req.end(body ?? undefined)
    destroyOnAbort(req, signal) // after `end`: a destroyed request must not be written to
  })
}

/** Destroys `req` — and with it its reply, and the connection — when `signal` aborts before the
 *  request has ended (its reply read to the end, or its connection closed), as the `signal`
 *  option of `http.request` does, and with the same error (`AbortError`, `ABORT_ERR`). A
 *  listener of its own rather than that option: Node's watches the request's end with an
 *  end-of-stream watcher, which cost every request about 30 µs of CPU more (measured in the
 *  router bench's bare HTTP relay, two requests per generation). */
function destroyOnAbort(req: http.ClientRequest, signal: AbortSignal): void {
  const onAbort = () => void req.destroy(abortError(signal))
  if (signal.aborted) return onAbort()
  signal.addEventListener('abort', onAbort, { once: true })
  // 'close': the reply was read to its end, or the request or its connection was destroyed.
  req.once('close', () => signal.removeEventListener('abort', onAbort))
}

/** `url`'s request options (protocol, host, port, path), parsed on first use. */
function targetOf(t: Transport, url: string): http.RequestOptions {
  let target = t.targets.get(url)
  if (target === undefined) {
    const parsed = new URL(url)
    target = {
      protocol: parsed.protocol,
      hostname: hostOf(url),
      port: parsed.port,
      path: `${parsed.pathname}${parsed.search}`,
    }
    t.targets.set(url, target)
  }
  return target
}

async function readJson(res: http.IncomingMessage): Promise<unknown> {
  const text = await readReplyText(res, maxLineBytes)
  try {
    return JSON.parse(text)
  } catch {
    throw new Error(`reply is not JSON (HTTP ${res.statusCode})`)
  }
}

function parseEvent(line: string, url: string): DecodeEvent {
  let value: unknown
  try {
    value = JSON.parse(line)
  } catch {
    throw new KvfenceError('internal_error', `decode worker ${url} sent a line that is not JSON`)
  }
  if (isPlainTokenEvent(value)) return value
  const parsed = DecodeEvent.safeParse(value)
  if (!parsed.success) {
    throw new KvfenceError(
      'internal_error',
      `decode worker ${url} sent an invalid event (${issueText(parsed.error.issues[0])})`,
    )
  }
  return parsed.data
}

/** Whether `value` is a token event without log-probabilities, the one event of every token:
 *  `{ type: 'token', tokenId }` with a non-negative integer id and nothing else, which is what
 *  {@link DecodeEvent} accepts of it (any other event goes through the schema). */
function isPlainTokenEvent(value: unknown): value is DecodeEvent {
  if (typeof value !== 'object' || value === null) return false
  const { type, tokenId } = value as Record<string, unknown>
  if (type !== 'token' || !Number.isSafeInteger(tokenId) || (tokenId as number) < 0) return false
  // Its own keys counted without an array per token (JSON.parse makes no inherited ones).
  let numKeys = 0
  for (const key in value) if (Object.hasOwn(value, key)) numKeys++
  return numKeys === 2
}

/** The KvfenceError for a worker's non-200 reply `{ error: { code, message } }`. */
function workerError(
  role: 'prefill' | 'decode',
  url: string,
  status: number | undefined,
  body: unknown,
): KvfenceError {
  if (status === 401 || status === 403)
    return new ClusterTokenRefusedError(`${role} worker ${url}`, status)
  const parsed = WorkerErrorSchema.safeParse(body)
  if (!parsed.success) {
    return new KvfenceError('worker_unavailable', `${role} worker ${url}: HTTP ${status}`)
  }
  const { code, message } = parsed.data.error
  return new WorkerReportedError(
    isErrorCode(code) ? code : 'internal_error',
    `${role} worker ${url}: ${code}: ${message}`,
  )
}

function asKvfenceError(err: unknown, where: string): KvfenceError {
  if (err instanceof KvfenceError) return err
  return new KvfenceError('worker_unavailable', `${where}: ${describe(err)}`)
}

function describe(err: unknown): string {
  if (err instanceof Error) {
    const tlsText = describeTlsError(err)
    if (tlsText !== err.message) return tlsText
    const code = (err as NodeJS.ErrnoException).code
    return code !== undefined && !err.message.includes(code)
      ? `${code} ${err.message}`
      : err.message
  }
  return String(err)
}

function issueText(issue: z.core.$ZodIssue | undefined): string {
  if (issue === undefined) return 'invalid'
  const path = issue.path.map(String).join('.')
  return path === '' ? issue.message : `${path}: ${issue.message}`
}

function normalizeBaseUrl(url: string, protocol: 'http:' | 'https:'): string {
  let parsed: URL
  try {
    parsed = new URL(url)
  } catch {
    throw new KvfenceError('internal_error', `worker URL ${JSON.stringify(url)} is not a URL`)
  }
  if (parsed.protocol !== protocol) {
    const why = protocol === 'https:' ? 'with TLS configured' : 'without TLS configured'
    throw new KvfenceError('internal_error', `worker URL ${url} must use ${protocol} ${why}`)
  }
  return parsed.origin
}

function hostOf(baseUrl: string): string {
  let host = hostsOfUrls.get(baseUrl)
  if (host === undefined) {
    host = new URL(baseUrl).hostname.replace(/^\[(.*)\]$/, '$1')
    hostsOfUrls.set(baseUrl, host)
  }
  return host
}

/** Worker URL → its host, parsed once: every request on a decode worker names its host. The keys
 *  are the configured workers' URLs, so the map stays small. */
const hostsOfUrls = new Map<string, string>()
