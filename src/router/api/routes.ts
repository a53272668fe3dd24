/** The router's HTTP API: an OpenAI-compatible gateway in front of a {@link Backend} — kvfence's
 *  own workers, or (gateway mode) another engine's OpenAI API.
 *  `POST /v1/chat/completions`, `POST /v1/completions`, `POST /v1/responses` (plain and SSE),
 *  `GET|DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items` (../responses/), `GET /v1/models`,
 *  `GET /v1/models/{id}`, `GET|HEAD /health`, `GET /server_info`, `GET /metrics`, and the
 *  operator's `POST /isolation_self_check` (./operator.ts: the cluster token, never a tenant key).
 *  While the router drains (../drain.ts), generation and model requests get 503 `shutting_down`
 *  and `/health` 503; `/server_info` and `/metrics` still answer, for the operator.
 *  No endpoint takes a request id from a client: ids are drawn here (128 random bits), and a
 *  request is aborted only by its own connection closing — so no tenant can abort, read or time
 *  another tenant's request.
 *  This file holds the routes and authentication; a generation request's life is
 *  ../generation.ts's. Knows API keys (as digests), paths and the OpenAI shapes; reaches the backend
 *  only through its interface. Logs request ids, tenant names, statuses, token counts and times —
 *  never keys, and prompts or completions only with `logContent`. */
import type { IncomingMessage, ServerResponse } from 'node:http'
import type { Logger } from 'pino'
import { KvfenceError, MethodNotAllowedError } from '../../common/errors.js'
import { metricsText } from '../../common/process-metrics.js'
import type { Backend } from '../backend.js'
import type { RouterConfig } from '../config.js'
import { type Drain, ShuttingDownError } from '../drain.js'
import { type GenerationRoute, completionRoutes, serveGeneration } from '../generation.js'
import {
  deleteResponse,
  listInputItems,
  responsesRoute,
  retrieveResponse,
} from '../responses/api.js'
import { ResponseStore } from '../responses/store.js'
import { sendError, sendJson } from './http.js'
import { runSelfCheckNow, selfCheckPath } from './operator.js'
import type { Limiter } from '../admission/limits.js'
import type { Sentinel } from '../sentinel/sentinel.js'
import type { RouterMetrics } from '../metrics/metrics.js'
import { asKvfenceError } from './public-errors.js'
import { modelCard, modelList } from './responses.js'
import { bearerKey, type Tenant, type TenantRegistry } from '../tenants/tenants.js'

/** What {@link createRouter} needs; all of it is passed in, nothing is global. The backend shares
 *  the limiter and the metrics. */
export interface RouterDeps {
  config: RouterConfig
  tenants: TenantRegistry
  backend: Backend
  log: Logger
  /** Tenant limits and the bounded queue. */
  limiter: Limiter
  /** Where to count. */
  metrics: RouterMetrics
  /** The drain: while it runs, new work is refused and `/health` is 503. */
  drain: Drain
  /** The response sentinel (src/router/sentinel/). */
  sentinel: Sentinel
  /** The Responses API's stored responses (a new, empty store when not given). */
  responseStore?: ResponseStore
  /** The cluster token that authenticates operator actions (./operator.ts); null or absent:
   *  they are off. */
  operatorToken?: string | null
}

/** A `node:http` request handler. */
export type RequestHandler = (req: IncomingMessage, res: ServerResponse) => void

/** Builds the router's request handler. */
export function createRouter(deps: RouterDeps): RequestHandler {
  const store = deps.responseStore ?? new ResponseStore()
  const routes: Routes = { ...deps, store, responsesRoute: responsesRoute(store) }
  return (req, res) => {
    deps.drain.noteRequest()
    // A draining router asks every client to reconnect (elsewhere) after this response.
    if (deps.drain.phase !== 'serving') res.setHeader('connection', 'close')
    route(routes, req, res).catch((err: unknown) => {
      const error = asKvfenceError(err)
      if (error instanceof ShuttingDownError)
        deps.log.warn({ code: error.code }, 'request refused: the router is draining')
      else if (error.status >= 500)
        deps.log.error({ code: error.code, detail: error.message }, 'request failed')
      else deps.log.info({ status: error.status, code: error.code }, 'request refused')
      if (!res.destroyed) sendError(req, res, error)
    })
  }
}

/** The deps with the Responses API's store and route. */
interface Routes extends RouterDeps {
  store: ResponseStore
  responsesRoute: GenerationRoute
}

async function route(deps: Routes, req: IncomingMessage, res: ServerResponse): Promise<void> {
  const { config, backend } = deps
  const path = pathOf(req.url)
  const isDraining = deps.drain.phase !== 'serving'
  // No new work once draining: the API's paths are refused before anything is read.
  if (isDraining && path.startsWith('/v1/')) throw new ShuttingDownError()
  switch (`${req.method} ${path}`) {
    case 'GET /health':
    case 'HEAD /health': // a load balancer's probe: the status alone (node sends no body)
      if (isDraining) return sendJson(res, 503, { status: 'unavailable', reason: 'draining' })
      return health(backend, res)
    case 'GET /server_info':
      return serverInfo(deps, res)
    case 'GET /metrics':
      res.writeHead(200, { 'content-type': deps.metrics.registry.contentType })
      res.end(await metricsText(deps.metrics.registry))
      return
    case 'GET /v1/models':
      authenticate(deps.tenants, req)
      refuseWhileRefusing(backend)
      return sendJson(
        res,
        200,
        modelList(config.model, config.createdAtSec, backend.contextWindow()),
      )
    case 'POST /v1/chat/completions':
      return serveGeneration(deps, completionRoutes.chat, req, res, authenticate(deps.tenants, req))
    case 'POST /v1/completions':
      return serveGeneration(
        deps,
        completionRoutes.completion,
        req,
        res,
        authenticate(deps.tenants, req),
      )
    case 'POST /v1/responses':
      return serveGeneration(deps, deps.responsesRoute, req, res, authenticate(deps.tenants, req))
    case `POST ${selfCheckPath}`:
      return runSelfCheckNow(deps.operatorToken ?? null, backend, deps.log, req, res)
  }
  const responseId = storedResponseIdOf(path)
  if (responseId !== null && (req.method === 'GET' || req.method === 'DELETE')) {
    const tenant = authenticate(deps.tenants, req)
    if (req.method === 'GET') return retrieveResponse(deps.store, tenant, responseId, res)
    return deleteResponse(deps.store, tenant, responseId, res)
  }
  const listedId = inputItemsIdOf(path)
  if (listedId !== null && req.method === 'GET') {
    return listInputItems(deps.store, authenticate(deps.tenants, req), listedId, req.url, res)
  }
  if (req.method === 'GET' && path.startsWith('/v1/models/')) {
    authenticate(deps.tenants, req)
    refuseWhileRefusing(backend)
    const id = path.slice('/v1/models/'.length)
    if (id !== config.model) {
      throw new KvfenceError('model_not_found', `The model '${id}' does not exist`, 'model')
    }
    return sendJson(res, 200, modelCard(config.model, config.createdAtSec, backend.contextWindow()))
  }
  const allow = allowedMethods.get(path)
  if (allow !== undefined) throw new MethodNotAllowedError(req.method ?? '?', path, allow)
  throw new KvfenceError(
    'not_found',
    `${req.method} ${path === '' ? 'of this path' : path} is not an endpoint of this server`,
  )
}

/** While the backend refuses every request (G1 no longer holds, a worker refuses the cluster
 *  token), the model's window is no promise the router keeps: `/v1/models` answers with the
 *  refusal a generation would get, not with a `max_model_len` no request can use. */
function refuseWhileRefusing(backend: Backend): void {
  const refusal = backend.refusal()
  if (refusal !== null) throw refusal
}

/** The tenant of the request's bearer key; `invalid_api_key` otherwise. The key is never
 *  echoed, logged or kept. */
function authenticate(tenants: TenantRegistry, req: IncomingMessage): Tenant {
  // Node keeps the first of several Authorization headers and drops the rest: a request carrying
  // two tenants' keys would be served as whichever came first. Ambiguous credentials are refused.
  const numHeaders = numAuthorizationHeaders(req.rawHeaders)
  if (numHeaders > 1) {
    throw new KvfenceError(
      'invalid_api_key',
      `Send one Authorization header; this request has ${numHeaders}.`,
    )
  }
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

/** How many Authorization headers `rawHeaders` (names and values in turn, as received) holds.
 *  Counted here rather than read from `req.headersDistinct`, which builds an array for every
 *  header of every request. */
function numAuthorizationHeaders(rawHeaders: readonly string[]): number {
  let num = 0
  for (let i = 0; i < rawHeaders.length; i += 2) {
    const name = rawHeaders[i]
    if (name.length === 13 && name.toLowerCase() === 'authorization') num++
  }
  return num
}

/** `GET /health`: 200 only when requests can be served — so a load balancer stops sending
 *  traffic to a router whose backend cannot serve. */
async function health(backend: Backend, res: ServerResponse): Promise<void> {
  const reason = await backend.unavailableReason()
  if (reason !== null) return sendJson(res, 503, { status: 'unavailable', reason })
  return sendJson(res, 200, { status: 'ok' })
}

/** `GET /server_info`: the model, the window, the backend's own fields and the queue. */
async function serverInfo(deps: RouterDeps, res: ServerResponse): Promise<void> {
  const { limiter } = deps
  const limits = {
    numRunning: limiter.numRunning,
    numQueued: limiter.numQueued,
    numWaitingForRoom: limiter.numWaitingForRoom,
  }
  const info = await deps.backend.serverInfo()
  sendJson(res, 200, {
    model: deps.config.model,
    contextWindow: deps.backend.contextWindow(),
    ...info,
    ...limits,
  })
}

/** The method each fixed path takes: another method on one of them is a 405 with `Allow`, not a
 *  404 saying the endpoint does not exist. */
const allowedMethods = new Map([
  ['/health', 'GET, HEAD'],
  ['/server_info', 'GET'],
  ['/metrics', 'GET'],
  ['/v1/models', 'GET'],
  ['/v1/chat/completions', 'POST'],
  ['/v1/completions', 'POST'],
  ['/v1/responses', 'POST'],
  [selfCheckPath, 'POST'],
])

/** The `{id}` of `/v1/responses/{id}` (any string but one holding a slash: the store judges
 *  it), or null for another path. */
function storedResponseIdOf(path: string): string | null {
  const prefix = '/v1/responses/'
  if (!path.startsWith(prefix)) return null
  const id = path.slice(prefix.length)
  return id.includes('/') ? null : id
}

/** The `{id}` of `/v1/responses/{id}/input_items`, or null for another path. */
function inputItemsIdOf(path: string): string | null {
  const prefix = '/v1/responses/'
  const suffix = '/input_items'
  if (!path.startsWith(prefix) || !path.endsWith(suffix)) return null
  const id = path.slice(prefix.length, -suffix.length)
  return id === '' || id.includes('/') ? null : id
}

/** The decoded path of a request URL ('' when it does not parse or has a dot segment: it then
 *  matches no route). */
function pathOf(url: string | undefined): string {
  // The raw path, never a resolved one: `new URL` turns `/v1/%2e%2e/metrics` into `/metrics`,
  // which let a request through a proxy that forwards only `/v1/*` reach the operators' paths.
  const raw = (url ?? '/').split(/[?#]/, 1)[0]
  if (!raw.startsWith('/')) return ''
  // Without escapes or dots the path is already decoded and has no dot segment: every
  // request's own path (`/v1/chat/completions`) skips the split and decode below.
  if (!raw.includes('%') && !raw.includes('.')) return raw
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
