/** Stand-ins for the layers beside and in front of an engine, each with its correct twin, on
 *  127.0.0.1 port 0, for the `operational-endpoints`, `near-duplicates` and `request-ids` probes.
 *  Not a test file itself. The "model" echoes: its answer is `max_tokens` words, the prompt's
 *  over and over, streamed one word per event (`chunkDelayMs` apart) with the answer's `cmpl-N` id.
 *  Tenants are the keys of standins.ts; `/health` needs no key, everything else does.
 *  - `slots`: llama.cpp's `/slots` (on by default): `prompts` shows each slot's last prompt, as
 *    llama-server does; `hidden`, the twin, shows the slots without their prompts;
 *    `in-flight` shows the prompt of a streamed request only while it is in flight (a slot
 *    cleared when its request ends).
 *  - `serverInfo`: SGLang's `/server_info` and `/get_server_info`: `api-key` serializes the whole
 *    server arguments with `api_key`, `admin_api_key` (sglang#30166); `clean`, the twin, nulls
 *    them. Both carry `eos_token` and `tokenizer_path` strings (not secrets).
 *  - `responseCache`: a gateway cache of whole answers: `shared-exact` keyed by the prompt
 *    normalised (lowercase, whitespace collapsed, words sorted) without the tenant;
 *    `shared-semantic` answers any prompt whose word set is ≥ 70 % like a cached one's (Jaccard,
 *    lowercase), without the tenant; `per-tenant`, the twin, keyed by tenant and exact prompt. A
 *    hit returns the stored answer, id and all.
 *  - `requestIds`: a gateway that joins a streamed request to the one in flight with the same
 *    client id (`x-request-id`, else `rid`, `request_id`, `user`): `shared` across tenants (the
 *    second gets the first's events, and the first's abort ends both); `reject` refuses a second
 *    request with an id in flight with 409 (any tenant's); `cancel` streams each on its own but
 *    an abort ends every stream with its id (any tenant's); `merged` (seen in a trial of a real
 *    server's continuous batching): a second request with an id in flight (any tenant's) gets its
 *    headers and nothing more until its client leaves, its tokens written into the first's
 *    stream; `per-tenant`, the twin, joins only a tenant's own.
 *  - `relay`: `crossing` writes the 3rd event of a stream to another client's stream in flight
 *    (LiteLLM#35023); `clean`, the twin (the default).
 *  - `hangsOnce`: one streamed request never answered (a request lost once, not a collision). */
import { createServer, type IncomingMessage, type ServerResponse } from 'node:http'
import type { AddressInfo } from 'node:net'
import { tenantKeys } from './standins.js'

export interface LayerOptions {
  readonly slots?: 'prompts' | 'hidden' | 'in-flight'
  readonly serverInfo?: 'api-key' | 'clean'
  readonly responseCache?: 'shared-exact' | 'shared-semantic' | 'per-tenant'
  readonly requestIds?: 'shared' | 'reject' | 'cancel' | 'merged' | 'per-tenant'
  /** The model's answer is `w0 w1 …` up to max_tokens, not the prompt's words (a model that does
   *  not echo, so a crossing carries no canary). */
  readonly isOpaque?: boolean
  readonly relay?: 'crossing' | 'clean'
  /** Between streamed events (ms); default 8. */
  readonly chunkDelayMs?: number
  /** The streamed request of this number (1 = the first) gets no answer at all, not even its
   *  headers, until its client leaves: one request hanging past the client's timeout, once. */
  readonly hangsOnce?: number
}

export interface LayerStandIn {
  readonly url: string
  /** The key `/server_info` serializes (`api-key`), to check it is never printed. */
  readonly adminKey: string
  /** Every path and method served, in order. */
  readonly requests: string[]
  close(): Promise<void>
}

export const standInAdminKey = 'sk-admin-7Qf3Zt9LmW2xR8pK'

/** One upstream stream: its events so far and the clients that read it. */
interface Upstream {
  readonly id: string
  readonly clients: Set<ServerResponse>
  isDone: boolean
  stop(): void
}

function normalise(prompt: string): string {
  return words(prompt).sort().join(' ')
}

function words(prompt: string): string[] {
  return prompt
    .toLowerCase()
    .split(/[\s.]+/)
    .filter((w) => w !== '')
}

function jaccard(a: readonly string[], b: readonly string[]): number {
  const sa = new Set(a)
  const sb = new Set(b)
  const common = [...sa].filter((w) => sb.has(w)).length
  return common / (sa.size + sb.size - common)
}

export async function startLayerStandIn(options: LayerOptions): Promise<LayerStandIn> {
  const chunkDelayMs = options.chunkDelayMs ?? 8
  const requests: string[] = []
  const slotPrompts: string[] = ['', '']
  /** Prompts of the streams in flight (`slots: 'in-flight'`). */
  const processing = new Set<string>()
  let numAnswers = 0
  const cache = new Map<string, { words: string[]; body: unknown }>()
  const inFlight = new Map<string, Upstream>()
  const cancelGroups = new Map<string, (() => void)[]>()
  const streams = new Set<ServerResponse>()
  const tenantOf = (req: IncomingMessage): string | null => {
    const auth = req.headers.authorization ?? ''
    const entry = Object.entries(tenantKeys).find(([, key]) => auth === `Bearer ${key}`)
    return entry ? entry[0] : null
  }

  const serveGet = (res: ServerResponse, path: string): void => {
    if (path === '/v1/models')
      return json(res, 200, { object: 'list', data: [{ id: 'tiny-echo', object: 'model' }] })
    if (path === '/metrics') {
      res.writeHead(200, { 'content-type': 'text/plain; version=0.0.4' })
      res.end(`standin_answers_total ${numAnswers}\n`)
      return
    }
    if (path === '/slots' && options.slots === 'in-flight')
      return json(res, 200, [
        ...[...processing].map((prompt, id) => ({ id, n_ctx: 4096, is_processing: true, prompt })),
        { id: processing.size, n_ctx: 4096, is_processing: false },
      ])
    if (path === '/slots' && options.slots !== undefined)
      return json(
        res,
        200,
        slotPrompts.map((prompt, id) => ({
          id,
          n_ctx: 4096,
          is_processing: false,
          ...(options.slots === 'prompts' ? { prompt } : {}),
        })),
      )
    if (
      (path === '/server_info' || path === '/get_server_info') &&
      options.serverInfo !== undefined
    ) {
      const isLeaky = options.serverInfo === 'api-key'
      return json(res, 200, {
        model_path: 'tiny-echo',
        tokenizer_path: 'tiny-echo',
        context_length: 4096,
        eos_token: '<|im_end|>',
        max_total_num_tokens: 65536,
        api_key: isLeaky ? tenantKeys.alice : null,
        admin_api_key: isLeaky ? standInAdminKey : null,
        ssl_keyfile_password: null,
        version: '0.5.x',
      })
    }
    json(res, 404, { error: { message: `no route ${path}`, type: 'not_found', code: 404 } })
  }

  const complete = (
    req: IncomingMessage,
    res: ServerResponse,
    tenant: string,
    body: Record<string, unknown>,
  ): void => {
    const prompt = typeof body.prompt === 'string' ? body.prompt : ''
    const maxTokens = typeof body.max_tokens === 'number' ? body.max_tokens : 16
    // The prompt's words again and again up to max_tokens: a stream long enough to overlap another.
    const promptWords = prompt.split(/\s+/).filter((w) => w !== '')
    const answer = Array.from({ length: promptWords.length === 0 ? 0 : maxTokens }, (_, i) =>
      options.isOpaque === true ? `w${i}` : promptWords[i % promptWords.length],
    )
    slotPrompts[numAnswers % slotPrompts.length] = prompt
    if (body.stream === true) return stream(req, res, tenant, body, answer)
    const cacheKey =
      options.responseCache === 'per-tenant' ? `${tenant}\n${prompt}` : normalise(prompt)
    const hit =
      options.responseCache === 'shared-semantic'
        ? [...cache.values()].find((e) => jaccard(e.words, words(prompt)) >= 0.7)
        : options.responseCache === undefined
          ? undefined
          : cache.get(cacheKey)
    if (hit) return json(res, 200, hit.body)
    const answerBody = {
      id: `cmpl-${++numAnswers}`,
      object: 'text_completion',
      model: 'tiny-echo',
      choices: [{ index: 0, text: answer.map((w) => ` ${w}`).join(''), finish_reason: 'length' }],
      usage: {
        prompt_tokens: answer.length + 1,
        completion_tokens: answer.length,
        total_tokens: 2 * answer.length + 1,
      },
    }
    if (options.responseCache !== undefined)
      cache.set(cacheKey, { words: words(prompt), body: answerBody })
    json(res, 200, answerBody)
  }

  const stream = (
    req: IncomingMessage,
    res: ServerResponse,
    tenant: string,
    body: Record<string, unknown>,
    answer: string[],
  ): void => {
    if (++numStreamed === options.hangsOnce) return
    const clientId = [req.headers['x-request-id'], body.rid, body.request_id, body.user].find(
      (v) => typeof v === 'string',
    )
    const key =
      clientId === undefined || options.requestIds === undefined
        ? null
        : options.requestIds !== 'per-tenant'
          ? clientId
          : `${tenant}\n${clientId}`
    const joined = key === null ? undefined : inFlight.get(key)
    if (options.requestIds === 'reject' && joined !== undefined && !joined.isDone)
      return json(res, 409, {
        error: { message: `request id ${clientId} is in use`, type: 'conflict', code: 409 },
      })
    res.writeHead(200, { 'content-type': 'text/event-stream' })
    streams.add(res)
    res.on('close', () => streams.delete(res))
    const isJoining = options.requestIds === 'shared' || options.requestIds === 'per-tenant'
    if (isJoining && joined !== undefined && !joined.isDone) {
      joined.clients.add(res)
      return
    }
    // `merged`: this request's tokens go to the stream in flight with its id; its own client
    // gets nothing more.
    const isMerging = options.requestIds === 'merged' && joined !== undefined && !joined.isDone
    const upstream: Upstream = {
      id: isMerging ? joined.id : `cmpl-${++numAnswers}`,
      clients: isMerging ? joined.clients : new Set([res]),
      isDone: false,
      stop: () => {},
    }
    if (key !== null && (joined === undefined || joined.isDone)) inFlight.set(key, upstream)
    const prompt = typeof body.prompt === 'string' ? body.prompt : ''
    processing.add(prompt)
    if (key !== null && options.requestIds === 'cancel')
      cancelGroups.set(key, [...(cancelGroups.get(key) ?? []), () => finish()])
    let index = 0
    const timer = setInterval(() => {
      if (index >= answer.length) return finish()
      const event = `data: ${JSON.stringify({ id: upstream.id, object: 'text_completion', choices: [{ index: 0, text: ` ${answer[index]}`, finish_reason: null }] })}\n\n`
      const others = [...streams].filter((s) => !upstream.clients.has(s))
      const targets =
        options.relay === 'crossing' && index === 2 && others.length > 0
          ? [others[0]]
          : upstream.clients
      for (const client of targets) if (!client.writableEnded) client.write(event)
      index++
    }, chunkDelayMs)
    const finish = (): void => {
      clearInterval(timer)
      processing.delete(prompt)
      upstream.isDone = true
      if (key !== null && inFlight.get(key) === upstream) inFlight.delete(key)
      if (isMerging) return
      for (const client of upstream.clients)
        if (!client.writableEnded) client.end('data: [DONE]\n\n')
    }
    // The first client's abort stops the upstream (and so every client joined to it); `cancel`
    // stops every stream with its id.
    res.on('close', () => {
      if (res.writableFinished || upstream.isDone) return
      finish()
      if (key !== null && options.requestIds === 'cancel')
        for (const stop of cancelGroups.get(key) ?? []) stop()
    })
  }

  let numStreamed = 0
  const server = createServer((req, res) => {
    const path = (req.url ?? '/').split('?')[0]
    requests.push(`${req.method} ${path}`)
    if (req.method === 'GET' && path === '/health') return json(res, 200, { status: 'ok' })
    const tenant = tenantOf(req)
    if (tenant === null)
      return json(res, 401, {
        error: { message: 'invalid api key', type: 'authentication_error', code: 401 },
      })
    if (req.method === 'GET') return serveGet(res, path)
    if (req.method !== 'POST' || path !== '/v1/completions')
      return json(res, 404, { error: { message: 'not found', type: 'not_found', code: 404 } })
    let raw = ''
    req.on('data', (c: Buffer) => (raw += c.toString()))
    req.on('end', () => {
      let body: Record<string, unknown>
      try {
        body = JSON.parse(raw) as Record<string, unknown>
      } catch {
        return json(res, 400, {
          error: { message: 'body is not JSON', type: 'invalid_request_error', code: 400 },
        })
      }
      complete(req, res, tenant, body)
    })
  })
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  const { port } = server.address() as AddressInfo
  return {
    url: `http://127.0.0.1:${port}`,
    adminKey: standInAdminKey,
    requests,
    close: () =>
      new Promise<void>((resolve) => {
        server.closeAllConnections()
        server.close(() => resolve())
      }),
  }
}

function json(res: ServerResponse, status: number, body: unknown): void {
  res.writeHead(status, { 'content-type': 'application/json' })
  res.end(JSON.stringify(body))
}
