/** One generation request in the router, for both endpoints and any backend: draw its id, parse
 *  its body, admit it (admission/pipeline.ts), let the backend answer it, and account for it —
 *  the metrics and one log line, whatever happened.
 *  Knows HTTP bodies, tenants and the backend interface; knows nothing of workers or engines. */
import type { IncomingMessage, ServerResponse } from 'node:http'
import { performance } from 'node:perf_hooks'
import type { Logger } from 'pino'
import { KvfenceError } from '../common/errors.js'
import { randomHex } from '../common/random-hex.js'
import { admitRequest, emptyHolds, releaseHolds } from './admission/pipeline.js'
import type { AnswerWriter, Backend, Outcome } from './backend.js'
import type { RouterConfig } from './config.js'
import { type Drain, ShuttingDownError } from './drain.js'
import { readJsonBody, sendError } from './api/http.js'
import { LimitError } from './admission/limit-error.js'
import { type Limiter } from './admission/limits.js'
import type { RouterMetrics } from './metrics/metrics.js'
import { endingError, publicError } from './api/public-errors.js'
import type { ResponseHeader } from './api/responses.js'
import { type Endpoint, type ParsedRequest, loggedPromptOf, requestParsers } from './api/schemas.js'
import type { Tenant } from './tenants/tenants.js'
import { sentinelPromptOf } from './sentinel/router-sentinel.js'
import type { Sentinel } from './sentinel/sentinel.js'

/** What a generation request needs; all of it passed in. */
export interface GenerationDeps {
  config: RouterConfig
  backend: Backend
  limiter: Limiter
  metrics: RouterMetrics
  log: Logger
  /** Counts the request as running; at its deadline it ends the request. */
  drain: Drain
  /** Checks every answer for other tenants' recent prompts (its mode may be `off`). */
  sentinel: Sentinel
}

/** What a generation endpoint is to the router: its name in metrics and logs, its response ids'
 *  prefix, and how its body becomes the request a backend runs. */
export interface GenerationRoute {
  /** The `endpoint` label of metrics and logs. */
  readonly label: string
  /** The prefix of its response ids (`chatcmpl-`, `cmpl-`, `resp_`). */
  readonly idPrefix: string
  /** The request the backend runs for `body`, and the writer of its answer when the endpoint
   *  writes its own bodies; throws `invalid_request` (or another client error) for a bad body.
   *  `header` is the response's id, time and model. */
  parse(
    body: unknown,
    tenant: Tenant,
    header: ResponseHeader,
  ): { parsed: ParsedRequest; writer?: AnswerWriter }
}

/** The route of each OpenAI completion endpoint (its bodies written by the backend). */
export const completionRoutes: { readonly [E in Endpoint]: GenerationRoute } = {
  chat: {
    label: 'chat',
    idPrefix: 'chatcmpl-',
    parse: (body) => ({ parsed: requestParsers.chat(body) }),
  },
  completion: {
    label: 'completion',
    idPrefix: 'cmpl-',
    parse: (body) => ({ parsed: requestParsers.completion(body) }),
  },
}

/** Serves `POST` of `route` for `tenant` (authenticated). Never rejects: a failure is answered
 *  (unless the client went away) and logged. */
export async function serveGeneration(
  deps: GenerationDeps,
  route: GenerationRoute,
  req: IncomingMessage,
  res: ServerResponse,
  tenant: Tenant,
): Promise<void> {
  const endpoint = route.label
  const startedMs = performance.now()
  // The only request id there is: drawn here, never taken from the client (no header or body
  // field can set it), so one tenant cannot name another's request.
  const rid = randomHex(16) // 128 bits
  const log = deps.log.child({ rid, tenant: tenant.name, endpoint })
  res.setHeader('x-request-id', rid)
  echoClientRequestId(req, res)
  const outcome = emptyOutcome()
  // Fires when the client goes away, or at the drain's deadline (its reason is then the error
  // the client is told).
  const abort = abortOnClose(res)
  const { signal } = abort
  const holds = emptyHolds()
  const leave = deps.drain.enter((reason) => abort.abort(reason))
  try {
    const body = await readJsonBody(req, deps.config.maxBodyBytes)
    const header: ResponseHeader = {
      id: `${route.idPrefix}${rid}`,
      created: Math.floor(Date.now() / 1000),
      model: deps.config.model,
    }
    const { parsed, writer } = route.parse(body, tenant, header)
    checkModel(deps.config, parsed)
    if (deps.config.logContent) outcome.content = { prompt: loggedPromptOf(parsed), completion: '' }
    const { prompt, maxTokens } = await admitRequest(
      deps,
      { tenant, parsed, signal, outcome },
      holds,
    )
    // Admitted prompts only: a refused one never reaches a worker, so no answer can hold it.
    const answerCheck = deps.sentinel.admit(
      tenant.name,
      tenant.isCanary === true,
      rid,
      sentinelPromptOf(parsed, prompt, deps.backend.detokenize),
    )
    deps.metrics.sentinelBytes.set(deps.sentinel.numBytes)
    await deps.backend.generate({
      parsed,
      body: body as Record<string, unknown>, // an object: the parser has checked it
      rid,
      tenant: tenant.name,
      prefixCachePartition: tenant.prefixCachePartition,
      prompt,
      maxTokens,
      header,
      res,
      signal,
      log,
      outcome,
      logFailure: (error) => logFailure(deps.backend, log, error),
      answerCheck,
      ...(writer === undefined ? {} : { writer }),
    })
  } catch (err) {
    const error = endingError(err, signal)
    outcome.status = error.status
    logFailure(deps.backend, log, error)
    // A request_aborted has no one left to tell.
    if (!res.destroyed && error.code !== 'request_aborted') {
      sendError(req, res, publicError(error, rid))
    }
  } finally {
    releaseHolds(holds, outcome.numCompletionTokens)
    account(deps, endpoint, tenant, outcome, startedMs, log)
    leave()
  }
}

/** `model_not_found` unless the request names the served model. */
function checkModel(config: RouterConfig, parsed: ParsedRequest): void {
  if (parsed.model !== config.model) {
    throw new KvfenceError(
      'model_not_found',
      `The model '${parsed.model}' does not exist; this server serves '${config.model}'`,
      'model',
    )
  }
}

/** G8: a controller whose signal fires when the client goes away, wherever the request is
 *  (queued, on the backend). */
function abortOnClose(res: ServerResponse): AbortController {
  const abort = new AbortController()
  res.on('close', () => {
    if (!res.writableFinished) abort.abort()
  })
  return abort
}

function emptyOutcome(): Outcome {
  return {
    status: 200,
    numPromptTokens: 0,
    numCompletionTokens: 0,
    finishReason: null,
    firstTokenMs: null,
    lastTokenMs: null,
    content: null,
  }
}

/** Logs a failed request at the level its kind deserves; the backend hears of it first. */
function logFailure(backend: Backend, log: Logger, err: KvfenceError): void {
  backend.noteFailure(err)
  if (err.code === 'request_aborted') log.info({ code: err.code }, 'client went away')
  // Load shedding is the router working as configured, not a failure to page anyone about.
  else if (err instanceof LimitError) log.warn({ code: err.code }, 'request shed for load')
  // Nor is the drain's deadline ending a request: the operator stopped the router.
  else if (err instanceof ShuttingDownError)
    log.warn({ code: err.code }, 'request ended: the drain deadline passed')
  else if (err.status >= 500) log.error({ code: err.code, detail: err.message }, 'request failed')
  // 4xx: the code and field suffice; the message may quote client input.
  else log.info({ code: err.code, param: err.param }, 'request refused')
}

/** The request's metrics and its log line. */
function account(
  deps: GenerationDeps,
  endpoint: string,
  tenant: Tenant,
  outcome: Outcome,
  startedMs: number,
  log: Logger,
): void {
  const { metrics } = deps
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
  // The line's object is built only when it is written: a busy router logs at warn.
  if (!log.isLevelEnabled('info')) return
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

/** The longest client request id echoed, characters. */
const maxClientRequestIdChars = 512

/** A client's own request id (`X-Client-Request-Id`, as OpenAI's API takes it, or `X-Request-Id`)
 *  goes back to that client alone as `x-client-request-id`; it never reaches a worker or an
 *  engine, whose requests carry the router's id only (sglang PR #19035, vLLM PR #27987: ids two
 *  clients chose alike crossed their requests). One that is not 1–512 visible ASCII characters is
 *  not echoed. */
function echoClientRequestId(req: IncomingMessage, res: ServerResponse): void {
  const sent = req.headers['x-client-request-id'] ?? req.headers['x-request-id']
  const id = Array.isArray(sent) ? sent[0] : sent
  if (id !== undefined && id.length <= maxClientRequestIdChars && /^[\x21-\x7e]+$/.test(id)) {
    res.setHeader('x-client-request-id', id)
  }
}
