/** A stand-in engine serving every generation entrypoint the `entrypoints` probe knows, on
 *  127.0.0.1, in each API's own shape: OpenAI completions and chat; Responses (JSON, streamed
 *  events, function tools with `function_call` items, `function_call_output` continuations and
 *  `previous_response_id` over stored responses of the same key); Anthropic `/v1/messages`
 *  (`content[]`, `usage.input_tokens` uncached only, `cache_read_input_tokens`); SGLang
 *  `/generate` (`text`, `meta_info.prompt_tokens`/`cached_tokens`); llama.cpp `/completion`
 *  (`content`, `tokens_cached`, `timings.prompt_n`/`cache_n`).
 *  Words are tokens. The model echoes the last `answerWords` words of its prompt (so an answer
 *  carries its own tenant's canaries). The prefix cache is one for all entrypoints: a prompt's
 *  cached tokens are the longest run of words it shares from its start with an earlier prompt
 *  under the same key; the key is the tenant (its bearer key) on every entrypoint except the ones
 *  of `saltless`, where it is one for everybody, as an entrypoint that drops the cache salt
 *  (vllm#46688 `/v1/messages`; vLLM PR #51818 Responses tool continuations: `responses-tools`).
 *  Streamed `/v1/messages` (Anthropic events) and `/generate` (SGLang's: each event the whole
 *  answer so far, then `[DONE]`) are served wherever their plain twin is; each name in `saltless` is
 *  one path: `messages-stream` drops the salt on the streamed path only, `messages` on the plain.
 *  `answerCache` makes those entrypoints also answer from a cache keyed by the prompt's first
 *  `answerCacheWords` words alone: the earlier tenant's answer, its canaries in it. Not a test
 *  file itself. */
import http from 'node:http'
import type { AddressInfo } from 'node:net'
import {
  streamedEntrypoints,
  type EntrypointName,
} from '../../src/audit/probes/entrypoint-shapes.js'

/** A request body as the stand-in reads it (fields checked where used). */
interface Body {
  readonly [field: string]: unknown
  readonly messages?: readonly { content: string }[]
  readonly tools?: readonly { name: string }[]
  readonly input?: string | readonly Item[]
}
/** A Responses input item: a message, a function call or its output. */
interface Item {
  readonly type?: string
  readonly content?: string
  readonly output?: string
}

/** Where the key drops the tenant: an entrypoint, or the Responses tool continuations. */
export type SaltlessPath = EntrypointName | 'responses-tools'

export interface EntrypointStandInOptions {
  /** Entrypoints served (completions is always served: the audit's own check uses it). */
  readonly serves: readonly EntrypointName[]
  readonly saltless?: readonly SaltlessPath[]
  /** True: the saltless entrypoints answer from a prompt-keyed answer cache (a content leak). */
  readonly answerCache?: boolean
  /** False: Responses refuses a non-empty `tools` with 400 (as kvfence); `fails`: answers it
   *  500. Default true. */
  readonly acceptsTools?: boolean | 'fails'
  /** A `/v1/messages` prompt of more than this many words kills the engine: that request and
   *  every one after it, on any path, get 500 (none when omitted). */
  readonly messagesDiesOverWords?: number
}

export interface EntrypointStandIn {
  readonly url: string
  /** `METHOD /path` of every request, in order. */
  readonly routes: string[]
  close(): Promise<void>
}

const answerWords = 6
const answerCacheWords = 32

/** Starts the stand-in. */
export async function startEntrypointStandIn(
  options: EntrypointStandInOptions,
): Promise<EntrypointStandIn> {
  const routes: string[] = []
  const cache: { key: string; words: string[] }[] = []
  const answers = new Map<string, string>()
  const stored = new Map<string, { key: string; text: string }>()
  let numIds = 0
  let isDead = false
  const isServed = (name: EntrypointName) =>
    name === 'completions' || options.serves.includes(plainOf(name))
  const isSaltless = (p: SaltlessPath) => (options.saltless ?? []).includes(p)

  /** The answer's text and counts for `text` under `key`, through the caches. */
  const generate = (text: string, key: string, path: SaltlessPath) => {
    const words = text.trim().split(/\s+/)
    let cached = 0
    for (const e of cache.filter((c) => c.key === key)) {
      let n = 0
      while (n < words.length && n < e.words.length && words[n] === e.words[n]) n++
      cached = Math.max(cached, n)
    }
    cache.push({ key, words })
    const head = words.slice(0, answerCacheWords).join(' ')
    let answer = words.slice(-answerWords).join(' ')
    if (options.answerCache === true && isSaltless(path)) {
      answer = answers.get(head) ?? answer
      answers.set(head, answer)
    }
    return { answer, promptTokens: words.length, cachedTokens: cached }
  }

  const server = http.createServer(async (req, res) => {
    const chunks: Buffer[] = []
    for await (const c of req as AsyncIterable<Buffer>) chunks.push(c)
    const route = `${req.method} ${req.url}`
    routes.push(route)
    const send = (status: number, body: unknown) => {
      res.writeHead(status, { 'content-type': 'application/json' })
      res.end(JSON.stringify(body))
    }
    const tenant = String(req.headers.authorization ?? '')
    const dead = () => send(500, { error: { message: 'engine died', type: 'server_error' } })
    if (isDead) return dead()
    if (route === 'GET /v1/models')
      return send(200, { object: 'list', data: [{ id: 'tiny', object: 'model' }] })
    const plain = entrypointOf(route)
    if (plain === null || !isServed(plain)) return send(404, { detail: 'Not Found' })
    const body = JSON.parse(Buffer.concat(chunks).toString('utf8') || '{}') as Body
    const keyFor = (p: SaltlessPath) => (isSaltless(p) ? '' : tenant)
    if (plain === 'responses') return serveResponses(body, tenant, keyFor, res, send)
    const name = body.stream === true ? streamedOf(plain) : plain
    const text = promptOf(plain, body)
    const diesOver = options.messagesDiesOverWords
    if (plain === 'messages' && diesOver !== undefined && text.split(/\s+/).length > diesOver) {
      isDead = true
      return dead()
    }
    const g = generate(text, keyFor(name), name)
    if (name === 'messages-stream') return streamMessages(res, g)
    if (name === 'generate-stream') return streamGenerate(res, g)
    send(200, shapeOf(plain, g))
  })

  /** Responses: plain, streamed, with tools and continuations. */
  const serveResponses = (
    body: Body,
    tenant: string,
    keyFor: (p: SaltlessPath) => string,
    res: http.ServerResponse,
    send: (status: number, body: unknown) => void,
  ) => {
    const tools = Array.isArray(body.tools) ? body.tools : []
    if (tools.length > 0 && options.acceptsTools === false)
      return send(400, { error: { message: "Invalid 'tools'", type: 'invalid_request_error' } })
    if (tools.length > 0 && options.acceptsTools === 'fails')
      return send(500, { error: { message: 'internal error', type: 'server_error' } })
    const items: readonly Item[] =
      typeof body.input === 'string' ? [{ content: body.input }] : (body.input ?? [])
    const isContinuation = items.some((i: Item) => i.type === 'function_call_output')
    let text = items
      .map((i: Item) => (i.type === 'function_call_output' ? (i.output ?? '') : (i.content ?? '')))
      .filter((t: string) => t !== '')
      .join(' ')
    if (typeof body.previous_response_id === 'string') {
      const earlier = stored.get(body.previous_response_id)
      if (earlier === undefined || earlier.key !== tenant)
        return send(404, {
          error: { message: 'Response not found', type: 'invalid_request_error' },
        })
      text = `${earlier.text} ${text}`
    }
    const path: SaltlessPath = isContinuation
      ? 'responses-tools'
      : body.stream === true
        ? 'responses-stream'
        : 'responses'
    const g = generate(text, keyFor(path), path)
    const id = `resp_${++numIds}`
    stored.set(id, { key: tenant, text })
    const output: unknown[] =
      tools.length > 0 && !isContinuation
        ? [
            {
              type: 'function_call',
              id: `fc_${numIds}`,
              call_id: `call_${numIds}`,
              name: tools[0].name,
              arguments: '{"id":"7"}',
              status: 'completed',
            },
          ]
        : [
            {
              type: 'message',
              id: `msg_${numIds}`,
              role: 'assistant',
              status: 'completed',
              content: [{ type: 'output_text', text: g.answer, annotations: [] }],
            },
          ]
    const response = {
      id,
      object: 'response',
      status: 'completed',
      output,
      usage: {
        input_tokens: g.promptTokens,
        input_tokens_details: { cached_tokens: g.cachedTokens },
        output_tokens: answerWords,
        total_tokens: g.promptTokens + answerWords,
      },
    }
    if (body.stream !== true) return send(200, response)
    res.writeHead(200, { 'content-type': 'text/event-stream' })
    const event = (value: Record<string, unknown>) =>
      res.write(`event: ${String(value.type)}\ndata: ${JSON.stringify(value)}\n\n`)
    event({
      type: 'response.created',
      response: { ...response, status: 'in_progress', output: [] },
    })
    for (const word of g.answer.split(' '))
      event({
        type: 'response.output_text.delta',
        output_index: 0,
        content_index: 0,
        delta: `${word} `,
      })
    event({ type: 'response.completed', response })
    res.end()
  }

  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r))
  return {
    url: `http://127.0.0.1:${(server.address() as AddressInfo).port}`,
    routes,
    close: async () => {
      server.closeAllConnections()
      await new Promise((r) => server.close(r))
    },
  }
}

function plainOf(name: EntrypointName): EntrypointName {
  return streamedEntrypoints[name] ?? name
}

function streamedOf(plain: EntrypointName): EntrypointName {
  const found = Object.entries(streamedEntrypoints).find(([, p]) => p === plain)
  return (found?.[0] as EntrypointName | undefined) ?? plain
}

type Generated = { answer: string; promptTokens: number; cachedTokens: number }

/** Anthropic's streamed message: usage on `message_start`, a text delta a word. */
function streamMessages(res: http.ServerResponse, g: Generated): void {
  res.writeHead(200, { 'content-type': 'text/event-stream' })
  const event = (value: Record<string, unknown>) =>
    res.write(`event: ${String(value.type)}\ndata: ${JSON.stringify(value)}\n\n`)
  const usage = {
    input_tokens: g.promptTokens - g.cachedTokens,
    cache_read_input_tokens: g.cachedTokens,
    cache_creation_input_tokens: 0,
    output_tokens: 1,
  }
  event({
    type: 'message_start',
    message: { id: 'msg_1', type: 'message', role: 'assistant', content: [], usage },
  })
  event({ type: 'content_block_start', index: 0, content_block: { type: 'text', text: '' } })
  for (const word of g.answer.split(' '))
    event({
      type: 'content_block_delta',
      index: 0,
      delta: { type: 'text_delta', text: `${word} ` },
    })
  event({ type: 'content_block_stop', index: 0 })
  event({
    type: 'message_delta',
    delta: { stop_reason: 'max_tokens' },
    usage: { output_tokens: answerWords },
  })
  event({ type: 'message_stop' })
  res.end()
}

/** SGLang's streamed `/generate`: each event the whole answer so far, then `[DONE]`. */
function streamGenerate(res: http.ServerResponse, g: Generated): void {
  res.writeHead(200, { 'content-type': 'text/event-stream' })
  const words = g.answer.split(' ')
  for (let i = 1; i <= words.length; i++) {
    const meta_info = {
      id: 'rid',
      prompt_tokens: g.promptTokens,
      cached_tokens: g.cachedTokens,
      completion_tokens: i,
    }
    res.write(
      `data: ${JSON.stringify({ text: words.slice(0, i).join(' '), meta_info, index: 0 })}\n\n`,
    )
  }
  res.write('data: [DONE]\n\n')
  res.end()
}

function entrypointOf(route: string): EntrypointName | null {
  const byRoute: Record<string, EntrypointName> = {
    'POST /v1/completions': 'completions',
    'POST /v1/chat/completions': 'chat',
    'POST /v1/responses': 'responses',
    'POST /v1/messages': 'messages',
    'POST /generate': 'generate',
    'POST /completion': 'completion',
  }
  return byRoute[route] ?? null
}

function promptOf(name: EntrypointName, body: Body): string {
  if (name === 'chat' || name === 'messages')
    return (body.messages ?? []).map((m) => m.content).join(' ')
  if (name === 'generate') return String(body.text)
  return String(body.prompt)
}

function shapeOf(
  name: EntrypointName,
  g: { answer: string; promptTokens: number; cachedTokens: number },
): unknown {
  const usage = {
    prompt_tokens: g.promptTokens,
    completion_tokens: answerWords,
    total_tokens: g.promptTokens + answerWords,
    prompt_tokens_details: { cached_tokens: g.cachedTokens },
  }
  if (name === 'completions')
    return {
      id: 'cmpl-1',
      object: 'text_completion',
      choices: [{ index: 0, text: g.answer, finish_reason: 'length' }],
      usage,
    }
  if (name === 'chat')
    return {
      id: 'chatcmpl-1',
      object: 'chat.completion',
      choices: [
        { index: 0, message: { role: 'assistant', content: g.answer }, finish_reason: 'length' },
      ],
      usage,
    }
  if (name === 'messages')
    return {
      id: 'msg_1',
      type: 'message',
      role: 'assistant',
      content: [{ type: 'text', text: g.answer }],
      stop_reason: 'max_tokens',
      usage: {
        input_tokens: g.promptTokens - g.cachedTokens,
        cache_read_input_tokens: g.cachedTokens,
        cache_creation_input_tokens: 0,
        output_tokens: answerWords,
      },
    }
  if (name === 'generate')
    return {
      text: g.answer,
      meta_info: {
        id: 'rid',
        prompt_tokens: g.promptTokens,
        cached_tokens: g.cachedTokens,
        completion_tokens: answerWords,
      },
    }
  return {
    content: g.answer,
    tokens_evaluated: g.promptTokens,
    tokens_cached: g.cachedTokens,
    timings: { prompt_n: g.promptTokens - g.cachedTokens, cache_n: g.cachedTokens },
    stop: true,
  }
}
