/** The Responses path and the gateway in `bench -- router` (issue #30's figures):
 *  - `responses_added_latency_ms_p50`: a streamed `POST /v1/responses` (the same 16-token prompt
 *    as `input`, `max_output_tokens` 15, `store: false`) through kvfence's router in front of the
 *    stand-in workers, paired with the same generation straight to the workers (the direct path of
 *    router-paths.ts); the p50 of per-pair differences, which goes first alternating.
 *  - `gateway_responses_added_latency_ms_p50` and `gateway_chat_added_latency_ms_p50`: the router
 *    in gateway mode in front of a stand-in vLLM (test/helpers/engines.ts: a 15-word streamed
 *    reply, a salted prefix cache), a streamed `/v1/responses` (run on the engine as a streamed
 *    chat completion, src/router/gateway/relay-text.ts) and a streamed chat completion through
 *    it, each paired with the same streamed chat completion sent straight to the engine.
 *  - `gateway_self_check_*`: what the gateway's isolation self-check (run at every start) cost the
 *    engine: requests, tokens and seconds, read from `/server_info` after each of `--repeats`
 *    starts of the gateway against the stand-in.
 *  The stand-in engine and the gateway run in a child process of their own; clients here. */
import { fork } from 'node:child_process'
import http from 'node:http'
import { fileURLToPath } from 'node:url'
import { pino } from 'pino'
import { startRouter, type RunningRouter } from '../src/router/start.js'
import { apiKeyDigest } from '../src/router/tenants/tenants.js'
import { startEngine, type Engine } from '../test/helpers/engines.js'
import { keys } from '../test/router/helpers.js'
import { quantile, spreadOf } from './ratio.js'
import type { FloorContext } from './router-floors.js'
import {
  directRequest,
  idleSocketMs,
  maxTokens,
  post,
  prompt,
  readAll,
  stop,
  timed,
} from './router-paths.js'

/** What the gateway's child reports once listening. */
interface GatewayEndpoints {
  engineUrl: string
  gatewayUrl: string
  /** The self-check's cost at each start: requests, tokens, ms. */
  selfChecks: { numRequests: number; numTokens: number; durationMs: number; results: string[] }[]
}

/** The Responses path's and the gateway's figures (see the module's header). */
export async function benchResponses(c: FloorContext): Promise<object> {
  const responses = () => responsesRequest(c.agent, c.endpoints.routerUrl, 'echo-test')
  const direct = () => directRequest(c.channels, c.endpoints)
  const native = await pairedAdded(c, responses, direct)
  const child = fork(fileURLToPath(import.meta.url), ['--serve-gateway', String(c.repeats)], {
    stdio: ['ignore', 'ignore', 'inherit', 'ipc'],
  })
  try {
    const g = await new Promise<GatewayEndpoints>((resolve, reject) => {
      child.once('message', (m) => resolve(m as GatewayEndpoints))
      child.once('exit', (code) => reject(new Error(`gateway process exited with ${code}`)))
    })
    const agent = new http.Agent({ keepAlive: true, maxSockets: Infinity, timeout: idleSocketMs })
    try {
      const engineChat = () => chatRequest(agent, g.engineUrl, 'tiny-engine', null)
      const gatewayResponses = () => responsesRequest(agent, g.gatewayUrl, 'served')
      const gatewayChat = () => chatRequest(agent, g.gatewayUrl, 'served', keys.alpha)
      const viaResponses = await pairedAdded(c, gatewayResponses, engineChat)
      const viaChat = await pairedAdded(c, gatewayChat, engineChat)
      const cost = (f: (x: GatewayEndpoints['selfChecks'][number]) => number) =>
        spreadOf(g.selfChecks.map(f), 3)
      return {
        responses_added_latency_ms_p50: native.median,
        responses_added_latency_ms_p50_spread: native,
        gateway_responses_added_latency_ms_p50: viaResponses.median,
        gateway_responses_added_latency_ms_p50_spread: viaResponses,
        gateway_chat_added_latency_ms_p50: viaChat.median,
        gateway_chat_added_latency_ms_p50_spread: viaChat,
        responses_latency_is:
          'median over repeats of the p50 of per-pair (through − straight) ms, streamed; native: router vs the workers direct; gateway: router in gateway mode vs a streamed chat completion straight to the stand-in vLLM',
        gateway_self_check_requests: cost((x) => x.numRequests).median,
        gateway_self_check_tokens: cost((x) => x.numTokens).median,
        gateway_self_check_seconds: cost((x) => x.durationMs / 1000).median,
        gateway_self_check_seconds_spread: cost((x) => x.durationMs / 1000),
        gateway_self_check_results: g.selfChecks[0]?.results ?? [],
        gateway_self_check_is:
          'cost of one isolation self-check (chat and completions, 3 requests each) against the stand-in vLLM on 127.0.0.1, read from /server_info after each start; a real engine adds its own generation time',
      }
    } finally {
      agent.destroy()
    }
  } finally {
    await stop(child)
  }
}

/** The spread over repeats of each repeat's p50 of per-pair (`through` − `straight`) ms, the
 *  pair's order alternating request by request. */
async function pairedAdded(
  c: FloorContext,
  through: () => Promise<void>,
  straight: () => Promise<void>,
): Promise<ReturnType<typeof spreadOf>> {
  for (let i = 0; i < 200; i++) await Promise.all([through(), straight()])
  const p50s: number[] = []
  for (let r = 0; r < c.repeats; r++) {
    const added: number[] = []
    for (let i = 0; i < c.numRequests; i++) {
      const first = i % 2 === 0 ? await timed(through) : await timed(straight)
      const second = i % 2 === 0 ? await timed(straight) : await timed(through)
      added.push(i % 2 === 0 ? first - second : second - first)
    }
    p50s.push(quantile(added, 0.5))
  }
  return spreadOf(p50s, 3)
}

/** A streamed `POST /v1/responses` (tenant alpha), read to its end. */
async function responsesRequest(agent: http.Agent, base: string, model: string): Promise<void> {
  const body = JSON.stringify({
    model,
    input: prompt,
    max_output_tokens: maxTokens,
    temperature: 0,
    store: false,
    stream: true,
  })
  const res = await post(agent, `${base}/v1/responses`, body, {
    authorization: `Bearer ${keys.alpha}`,
  })
  const text = await readAll(res)
  if (res.statusCode !== 200) throw new Error(`responses: HTTP ${res.statusCode}: ${text}`)
}

/** A streamed chat completion to `base` (with `key` as a tenant's, or none: the engine), read to
 *  its end. */
async function chatRequest(
  agent: http.Agent,
  base: string,
  model: string,
  key: string | null,
): Promise<void> {
  const body = JSON.stringify({
    model,
    messages: [{ role: 'user', content: prompt }],
    max_tokens: maxTokens,
    temperature: 0,
    stream: true,
  })
  const headers: Record<string, string> = key === null ? {} : { authorization: `Bearer ${key}` }
  const res = await post(agent, `${base}/v1/chat/completions`, body, headers)
  const text = await readAll(res)
  if (res.statusCode !== 200) throw new Error(`chat ${base}: HTTP ${res.statusCode}: ${text}`)
}

/** The gateway's child: a stand-in vLLM, the gateway started `numStarts` times in front of it
 *  (each start runs the self-check; all but the last closed again), and the last one serving. */
async function serveGateway(numStarts: number): Promise<void> {
  const engine = await startEngine('vllm', {
    poolTokens: 1_000_000,
    maxModelLen: 4096,
    numTokens: maxTokens,
    prefixCache: 'salted',
  })
  const selfChecks: GatewayEndpoints['selfChecks'] = []
  let gateway: RunningRouter | null = null
  for (let i = 0; i < numStarts; i++) {
    await gateway?.close()
    gateway = await startGateway(engine)
    selfChecks.push(await selfCheckCost(gateway))
  }
  // The stand-in records every request for tests; a benchmark only needs it to answer.
  setInterval(() => {
    engine.completions.length = 0
    engine.completionHeaders.length = 0
    engine.routes.length = 0
  }, 1000).unref()
  process.send?.({ engineUrl: engine.url, gatewayUrl: gateway!.url, selfChecks })
  process.on('disconnect', () => {
    void gateway!
      .close()
      .then(() => engine.close())
      .finally(() => process.exit(0))
  })
}

function startGateway(engine: Engine): Promise<RunningRouter> {
  return startRouter({
    gateway: { kind: engine.kind, url: engine.url, discoveryIntervalMs: 0, selfCheckIntervalMs: 0 },
    modelName: 'served',
    tenants: [{ name: 'alpha', keySha256: apiKeyDigest(keys.alpha) }],
    port: 0,
    queue: { maxConcurrentRequests: 256, maxQueuedRequests: 1024 },
    logContent: false,
    log: pino({ level: 'warn' }),
  })
}

/** The cost of the self-check the gateway ran at its start, from its `/server_info`. */
async function selfCheckCost(
  gateway: RunningRouter,
): Promise<GatewayEndpoints['selfChecks'][number]> {
  const res = await fetch(`${gateway.url}/server_info`, {
    headers: { authorization: `Bearer ${keys.alpha}` },
  })
  const info = (await res.json()) as {
    isolationSelfCheck?: {
      numRequests: number
      numTokens: number
      durationMs: number
      paths: { endpoint: string; result: string }[]
    } | null
  }
  const report = info.isolationSelfCheck
  if (res.status !== 200 || report == null) {
    throw new Error(`the gateway's /server_info holds no self-check (HTTP ${res.status})`)
  }
  return {
    numRequests: report.numRequests,
    numTokens: report.numTokens,
    durationMs: report.durationMs,
    results: report.paths.map((p) => `${p.endpoint}: ${p.result}`),
  }
}

if (process.argv[1] === fileURLToPath(import.meta.url) && process.argv[2] === '--serve-gateway') {
  serveGateway(Number(process.argv[3])).catch((err: unknown) => {
    process.stderr.write(`bench router: ${err instanceof Error ? err.message : String(err)}\n`)
    process.exit(2)
  })
}
