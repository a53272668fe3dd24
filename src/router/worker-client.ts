/** The router side of the control plane (see `src/engine/control.ts`): asks a decode worker to
 *  reserve pages and stream tokens, asks a prefill worker to fill them, and aborts both when the
 *  request ends early (G8). HTTP/1.1 + JSON over keep-alive `node:http` agents.
 *  Knows worker URLs, token ids and request ids; knows nothing of text, API keys or OpenAI shapes. */
import { clusterTokenHeader } from '../engine/cluster-token.js'
import assert from 'node:assert/strict'
import http from 'node:http'
import { z } from 'zod'
import {
  DecodeEvent,
  GenerateRequest,
  type PrefillRequest,
  PrefillResult,
  ServerInfo,
  type TokenLogprobs,
} from '../engine/control.js'
import { KvfenceError, isErrorCode, type ErrorCode } from '../errors.js'
import type { WorkerReport } from './capacity.js'
import { readReplyText } from './http.js'

/** What {@link WorkerClient.generate} yields: the decode worker's tokens, then one `done`. */
export type GenerationEvent =
  | {
      type: 'token'
      tokenId: number
      /** Only when the request asked for log-probabilities (the first token's come from the
       *  prefill worker's result). */
      logprobs?: TokenLogprobs
    }
  | {
      type: 'done'
      finishReason: 'stop' | 'length'
      promptTokens: number
      completionTokens: number
      /** Prompt tokens served from a prefix cache, when the decode worker reports it. */
      cachedTokens?: number
      /** Pages the prefill worker transferred for this request. */
      numTransferredPages: number
    }

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
  /** `GET {url}/server_info` of one worker; throws `worker_unavailable`. */
  serverInfo(url: string, signal?: AbortSignal): Promise<ServerInfo>
  /** `GET {url}/metrics` of one worker (Prometheus text); throws `worker_unavailable`. */
  metricsText(url: string, signal?: AbortSignal): Promise<string>
  /** Whether the worker at `url` takes the router's cluster token: true unless it answers a
   *  control-plane probe (`POST /internal/cluster_token_check`) with 401/403 (a worker that takes
   *  the token answers 200; one from before that route, 404). Throws `worker_unavailable` when it
   *  does not answer. */
  acceptsClusterToken(url: string, signal?: AbortSignal): Promise<boolean>
  /** `/server_info` of every worker (prefill first); throws `worker_unavailable` if any fails. */
  serverInfoAll(signal?: AbortSignal): Promise<WorkerReport[]>
  /** Runs one request on a decode and a prefill worker (picked round-robin). Yields the decode
   *  worker's tokens — the first only after the prefill worker's result was checked against it —
   *  and a final `done`; throws a {@link KvfenceError} on any failure (never a normal `done`
   *  after one). Aborting `signal`, or leaving the iteration early, closes both
   *  worker requests, which aborts the request on both workers (G8). */
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
}

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

/** A {@link WorkerClient} over `node:http` with one keep-alive agent. */
export function createWorkerClient(options: WorkerClientOptions): WorkerClient {
  if (options.prefillUrls.length === 0 || options.decodeUrls.length === 0) {
    throw new KvfenceError('internal_error', 'need at least one prefill and one decode worker URL')
  }
  const prefillUrls = Object.freeze(options.prefillUrls.map(normalizeBaseUrl))
  const decodeUrls = Object.freeze(options.decodeUrls.map(normalizeBaseUrl))
  const idleTimeoutMs = options.idleTimeoutMs ?? defaultIdleTimeoutMs
  const infoTimeoutMs = options.infoTimeoutMs ?? defaultInfoTimeoutMs
  const guardsEnabled = options.guardsEnabled ?? true
  // Workers take control requests only from the holder of the cluster token.
  const controlHeaders: http.OutgoingHttpHeaders =
    options.clusterToken == null ? {} : { [clusterTokenHeader]: options.clusterToken }
  // `timeout` closes a pooled connection that sat idle that long (an in-use one only gets a
  // 'timeout' event, which nothing here listens to: long silences are `idleTimeoutMs`'s job).
  const agent = new http.Agent({
    keepAlive: true,
    timeout: options.freeSocketTimeoutMs ?? freeSocketTimeoutMs,
  })
  let nextPrefill = 0
  let nextDecode = 0
  /** Decode worker URL → its transfer (data-plane) address, from its `/server_info`: the fallback
   *  for a decode worker whose `reserved` event does not name it. Refreshed by every
   *  `/server_info` read, dropped on any failure of a request on that worker. */
  const transferAddresses = new Map<string, Promise<TransferAddress>>()

  async function serverInfo(url: string, signal?: AbortSignal): Promise<ServerInfo> {
    const deadline = AbortSignal.timeout(infoTimeoutMs)
    const combined = signal === undefined ? deadline : AbortSignal.any([signal, deadline])
    let res: http.IncomingMessage
    let body: unknown
    try {
      res = await sendIdempotent(agent, `${url}/server_info`, combined)
      body = await readJson(res)
    } catch (err) {
      throw new KvfenceError('worker_unavailable', `worker ${url}/server_info: ${describe(err)}`)
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
    if (info.role === 'decode' && info.transferPort !== undefined && decodeUrls.includes(url)) {
      const address = { host: info.transferHost ?? hostOf(url), port: info.transferPort }
      transferAddresses.set(url, Promise.resolve(address))
    }
    return info
  }

  async function metricsText(url: string, signal?: AbortSignal): Promise<string> {
    const deadline = AbortSignal.timeout(infoTimeoutMs)
    const combined = signal === undefined ? deadline : AbortSignal.any([signal, deadline])
    try {
      const res = await sendIdempotent(agent, `${url}/metrics`, combined)
      const text = await readReplyText(res, maxLineBytes)
      if (res.statusCode !== 200) throw new Error(`HTTP ${res.statusCode}`)
      return text
    } catch (err) {
      throw new KvfenceError('worker_unavailable', `worker ${url}/metrics: ${describe(err)}`)
    }
  }

  async function acceptsClusterToken(url: string, signal?: AbortSignal): Promise<boolean> {
    const deadline = AbortSignal.timeout(infoTimeoutMs)
    const combined = signal === undefined ? deadline : AbortSignal.any([signal, deadline])
    try {
      const res = await send(
        agent,
        `${url}/internal/cluster_token_check`,
        'POST',
        '{}',
        combined,
        controlHeaders,
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
    decodeUrl: string,
    reserved: Extract<DecodeEvent, { type: 'reserved' }>,
    signal: AbortSignal,
  ): Promise<TransferAddress> {
    if (reserved.transferPort !== undefined) {
      return Promise.resolve({
        host: reserved.transferHost ?? hostOf(decodeUrl),
        port: reserved.transferPort,
      })
    }
    let address = transferAddresses.get(decodeUrl)
    if (address === undefined) {
      address = serverInfo(decodeUrl, signal).then((info) => {
        if (info.role !== 'decode' || info.transferPort === undefined) {
          throw new KvfenceError(
            'worker_unavailable',
            `worker ${decodeUrl} is not a decode worker with a transfer port (role ${info.role})`,
          )
        }
        return { host: info.transferHost ?? hostOf(decodeUrl), port: info.transferPort }
      })
      address.catch(() => transferAddresses.delete(decodeUrl))
      transferAddresses.set(decodeUrl, address)
    }
    return address
  }

  async function prefill(
    url: string,
    request: PrefillRequest,
    signal: AbortSignal,
  ): Promise<PrefillResult> {
    const res = await send(
      agent,
      `${url}/internal/prefill`,
      'POST',
      JSON.stringify(request),
      signal,
      controlHeaders,
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

  async function* generate(
    request: GenerateRequest,
    signal: AbortSignal,
  ): AsyncGenerator<GenerationEvent, void> {
    assert.ok(GenerateRequest.safeParse(request).success, 'router built an invalid GenerateRequest')
    const rid = request.requestId
    const decodeUrl = decodeUrls[nextDecode++ % decodeUrls.length]
    const prefillUrl = prefillUrls[nextPrefill++ % prefillUrls.length]

    // One controller closes both worker requests; the first failure recorded wins.
    const inner = new AbortController()
    let failure: KvfenceError | null = null
    const fail = (err: unknown) => {
      failure ??= asKvfenceError(err, `request ${rid}`)
      inner.abort()
    }
    const onClientAbort = () =>
      fail(new KvfenceError('request_aborted', `request ${rid} was aborted by the client`))
    if (signal.aborted) onClientAbort()
    else signal.addEventListener('abort', onClientAbort, { once: true })
    let idleTimer: NodeJS.Timeout | undefined
    const touch = () => {
      clearTimeout(idleTimer)
      idleTimer = setTimeout(
        () =>
          fail(
            new KvfenceError(
              'worker_unavailable',
              `decode worker ${decodeUrl} sent nothing for ${idleTimeoutMs} ms (request ${rid})`,
            ),
          ),
        idleTimeoutMs,
      )
    }
    let isFinished = false

    try {
      touch()
      let res: http.IncomingMessage
      let isReusedSocket: boolean
      try {
        ;({ res, isReusedSocket } = await sendOn(
          agent,
          `${decodeUrl}/internal/generate`,
          'POST',
          JSON.stringify(request),
          inner.signal,
          controlHeaders,
        ))
      } catch (err) {
        throw (
          failure ??
          new KvfenceError('worker_unavailable', `decode worker ${decodeUrl}: ${describe(err)}`)
        )
      }
      if (res.statusCode !== 200) {
        const error = workerError(
          'decode',
          decodeUrl,
          res.statusCode,
          await readJson(res).catch(() => null),
        )
        throw error.code === 'capacity_exhausted' ? new PoolFullError(error.message) : error
      }

      let prefillResult: Promise<PrefillResult> | null = null
      let numTokens = 0
      let done: Extract<DecodeEvent, { type: 'done' }> | null = null
      // Read to the end of the response even after `done` (which is the last line): leaving the
      // loop early would destroy the keep-alive connection, costing a new one per request.
      for await (const event of decodeEvents(res, decodeUrl)) {
        touch()
        if (done !== null) throw protocolError(decodeUrl, rid, `a ${event.type} event after done`)
        switch (event.type) {
          case 'reserved': {
            if (prefillResult !== null)
              throw protocolError(decodeUrl, rid, 'a second reserved event')
            // A new connection may be to a decode worker restarted since its address was cached.
            if (!isReusedSocket && event.transferPort === undefined) {
              transferAddresses.delete(decodeUrl)
            }
            const decode = await transferAddress(decodeUrl, event, inner.signal)
            prefillResult = prefill(
              prefillUrl,
              {
                requestId: rid,
                tenant: request.tenant,
                promptTokenIds: request.promptTokenIds,
                sampling: request.sampling,
                transferSecret: request.transferSecret,
                decode,
              },
              inner.signal,
            )
            prefillResult.catch((err: unknown) => {
              fail(
                err instanceof KvfenceError
                  ? err
                  : new KvfenceError(
                      'worker_unavailable',
                      `prefill worker ${prefillUrl}: ${describe(err)}`,
                    ),
              )
            })
            break
          }
          case 'token':
            if (prefillResult === null)
              throw protocolError(decodeUrl, rid, 'a token before reserved')
            if (numTokens >= request.maxTokens) {
              throw protocolError(decodeUrl, rid, `more than maxTokens ${request.maxTokens} tokens`)
            }
            if (numTokens === 0) {
              // No output leaves before the prefill worker confirmed this request's transfer.
              const result = await prefillResult
              if (guardsEnabled) checkPrefill(result, event.tokenId, request, prefillUrl, decodeUrl)
              numTokens++
              // The first token was sampled by the prefill worker: its log-probabilities too.
              yield result.firstTokenLogprobs === undefined
                ? event
                : { ...event, logprobs: result.firstTokenLogprobs }
              break
            }
            numTokens++
            yield event
            break
          case 'done':
            if (prefillResult === null) throw protocolError(decodeUrl, rid, 'done before reserved')
            done = event
            break
          case 'error':
            throw new WorkerReportedError(
              isErrorCode(event.code) ? event.code : 'internal_error',
              `decode worker ${decodeUrl}: ${event.code}: ${event.message}`,
            )
        }
      }
      if (done === null || prefillResult === null) {
        throw new KvfenceError(
          'worker_unavailable',
          `decode worker ${decodeUrl} ended request ${rid} without a done event`,
        )
      }
      const result = await prefillResult
      if (guardsEnabled) checkDone(done, numTokens, request, decodeUrl)
      isFinished = true
      const { type, finishReason, promptTokens, completionTokens } = done
      // Prefix-cache hits happen on the prefill worker; only it knows how many prompt tokens were cached.
      const cachedTokens = result.cachedTokens ?? done.cachedTokens
      if (
        guardsEnabled &&
        cachedTokens !== undefined &&
        !(cachedTokens >= 0 && cachedTokens < promptTokens)
      ) {
        throw protocolError(
          prefillUrl,
          rid,
          `cachedTokens ${cachedTokens} outside [0, ${promptTokens})`,
        )
      }
      yield {
        type,
        finishReason,
        promptTokens,
        completionTokens,
        ...(cachedTokens === undefined ? {} : { cachedTokens }),
        numTransferredPages: result.numPages,
      }
    } catch (err) {
      const error = failure ?? asKvfenceError(err, `decode worker ${decodeUrl}`)
      // Any failure but the client's own abort may mean the decode worker restarted elsewhere:
      // read its transfer address afresh next time.
      if (error.code !== 'request_aborted' && !(error instanceof PoolFullError)) {
        transferAddresses.delete(decodeUrl)
      }
      throw error
    } finally {
      clearTimeout(idleTimer)
      signal.removeEventListener('abort', onClientAbort)
      if (!isFinished) inner.abort()
    }
  }

  return Object.freeze({
    prefillUrls,
    decodeUrls,
    serverInfo,
    metricsText,
    acceptsClusterToken,
    async serverInfoAll(signal?: AbortSignal): Promise<WorkerReport[]> {
      const urls = [...prefillUrls, ...decodeUrls]
      const infos = await Promise.all(urls.map((url) => serverInfo(url, signal)))
      return urls.map((url, i) => ({ url, info: infos[i] }))
    },
    generate,
    close(): void {
      agent.destroy()
    },
  })
}

// ---------------------------------------------------------------------------------------------
// Consistency checks (defence in depth behind the workers' own guards; off with guards off)

/** The prefill worker's result must be for this request, cover the whole prompt, and agree with
 *  the decode worker on the first token; otherwise the output is of unknown origin. */
function checkPrefill(
  result: PrefillResult,
  firstTokenId: number,
  request: GenerateRequest,
  prefillUrl: string,
  decodeUrl: string,
): void {
  const rid = request.requestId
  const numPromptTokens = request.promptTokenIds.length
  const problems: string[] = []
  if (result.requestId !== rid) problems.push(`prefill answered for request ${result.requestId}`)
  if (result.numTokens !== numPromptTokens) {
    problems.push(`prefill sent ${result.numTokens} prompt tokens, want ${numPromptTokens}`)
  }
  if (result.firstTokenId !== firstTokenId) {
    problems.push(`first token ${firstTokenId} from decode, ${result.firstTokenId} from prefill`)
  }
  if (problems.length > 0) {
    throw new KvfenceError(
      'guard_violation',
      `request ${rid} (prefill ${prefillUrl}, decode ${decodeUrl}): ${problems.join('; ')}`,
    )
  }
}

/** The decode worker's `done` must count the prompt the router sent and the tokens it streamed. */
function checkDone(
  done: Extract<DecodeEvent, { type: 'done' }>,
  numTokens: number,
  request: GenerateRequest,
  decodeUrl: string,
): void {
  const numPromptTokens = request.promptTokenIds.length
  const problems: string[] = []
  if (done.promptTokens !== numPromptTokens) {
    problems.push(`decode counted ${done.promptTokens} prompt tokens, want ${numPromptTokens}`)
  }
  if (done.completionTokens !== numTokens) {
    problems.push(
      `decode counted ${done.completionTokens} completion tokens, streamed ${numTokens}`,
    )
  }
  if (problems.length > 0) {
    throw new KvfenceError(
      'guard_violation',
      `request ${request.requestId} (decode ${decodeUrl}): ${problems.join('; ')}`,
    )
  }
}

function protocolError(url: string, rid: string, what: string): KvfenceError {
  return new KvfenceError('internal_error', `decode worker ${url} sent ${what} for request ${rid}`)
}

// ---------------------------------------------------------------------------------------------
// HTTP plumbing

/** A GET that is safe to repeat: sent once more, on a new connection, when a reused keep-alive
 *  connection was reset before any reply (the worker closed it as the request went out). POSTs
 *  are never repeated: a worker may have acted on one. */
async function sendIdempotent(
  agent: http.Agent,
  url: string,
  signal: AbortSignal,
): Promise<http.IncomingMessage> {
  try {
    return await send(agent, url, 'GET', null, signal)
  } catch (err) {
    if (!(err instanceof ReusedSocketReset)) throw err
    return send(false, url, 'GET', null, signal) // a connection of its own, never a pooled one
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
  agent: http.Agent | false,
  url: string,
  method: 'GET' | 'POST',
  body: string | null,
  signal: AbortSignal,
  extraHeaders: http.OutgoingHttpHeaders = {},
): Promise<http.IncomingMessage> {
  return sendOn(agent, url, method, body, signal, extraHeaders).then((sent) => sent.res)
}

/** {@link send}, also telling whether the request went out on a reused keep-alive connection. */
function sendOn(
  agent: http.Agent | false,
  url: string,
  method: 'GET' | 'POST',
  body: string | null,
  signal: AbortSignal,
  extraHeaders: http.OutgoingHttpHeaders = {},
): Promise<{ res: http.IncomingMessage; isReusedSocket: boolean }> {
  return new Promise((resolve, reject) => {
    const headers: http.OutgoingHttpHeaders = { accept: 'application/json', ...extraHeaders }
    if (body !== null) {
      headers['content-type'] = 'application/json'
      headers['content-length'] = Buffer.byteLength(body)
    }
    const req = http.request(url, { method, agent, signal, headers }, (res) =>
      resolve({ res, isReusedSocket: req.reusedSocket }),
    )
    req.on('error', (err: NodeJS.ErrnoException) =>
      reject(req.reusedSocket && err.code === 'ECONNRESET' ? new ReusedSocketReset(err) : err),
    )
    req.end(body ?? undefined)
  })
}

async function readJson(res: http.IncomingMessage): Promise<unknown> {
  const text = await readReplyText(res, maxLineBytes)
  try {
    return JSON.parse(text)
  } catch {
    throw new Error(`reply is not JSON (HTTP ${res.statusCode})`)
  }
}

/** The decode worker's NDJSON stream, one parsed event per line. */
async function* decodeEvents(res: http.IncomingMessage, url: string): AsyncGenerator<DecodeEvent> {
  res.setEncoding('utf8')
  let pending = ''
  for await (const chunk of res as AsyncIterable<string>) {
    pending += chunk
    let newline: number
    while ((newline = pending.indexOf('\n')) !== -1) {
      const line = pending.slice(0, newline).trim()
      pending = pending.slice(newline + 1)
      if (line !== '') yield parseEvent(line, url)
    }
    if (pending.length > maxLineBytes) {
      throw new KvfenceError(
        'internal_error',
        `decode worker ${url} sent a line over ${maxLineBytes} bytes`,
      )
    }
  }
  if (pending.trim() !== '') yield parseEvent(pending.trim(), url)
}

function parseEvent(line: string, url: string): DecodeEvent {
  let value: unknown
  try {
    value = JSON.parse(line)
  } catch {
    throw new KvfenceError('internal_error', `decode worker ${url} sent a line that is not JSON`)
  }
  const parsed = DecodeEvent.safeParse(value)
  if (!parsed.success) {
    throw new KvfenceError(
      'internal_error',
      `decode worker ${url} sent an invalid event (${issueText(parsed.error.issues[0])})`,
    )
  }
  return parsed.data
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

/** An error a worker reported. Its message names the worker (and may name pages or peers): the
 *  router logs it and tells the client only the code and a fixed sentence, even for a 4xx. */
export class WorkerReportedError extends KvfenceError {
  constructor(code: ErrorCode, message: string) {
    super(code, message)
    this.name = 'WorkerReportedError'
  }
}

function asKvfenceError(err: unknown, where: string): KvfenceError {
  if (err instanceof KvfenceError) return err
  return new KvfenceError('worker_unavailable', `${where}: ${describe(err)}`)
}

function describe(err: unknown): string {
  if (err instanceof Error) {
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

function normalizeBaseUrl(url: string): string {
  let parsed: URL
  try {
    parsed = new URL(url)
  } catch {
    throw new KvfenceError('internal_error', `worker URL ${JSON.stringify(url)} is not a URL`)
  }
  if (parsed.protocol !== 'http:') {
    throw new KvfenceError('internal_error', `worker URL ${url} must use http:`)
  }
  return parsed.origin
}

/** Where a prefill worker sends a request's KV pages. */
interface TransferAddress {
  host: string
  port: number
}

function hostOf(baseUrl: string): string {
  return new URL(baseUrl).hostname.replace(/^\[(.*)\]$/, '$1')
}
