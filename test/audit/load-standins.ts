/** Stand-in engines for the load probes (`race-load`, `stall`), on 127.0.0.1, port 0, with the
 *  kvfence surface (`/v1/models`, `/server_info`, `/metrics`) and the echo model of standins.ts
 *  (a token is a whitespace-separated word, plus one BOS token; the output is the prompt's words).
 *  - `race`: a race that opens only under continuous load with long prompts in flight (SGLang PR
 *    #37505): when at least `minInFlight` completions are in flight and one of them has at least
 *    `longWords` words, an answer starts with another in-flight request's words (`cross`: a
 *    content leak), or loses its last word and a structured answer its closing brace (`break`:
 *    changed, with no foreign words). Without `race`: its correct twin.
 *  - `prefillLimitTokens`: prefill and decode started with different limits (InferenceX PR
 *    #2257): a prompt over it but within the advertised context is taken, its pages reserved, and
 *    never answered (no byte), and the pages stay reserved after the client leaves. Set to the
 *    context: its correct twin.
 *  Structured output: `response_format: {type: 'json_object'}` answers `{"echo": "<words>"}`.
 *  Streams send one event per word. Every answer waits `delayMs` plus `msPerWord` per prompt word. */
import { createServer, type IncomingMessage, type ServerResponse } from 'node:http'
import type { AddressInfo } from 'node:net'
import { tenantKeys } from './standins.js'

export interface LoadStandInOptions {
  readonly contextTokens: number
  readonly poolTokens: number
  /** Reported as `max_running_requests` in `/server_info`; absent: not reported. */
  readonly maxRunning?: number
  readonly race?: {
    readonly minInFlight: number
    readonly longWords: number
    readonly mode: 'cross' | 'break'
  }
  readonly prefillLimitTokens?: number
  readonly delayMs?: number
  readonly msPerWord?: number
}

export interface LoadStandIn {
  readonly url: string
  readonly stats: {
    maxInFlight: number
    numRaced: number
    numStalled: number
    numPagesUsed: number
  }
  close(): Promise<void>
}

const pageTokens = 16
const keys = new Set(Object.values(tenantKeys))

function sendJson(res: ServerResponse, status: number, body: unknown): void {
  res.writeHead(status, { 'content-type': 'application/json' })
  res.end(JSON.stringify(body))
}

async function readBody(req: IncomingMessage): Promise<string> {
  let body = ''
  for await (const chunk of req) body += String(chunk)
  return body
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms))

export async function startLoadStandIn(options: LoadStandInOptions): Promise<LoadStandIn> {
  const stats = { maxInFlight: 0, numRaced: 0, numStalled: 0, numPagesUsed: 0 }
  const inFlight = new Set<string[]>()
  let numRunning = 0
  const sockets = new Set<import('node:net').Socket>()
  const serveGet = (path: string, res: ServerResponse): void => {
    if (path === '/v1/models')
      return sendJson(res, 200, {
        object: 'list',
        data: [{ id: 'tiny-echo', object: 'model', max_model_len: options.contextTokens }],
      })
    if (path === '/server_info')
      return sendJson(res, 200, {
        contextWindow: options.contextTokens,
        effectiveCapacityTokens: options.poolTokens,
        ...(options.maxRunning === undefined ? {} : { max_running_requests: options.maxRunning }),
        workers: [
          { role: 'prefill', capacityTokens: options.poolTokens, numPagesUsed: 0 },
          { role: 'decode', capacityTokens: options.poolTokens, numPagesUsed: stats.numPagesUsed },
        ],
      })
    if (path === '/metrics') {
      res.writeHead(200, { 'content-type': 'text/plain; version=0.0.4' })
      res.end(`kvfence_router_requests_running ${numRunning}\n`)
      return
    }
    sendJson(res, 404, { error: { message: 'not found', type: 'not_found', code: 404 } })
  }
  const complete = async (req: IncomingMessage, res: ServerResponse): Promise<void> => {
    const auth = (req.headers.authorization ?? '').replace(/^Bearer /, '')
    if (!keys.has(auth))
      return sendJson(res, 401, {
        error: { message: 'bad key', type: 'auth', code: 'invalid_api_key' },
      })
    const body = JSON.parse(await readBody(req)) as Record<string, unknown>
    const words = String(body.prompt)
      .split(/\s+/)
      .filter((w) => w !== '')
    const maxTokens = Number(body.max_tokens ?? 16)
    const numTokens = words.length + 1
    if (numTokens + maxTokens > options.contextTokens)
      return sendJson(res, 400, {
        error: {
          message: 'too long',
          type: 'invalid_request_error',
          code: 'context_length_exceeded',
        },
      })
    const numPages = Math.ceil((numTokens + maxTokens) / pageTokens)
    stats.numPagesUsed += numPages
    numRunning++
    if (options.prefillLimitTokens !== undefined && numTokens > options.prefillLimitTokens) {
      // Decode took it and waits for a transfer prefill never sends: no byte, pages kept.
      stats.numStalled++
      return
    }
    inFlight.add(words)
    stats.maxInFlight = Math.max(stats.maxInFlight, inFlight.size)
    let isDone = false
    res.on('close', () => {
      if (isDone) return
      isDone = true
      inFlight.delete(words)
      numRunning--
      stats.numPagesUsed -= numPages
    })
    await sleep((options.delayMs ?? 0) + (options.msPerWord ?? 0) * words.length)
    const race = options.race
    const isRaced =
      race !== undefined &&
      inFlight.size >= race.minInFlight &&
      [...inFlight].some((w) => w.length >= race.longWords)
    let output = words.slice(0, maxTokens)
    if (isRaced && race.mode === 'cross') {
      const other = [...inFlight].find((w) => w !== words)
      if (other !== undefined) output = [...other.slice(0, 3), ...output].slice(0, maxTokens)
    }
    if (isRaced) stats.numRaced++
    if (isRaced && race.mode === 'break') output = output.slice(0, -1)
    const format = body.response_format as { type?: string } | undefined
    let text = output.join(' ')
    if (format?.type === 'json_object') {
      text = JSON.stringify({ echo: text })
      if (isRaced && race.mode === 'break') text = text.slice(0, -1)
    }
    const usage = { prompt_tokens: numTokens, completion_tokens: output.length }
    if (body.stream === true) {
      res.writeHead(200, { 'content-type': 'text/event-stream' })
      for (const piece of text.split(/(?= )/))
        res.write(`data: ${JSON.stringify({ choices: [{ index: 0, text: piece }] })}\n\n`)
      res.write(`data: ${JSON.stringify({ choices: [], usage })}\n\n`)
      res.end('data: [DONE]\n\n')
    } else {
      sendJson(res, 200, {
        object: 'text_completion',
        model: 'tiny-echo',
        choices: [{ index: 0, text, finish_reason: 'length' }],
        usage,
      })
    }
  }
  const server = createServer((req, res) => {
    const path = (req.url ?? '/').split('?')[0]
    if (req.method === 'GET') return serveGet(path, res)
    if (req.method === 'POST' && path === '/v1/completions') {
      complete(req, res).catch(() =>
        sendJson(res, 400, {
          error: { message: 'bad body', type: 'invalid_request_error', code: 400 },
        }),
      )
      return
    }
    sendJson(res, 404, { error: { message: 'not found', type: 'not_found', code: 404 } })
  })
  server.on('connection', (s) => {
    sockets.add(s)
    s.on('close', () => sockets.delete(s))
  })
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  const { port } = server.address() as AddressInfo
  return {
    url: `http://127.0.0.1:${port}`,
    stats,
    close: () =>
      new Promise<void>((resolve) => {
        for (const s of sockets) s.destroy()
        server.close(() => resolve())
      }),
  }
}
