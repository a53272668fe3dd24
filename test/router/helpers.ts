/** Test fixtures for the router: a char-level tokenizer written to a temp dir, stand-in prefill
 *  and decode workers speaking the control plane (the control channel, and `/server_info` and
 *  `/metrics` over HTTP) on real loopback sockets, a router in front of them, and captured logs.
 *  Not a test file itself. */
import assert from 'node:assert/strict'
import { readFileSync, rmSync, writeFileSync } from 'node:fs'
import http from 'node:http'
import { type AddressInfo, connect } from 'node:net'
import { join } from 'node:path'
import OpenAI from 'openai'
import type { Duplex } from 'node:stream'
import { acceptChannels } from '../../src/control/channel-server.js'
import type {
  DecodeEvent,
  GenerateRequest,
  PrefillRequest,
  PrefillResult,
  ServerInfo,
} from '../../src/control/messages.js'
import { KvfenceError, type ErrorCode } from '../../src/common/errors.js'
import { apiKeyDigest } from '../../src/router/tenants/tenants.js'
import { captureLogs, type LogCapture } from '../helpers/logs.js'
import { waitUntil } from '../helpers/poll.js'
import { type RunningRouter, type StartRouterOptions, startRouter } from '../../src/router/start.js'
import { tempDir } from '../helpers/temp-dir.js'
import { inProcessTokenizer } from '../helpers/in-process-tokenizer.js'

// ---------------------------------------------------------------------------------------------
// A char-level tokenizer: 0 <pad>, 1 <s>, 2 </s>, 3 <sep>, 4 "\n", 5.. printable ASCII

export const bosId = 1
export const eosId = 2

/** The chat template of the test tokenizer: `<role>content\n` per message, then `<assistant>`. */
export const testChatTemplate =
  "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"

/** Token ids of `text` in the test vocabulary (no BOS). */
export function charIds(text: string): number[] {
  return [...text].map((ch) => {
    if (ch === '\n') return 4
    const code = ch.charCodeAt(0)
    assert.ok(code >= 32 && code <= 126, `not printable ASCII: ${JSON.stringify(ch)}`)
    return code - 32 + 5
  })
}

/** Writes `tokenizer.json` + `tokenizer_config.json` to a fresh temp dir; returns the dir. */
export function writeTestTokenizer(
  config: Record<string, unknown> = {},
  options: { chatTemplate?: string | null } = {},
): string {
  const dir = tempDir('kvfence-tok-')
  const specials = ['<pad>', '<s>', '</s>', '<sep>']
  const vocab: Record<string, number> = {}
  specials.forEach((s, id) => (vocab[s] = id))
  vocab['\n'] = 4
  for (let code = 32; code <= 126; code++) vocab[String.fromCharCode(code)] = code - 32 + 5
  const tokenizer = {
    version: '1.0',
    truncation: null,
    padding: null,
    added_tokens: specials.map((content, id) => ({
      id,
      content,
      single_word: false,
      lstrip: false,
      rstrip: false,
      normalized: false,
      special: true,
    })),
    normalizer: null,
    pre_tokenizer: null,
    post_processor: {
      type: 'TemplateProcessing',
      single: [{ SpecialToken: { id: '<s>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }],
      pair: [
        { SpecialToken: { id: '<s>', type_id: 0 } },
        { Sequence: { id: 'A', type_id: 0 } },
        { Sequence: { id: 'B', type_id: 1 } },
      ],
      special_tokens: { '<s>': { id: '<s>', ids: [1], tokens: ['<s>'] } },
    },
    decoder: { type: 'Fuse' },
    model: {
      type: 'BPE',
      dropout: null,
      unk_token: null,
      continuing_subword_prefix: null,
      end_of_word_suffix: null,
      fuse_unk: false,
      byte_fallback: false,
      ignore_merges: false,
      vocab,
      merges: [],
    },
  }
  const chatTemplate = options.chatTemplate === undefined ? testChatTemplate : options.chatTemplate
  const tokenizerConfig = {
    bos_token: '<s>',
    eos_token: '</s>',
    pad_token: '<pad>',
    add_bos_token: true,
    add_eos_token: false,
    ...(chatTemplate === null ? {} : { chat_template: chatTemplate }),
    ...config,
  }
  writeFileSync(join(dir, 'tokenizer.json'), JSON.stringify(tokenizer))
  writeFileSync(join(dir, 'tokenizer_config.json'), JSON.stringify(tokenizerConfig))
  return dir
}

/** The test tokenizer with one long added token, so that the length bound before tokenizing
 *  (window × longest token × 4 characters) lets a 900 KB prompt through to the tokenizer. */
export function tokenizerWithLongToken(): string {
  const dir = writeTestTokenizer()
  const file = join(dir, 'tokenizer.json')
  const json = JSON.parse(readFileSync(file, 'utf8')) as {
    added_tokens: object[]
    model: { vocab: Record<string, number> }
  }
  const content = `<${'long'.repeat(500)}>`
  const id = Object.keys(json.model.vocab).length
  json.model.vocab[content] = id
  json.added_tokens.push({
    id,
    content,
    single_word: false,
    lstrip: false,
    rstrip: false,
    normalized: false,
    special: true,
  })
  writeFileSync(file, JSON.stringify(json))
  return dir
}

// ---------------------------------------------------------------------------------------------
// Stand-in workers

/** How the stand-ins behave. */
export interface StandInOptions {
  /** Tokens the decode worker streams for a prompt (default: "Hello, tenant!" then EOS). */
  reply?: (promptTokenIds: readonly number[]) => number[]
  pageSize?: number
  numPages?: number
  maxPositionEmbeddings?: number
  guardsEnabled?: boolean
  faults?: string[]
  model?: string
  /** Delay between tokens, ms (0 = one event-loop turn). */
  tokenDelayMs?: number
  /** Delay of the prefill worker before it answers, ms. */
  prefillDelayMs?: number
  /** The decode worker refuses each `generate` stream outright … */
  decodeRefusal?: { status: number; code: string; message: string }
  /** … only its first this many requests (default: all). */
  decodeRefusalTimes?: number
  /** `cachedTokens` the decode worker reports in `done` (default: absent). */
  cachedTokens?: number
  /** Guard trips the workers report at `/metrics` (`kvfence_guard_trips_total`). */
  guardTrips?: Record<string, number>
  /** The prefill worker refuses each `prefill` stream … */
  prefillRefusal?: { status: number; code: string; message: string }
  /** … only its first this many requests (default: all). */
  prefillRefusalTimes?: number
  /** The decode worker names its transfer port in each `reserved` event (as a decode worker that
   *  follows messages.ts does); default false (an older decode worker: `/server_info` only). */
  isTransferPortReserved?: boolean
  /** The decode worker sends an `error` event after this many tokens. */
  decodeErrorAfterTokens?: number
  /** The prefill worker reports this first token instead of the real one. */
  prefillFirstTokenId?: number
  /** The prefill worker reports this many prompt tokens sent (the incident's placeholder: 1). */
  prefillNumTokens?: number
  /** The decode worker's KV pool holds this many requests at once; one more is refused with
   *  503 `capacity_exhausted` (a full pool), and a request's room is freed before its `done`. */
  maxRunningDecodes?: number
  /** The decode worker holds each request it takes after its first token until the test calls
   *  `releaseHeld` (in the order they were taken). */
  isHoldingReplies?: boolean
  /** The stand-ins serve the control channel (`GET /internal/channel`), as workers do; false
   *  plays a peer without it (the upgrade answered 404). Default true. */
  isChannelServed?: boolean
}

/** Two `node:http` servers implementing the control plane, recording what they receive. */
export interface StandIns {
  prefillUrl: string
  decodeUrl: string
  transferPort: number
  generateRequests: GenerateRequest[]
  prefillRequests: PrefillRequest[]
  /** What happened, in order: `generate RID`, `decode-closed RID`, `prefill RID`. */
  events: string[]
  /** Stand in for a restart of the decode worker's transfer receiver on another port. */
  setTransferPort(port: number): void
  /** Close every connection to the decode worker (as a restart does). */
  closeDecodeConnections(): void
  /** TCP connections the decode worker has accepted so far. */
  numDecodeConnections(): number
  /** Control channels the decode worker has accepted so far (upgrades it switched). */
  numDecodeChannels(): number
  /** `GET /server_info` requests the decode worker has answered so far. */
  numDecodeInfoReads(): number
  /** Stand in for a restart of both workers with pools of `numPages` pages. */
  setNumPages(numPages: number): void
  /** `generate` streams refused by `decodeRefusal`. */
  numRefused(): number
  /** `generate` streams refused for a full pool (`maxRunningDecodes`). */
  numPoolRefused(): number
  /** Requests the decode worker took (not refused), in order. */
  takenRequests: GenerateRequest[]
  /** Requests held after their first token (`isHoldingReplies`). */
  numHeld(): number
  /** Lets the oldest held request finish. */
  releaseHeld(): void
  /** Request ids whose stream the router cancelled (or whose channel closed) before the worker
   *  finished. */
  decodeClosedEarly: string[]
  prefillClosedEarly: string[]
  /** Number of request steps (generate and prefill streams) the workers were sent. */
  numInternalRequests(): number
  close(): Promise<void>
}

/** The default reply text of the stand-in decode worker. */
export const defaultReplyText = 'Hello, tenant!'

/** Starts a stand-in prefill worker and decode worker on 127.0.0.1. */
export async function startStandIns(options: StandInOptions = {}): Promise<StandIns> {
  const pageSize = options.pageSize ?? 16
  let numPages = options.numPages ?? 64
  const reply_ = options.reply ?? (() => [...charIds(defaultReplyText), eosId])
  let transferPort = 47_000 + Math.floor(Math.random() * 1000) // never connected to
  const prefilled = new Map<string, () => void>() // rid → wake the decode worker
  const prefilledEarly = new Set<string>()
  const state = {
    generateRequests: [] as GenerateRequest[],
    prefillRequests: [] as PrefillRequest[],
    decodeClosedEarly: [] as string[],
    prefillClosedEarly: [] as string[],
    events: [] as string[],
    takenRequests: [] as GenerateRequest[],
  }
  const held: (() => void)[] = []
  let numRunningDecodes = 0
  let numPoolRefused = 0
  const info = (role: 'prefill' | 'decode'): ServerInfo => ({
    role,
    model: options.model ?? 'echo-test',
    pageSize,
    numPages,
    capacityTokens: numPages * pageSize,
    numPagesFree: numPages,
    numPagesUsed: 0,
    maxPositionEmbeddings: options.maxPositionEmbeddings ?? 4096,
    guardsEnabled: options.guardsEnabled ?? true,
    faults: options.faults ?? [],
    ...(role === 'decode' ? { transferPort } : {}),
  })

  const metricsText = (role: string) =>
    '# HELP kvfence_guard_trips_total Times a safety guard refused an operation, by guard\n' +
    '# TYPE kvfence_guard_trips_total gauge\n' +
    Object.entries(options.guardTrips ?? { G3: 0 })
      .map(([guard, n]) => `kvfence_guard_trips_total{guard="${guard}",role="${role}"} ${n}\n`)
      .join('')
  let numRefused = 0
  let numPrefillRefused = 0
  /** The decode worker's work on one request. */
  const runDecode = async (request: GenerateRequest, reply: StandInReply) => {
    state.generateRequests.push(request)
    const rid = request.requestId
    state.events.push(`generate ${rid}`)
    reply.onClosedEarly(() => {
      state.decodeClosedEarly.push(rid)
      state.events.push(`decode-closed ${rid}`)
    })
    if (options.decodeRefusal && numRefused < (options.decodeRefusalTimes ?? Infinity)) {
      numRefused++
      const { status, code, message } = options.decodeRefusal
      return reply.refuse(status, code, message)
    }
    if (numRunningDecodes >= (options.maxRunningDecodes ?? Infinity)) {
      numPoolRefused++
      return reply.refuse(503, 'capacity_exhausted', 'KV pool full')
    }
    numRunningDecodes++
    let isInPool = true
    const leavePool = () => {
      if (isInPool) numRunningDecodes--
      isInPool = false
    }
    reply.onClosed(leavePool)
    state.takenRequests.push(request)
    reply.emit({
      type: 'reserved',
      numPages: Math.ceil(request.promptTokenIds.length / pageSize),
      ...(options.isTransferPortReserved ? { transferPort } : {}),
    })
    if (!prefilledEarly.has(rid)) await new Promise<void>((resolve) => prefilled.set(rid, resolve))
    const tokens = reply_(request.promptTokenIds)
    let numTokens = 0
    let finishReason: 'stop' | 'length' = 'length'
    for (const token of tokens) {
      if (reply.isClosed) return
      if (numTokens === options.decodeErrorAfterTokens) {
        reply.emit({
          type: 'error',
          code: 'guard_violation',
          message: 'page 3 of tenant beta in use',
        })
        return reply.end()
      }
      reply.emit({ type: 'token', tokenId: token })
      numTokens++
      if (numTokens === 1 && options.isHoldingReplies) await new Promise<void>((r) => held.push(r))
      await delay(options.tokenDelayMs ?? 0)
      if (request.stopTokenIds.includes(token)) {
        finishReason = 'stop'
        break
      }
      if (numTokens >= request.maxTokens) break
    }
    if (reply.isClosed) return
    leavePool()
    reply.emit({
      type: 'done',
      finishReason,
      promptTokens: request.promptTokenIds.length,
      completionTokens: numTokens,
      ...(options.cachedTokens === undefined ? {} : { cachedTokens: options.cachedTokens }),
    })
    reply.end()
  }

  /** The prefill worker's work on one request. */
  const runPrefill = async (request: PrefillRequest, reply: StandInReply) => {
    state.prefillRequests.push(request)
    const rid = request.requestId
    state.events.push(`prefill ${rid}`)
    reply.onClosedEarly(() => state.prefillClosedEarly.push(rid))
    await delay(options.prefillDelayMs ?? 1)
    if (reply.isClosed) return
    if (request.decode.host !== '127.0.0.1' || request.decode.port !== transferPort) {
      // What a real prefill worker meets at a stale address: nobody listening.
      const where = `${request.decode.host}:${request.decode.port}`
      const message = `connect ECONNREFUSED ${where} (the decode worker's transfer port is ${transferPort})`
      return reply.refuse(502, 'transfer_failed', message)
    }
    if (options.prefillRefusal && numPrefillRefused < (options.prefillRefusalTimes ?? Infinity)) {
      numPrefillRefused++
      const { status, code, message } = options.prefillRefusal
      return reply.refuse(status, code, message)
    }
    const wake = prefilled.get(rid)
    if (wake) wake()
    else prefilledEarly.add(rid)
    reply.emit({
      requestId: rid,
      numPages: Math.ceil(request.promptTokenIds.length / pageSize),
      numTokens: options.prefillNumTokens ?? request.promptTokenIds.length,
      firstTokenId: options.prefillFirstTokenId ?? reply_(request.promptTokenIds)[0],
    })
    reply.end()
  }

  let numDecodeInfoReads = 0
  const decode = http.createServer((req, res) => {
    if (req.method === 'GET' && req.url === '/server_info') {
      numDecodeInfoReads++
      return json(res, 200, info('decode'))
    }
    if (req.method === 'GET' && req.url === '/metrics') {
      res.writeHead(200, { 'content-type': 'text/plain; version=0.0.4' })
      return res.end(metricsText('decode'))
    }
    json(res, 404, {})
  })

  const prefill = http.createServer((req, res) => {
    if (req.method === 'GET' && req.url === '/server_info') return json(res, 200, info('prefill'))
    if (req.method === 'GET' && req.url === '/metrics') {
      res.writeHead(200, { 'content-type': 'text/plain; version=0.0.4' })
      return res.end(metricsText('prefill'))
    }
    json(res, 404, {})
  })

  // The control channel (the workers' own end of it, src/control/channel-server.ts), unless the
  // stand-ins play a peer without it.
  const channelSockets = new Set<Duplex>()
  let numDecodeChannels = 0
  if (options.isChannelServed ?? true) {
    const track = (server: http.Server) =>
      server.on('upgrade', (_req, socket: Duplex) => {
        channelSockets.add(socket)
        socket.once('close', () => channelSockets.delete(socket))
      })
    acceptChannels(
      decode,
      {
        generate: (request, closed, sink) =>
          new Promise<void>((resolve, reject) => {
            const reply = channelReply(closed, (event) => sink.write(event as DecodeEvent), resolve)
            runDecode(request, reply).catch(reject)
          }),
      },
      { clusterToken: null },
    )
    acceptChannels(
      prefill,
      {
        prefill: (request, closed) =>
          new Promise<PrefillResult>((resolve, reject) => {
            const reply = channelReply(
              closed,
              (result) => resolve(result as PrefillResult),
              () => {},
            )
            runPrefill(request, reply).catch(reject)
          }),
      },
      { clusterToken: null },
    )
    track(decode)
    track(prefill)
    decode.on('upgrade', () => numDecodeChannels++)
  }

  let numDecodeConnections = 0
  decode.on('connection', () => numDecodeConnections++)
  const [decodePort, prefillPort] = await Promise.all([listen(decode), listen(prefill)])
  return {
    ...state,
    prefillUrl: `http://127.0.0.1:${prefillPort}`,
    decodeUrl: `http://127.0.0.1:${decodePort}`,
    get transferPort() {
      return transferPort
    },
    setTransferPort: (port: number) => (transferPort = port),
    closeDecodeConnections: () => {
      decode.closeAllConnections()
      for (const socket of channelSockets) socket.destroy()
    },
    numDecodeConnections: () => numDecodeConnections,
    numDecodeChannels: () => numDecodeChannels,
    numDecodeInfoReads: () => numDecodeInfoReads,
    setNumPages: (n: number) => (numPages = n),
    numRefused: () => numRefused,
    numPoolRefused: () => numPoolRefused,
    numHeld: () => held.length,
    releaseHeld: () => held.shift()?.(),
    numInternalRequests: () => state.generateRequests.length + state.prefillRequests.length,
    async close() {
      for (const server of [decode, prefill]) server.closeAllConnections()
      for (const socket of channelSockets) socket.destroy()
      await Promise.all([decode, prefill].map((s) => new Promise((r) => s.close(r))))
    },
  }
}

// ---------------------------------------------------------------------------------------------
// A router in front of stand-ins

/** API keys of the two test tenants. */
export const keys = { alpha: 'sk-alpha-7f3e9c1d2b', beta: 'sk-beta-41a8d0e6c5' }

/** Captured logs, for the harness and the router's tests (see test/helpers/logs.ts). */
export { captureLogs, type LogCapture }

/** Everything a router test needs. */
export interface Harness {
  router: RunningRouter
  workers: StandIns
  logs: LogCapture
  tokenizerDir: string
  /** An OpenAI client for a tenant's key (no retries). */
  client(apiKey?: string): OpenAI
  /** `fetch` against the router with tenant alpha's key unless `headers` say otherwise. */
  post(path: string, body: string | object, headers?: Record<string, string>): Promise<Response>
  close(): Promise<void>
}

/** Starts stand-ins and a router (port 0) in front of them. */
export async function startHarness(
  standIn: StandInOptions = {},
  routerOptions: Partial<StartRouterOptions> = {},
): Promise<Harness> {
  const workers = await startStandIns(standIn)
  const logs = captureLogs()
  const tokenizerDir = writeTestTokenizer()
  let router: RunningRouter
  try {
    router = await startRouter({
      modelDir: tokenizerDir,
      prefillUrls: [workers.prefillUrl],
      decodeUrls: [workers.decodeUrl],
      tenants: [
        { name: 'alpha', keySha256: apiKeyDigest(keys.alpha) },
        { name: 'beta', keySha256: apiKeyDigest(keys.beta) },
      ],
      port: 0,
      log: logs.log,
      workerWaitMs: 0,
      tokenizerProcessesOnDemand: true, // most tests send no long prompt
      startTokenizer: inProcessTokenizer,
      ...routerOptions,
    })
  } catch (err) {
    await workers.close()
    rmSync(tokenizerDir, { recursive: true, force: true })
    throw err
  }
  return {
    router,
    workers,
    logs,
    tokenizerDir,
    client: (apiKey = keys.alpha) =>
      new OpenAI({ baseURL: `${router.url}/v1`, apiKey, maxRetries: 0, timeout: 10_000 }),
    post: (path, body, headers = {}) =>
      fetch(`${router.url}${path}`, {
        method: 'POST',
        headers: {
          authorization: `Bearer ${keys.alpha}`,
          'content-type': 'application/json',
          ...headers,
        },
        body: typeof body === 'string' ? body : JSON.stringify(body),
      }),
    async close() {
      await router.close()
      await workers.close()
      rmSync(tokenizerDir, { recursive: true, force: true })
    },
  }
}

/** Sends `bytes` on a raw TCP socket to `url`'s port (for what no HTTP client sends: a header
 *  twice, a malformed request) and reads to the end; the answer's status, its head (lower case)
 *  and its body. */
export async function rawRequest(
  url: string,
  bytes: string,
): Promise<{ status: number; head: string; body: string }> {
  const { port } = new URL(url)
  const raw = await new Promise<string>((resolve, reject) => {
    const socket = connect(Number(port), '127.0.0.1')
    let text = ''
    socket.on('data', (c: Buffer) => (text += c.toString('utf8')))
    socket.on('end', () => resolve(text))
    socket.on('error', reject)
    socket.end(bytes)
  })
  const split = raw.indexOf('\r\n\r\n')
  return {
    status: Number(/^HTTP\/1\.1 (\d+)/.exec(raw)?.[1]),
    head: raw.slice(0, split).toLowerCase(),
    body: raw.slice(split + 4),
  }
}

/** Polls `predicate` every 5 ms until it holds or `timeoutMs` passes. */
export async function waitFor(predicate: () => boolean, timeoutMs = 2_000): Promise<void> {
  await waitUntil(predicate, { timeoutMs, intervalMs: 5 })
}

// ---------------------------------------------------------------------------------------------

/** A stand-in's answer to one request step. */
interface StandInReply {
  /** Whether the router cancelled the stream (or closed the channel it came on). */
  readonly isClosed: boolean
  /** `onEarly` runs once if the router cancels the stream before its answer ended. */
  onClosedEarly(onEarly: () => void): void
  /** `onClose` runs once the request is closed, early or not. */
  onClosed(onClose: () => void): void
  /** Refuses the request (a `failed` frame with `code` and `message`; `status` is the HTTP
   *  status the code stands for, unused on the channel). */
  refuse(status: number, code: string, message: string): void
  /** Sends an event (decode) or the result (prefill). */
  emit(body: object): void
  /** Ends the answer. */
  end(): void
}

/** A {@link StandInReply} as a channel stream: `closed` aborts on `cancel` or the connection
 *  closing; a refusal is thrown (the channel sends it as `failed`). */
function channelReply(
  closed: AbortSignal,
  emit: (body: object) => void,
  onEnd: () => void,
): StandInReply {
  let isEnded = false
  const onCloses: (() => void)[] = []
  const close = () => {
    for (const onClose of onCloses.splice(0)) onClose()
  }
  closed.addEventListener('abort', close, { once: true })
  return {
    get isClosed() {
      return closed.aborted
    },
    onClosedEarly: (onEarly) =>
      closed.addEventListener('abort', () => {
        if (!isEnded) onEarly()
      }),
    onClosed: (onClose) => void onCloses.push(onClose),
    refuse(status, code, message) {
      isEnded = true
      close()
      throw new KvfenceError(code as ErrorCode, message)
    },
    emit,
    end() {
      isEnded = true
      close()
      onEnd()
    },
  }
}

function json(res: http.ServerResponse, status: number, body: unknown): void {
  res.writeHead(status, { 'content-type': 'application/json' })
  res.end(JSON.stringify(body))
}

function delay(ms: number): Promise<void> {
  return new Promise((resolve) => (ms <= 0 ? setImmediate(resolve) : setTimeout(resolve, ms)))
}

function listen(server: http.Server): Promise<number> {
  return new Promise((resolve) =>
    server.listen(0, '127.0.0.1', () => resolve((server.address() as AddressInfo).port)),
  )
}
