/** The router's HTTP API: an OpenAI-compatible gateway in front of kvfence workers.
 *  `POST /v1/chat/completions`, `POST /v1/completions` (plain and SSE), `GET /v1/models`,
 *  `GET /health`, `GET /server_info`, `GET /metrics`.
 *  Knows API keys (as digests), text, tokens and the OpenAI shapes; reaches workers only through
 *  a {@link WorkerClient}. Logs request ids, tenant names, statuses, token counts and times —
 *  never keys, prompts or completions. */
import { randomBytes } from 'node:crypto'
import type { IncomingMessage, ServerResponse } from 'node:http'
import { performance } from 'node:perf_hooks'
import type { Logger } from 'pino'
import type { GenerateRequest } from '../engine/control.js'
import { KvfenceError, type ErrorCode, toOpenAiError } from '../errors.js'
import type { Tokenizer } from '../model/tokenizer.js'
import { admit, chatPromptTokenIds, completionPromptTokenIds } from './admission.js'
import type { RouterConfig } from './config.js'
import { readJsonBody, sendError, sendJson } from './http.js'
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
  parseChatRequest,
  parseCompletionRequest,
} from './schemas.js'
import { bearerKey, type TenantRegistry } from './tenants.js'
import { TextStream } from './text-stream.js'
import type { WorkerClient } from './worker-client.js'

/** What {@link createRouter} needs; all of it is passed in, nothing is global. */
export interface RouterDeps {
  config: RouterConfig
  tenants: TenantRegistry
  tokenizer: Tokenizer
  workers: WorkerClient
  log: Logger
  /** Where to count; a fresh registry when omitted. */
  metrics?: RouterMetrics
}

/** A `node:http` request handler. */
export type RequestHandler = (req: IncomingMessage, res: ServerResponse) => void

type Endpoint = 'chat' | 'completion'

/** Builds the router's request handler. */
export function createRouter(deps: RouterDeps): RequestHandler {
  const { config, tenants, tokenizer, workers } = deps
  const metrics = deps.metrics ?? createRouterMetrics()
  const decode = (ids: readonly number[]) => tokenizer.decode(ids)

  // -------------------------------------------------------------------------------------------
  // Dispatch

  async function handle(req: IncomingMessage, res: ServerResponse): Promise<void> {
    const path = pathOf(req.url)
    const route = `${req.method} ${path}`
    switch (route) {
      case 'GET /health':
        return sendJson(res, 200, { status: 'ok' })
      case 'GET /server_info':
        return serverInfo(req, res)
      case 'GET /metrics':
        res.writeHead(200, { 'content-type': metrics.registry.contentType })
        res.end(await metrics.registry.metrics())
        return
      case 'GET /v1/models':
        authenticate(req)
        return sendJson(
          res,
          200,
          modelList(config.model, config.createdAtSec, config.contextWindow),
        )
      case 'POST /v1/chat/completions':
        return generation('chat', req, res, authenticate(req).name)
      case 'POST /v1/completions':
        return generation('completion', req, res, authenticate(req).name)
    }
    if (req.method === 'GET' && path.startsWith('/v1/models/')) {
      authenticate(req)
      const id = path.slice('/v1/models/'.length)
      if (id !== config.model) {
        throw new KvfenceError('model_not_found', `The model '${id}' does not exist`, 'model')
      }
      return sendJson(res, 200, modelCard(config.model, config.createdAtSec, config.contextWindow))
    }
    throw new KvfenceError('not_found', `${req.method} ${path} is not an endpoint of this server`)
  }

  /** The tenant of the request's bearer key; `invalid_api_key` otherwise. The key is never
   *  echoed, logged or kept. */
  function authenticate(req: IncomingMessage): { name: string } {
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
    let reports
    try {
      reports = await workers.serverInfoAll()
    } catch (err) {
      deps.log.warn({ detail: messageOf(err) }, 'server_info: a worker did not answer')
      throw new KvfenceError('worker_unavailable', 'a worker did not report its state')
    }
    const infos = reports.map((r) => r.info)
    sendJson(res, 200, {
      model: config.model,
      contextWindow: config.contextWindow,
      effectiveCapacityTokens: config.effectiveCapacityTokens,
      pageSize: config.pageSize,
      guardsEnabled: config.guardsEnabled && infos.every((i) => i.guardsEnabled),
      faults: [...new Set(infos.flatMap((i) => i.faults))].sort(),
      workers: infos,
    })
  }

  // -------------------------------------------------------------------------------------------
  // Generation (both endpoints)

  async function generation(
    endpoint: Endpoint,
    req: IncomingMessage,
    res: ServerResponse,
    tenant: string,
  ): Promise<void> {
    const startedMs = performance.now()
    const rid = randomBytes(16).toString('hex') // 128 bits
    const log = deps.log.child({ rid, tenant, endpoint })
    res.setHeader('x-request-id', rid)
    const outcome: Outcome = {
      status: 200,
      numPromptTokens: 0,
      numCompletionTokens: 0,
      finishReason: null,
    }
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
      const promptTokenIds =
        endpoint === 'chat'
          ? chatPromptTokenIds(tokenizer, (parsed as ParsedChatRequest).messages)
          : completionPromptTokenIds(tokenizer, (parsed as ParsedCompletionRequest).prompt)
      outcome.numPromptTokens = promptTokenIds.length
      let maxTokens: number
      try {
        maxTokens = admit(promptTokenIds.length, parsed.maxTokens, config.contextWindow, {
          promptParam: endpoint === 'chat' ? 'messages' : 'prompt',
          maxTokensParam: parsed.maxTokensParam,
        })
      } catch (err) {
        metrics.admissionRejections.inc({ reason: 'context_length_exceeded' })
        throw err
      }
      metrics.promptTokens.inc(promptTokenIds.length)

      const request: GenerateRequest = {
        requestId: rid,
        tenant,
        promptTokenIds,
        maxTokens,
        sampling: parsed.sampling,
        stopTokenIds: tokenizer.eosTokenId === null ? [] : [tokenizer.eosTokenId],
        transferSecret: randomBytes(32).toString('hex'), // 256 bits
      }
      // G8: the client going away aborts both worker requests.
      const abort = new AbortController()
      res.on('close', () => {
        if (!res.writableFinished) abort.abort()
      })
      const header: ResponseHeader = {
        id: `${endpoint === 'chat' ? 'chatcmpl' : 'cmpl'}-${rid}`,
        created: Math.floor(Date.now() / 1000),
        model: config.model,
      }
      const context = { endpoint, request, parsed, header, signal: abort.signal, res, outcome, log }
      if (parsed.isStream) await respondStreamed(context)
      else await respondWhole(context)
    } catch (err) {
      const error = asKvfenceError(err)
      outcome.status = error.status
      logFailure(log, error)
      if (!res.destroyed) sendError(req, res, publicError(error, rid))
    } finally {
      const ms = Math.round(performance.now() - startedMs)
      metrics.requests.inc({ endpoint, status: String(outcome.status) })
      metrics.requestSeconds.observe({ endpoint }, ms / 1000)
      metrics.completionTokens.inc(outcome.numCompletionTokens)
      log.info(
        {
          status: outcome.status,
          promptTokens: outcome.numPromptTokens,
          completionTokens: outcome.numCompletionTokens,
          finishReason: outcome.finishReason,
          ms,
        },
        'request finished',
      )
    }
  }

  /** Runs the request on the workers, feeding every piece of new text to `onText`. */
  async function runGeneration(
    c: GenerationContext,
    onText: (text: string) => Promise<void>,
  ): Promise<{ finishReason: FinishReason; numCompletionTokens: number }> {
    const text = new TextStream(decode, c.parsed.stop)
    for await (const event of workers.generate(c.request, c.signal)) {
      if (event.type === 'token') {
        const step = text.push(event.tokenId)
        c.outcome.numCompletionTokens = text.numTokens
        if (step.text !== '') await onText(step.text)
        // Leaving the loop closes both worker requests.
        if (step.isStopped) return { finishReason: 'stop', numCompletionTokens: text.numTokens }
      } else {
        const rest = text.finish()
        if (rest.text !== '') await onText(rest.text)
        return { finishReason: event.finishReason, numCompletionTokens: event.completionTokens }
      }
    }
    throw new KvfenceError('internal_error', `request ${c.request.requestId} ended without done`)
  }

  async function respondWhole(c: GenerationContext): Promise<void> {
    let text = ''
    const result = await runGeneration(c, async (piece) => {
      text += piece
    })
    const usage = usageOf(c.outcome.numPromptTokens, result.numCompletionTokens)
    c.outcome.numCompletionTokens = result.numCompletionTokens
    c.outcome.finishReason = result.finishReason
    sendJson(
      c.res,
      200,
      c.endpoint === 'chat'
        ? chatCompletion(c.header, text, result.finishReason, usage)
        : textCompletion(c.header, text, result.finishReason, usage),
    )
  }

  /** SSE. Headers go out with the first text, so that a refusal before any output (capacity,
   *  a failed prefill) is still a plain HTTP error; a failure after it is an in-stream error
   *  event followed by the end of the stream, never a normal finish. */
  async function respondStreamed(c: GenerationContext): Promise<void> {
    const { res, header, endpoint } = c
    const isUsageStreamed = c.parsed.isUsageStreamed
    let isStarted = false
    const start = async () => {
      if (isStarted) return
      isStarted = true
      startSse(res, {})
      if (endpoint === 'chat') {
        await writeSse(
          res,
          chatChunk(header, { role: 'assistant', content: '' }, null, isUsageStreamed),
        )
      }
    }
    try {
      const result = await runGeneration(c, async (piece) => {
        await start()
        await writeSse(
          res,
          endpoint === 'chat'
            ? chatChunk(header, { content: piece }, null, isUsageStreamed)
            : textCompletion(header, piece, null, undefined),
        )
      })
      c.outcome.numCompletionTokens = result.numCompletionTokens
      c.outcome.finishReason = result.finishReason
      await start()
      await writeSse(
        res,
        endpoint === 'chat'
          ? chatChunk(header, {}, result.finishReason, isUsageStreamed)
          : textCompletion(header, '', result.finishReason, undefined),
      )
      if (isUsageStreamed) {
        const usage = usageOf(c.outcome.numPromptTokens, result.numCompletionTokens)
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

  return (req, res) => {
    handle(req, res).catch((err: unknown) => {
      const error = asKvfenceError(err)
      if (error.status >= 500)
        deps.log.error({ code: error.code, detail: error.message }, 'request failed')
      else deps.log.info({ status: error.status, code: error.code }, 'request refused')
      if (!res.destroyed) sendError(req, res, error)
    })
  }
}

// ---------------------------------------------------------------------------------------------
// Helpers

/** What the request log line reports. */
interface Outcome {
  status: number
  numPromptTokens: number
  numCompletionTokens: number
  finishReason: FinishReason | null
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
  if (err.status < 500 && err.code !== 'request_aborted') return err
  const sentence = publicMessages[err.code] ?? 'Internal error.'
  return new KvfenceError(err.code, `${sentence} (request ${rid})`, null)
}

function logFailure(log: Logger, err: KvfenceError): void {
  if (err.code === 'request_aborted') log.info({ code: err.code }, 'client went away')
  else if (err.status >= 500) log.error({ code: err.code, detail: err.message }, 'request failed')
  // 4xx: the code and field suffice; the message may quote client input.
  else log.info({ code: err.code, param: err.param }, 'request refused')
}

/** The decoded path of a request URL ('' when it does not parse, which matches no route). */
function pathOf(url: string | undefined): string {
  try {
    return decodeURIComponent(new URL(url ?? '/', 'http://router').pathname)
  } catch {
    return ''
  }
}

function asKvfenceError(err: unknown): KvfenceError {
  if (err instanceof KvfenceError) return err
  return new KvfenceError('internal_error', messageOf(err))
}

function messageOf(err: unknown): string {
  return err instanceof Error ? err.message : String(err)
}
