/** A stand-in for Hugging Face `transformers serve` (5.x, on CPU), on 127.0.0.1, port 0: an
 *  OpenAI-compatible server that says nothing of its context or KV pool and validates little,
 *  with the behaviours the auditor met on the real one:
 *  - `max_tokens` is not validated, and a generation goes on after its client has left, holding
 *    its place in the batch (`maxBatch`, default 1: one generation at a time, the rest wait), so
 *    one `max_tokens: 10000000` wedges it for good;
 *  - with `poolTokens` (continuous batching's pool), a prompt plus `max_tokens` over the pool
 *    kills the batching worker: every completion after gets 503 and `/health` 503
 *    (`cb_worker_dead`); `dieAfterCompletions` kills it after that many completions, whatever
 *    their size;
 *  - with `sharedPrefixCache`, a cache of pages (32 tokens) shared by every request whatever its
 *    tenant, where a request's pages are shared only once it has generated its second token;
 *    prefill costs `prefillMsPerToken` per token not found in it; `cached_tokens` is never
 *    reported;
 *  - streams end without `data: [DONE]`; `/v1/models` can answer 500 (`isModelsBroken`);
 *  - with `staleReturn`, a prompt sent again after more than `poolTokens` tokens of other
 *    prompts (evicted) is answered from the pages another tenant's latest request left: the last
 *    words of its prompt (an engine that replays eviction traffic to a returning tenant).
 *  No key is checked (any bearer is taken). The "model" echoes: a token is a whitespace-separated
 *  word plus one BOS token, and the answer is the prompt's last `max_tokens` words, in a cycle. */
import { createHash } from 'node:crypto'
import { createServer, type IncomingMessage, type ServerResponse } from 'node:http'
import type { AddressInfo } from 'node:net'

export interface HfStandInOptions {
  /** Generations at once; the rest wait in order (default 1). */
  readonly maxBatch?: number
  /** Milliseconds per generated token (default 1). */
  readonly tokenDelayMs?: number
  /** Milliseconds of prefill per prompt token not served from the shared cache (default 0). */
  readonly prefillMsPerToken?: number
  /** The batching worker's KV pool (tokens): a request over it kills the worker. */
  readonly poolTokens?: number
  /** The worker dies after this many completions have started. */
  readonly dieAfterCompletions?: number
  readonly sharedPrefixCache?: boolean
  readonly isModelsBroken?: boolean
  /** With `poolTokens`: a prompt that returns after its pages were evicted is answered from the
   *  pages the previous request left. */
  readonly staleReturn?: boolean
}

export interface HfStandInStats {
  numCompletions: number
  /** The largest `max_tokens` any completion asked for. */
  maxMaxTokens: number
  /** The largest prompt (tokens) any completion sent. */
  maxPromptTokens: number
  /** Tokens generated after their client had left. */
  numTokensAfterLeaving: number
  /** Generations still running, and waiting for a place. */
  numGenerating: number
  numWaiting: number
  isWorkerDead: boolean
  /** What killed the worker. */
  deathCause: string | null
  /** Prompt tokens served from the shared cache, over all completions. */
  numCachedTokensServed: number
}

export interface HfStandIn {
  readonly url: string
  readonly stats: HfStandInStats
  close(): Promise<void>
}

const pageTokens = 32
const modelId = 'echo-tiny'

export async function startHfStandIn(options: HfStandInOptions = {}): Promise<HfStandIn> {
  const stats: HfStandInStats = {
    numCompletions: 0,
    maxMaxTokens: 0,
    maxPromptTokens: 0,
    numTokensAfterLeaving: 0,
    numGenerating: 0,
    numWaiting: 0,
    isWorkerDead: false,
    deathCause: null,
    numCachedTokensServed: 0,
  }
  const maxBatch = options.maxBatch ?? 1
  const tokenDelayMs = options.tokenDelayMs ?? 1
  const waiting: (() => void)[] = []
  const sharedPages = new Set<string>()
  /** Per prompt: the tokens processed by the time it was last served (eviction by volume). */
  const lastServedAt = new Map<string, number>()
  let tokensProcessed = 0
  /** The last prompt of each tenant (by its bearer), the most recent last. */
  const lastPromptOf = new Map<string, string[]>()
  let isClosed = false

  const kill = (cause: string): void => {
    stats.isWorkerDead = true
    stats.deathCause ??= cause
  }
  const dead = (res: ServerResponse): void =>
    sendJson(res, 503, {
      error: { message: 'continuous batching worker died', type: 'server_error' },
    })

  const complete = async (body: string, req: IncomingMessage, res: ServerResponse) => {
    const request = parse(body)
    if (typeof request === 'string')
      return sendJson(res, 422, { error: { message: request, type: 'invalid_request_error' } })
    if (stats.isWorkerDead) return dead(res)
    const words = request.prompt.trim().split(/\s+/)
    const promptTokens = words.length + 1
    stats.numCompletions++
    stats.maxMaxTokens = Math.max(stats.maxMaxTokens, request.max_tokens)
    stats.maxPromptTokens = Math.max(stats.maxPromptTokens, promptTokens)
    if (
      options.dieAfterCompletions !== undefined &&
      stats.numCompletions > options.dieAfterCompletions
    )
      kill(`after ${options.dieAfterCompletions} completions`)
    if (options.poolTokens !== undefined && promptTokens > options.poolTokens)
      kill(`a ${promptTokens}-token prompt over the ${options.poolTokens}-token pool`)
    if (stats.isWorkerDead) return dead(res)

    let hasLeft = false
    res.on('close', () => {
      if (!res.writableFinished) hasLeft = true
    })
    if (stats.numGenerating >= maxBatch) {
      stats.numWaiting++
      await new Promise<void>((resolve) => waiting.push(resolve))
      stats.numWaiting--
    }
    stats.numGenerating++
    try {
      const answer = answerWords(req.headers.authorization ?? '', words, request.max_tokens)
      const pages = pageKeys(words)
      const numCached = options.sharedPrefixCache ? cachedPrefixTokens(pages, sharedPages) : 0
      stats.numCachedTokensServed += numCached
      await sleep((promptTokens - numCached) * (options.prefillMsPerToken ?? 0))
      tokensProcessed += promptTokens
      if (request.stream && !hasLeft)
        res.writeHead(200, { 'content-type': 'text/event-stream', 'cache-control': 'no-cache' })
      let text = ''
      // Generates to max_tokens whether or not anyone still reads: the wedge.
      for (let i = 0; i < request.max_tokens && !isClosed && !stats.isWorkerDead; i++) {
        if (i > 0 || !request.stream) await sleep(tokenDelayMs)
        const word = `${answer[i % answer.length]} `
        text += word
        if (hasLeft) stats.numTokensAfterLeaving++
        else if (request.stream)
          res.write(`data: ${JSON.stringify({ choices: [{ index: 0, text: word }] })}\n\n`)
        // Pages are shared only once a second token has been generated.
        if (i === 1 && options.sharedPrefixCache) for (const p of pages) sharedPages.add(p)
      }
      const usage = { prompt_tokens: promptTokens, completion_tokens: request.max_tokens }
      if (hasLeft) return
      if (request.stream) {
        // No `data: [DONE]`: the stream just ends.
        res.end(
          `data: ${JSON.stringify({ choices: [{ index: 0, text: '', finish_reason: 'length' }], usage })}\n\n`,
        )
      } else {
        sendJson(res, 200, {
          id: `cmpl-${stats.numCompletions}`,
          object: 'text_completion',
          model: modelId,
          choices: [{ index: 0, text, finish_reason: 'length' }],
          usage,
        })
      }
    } finally {
      stats.numGenerating--
      waiting.shift()?.()
      void req
    }
  }

  /** The answer's words: the prompt's last `maxTokens` words, or, for a prompt returning after
   *  eviction with `staleReturn`, the last words of the latest prompt another tenant sent (the
   *  pages its request left). */
  const answerWords = (tenant: string, words: string[], maxTokens: number): string[] => {
    const key = words.join(' ')
    const last = lastServedAt.get(key)
    const isEvicted =
      last !== undefined &&
      options.poolTokens !== undefined &&
      tokensProcessed - last > options.poolTokens
    const other = [...lastPromptOf].reverse().find(([t]) => t !== tenant)?.[1]
    const source = options.staleReturn && isEvicted && other !== undefined ? other : words
    lastServedAt.set(key, tokensProcessed + words.length + 1)
    lastPromptOf.delete(tenant)
    lastPromptOf.set(tenant, words)
    return maxTokens === 0 ? [] : source.slice(-Math.min(maxTokens, source.length))
  }

  const server = createServer((req, res) => {
    const chunks: Buffer[] = []
    req.on('data', (c: Buffer) => chunks.push(c))
    req.on('end', () => {
      const body = Buffer.concat(chunks).toString('utf8')
      const path = (req.url ?? '/').split('?')[0]
      if (req.method === 'GET' && path === '/health')
        return stats.isWorkerDead
          ? sendJson(res, 503, { status: 'error', reason: 'cb_worker_dead' })
          : sendJson(res, 200, { status: 'ok' })
      if (req.method === 'GET' && path === '/v1/models') {
        if (options.isModelsBroken)
          return sendJson(res, 500, { error: { message: 'Internal Server Error' } })
        return sendJson(res, 200, {
          object: 'list',
          data: [{ id: modelId, object: 'model', owned_by: 'hf' }],
        })
      }
      if (req.method === 'POST' && path === '/v1/completions') {
        complete(body, req, res).catch(() => res.destroy())
        return
      }
      sendJson(res, 404, { detail: 'Not Found' })
    })
  })
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  const { port } = server.address() as AddressInfo
  return {
    url: `http://127.0.0.1:${port}`,
    stats,
    close: async () => {
      isClosed = true
      for (const resolve of waiting.splice(0)) resolve()
      server.closeAllConnections()
      await new Promise<void>((resolve) => server.close(() => resolve()))
    },
  }
}

/** Keys of the prompt's whole pages: each names every token up to its end (a prefix hash). */
function pageKeys(words: readonly string[]): string[] {
  const keys: string[] = []
  const hash = createHash('sha256')
  for (let end = pageTokens; end <= words.length; end += pageTokens) {
    hash.update(words.slice(end - pageTokens, end).join(' '))
    keys.push(hash.copy().digest('hex'))
  }
  return keys
}

function cachedPrefixTokens(pages: readonly string[], shared: ReadonlySet<string>): number {
  let n = 0
  while (n < pages.length && shared.has(pages[n])) n++
  return n * pageTokens
}

function parse(body: string): { prompt: string; max_tokens: number; stream: boolean } | string {
  let json: unknown
  try {
    json = JSON.parse(body)
  } catch {
    return 'body is not valid JSON'
  }
  const o = json as Record<string, unknown>
  if (typeof o.prompt !== 'string') return 'prompt: field required'
  // No bound on max_tokens: any integer is taken (a negative one or 0 yields nothing).
  if (o.max_tokens !== undefined && typeof o.max_tokens !== 'number')
    return 'max_tokens: Input should be a valid integer'
  const maxTokens = typeof o.max_tokens === 'number' ? o.max_tokens : 16
  if (!Number.isInteger(maxTokens)) return 'max_tokens: not an integer'
  return { prompt: o.prompt, max_tokens: Math.max(0, maxTokens), stream: o.stream === true }
}

function sleep(ms: number): Promise<void> {
  return ms <= 0 ? Promise.resolve() : new Promise((r) => setTimeout(r, ms))
}

function sendJson(res: ServerResponse, status: number, body: unknown): void {
  if (res.headersSent || res.destroyed) return
  res.writeHead(status, { 'content-type': 'application/json' })
  res.end(JSON.stringify(body))
}
