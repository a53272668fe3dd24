/** The control plane as the router uses it: one request's steps on a decode and a prefill
 *  worker over the control channel (channel-client.ts: one multiplexed connection per worker,
 *  plaintext or mutual TLS 1.3 against the cluster CA), driven by the hand-off (handoff.ts), which
 *  orders the steps and checks the workers' reports before any token leaves; each worker picked
 *  round-robin among those of its role whose last probe answered (worker-probe.ts, which also
 *  serves the router's `/server_info`, `/metrics` and token probes over HTTP).
 *  Knows worker URLs, channels and request ids; knows nothing of text, API keys or OpenAI shapes. */
import { z } from 'zod'
import { KvfenceError, isErrorCode } from '../common/errors.js'
import type { TlsMaterial } from '../link/tls.js'
import { untilAborted } from './abort.js'
import { openChannel, type ControlChannel } from './channel-client.js'
import { describeError } from './error-text.js'
import {
  handOff,
  WorkerReportedError,
  type DecodeSide,
  type GenerationEvent,
  type HandoffOptions,
  type PrefillSide,
} from './handoff.js'
import type { GenerateRequest, ServerInfo } from './messages.js'
import { createWorkerProbe, type WorkerProbe, type WorkerReport } from './worker-probe.js'

export { WorkerReportedError, type GenerationEvent, type WorkerReport }

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

/** A worker refused the router's control channel with 401/403: it does not take the router's
 *  cluster token. That is the operator's misconfiguration (the router's `KVFENCE_CLUSTER_TOKEN`
 *  differs from the workers'), never the tenant's, so it is `worker_unavailable` (503), not the
 *  worker's `invalid_api_key`. The message names the worker, never the token. */
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
  /** Runs one request on a decode and a prefill worker through `handOff` (handoff.ts), each
   *  picked round-robin among the workers of its role not found unreachable by their last probe.
   *  Yields the decode worker's tokens — the first only after the prefill worker's result was
   *  checked against it — and a final `done`; throws a {@link KvfenceError} on any failure (never
   *  a normal `done` after one). When no worker of a role is reachable, each is probed again (for
   *  up to 1 s) before any is asked to run it: `worker_unavailable` at the first pull when none
   *  answers. Aborting `signal`, or leaving the iteration early, sends a `cancel` frame on both
   *  workers' streams, which aborts the request on both workers (G8). */
  generate(request: GenerateRequest, signal: AbortSignal): AsyncGenerator<GenerationEvent, void>
  /** Closes the channels and pooled connections. */
  close(): void
}

/** Options of {@link createWorkerClient}. */
export interface WorkerClientOptions {
  prefillUrls: readonly string[]
  decodeUrls: readonly string[]
  /** Longest silence from the decode worker during a request before it fails, in ms. */
  idleTimeoutMs?: number
  /** Deadline of a probe (`/server_info`, `/metrics`, the token check) and of opening a channel,
   *  in ms. */
  infoTimeoutMs?: number
  /** Idle time after which a probe's pooled connection is closed, in ms (see worker-probe.ts);
   *  must stay below the workers' `keepAliveTimeout`. */
  freeSocketTimeoutMs?: number
  /** Cross-check the workers' reports (prompt length, first token, counts) before any output
   *  leaves; false only in the incident's configuration. Default true. */
  guardsEnabled?: boolean
  /** The cluster token the workers require on the channel and `POST /internal/*` (see
   *  cluster-token.ts). */
  clusterToken?: string | null
  /** The router's TLS files, read: required for `https:` worker URLs, refused with `http:` ones
   *  (every worker of a client speaks the same). Default: none (plaintext). */
  tls?: TlsMaterial | null
}

const defaultIdleTimeoutMs = 120_000

/** What every request of one client shares. */
interface Workers {
  readonly probe: WorkerProbe
  readonly tls: TlsMaterial | null
  readonly clusterToken: string | null
  /** Worker URL → its control channel (being opened, or open). */
  readonly channels: Map<string, ChannelEntry>
}

/** A worker's control channel as the client holds it. */
interface ChannelEntry {
  readonly opening: Promise<ControlChannel>
  /** Once opened: the channel. */
  value?: ControlChannel
}

/** A {@link WorkerClient}: request steps over the control channel, probes over HTTP. */
export function createWorkerClient(options: WorkerClientOptions): WorkerClient {
  if (options.prefillUrls.length === 0 || options.decodeUrls.length === 0) {
    throw new KvfenceError('internal_error', 'need at least one prefill and one decode worker URL')
  }
  const tls = options.tls ?? null
  const protocol = tls === null ? 'http:' : 'https:'
  const prefillUrls = Object.freeze(options.prefillUrls.map((u) => normalizeBaseUrl(u, protocol)))
  const decodeUrls = Object.freeze(options.decodeUrls.map((u) => normalizeBaseUrl(u, protocol)))
  const clusterToken = options.clusterToken ?? null
  const probe = createWorkerProbe({
    decodeUrls,
    clusterToken,
    tls,
    ...(options.infoTimeoutMs === undefined ? {} : { infoTimeoutMs: options.infoTimeoutMs }),
    ...(options.freeSocketTimeoutMs === undefined
      ? {}
      : { freeSocketTimeoutMs: options.freeSocketTimeoutMs }),
  })
  const w: Workers = { probe, tls, clusterToken, channels: new Map() }
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
    const decodeUrl = probe.pickReachable(decode)
    const prefillUrl = probe.pickReachable(prefill)
    if (decodeUrl !== null && prefillUrl !== null)
      return generateOn(w, decodeUrl, prefillUrl, request, options)
    // A stopped worker keeps its connections open and answers nothing: sent there, the request
    // would wait out `idleTimeoutMs`. Probed again first, a restarted or resumed one serves it
    // (a generator layer of its own only on this path).
    return (async function* () {
      const [d, p] = await Promise.all([
        probe.pickAfterProbe(decode, request.requestId, signal),
        probe.pickAfterProbe(prefill, request.requestId, signal),
      ])
      yield* generateOn(w, d, p, request, options)
    })()
  }

  return Object.freeze({
    prefillUrls,
    decodeUrls,
    serverInfo: probe.serverInfo,
    metricsText: probe.metricsText,
    acceptsClusterToken: probe.acceptsClusterToken,
    async serverInfoAll(signal?: AbortSignal): Promise<WorkerReport[]> {
      const urls = [...prefillUrls, ...decodeUrls]
      const infos = await Promise.all(urls.map((url) => probe.serverInfo(url, signal)))
      return urls.map((url, i) => ({ url, info: infos[i] }))
    },
    generate,
    close(): void {
      probe.close()
      for (const entry of w.channels.values()) {
        void entry.opening.then(
          (c) => c.close(),
          () => {},
        )
      }
      w.channels.clear()
    },
  })
}

// ---------------------------------------------------------------------------------------------
// One request: the two workers as the hand-off's sides

/** {@link handOff} on one decode and one prefill worker. Any failure but the client's own abort
 *  or a full pool may mean the decode worker restarted elsewhere: its cached transfer address is
 *  then dropped, to be read afresh next time. */
function generateOn(
  w: Workers,
  decodeUrl: string,
  prefillUrl: string,
  request: GenerateRequest,
  options: HandoffOptions,
): AsyncGenerator<GenerationEvent, void> {
  const onFailure = (err: KvfenceError) => {
    const isClientAbort = err.code === 'request_aborted'
    if (!isClientAbort && !(err instanceof PoolFullError)) w.probe.forgetTransferAddress(decodeUrl)
  }
  return handOff(request, decodeSide(w, decodeUrl), prefillSide(w, prefillUrl), {
    ...options,
    onFailure,
  })
}

/** The decode worker at `url`: a `generate` stream on its channel, its events. A refusal with
 *  `capacity_exhausted` is a {@link PoolFullError}; every failure a KvfenceError. */
function decodeSide(w: Workers, url: string): DecodeSide {
  return {
    name: url,
    generate(request, signal) {
      // The stream opens on the first pull.
      return lazyIterator(() =>
        untilAborted(channelTo(w, url, 'decode'), signal).then((channel) =>
          channel.generate(request, signal),
        ),
      )
    },
    // Every worker names its transfer port in `reserved`; for a peer that does not, the address
    // its `/server_info` gave stands while the channel does (a restarted worker closes it, and
    // any failure drops the cache: see generateOn).
    transferAddress: (reserved, signal) => w.probe.transferAddress(url, reserved, signal),
  }
}

/** The prefill worker at `url`: a `prefill` stream on its channel, its result. A refusal with
 *  `capacity_exhausted` is a {@link PoolFullError}; every failure a KvfenceError. */
function prefillSide(w: Workers, url: string): PrefillSide {
  return {
    name: url,
    prefill: (request, signal) =>
      untilAborted(channelTo(w, url, 'prefill'), signal)
        .then((channel) => channel.prefill(request, signal))
        .catch((err: unknown) => {
          throw asKvfenceError(err, `prefill worker ${url}`)
        }),
  }
}

/** The channel to the worker at `url`: the open one, one being opened, or a new one. Throws
 *  `worker_unavailable` when it cannot connect or the worker does not serve the channel,
 *  {@link ClusterTokenRefusedError} when the worker refuses the token. */
function channelTo(w: Workers, url: string, role: 'prefill' | 'decode'): Promise<ControlChannel> {
  const held = w.channels.get(url)
  if (held !== undefined && (held.value === undefined || held.value.isOpen)) return held.opening
  // A new connection may be to a decode worker restarted since its address was cached.
  if (role === 'decode') w.probe.forgetTransferAddress(url)
  const opening = openChannel({
    url,
    role,
    tls: w.tls,
    clusterToken: w.clusterToken,
    connectTimeoutMs: w.probe.infoTimeoutMs,
    refusal: (status, body) => {
      const error = workerError(role, url, status, body)
      return error.code === 'capacity_exhausted' ? new PoolFullError(error.message) : error
    },
  }).catch((err: unknown) => {
    if (w.channels.get(url) === entry) w.channels.delete(url)
    throw asKvfenceError(err, `${role} worker ${url}`)
  })
  const entry: ChannelEntry = { opening }
  void opening.then(
    (value) => (entry.value = value),
    () => {},
  )
  w.channels.set(url, entry)
  return opening
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

// ---------------------------------------------------------------------------------------------
// Workers' refusals

const WorkerErrorSchema = z.object({
  error: z.object({ code: z.string(), message: z.string() }),
})

/** The KvfenceError for a worker's refusal `{ error: { code, message } }`: of the channel's
 *  upgrade (with its HTTP `status`), or of one stream (a `failed` frame, `status` undefined). */
function workerError(
  role: 'prefill' | 'decode',
  url: string,
  status: number | undefined,
  body: unknown,
): KvfenceError {
  if (status === 401 || status === 403)
    return new ClusterTokenRefusedError(`${role} worker ${url}`, status)
  if (status === 404) {
    return new KvfenceError(
      'worker_unavailable',
      `${role} worker ${url} does not serve the control channel (HTTP 404 to its upgrade)`,
    )
  }
  // A refused upgrade is the worker's state, not the request's: never a 4xx for the client.
  const parsed = status === undefined ? WorkerErrorSchema.safeParse(body) : null
  if (parsed === null || !parsed.success) {
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
  return new KvfenceError('worker_unavailable', `${where}: ${describeError(err)}`)
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
