/** The router's HTTP API: an OpenAI-compatible gateway in front of kvfence workers, or (gateway
 *  mode) in front of another engine's OpenAI API.
 *  `POST /v1/chat/completions`, `POST /v1/completions` (plain and SSE), `GET /v1/models`,
 *  `GET /v1/models/{id}`, `GET /health`, `GET /server_info`, `GET /metrics`.
 *  No endpoint takes a request id from a client: ids are drawn here (128 random bits), and a
 *  request is aborted only by its own connection closing — so no tenant can abort, read or time
 *  another tenant's request.
 *  Knows API keys (as digests), text, tokens and the OpenAI shapes; reaches workers only through
 *  a {@link WorkerClient} or a {@link Gateway}. Logs request ids, tenant names, statuses, token
 *  counts and times — never keys, and prompts or completions only with `logContent`. */
import { randomBytes } from 'node:crypto'
import type { IncomingMessage, ServerResponse } from 'node:http'
import { performance } from 'node:perf_hooks'
import type { Logger } from 'pino'
import type { GenerateRequest } from '../engine/control.js'
import { KvfenceError, MethodNotAllowedError, type ErrorCode, toOpenAiError } from '../errors.js'
import type { Tokenizer } from '../model/tokenizer.js'
import { admit, chatPromptTokenIds, completionPromptTokenIds } from './admission.js'
import type { CapacityMonitor } from './capacity-monitor.js'
import type { RouterConfig } from './config.js'
import type { Gateway } from './gateway.js'
import { coalesceWrites, readJsonBody, sendError, sendJson } from './http.js'
import { LimitError, type Limiter, type RoomHold, createLimiter } from './limits.js'
import { metricsText } from '../process-metrics.js'
import { type RouterMetrics, createRouterMetrics } from './metrics.js'
import {
  type FinishReason,
  type ResponseHeader,
  chatChunk,
  chatCompletion,
  chatUsageChunk,
  endSse,
  modelCard,
  modelList,
  startSse,
  textCompletion,
  textUsageChunk,
  usageOf,
  writeSse,
} from './responses.js'
import {
  type ParsedChatRequest,
  type ParsedCompletionRequest,
  checkStopTokenIds,
  parseChatRequest,
  parseCompletionRequest,
} from './schemas.js'
import {
  CompletionLogprobsBuilder,
  type GeneratedLogprobs,
  chatLogprobs,
  tokenTextOf,
} from './logprobs.js'
import { bearerKey, type Tenant, type TenantRegistry } from './tenants.js'
import { TextStream } from './text-stream.js'
import {
  type GenerationEvent,
  PoolFullError,
  type WorkerClient,
  WorkerReportedError,
} from './worker-client.js'

/** Where requests run: kvfence's own prefill and decode workers (the router tokenizes and
 *  detokenizes), or another engine's OpenAI API behind a {@link Gateway}. */
export type RouterBackend =
  | {
      kind: 'kvfence'
      tokenizer: Tokenizer
      workers: WorkerClient
      /** G1 re-checked while running; without it the window of `config` holds for good. */
      capacity?: CapacityMonitor
    }
  | { kind: 'gateway'; gateway: Gateway }

/** What {@link createRouter} needs; all of it is passed in, nothing is global. */
export interface RouterDeps {
  config: RouterConfig
  tenants: TenantRegistry
  backend: RouterBackend
  log: Logger
  /** Tenant limits and the bounded queue; `createLimiter()`'s defaults when omitted. */
  limiter?: Limiter
  /** Where to count; a fresh registry when omitted. */
  metrics?: RouterMetrics
}

/** A `node:http` request handler. */
export type RequestHandler = (req: IncomingMessage, res: ServerResponse) => void

/** The two generation endpoints. */
export type Endpoint = 'chat' | 'completion'

/** Longest single wait before re-trying a request that found the KV pool full, ms. */
const poolFullRetryMs = 250

/** Builds the router's request handler. */
export function createRouter(deps: RouterDeps): RequestHandler {
  const { config, tenants, backend } = deps
  const metrics = deps.metrics ?? createRouterMetrics()
  const limiter = deps.limiter ?? createLimiter()
  /** G1 now: natively as last re-checked (or fixed at start), rediscovered in gateway mode. */
  const capacity = () =>
    backend.kind === 'kvfence' && backend.capacity !== undefined ? backend.capacity.current() : null
  /** The advertised context window now. */
  const contextWindow = () =>
    backend.kind === 'gateway'
      ? backend.gateway.contextWindow()
      : (capacity()?.contextWindow ?? config.contextWindow)

  // -------------------------------------------------------------------------------------------
  // Dispatch

  /** `GET /health`: 200 only when requests can be served — every worker answers and G1 holds —
   *  so a load balancer stops sending traffic to a router whose workers are gone. */
  async function health(res: ServerResponse): Promise<void> {
    const refusal = capacity()?.refusal ?? null
    if (refusal !== null) {
      // G1, or a worker that refuses the router's cluster token (the operator's to fix).
      const reason = capacity()?.refusalReason ?? 'G1'
      return sendJson(res, 503, { status: 'unavailable', reason })
    }
    if (backend.kind === 'kvfence') {
      try {
        await backend.workers.serverInfoAll(AbortSignal.timeout(healthTimeoutMs))
      } catch {
        return sendJson(res, 503, { status: 'unavailable', reason: 'a worker is unreachable' })
      }
    }
    return sendJson(res, 200, { status: 'ok' })
  }

  async function handle(req: IncomingMessage, res: ServerResponse): Promise<void> {
    const path = pathOf(req.url)
    const route = `${req.method} ${path}`
    switch (route) {
      case 'GET /health':
        return health(res)
      case 'GET /server_info':
        return serverInfo(req, res)
      case 'GET /metrics':
        res.writeHead(200, { 'content-type': metrics.registry.contentType })
        res.end(await metricsText(metrics.registry))
        return
      case 'GET /v1/models':
        authenticate(req)
        return sendJson(res, 200, modelList(config.model, config.createdAtSec, contextWindow()))
      case 'POST /v1/chat/completions':
        return generation('chat', req, res, authenticate(req))
      case 'POST /v1/completions':
        return generation('completion', req, res, authenticate(req))
    }
    if (req.method === 'GET' && path.startsWith('/v1/models/')) {
      authenticate(req)
      const id = path.slice('/v1/models/'.length)
      if (id !== config.model) {
        throw new KvfenceError('model_not_found', `The model '${id}' does not exist`, 'model')
      }
      return sendJson(res, 200, modelCard(config.model, config.createdAtSec, contextWindow()))
    }
    const allow = allowedMethods.get(path)
    if (allow !== undefined) throw new MethodNotAllowedError(req.method ?? '?', path, allow)
    throw new KvfenceError(
      'not_found',
      `${req.method} ${path === '' ? 'of this path' : path} is not an endpoint of this server`,
    )
  }

  /** The tenant of the request's bearer key; `invalid_api_key` otherwise. The key is never
   *  echoed, logged or kept. */
  function authenticate(req: IncomingMessage): Tenant {
    const key = bearerKey(req.headers.authorization)
    if (key === null) {
      throw new KvfenceError(
        'invalid_api_key',
        "You didn't provide an API key. Send it as 'Authorization: Bearer KEY'.",
      )
    }
    const tenant = tenants.authenticate(key)
    if (tenant === null) throw new KvfenceError('invalid_api_key', 'Incorrect API key provided.')
    return tenant
  }

  async function serverInfo(_req: IncomingMessage, res: ServerResponse): Promise<void> {
    const limits = {
      numRunning: limiter.numRunning,
      numQueued: limiter.numQueued,
    }
    if (backend.kind === 'gateway') {
      const info = backend.gateway.info()
      return sendJson(res, 200, {
        model: config.model,
        contextWindow: contextWindow(),
        effectiveCapacityTokens: info.capacityTokens,
        guardsEnabled: config.guardsEnabled,
        backend: info,
        ...limits,
      })
    }
    let reports
    try {
      reports = await backend.workers.serverInfoAll()
    } catch (err) {
      deps.log.warn({ detail: messageOf(err) }, 'server_info: a worker did not answer')
      throw new KvfenceError('worker_unavailable', 'a worker did not report its state')
    }
    const infos = reports.map((r) => r.info)
    const now = capacity()
    sendJson(res, 200, {
      model: config.model,
      contextWindow: contextWindow(),
      effectiveCapacityTokens: now?.effectiveCapacityTokens ?? config.effectiveCapacityTokens,
      ...(now?.refusal ? { refusing: now.refusal.message } : {}),
      pageSize: config.pageSize,
      guardsEnabled: config.guardsEnabled && infos.every((i) => i.guardsEnabled),
      faults: [...new Set(infos.flatMap((i) => i.faults))].sort(),
      workers: infos,
      ...limits,
    })
  }

  // -------------------------------------------------------------------------------------------
  // Generation (both endpoints, both backends)

  async function generation(
    endpoint: Endpoint,
    req: IncomingMessage,
    res: ServerResponse,
    tenant: Tenant,
  ): Promise<void> {
    const startedMs = performance.now()
    // The only request id there is: drawn here, never taken from the client (no header or body
    // field can set it), so one tenant cannot name another's request.
    const rid = randomBytes(16).toString('hex') // 128 bits
    const log = deps.log.child({ rid, tenant: tenant.name, endpoint })
    res.setHeader('x-request-id', rid)
    const outcome: Outcome = {
      status: 200,
      numPromptTokens: 0,
      numCompletionTokens: 0,
      finishReason: null,
      firstTokenMs: null,
      lastTokenMs: null,
      content: null,
    }
    // G8: the client going away aborts the request, wherever it is (queued, on the workers).
    const abort = new AbortController()
    res.on('close', () => {
      if (!res.writableFinished) abort.abort()
    })
    let ticket: { release(numUnusedTokens: number): void } | null = null
    let room: RoomHold | null = null
    let numReservedCompletion = 0
    let slot: { release(): void } | null = null
    try {
      const body = await readJsonBody(req, config.maxBodyBytes)
      const parsed = endpoint === 'chat' ? parseChatRequest(body) : parseCompletionRequest(body)
      if (parsed.model !== config.model) {
        throw new KvfenceError(
          'model_not_found',
          `The model '${parsed.model}' does not exist; this server serves '${config.model}'`,
          'model',
        )
      }
      if (config.logContent) {
        outcome.content = {
          // The prompt alone (messages, text or token ids), never the rest of the body.
          prompt: endpoint === 'chat' ? (parsed as ParsedChatRequest).messages : promptText(parsed),
          completion: '',
        }
      }
      const refusal = capacity()?.refusal
      if (refusal) throw refusal // G1: the workers can no longer hold the advertised window
      try {
        // Before tokenizing, and held while tokenizing: a tenant at its limit must not spend the
        // event loop every tenant shares on prompts that are refused anyway (16 parallel 1 MB
        // prompts of a tenant limited to 1 stalled every other tenant 12 s).
        room = limiter.holdTenantRoom(tenant.name, tenant.limits)
      } catch (err) {
        metrics.admissionRejections.inc({ reason: 'tenant_limit' })
        throw err
      }
      const prompt = await promptOf(endpoint, parsed, abort.signal)
      outcome.numPromptTokens = prompt.numTokens
      const window = contextWindow()
      let maxTokens: number
      try {
        maxTokens = admit(prompt.numTokens, parsed.maxTokens, window, {
          promptParam: endpoint === 'chat' ? 'messages' : 'prompt',
          maxTokensParam: parsed.maxTokensParam,
        })
      } catch (err) {
        metrics.admissionRejections.inc({ reason: 'context_length_exceeded' })
        throw err
      }
      try {
        ticket = limiter.admitTenant(tenant.name, tenant.limits, prompt.numTokens + maxTokens, room)
        numReservedCompletion = maxTokens
      } catch (err) {
        metrics.admissionRejections.inc({ reason: 'tenant_limit' })
        throw err
      }
      try {
        slot = await limiter.acquireSlot(abort.signal)
      } catch (err) {
        if (err instanceof LimitError) metrics.admissionRejections.inc({ reason: 'queue_full' })
        throw err
      }
      metrics.promptTokens.inc(prompt.numTokens)

      const header: ResponseHeader = {
        id: `${endpoint === 'chat' ? 'chatcmpl' : 'cmpl'}-${rid}`,
        created: Math.floor(Date.now() / 1000),
        model: config.model,
      }
      if (backend.kind === 'gateway') {
        const result = await backend.gateway.proxy({
          endpoint,
          body: body as Record<string, unknown>,
          rid,
          tenant: tenant.name,
          maxTokens,
          isStream: parsed.isStream,
          res,
          signal: abort.signal,
          onToken: () => markToken(outcome),
          log,
        })
        outcome.status = result.status
        outcome.numCompletionTokens = result.numCompletionTokens
        outcome.finishReason = result.finishReason
        if (outcome.content) outcome.content.completion = result.text
        return
      }
      checkStopTokenIds(parsed.stopTokenIds, backend.tokenizer.vocabSize)
      const eos =
        backend.tokenizer.eosTokenId === null || parsed.ignoreEos
          ? []
          : [backend.tokenizer.eosTokenId]
      const request: GenerateRequest = {
        requestId: rid,
        tenant: tenant.name,
        promptTokenIds: prompt.tokenIds!,
        maxTokens,
        sampling: parsed.sampling,
        stopTokenIds: [...new Set([...eos, ...parsed.stopTokenIds])],
        transferSecret: randomBytes(32).toString('hex'), // 256 bits
      }
      const context = { endpoint, request, parsed, header, signal: abort.signal, res, outcome, log }
      if (parsed.isStream) await respondStreamed(context)
      else await respondWhole(context)
    } catch (err) {
      const error = asKvfenceError(err)
      outcome.status = error.status
      logFailure(log, error)
      // A request_aborted has no one left to tell.
      if (!res.destroyed && error.code !== 'request_aborted') {
        sendError(req, res, publicError(error, rid))
      }
    } finally {
      slot?.release()
      ticket?.release(Math.max(0, numReservedCompletion - outcome.numCompletionTokens))
      room?.release() // a request refused or failed before its ticket (idempotent after it)
      const ms = Math.round(performance.now() - startedMs)
      metrics.requests.inc({ endpoint, tenant: tenant.name, status: String(outcome.status) })
      metrics.requestSeconds.observe({ endpoint }, ms / 1000)
      metrics.completionTokens.inc(outcome.numCompletionTokens)
      if (outcome.firstTokenMs !== null) {
        metrics.ttftSeconds.observe({ endpoint }, (outcome.firstTokenMs - startedMs) / 1000)
        if (outcome.numCompletionTokens >= 2 && outcome.lastTokenMs !== null) {
          metrics.tpotSeconds.observe(
            { endpoint },
            (outcome.lastTokenMs - outcome.firstTokenMs) / 1000 / (outcome.numCompletionTokens - 1),
          )
        }
      }
      log.info(
        {
          status: outcome.status,
          promptTokens: outcome.numPromptTokens,
          completionTokens: outcome.numCompletionTokens,
          finishReason: outcome.finishReason,
          ms,
          ...(outcome.content ?? {}),
        },
        'request finished',
      )
    }
  }

  /** The prompt's token count (and, natively, its ids) from the backend's own tokenizer. */
  async function promptOf(
    endpoint: Endpoint,
    parsed: ParsedChatRequest | ParsedCompletionRequest,
    signal: AbortSignal,
  ): Promise<{ numTokens: number; tokenIds: number[] | null }> {
    if (backend.kind === 'gateway') {
      const numTokens = await backend.gateway.countPromptTokens(endpoint, parsed, signal)
      return { numTokens, tokenIds: null }
    }
    refuseUntokenizable(endpoint, parsed, backend.tokenizer.maxTokenChars)
    const tokenIds =
      endpoint === 'chat'
        ? chatPromptTokenIds(backend.tokenizer, (parsed as ParsedChatRequest).messages)
        : completionPromptTokenIds(backend.tokenizer, (parsed as ParsedCompletionRequest).prompt)
    return { numTokens: tokenIds.length, tokenIds }
  }

  /** G2 before tokenizing, for prompts too long to fit in any tokenization: tokenizing runs on the
   *  event loop every tenant shares (a 1 MB prompt takes most of a second), so one that cannot
   *  fit is refused by its length alone. No token stands for more than `maxTokenChars` characters
   *  before normalization, and normalization shrinks text by at most a few times (NFKC composing
   *  Hangul jamo: 3 to 1), so a text over window × maxTokenChars × 4 characters needs more tokens
   *  than the window holds. Anything shorter is tokenized and counted exactly. */
  function refuseUntokenizable(
    endpoint: Endpoint,
    parsed: ParsedChatRequest | ParsedCompletionRequest,
    maxTokenChars: number,
  ): void {
    const numChars =
      endpoint === 'chat'
        ? (parsed as ParsedChatRequest).messages.reduce((n, m) => n + m.content.length, 0)
        : 'text' in (parsed as ParsedCompletionRequest).prompt
          ? ((parsed as ParsedCompletionRequest).prompt as { text: string }).text.length
          : 0
    const window = contextWindow()
    if (numChars <= window * maxTokenChars * 4) return
    metrics.admissionRejections.inc({ reason: 'context_length_exceeded' })
    throw new KvfenceError(
      'context_length_exceeded',
      `This model's maximum context length is ${window} tokens; a prompt of ${numChars} characters cannot fit in it (no token of this model stands for more than ${maxTokenChars} characters).`,
      endpoint === 'chat' ? 'messages' : 'prompt',
    )
  }

  /** The workers' events for a request. A request refused because a KV pool (decode or prefill)
   *  is momentarily full, before any token, is tried again each time a running request ends,
   *  until `maxQueueWaitMs`; then 503 with `Retry-After` (G2). Each retry goes out under a fresh
   *  request id and transfer secret: the previous attempt's decode request was closed before the
   *  refusal surfaced, but the decode worker may not have seen that close yet, and must never
   *  match a transfer to a reservation of another attempt. */
  async function* workerEvents(
    workers: WorkerClient,
    c: GenerationContext,
  ): AsyncGenerator<GenerationEvent, void> {
    const deadline = performance.now() + limiter.maxQueueWaitMs
    for (let attempt = 0; ; attempt++) {
      const request: GenerateRequest =
        attempt === 0
          ? c.request
          : {
              ...c.request,
              requestId: randomBytes(16).toString('hex'),
              transferSecret: randomBytes(32).toString('hex'),
            }
      if (attempt > 0) c.log.debug({ attempt, workerRid: request.requestId }, 'retrying')
      const events = workers.generate(request, c.signal)
      let first: IteratorResult<GenerationEvent, void>
      try {
        first = await events.next()
      } catch (err) {
        if (!(err instanceof PoolFullError)) throw err
        const remaining = deadline - performance.now()
        if (remaining <= 0) {
          metrics.admissionRejections.inc({ reason: 'pool_full' })
          throw new LimitError(
            'capacity_exhausted',
            `The KV pool has no room for this request right now (waited ${limiter.maxQueueWaitMs} ms); retry later.`,
            1,
          )
        }
        metrics.poolFullRetries.inc()
        c.log.debug({ detail: err.message }, 'KV pool full; waiting for room')
        await limiter.waitForRoom(Math.min(remaining, poolFullRetryMs), c.signal)
        continue
      }
      if (first.done) return
      try {
        yield first.value
        yield* events
      } finally {
        // A consumer that stops at the first event (a stop string in the first token) must still
        // close both worker requests (G8); `yield*` forwards that only from the second event on.
        await events.return()
      }
      return
    }
  }

  /** Runs the request on the workers, feeding every piece of new text to `onText` with the
   *  log-probabilities of the tokens received since the previous piece (when asked for; else
   *  none). Those of tokens after the last piece are in the result's `logprobs`. */
  async function runGeneration(
    c: GenerationContext,
    onText: (text: string, logprobs: GeneratedLogprobs[]) => Promise<void>,
  ): Promise<{
    finishReason: FinishReason
    numCompletionTokens: number
    cachedTokens: number
    logprobs: GeneratedLogprobs[]
  }> {
    if (backend.kind !== 'kvfence')
      throw new KvfenceError('internal_error', 'not a kvfence backend')
    const text = new TextStream((ids) => backend.tokenizer.decode(ids), c.parsed.stop)
    const isLogprobs = c.request.sampling.numLogprobs != null
    let pending: GeneratedLogprobs[] = []
    const emit = async (piece: string) => {
      if (c.outcome.content) c.outcome.content.completion += piece
      const logprobs = pending
      pending = []
      await onText(piece, logprobs)
    }
    for await (const event of workerEvents(backend.workers, c)) {
      if (event.type === 'token') {
        markToken(c.outcome)
        if (isLogprobs) {
          if (event.logprobs === undefined) {
            throw new KvfenceError(
              'internal_error',
              `request ${c.request.requestId}: a worker sent token ${text.numTokens} without log-probabilities`,
            )
          }
          pending.push({ tokenId: event.tokenId, logprobs: event.logprobs })
        }
        const step = text.push(event.tokenId)
        c.outcome.numCompletionTokens = text.numTokens
        if (step.text !== '') await emit(step.text)
        // Leaving the loop closes both worker requests.
        if (step.isStopped) {
          return {
            finishReason: 'stop',
            numCompletionTokens: text.numTokens,
            cachedTokens: 0,
            logprobs: pending,
          }
        }
      } else {
        const rest = text.finish()
        if (rest.text !== '') await emit(rest.text)
        metrics.transfers.inc({ status: 'ok' })
        metrics.transferPages.inc(event.numTransferredPages)
        return {
          finishReason: event.finishReason,
          numCompletionTokens: event.completionTokens,
          cachedTokens: event.cachedTokens ?? 0,
          logprobs: pending,
        }
      }
    }
    throw new KvfenceError('internal_error', `request ${c.request.requestId} ended without done`)
  }

  /** The text of a token id, for log-probabilities (kvfence backend only); with `shown`, as the
   *  completion text shows it (special tokens skipped). */
  function tokenText(shown = false) {
    if (backend.kind !== 'kvfence')
      throw new KvfenceError('internal_error', 'not a kvfence backend')
    return tokenTextOf((ids, options) => backend.tokenizer.decode(ids, options), shown)
  }

  async function respondWhole(c: GenerationContext): Promise<void> {
    let text = ''
    const logprobs: GeneratedLogprobs[] = []
    const result = await runGeneration(c, async (piece, pieceLogprobs) => {
      text += piece
      logprobs.push(...pieceLogprobs)
    })
    logprobs.push(...result.logprobs)
    const isLogprobs = c.request.sampling.numLogprobs != null
    const usage = usageOf(
      c.outcome.numPromptTokens,
      result.numCompletionTokens,
      result.cachedTokens,
    )
    c.outcome.numCompletionTokens = result.numCompletionTokens
    c.outcome.finishReason = result.finishReason
    sendJson(
      c.res,
      200,
      c.endpoint === 'chat'
        ? chatCompletion(
            c.header,
            text,
            result.finishReason,
            usage,
            isLogprobs ? chatLogprobs(logprobs, tokenText()) : null,
          )
        : textCompletion(
            c.header,
            text,
            result.finishReason,
            usage,
            isLogprobs
              ? new CompletionLogprobsBuilder(tokenText(), tokenText(true)).next(logprobs)
              : null,
          ),
    )
  }

  /** SSE. Headers go out with the first text, so that a refusal before any output (capacity,
   *  a failed prefill) is still a plain HTTP error; a failure after it is an in-stream error
   *  event followed by the end of the stream, never a normal finish. */
  async function respondStreamed(c: GenerationContext): Promise<void> {
    const { res, header, endpoint } = c
    const isUsageStreamed = c.parsed.isUsageStreamed
    const isLogprobs = c.request.sampling.numLogprobs != null
    const texts = isLogprobs ? tokenText() : null
    const completionLogprobs =
      texts === null ? null : new CompletionLogprobsBuilder(texts, tokenText(true))
    /** A chunk's `logprobs` for `entries` (null when not asked for). */
    const chatChunkLogprobs = (entries: GeneratedLogprobs[]) =>
      texts === null ? null : chatLogprobs(entries, texts)
    const textChunkLogprobs = (entries: GeneratedLogprobs[]) =>
      completionLogprobs === null ? null : completionLogprobs.next(entries)
    let isStarted = false
    const start = async () => {
      if (isStarted) return
      isStarted = true
      startSse(res, {})
      coalesceWrites(res) // tokens of one event-loop turn leave in one socket write
      if (endpoint === 'chat') {
        await writeSse(
          res,
          chatChunk(header, { role: 'assistant', content: '' }, null, isUsageStreamed),
        )
      }
    }
    try {
      const result = await runGeneration(c, async (piece, logprobs) => {
        await start()
        await writeSse(
          res,
          endpoint === 'chat'
            ? chatChunk(
                header,
                { content: piece },
                null,
                isUsageStreamed,
                chatChunkLogprobs(logprobs),
              )
            : textCompletion(header, piece, null, undefined, textChunkLogprobs(logprobs)),
        )
      })
      c.outcome.numCompletionTokens = result.numCompletionTokens
      c.outcome.finishReason = result.finishReason
      await start()
      // The last chunk carries the log-probabilities of tokens whose text was held back or empty
      // (a stop string, an end-of-sequence token).
      await writeSse(
        res,
        endpoint === 'chat'
          ? chatChunk(
              header,
              {},
              result.finishReason,
              isUsageStreamed,
              chatChunkLogprobs(result.logprobs),
            )
          : textCompletion(
              header,
              '',
              result.finishReason,
              undefined,
              textChunkLogprobs(result.logprobs),
            ),
      )
      if (isUsageStreamed) {
        const usage = usageOf(
          c.outcome.numPromptTokens,
          result.numCompletionTokens,
          result.cachedTokens,
        )
        await writeSse(
          res,
          endpoint === 'chat' ? chatUsageChunk(header, usage) : textUsageChunk(header, usage),
        )
      }
      endSse(res)
    } catch (err) {
      if (!isStarted) throw err
      const error = asKvfenceError(err)
      c.outcome.status = error.status
      logFailure(c.log, error)
      if (!res.destroyed) {
        res.end(
          `data: ${JSON.stringify(toOpenAiError(publicError(error, c.request.requestId)))}\n\n`,
        )
      }
    }
  }

  /** Records a generated token's time (for TTFT and TPOT). */
  function markToken(outcome: Outcome): void {
    const now = performance.now()
    outcome.firstTokenMs ??= now
    outcome.lastTokenMs = now
  }

  /** Counts a failed transfer (the KV never reached the decode worker intact). */
  function noteFailure(error: KvfenceError): void {
    if (error.code === 'transfer_failed') metrics.transfers.inc({ status: 'failed' })
  }

  return (req, res) => {
    handle(req, res).catch((err: unknown) => {
      const error = asKvfenceError(err)
      if (error.status >= 500)
        deps.log.error({ code: error.code, detail: error.message }, 'request failed')
      else deps.log.info({ status: error.status, code: error.code }, 'request refused')
      if (!res.destroyed) sendError(req, res, error)
    })
  }

  function logFailure(log: Logger, err: KvfenceError): void {
    noteFailure(err)
    if (isWorkerFailure(err) && err !== capacity()?.refusal && backend.kind === 'kvfence') {
      // A worker that failed may have restarted with a smaller pool: re-check G1 now.
      backend.capacity?.recheckSoon()
    }
    if (err.code === 'request_aborted') log.info({ code: err.code }, 'client went away')
    // Load shedding is the router working as configured, not a failure to page anyone about.
    else if (err instanceof LimitError) log.warn({ code: err.code }, 'request shed for load')
    else if (err.status >= 500) log.error({ code: err.code, detail: err.message }, 'request failed')
    // 4xx: the code and field suffice; the message may quote client input.
    else log.info({ code: err.code, param: err.param }, 'request refused')
  }
}

// ---------------------------------------------------------------------------------------------
// Helpers

/** The method each fixed path takes: another method on one of them is a 405 with `Allow`, not a
 *  404 saying the endpoint does not exist. */
const allowedMethods = new Map([
  ['/health', 'GET'],
  ['/server_info', 'GET'],
  ['/metrics', 'GET'],
  ['/v1/models', 'GET'],
  ['/v1/chat/completions', 'POST'],
  ['/v1/completions', 'POST'],
])

/** How long `/health` waits for the workers' `/server_info` (ms). */
const healthTimeoutMs = 2_000

/** What the request log line and the metrics report. */
interface Outcome {
  status: number
  numPromptTokens: number
  numCompletionTokens: number
  finishReason: FinishReason | null
  /** `performance.now()` of the first and the last generated token. */
  firstTokenMs: number | null
  lastTokenMs: number | null
  /** Prompt and completion, kept only with `logContent`. */
  content: { prompt: unknown; completion: string } | null
}

interface GenerationContext {
  endpoint: Endpoint
  request: GenerateRequest
  parsed: ParsedChatRequest | ParsedCompletionRequest
  header: ResponseHeader
  signal: AbortSignal
  res: ServerResponse
  outcome: Outcome
  log: Logger
}

/** What a client is told about a server-side failure: the code, a fixed sentence and the
 *  request id; the workers' own message (which may name pages, requests or peers) is logged only. */
const publicMessages: Partial<Record<ErrorCode, string>> = {
  capacity_exhausted: 'The server has no free KV capacity for this request right now; retry later.',
  worker_unavailable: 'A worker is unavailable.',
  transfer_failed: 'The KV transfer between workers failed; the request was stopped.',
  guard_violation: 'A KV integrity guard stopped this request.',
  request_aborted: 'The request was aborted.',
  internal_error: 'Internal error.',
}

function publicError(err: KvfenceError, rid: string): KvfenceError {
  if (err instanceof LimitError) return err // the router's own words, with its Retry-After
  if (err instanceof WorkerReportedError && err.status < 500) {
    const sentence =
      err.code === 'context_length_exceeded'
        ? "The prompt and max_tokens exceed what the workers' KV pools can hold."
        : 'A worker refused this request.'
    return new KvfenceError(err.code, `${sentence} (request ${rid})`, null)
  }
  if (err.status < 500 && err.code !== 'request_aborted') return err
  const sentence = publicMessages[err.code] ?? 'Internal error.'
  return new KvfenceError(err.code, `${sentence} (request ${rid})`, null)
}

/** A completions request's prompt as logged with `logContent`: its text, or its token ids. */
function promptText(parsed: ParsedChatRequest | ParsedCompletionRequest): string | number[] {
  const { prompt } = parsed as ParsedCompletionRequest
  return 'text' in prompt ? prompt.text : prompt.tokenIds
}

/** The decoded path of a request URL ('' when it does not parse or has a dot segment: it then
 *  matches no route). */
function pathOf(url: string | undefined): string {
  // The raw path, never a resolved one: `new URL` turns `/v1/%2e%2e/metrics` into `/metrics`,
  // which let a request through a proxy that forwards only `/v1/*` reach the operators' paths.
  const raw = (url ?? '/').split(/[?#]/, 1)[0]
  if (!raw.startsWith('/')) return ''
  const segments: string[] = []
  for (const segment of raw.split('/')) {
    let decoded: string
    try {
      decoded = decodeURIComponent(segment)
    } catch {
      return ''
    }
    // Dot segments name no route: refuse them rather than resolve them. (An encoded slash stays
    // inside its segment: `meta-llama%2FLlama-3` is one model id, and routes match exactly.)
    if (decoded === '.' || decoded === '..') return ''
    segments.push(decoded)
  }
  return segments.join('/')
}

/** A failure that may mean a worker went away or restarted. */
function isWorkerFailure(err: KvfenceError): boolean {
  return err.code === 'worker_unavailable' || err.code === 'transfer_failed'
}

function asKvfenceError(err: unknown): KvfenceError {
  if (err instanceof KvfenceError) return err
  return new KvfenceError('internal_error', messageOf(err))
}

function messageOf(err: unknown): string {
  return err instanceof Error ? err.message : String(err)
}
