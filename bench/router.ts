/** Router benchmark: what the router adds in front of a prefill/decode pair, measured in one run
 *  against a fast stand-in pair (no model: the decode worker streams a fixed 15-token reply as fast
 *  as its event loop turns), so that only the router's own cost shows.
 *  - Added latency: the same request (16 prompt tokens, 15 generated), one at a time, alternately
 *    (a) through the router (`POST /v1/completions`, not streamed) and (b) straight to the
 *    workers, doing the router's control-plane steps by hand on a control channel of its own to
 *    each (a `generate` stream on D, on `reserved` a `prefill` stream on P, read to `done`). Each router request is paired with the
 *    direct one sent beside it (which goes first alternates per pair, so drift and order weigh on
 *    both alike); `router_added_latency_ms_p50`/`_p99` are the p50/p99 of the per-pair differences
 *    (a) − (b), never a difference of two percentiles (which can come out negative: the two
 *    tails are different requests). Target p50 ≤ 0.5 ms. `router_latency_ms_*` and
 *    `direct_latency_ms_*` are each path's own percentiles.
 *  - Throughput: 64 concurrent clients, each sending streamed completions back to back for
 *    `--seconds` (default 3), through the router and, for the ratio, straight to the workers.
 *  - Socket writes: `router_socket_writes_per_streamed_request`, the router's writes to client
 *    sockets (`_write`/`_writev` calls, counted in the child) per streamed request of the
 *    throughput run: one per event-loop turn in which the stream had something to send (the
 *    headers leave with the first text; src/router/api/http.ts `coalesceWrites`), so 15 for the
 *    stand-in's reply (14 turns with text, then the last chunk with `[DONE]`; its EOS adds no
 *    text). Deterministic while the stand-in sends one token per turn, as a decode worker sends
 *    a stream one token per step; fewer means tokens were coalesced.
 *  - HTTPS: `router_https_added_latency_ms_p50`, what serving clients over HTTPS (TLS 1.3, a
 *    certificate of `kvfence certs init`, keep-alive connections) adds: the same request through a
 *    second router of the same child, started with `https`, in front of the same stand-ins, paired
 *    with one through the plaintext router (which goes first alternates); the p50 of the per-pair
 *    differences (HTTPS − HTTP). Target ≤ 1 ms.
 *  - CPU per request: `child_cpu_ms_per_streamed_request_via_router` and
 *    `child_cpu_ms_per_request_direct`, the child's CPU time (stand-ins and router: user +
 *    system) over each throughput run ÷ the requests it completed, and `router_to_direct_cpu_ratio`
 *    (direct ÷ via router). On a shared machine the rates swing with other processes' load,
 *    while the CPU a request costs moves far less: the better figure to compare two versions by.
 *  Every figure is the median over `--repeats` (default 5) repeats; every ratio is the median of
 *  per-repeat ratios of its two sides run beside each other (which goes first alternating), with
 *  its spread (`NAME_spread`: min, quartiles, max, n; bench/ratio.ts).
 *  - The floor (router-floors.ts): the same streamed request through nginx and haproxy in front of
 *    the same router, per triple with the router and the direct path: the router's added latency
 *    and CPU per streamed request beside a plain relay's, and `router_minus_floor_p50_ms` (goals:
 *    ≤ 0.2 ms over the floor, ≤ 0.3 ms added). A floor whose binary is absent says so.
 *  - The Responses path and the gateway (router-responses.ts): added latency of a streamed
 *    `/v1/responses` through the router and through the gateway, and the gateway's isolation
 *    self-check's cost (requests, tokens, seconds).
 *  - `--baseline DIR` (router-baseline.ts): this build's router against another build's (DIR's
 *    `dist/bench/router.js`), CPU per streamed request as a ratio with its spread.
 *  - `load_average_at_start`/`_at_end`: the machine's load (1, 5, 15 min) around the run: a
 *    figure without its load cannot be compared with another.
 *  The stand-ins name their transfer port in each `reserved` event, as kvfence's decode worker
 *  does (an older worker's `/server_info`-only address would add a round trip the bench is not
 *  about).
 *  The stand-ins and the router run in one child process (the stand-ins of test/router/helpers.ts,
 *  the real `startRouter`); the clients run here, over keep-alive `node:http`.
 *
 *
 *  `--part floor` measures instead what the control plane between router and workers costs,
 *  without the router's own work: in one child, in front of the same stand-ins, three relays of
 *  the same streamed request — the real router, a bare relay over the control channel as the
 *  router speaks it (src/control/channel-client.ts: no authentication, admission, tokenizer,
 *  checks or metrics), and a bare relay over a
 *  prototype channel (one persistent connection per worker, all requests multiplexed on it as
 *  length-prefixed frames, a token a 13-byte binary frame, one socket write per event-loop turn
 *  per connection; stand-ins of the same work behind it) — and the direct path. Each figure is
 *  the child's CPU per request (`floor_child_cpu_ms_per_request_*`) and each relay's rate ÷
 *  direct's (`floor_*_to_direct_throughput_ratio`), medians over repeats of 64-client runs, the
 *  paths in turn. The channel is a measurement prototype, not a protocol of kvfence.
 *
 *  The router reaches the stand-ins over the control channel, which they serve as workers do.
 *
 *  Args: `--repeats N` (default 5), `--requests N` per repeat and path (default 400),
 *  `--seconds S` of each throughput run (default 3), `--clients N` (default 64), `--baseline DIR`,
 *  `--part P` to run one part only: main, https, redis, relay-floors, responses, baseline (with
 *  `--baseline`), or floor (the control-plane floor above, never run by default). */
import { fork } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import { mkdtempSync, readFileSync, rmSync } from 'node:fs'
import http from 'node:http'
import https from 'node:https'
import net from 'node:net'
import { performance } from 'node:perf_hooks'
import { loadavg, tmpdir } from 'node:os'
import { join } from 'node:path'
import { fileURLToPath } from 'node:url'
import { pino } from 'pino'
import { type Limiter, createLimiter } from '../src/router/admission/limits.js'
import { queueLimitDefaults } from '../src/router/admission/queue-limits.js'
import { createRedisLimitStore } from '../src/router/admission/redis-limits.js'
import { startRouter } from '../src/router/start.js'
import { forkTokenizer } from '../src/router/tokenize/tokenizer-fork.js'
import { apiKeyDigest } from '../src/router/tenants/tenants.js'
import { initCerts } from '../src/cli/certs.js'
import { GenerateRequest, PrefillRequest } from '../src/control/messages.js'
import { sseTemplate, textCompletion } from '../src/router/api/responses.js'
import {
  bosId,
  charIds,
  defaultReplyText,
  eosId,
  type Harness,
  keys,
  startHarness,
} from '../test/router/helpers.js'
import { redisSkipReason, startRedis } from '../test/router/admission/redis-helpers.js'
import { quantile, ratioFields } from './ratio.js'
import {
  type DirectChannels,
  type Endpoints,
  childCounts,
  closedLoopRate,
  directRequest,
  idleSocketMs,
  intFlag,
  maxTokens,
  openDirectChannels,
  prompt,
  readAll,
  round,
  routerRequest,
  stop,
  stringFlag,
  timed,
} from './router-paths.js'
import { benchBaseline } from './router-baseline.js'
import { type FloorContext, benchRelayFloors } from './router-floors.js'
import { benchResponses } from './router-responses.js'

/** The parts of `bench -- router` that `--part` can name (all of them but `floor` run by
 *  default; `baseline` needs `--baseline DIR`). */
const parts = ['main', 'https', 'redis', 'relay-floors', 'responses', 'baseline', 'floor'] as const
type Part = (typeof parts)[number]

/** The run's options, from the command line. */
interface RouterBenchOptions {
  repeats: number
  numRequests: number
  seconds: number
  numClients: number
  /** A kvfence build to compare with (its root: `dist/` built), or null. */
  baselineDir: string | null
}

/** Runs the benchmark and returns its JSON. */
export async function benchRouter(args: string[]): Promise<object> {
  const o: RouterBenchOptions = {
    repeats: intFlag(args, '--repeats', 5),
    numRequests: intFlag(args, '--requests', 400),
    seconds: intFlag(args, '--seconds', 3),
    numClients: intFlag(args, '--clients', 64),
    baselineDir: stringFlag(args, '--baseline'),
  }
  const part = stringFlag(args, '--part')
  if (part !== null && !(parts as readonly string[]).includes(part)) {
    throw new Error(`--part takes one of ${parts.join(', ')}, got ${part}`)
  }
  if (part === 'floor') return benchFloor(o.repeats, o.seconds, o.numClients)
  if (part === 'baseline' && o.baselineDir === null)
    throw new Error('--part baseline needs --baseline DIR')
  const isRun = (p: Part) =>
    part === null ? p !== 'floor' && (p !== 'baseline' || o.baselineDir !== null) : part === p
  const certs = mkdtempSync(join(tmpdir(), 'kvfence-bench-router-'))
  await initCerts(certs)
  const child = fork(fileURLToPath(import.meta.url), ['--serve', certs], {
    stdio: ['ignore', 'ignore', 'inherit', 'ipc'],
  })
  try {
    const endpoints = await new Promise<Endpoints>((resolve, reject) => {
      child.once('message', (m) => resolve(m as Endpoints))
      child.once('exit', (code) => reject(new Error(`stand-in process exited with ${code}`)))
    })
    // Idle pooled connections are closed here before the servers' keep-alive timeout (Node's 5 s)
    // closes them: else a request sent as the server closes one fails with ECONNRESET (seen at
    // load average 25, where a turn of the loop can take seconds).
    const agent = new http.Agent({ keepAlive: true, maxSockets: Infinity, timeout: idleSocketMs })
    const channels = await openDirectChannels(endpoints)
    const c = { ...o, child, agent, endpoints, channels }
    const results: object[] = [{ load_average_at_start: loadavg().map((x) => round(x, 2)) }]
    try {
      if (isRun('main')) results.push(await benchMain(c))
      if (isRun('relay-floors')) results.push(await benchRelayFloors(c))
      if (isRun('responses')) results.push(await benchResponses(c))
      if (isRun('https')) {
        results.push(await benchHttps(agent, endpoints, certs, o.repeats, o.numRequests))
      }
    } finally {
      agent.destroy()
      channels.decode.close()
      channels.prefill.close()
    }
    if (isRun('redis')) results.push(await benchRedisLimits(o.repeats, o.numRequests))
    if (isRun('baseline')) results.push(await benchBaseline(o.baselineDir!, o))
    results.push({ load_average_at_end: loadavg().map((x) => round(x, 2)) })
    return Object.assign({}, ...results) as object
  } finally {
    await stop(child)
    rmSync(certs, { recursive: true, force: true })
  }
}

/** The router's own figures against the direct path: added latency (whole completions, pairs),
 *  streamed throughput, socket writes and CPU per streamed request (see the module's header). */
async function benchMain(c: FloorContext): Promise<object> {
  const { child, agent, endpoints, channels, repeats, numRequests, seconds, numClients } = c
  const viaRouter = () => routerRequest(agent, endpoints, false)
  const direct = () => directRequest(channels, endpoints)

  // Warm up both paths (JIT, connections).
  for (let i = 0; i < 200; i++) await Promise.all([viaRouter(), direct()])

  const latency = []
  const throughput = []
  for (let r = 0; r < repeats; r++) {
    const routerMs: number[] = []
    const directMs: number[] = []
    for (let i = 0; i < numRequests; i++) {
      if (i % 2 === 0) {
        routerMs.push(await timed(viaRouter))
        directMs.push(await timed(direct))
      } else {
        directMs.push(await timed(direct))
        routerMs.push(await timed(viaRouter))
      }
    }
    const addedMs = routerMs.map((ms, i) => ms - directMs[i])
    latency.push({
      addedP50: quantile(addedMs, 0.5),
      addedP99: quantile(addedMs, 0.99),
      routerP50: quantile(routerMs, 0.5),
      routerP99: quantile(routerMs, 0.99),
      directP50: quantile(directMs, 0.5),
      directP99: quantile(directMs, 0.99),
    })
    // Which path runs first alternates repeat by repeat, so that drift weighs on both alike.
    const streamed = async (path: 'router' | 'direct') => {
      const before = await childCounts(child)
      const send = path === 'router' ? () => routerRequest(agent, endpoints, true) : direct
      const run = await closedLoopRate(send, numClients, seconds)
      const after = await childCounts(child)
      const perRequest = (x: number, y: number) => (x - y) / run.numDone
      return {
        rate: run.rate,
        cpuMs: perRequest(after.cpuMs, before.cpuMs),
        writes: perRequest(after.numWrites, before.numWrites),
      }
    }
    const order = r % 2 === 0 ? (['router', 'direct'] as const) : (['direct', 'router'] as const)
    const runs = {
      router: { rate: 0, cpuMs: 0, writes: 0 },
      direct: { rate: 0, cpuMs: 0, writes: 0 },
    }
    for (const path of order) runs[path] = await streamed(path)
    throughput.push({
      router: runs.router.rate,
      direct: runs.direct.rate,
      writesPerRequest: runs.router.writes,
      routerCpuMs: runs.router.cpuMs,
      directCpuMs: runs.direct.cpuMs,
    })
  }
  const med = (values: number[]) => round(quantile(values, 0.5), 3)
  return {
    router_added_latency_ms_p50: med(latency.map((l) => l.addedP50)),
    router_added_latency_ms_p99: med(latency.map((l) => l.addedP99)),
    router_added_latency_target_ms_p50: 0.5,
    router_added_latency_is:
      'percentiles of per-pair (router − direct) ms, pairs sent back to back',
    router_latency_ms_p50: med(latency.map((l) => l.routerP50)),
    router_latency_ms_p99: med(latency.map((l) => l.routerP99)),
    direct_latency_ms_p50: med(latency.map((l) => l.directP50)),
    direct_latency_ms_p99: med(latency.map((l) => l.directP99)),
    streaming_requests_per_s: med(throughput.map((t) => t.router)),
    direct_requests_per_s: med(throughput.map((t) => t.direct)),
    ...ratioFields(
      'router_to_direct_throughput_ratio',
      throughput.map((t) => t.router / t.direct),
    ),
    router_socket_writes_per_streamed_request: med(throughput.map((t) => t.writesPerRequest)),
    child_cpu_ms_per_streamed_request_via_router: med(throughput.map((t) => t.routerCpuMs)),
    child_cpu_ms_per_request_direct: med(throughput.map((t) => t.directCpuMs)),
    ...ratioFields(
      'router_to_direct_cpu_ratio',
      throughput.map((t) => t.directCpuMs / t.routerCpuMs),
    ),
    clients: numClients,
    repeats,
    requests_per_repeat: numRequests,
    throughput_seconds: seconds,
    prompt_tokens: prompt.length + 1,
    completion_tokens: maxTokens,
    note: 'stand-in workers (no model) in one child process with the router; clients here',
  }
}

// ---------------------------------------------------------------------------------------------
// HTTPS

/** `router_https_added_latency_ms_p50`: per pair, one request through the HTTPS router and one
 *  through the plaintext router (keep-alive agents, so a handshake only on a new connection;
 *  which goes first alternates); the median over repeats of the p50 of the differences. */
async function benchHttps(
  agent: http.Agent,
  e: Endpoints,
  certs: string,
  repeats: number,
  numRequests: number,
): Promise<object> {
  const httpsAgent = new https.Agent({
    keepAlive: true,
    maxSockets: Infinity,
    timeout: idleSocketMs,
    ca: readFileSync(join(certs, 'ca.crt')),
  })
  const viaHttps = () => routerRequest(httpsAgent, { ...e, routerUrl: e.httpsRouterUrl }, false)
  const viaHttp = () => routerRequest(agent, e, false)
  try {
    for (let i = 0; i < 200; i++) await Promise.all([viaHttps(), viaHttp()])
    const p50s: number[] = []
    for (let r = 0; r < repeats; r++) {
      const addedMs: number[] = []
      for (let i = 0; i < numRequests; i++) {
        const httpsFirst = i % 2 === 0 ? await timed(viaHttps) : 0
        const plainMs = await timed(viaHttp)
        const httpsMs = i % 2 === 0 ? httpsFirst : await timed(viaHttps)
        addedMs.push(httpsMs - plainMs)
      }
      p50s.push(quantile(addedMs, 0.5))
    }
    return {
      router_https_added_latency_ms_p50: round(quantile(p50s, 0.5), 3),
      router_https_added_latency_target_ms_p50: 1,
      router_https_added_latency_is:
        'p50 of per-pair (HTTPS router − plaintext router) ms, keep-alive, TLS 1.3, same stand-ins',
    }
  } finally {
    httpsAgent.destroy()
  }
}

// ---------------------------------------------------------------------------------------------
// Redis-backed limits

/** `redis_limits_added_latency_ms_p50`: what counting a tenant's limits in Redis (a local
 *  redis-server, two scripts per request: its concurrency unit, then its tokens) adds to
 *  admission against counting them in process. Per request, the tenant's steps of admission
 *  (`holdTenantRoom`, `admitTenant`, then `release`) run once on each limiter, back to back (which
 *  goes first alternates); the figure is the median over repeats of the p50 of the per-pair
 *  differences. Skipped, with its reason, when redis-server is absent. */
async function benchRedisLimits(repeats: number, numRequests: number): Promise<object> {
  const skipped = redisSkipReason()
  if (skipped !== null) return { redis_limits_skipped: skipped }
  const redis = await startRedis()
  const store = await createRedisLimitStore({ url: redis.url }, pino({ level: 'silent' }))
  try {
    const viaRedis = createLimiter(queueLimitDefaults, () => performance.now(), store)
    const inProcess = createLimiter(queueLimitDefaults)
    const limits = { maxConcurrentRequests: 64, tokensPerMinute: 1e12 }
    const admitOnce = async (limiter: Limiter) => {
      const room = await limiter.holdTenantRoom('bench', limits)
      const ticket = await limiter.admitTenant('bench', limits, 31, room)
      ticket.release(0)
    }
    for (let i = 0; i < 200; i++) await Promise.all([admitOnce(viaRedis), admitOnce(inProcess)])
    const p50s: number[] = []
    for (let r = 0; r < repeats; r++) {
      const addedMs: number[] = []
      for (let i = 0; i < numRequests; i++) {
        const redisMs = i % 2 === 0 ? await timed(() => admitOnce(viaRedis)) : 0
        const localMs = await timed(() => admitOnce(inProcess))
        const afterMs = i % 2 === 0 ? redisMs : await timed(() => admitOnce(viaRedis))
        addedMs.push(afterMs - localMs)
      }
      p50s.push(quantile(addedMs, 0.5))
    }
    return {
      redis_limits_added_latency_ms_p50: round(quantile(p50s, 0.5), 3),
      redis_limits_added_latency_target_ms_p50: 1,
      redis_limits_added_latency_is:
        'p50 of per-pair (Redis store − in-process) ms of a tenant’s admission steps, local redis-server',
    }
  } finally {
    store.close()
    await redis.kill()
  }
}

// ---------------------------------------------------------------------------------------------
// The child: stand-ins and a router

/** The router options of the child's routers. */
const benchRouterOptions = {
  queue: { maxConcurrentRequests: 256, maxQueuedRequests: 1024 },
  logContent: false,
}

/** The fast stand-ins (no delays, a pool that never fills) and a router in front of them,
 *  logging at `warn`; the stand-ins' records of requests are emptied every second. */
async function startBenchHarness(): Promise<Harness> {
  const h = await startHarness(
    { tokenDelayMs: 0, prefillDelayMs: 0, numPages: 4096, isTransferPortReserved: true },
    benchRouterOptions,
  )
  h.logs.log.level = 'warn' // a line per request would be the router's largest cost here
  // The stand-ins record every request for tests; a benchmark only needs them to answer.
  setInterval(() => {
    h.workers.generateRequests.length = 0
    h.workers.prefillRequests.length = 0
    h.workers.events.length = 0
  }, 1000).unref()
  return h
}

async function serve(certs: string): Promise<void> {
  const h = await startBenchHarness()
  // The same router over HTTPS, in front of the same stand-ins.
  const httpsRouter = await startRouter({
    ...benchRouterOptions,
    modelDir: h.tokenizerDir,
    prefillUrls: [h.workers.prefillUrl],
    decodeUrls: [h.workers.decodeUrl],
    tenants: [{ name: 'alpha', keySha256: apiKeyDigest(keys.alpha) }],
    port: 0,
    log: h.logs.log,
    workerWaitMs: 0,
    https: { cert: join(certs, 'router.crt'), key: join(certs, 'router.key') },
    startTokenizer: forkTokenizer,
    tokenizerProcessesOnDemand: true, // the bench's prompts are short: tokenized inline
  })
  // Count the router's socket writes to its clients (server-side sockets on the router's port).
  let numWrites = 0
  const socketProto = net.Socket.prototype as unknown as Record<
    '_write' | '_writev',
    (this: net.Socket & { server?: unknown }, ...args: unknown[]) => void
  >
  for (const method of ['_write', '_writev'] as const) {
    const original = socketProto[method]
    socketProto[method] = function (...args) {
      if (this.server !== undefined && this.localPort === h.router.port) numWrites++
      return original.apply(this, args)
    }
  }
  answerCounts(() => numWrites)
  const endpoints: Endpoints = {
    routerUrl: h.router.url,
    httpsRouterUrl: httpsRouter.url,
    prefillUrl: h.workers.prefillUrl,
    decodeUrl: h.workers.decodeUrl,
    transferPort: h.workers.transferPort,
  }
  process.send?.(endpoints)
  process.on('disconnect', () => {
    void httpsRouter
      .close()
      .then(() => h.close())
      .finally(() => process.exit(0))
  })
}

/** Answers the parent's {@link childCounts}: `numWrites()` and the process's CPU so far. */
function answerCounts(numWrites: () => number): void {
  process.on('message', (m: { type?: string }) => {
    if (m.type !== 'writes') return
    const cpu = process.cpuUsage() // the whole process (prompts this short are tokenized inline)
    process.send?.({
      type: 'writes',
      numWrites: numWrites(),
      cpuMs: (cpu.user + cpu.system) / 1000,
    })
  })
}

// ---------------------------------------------------------------------------------------------
// The floor (`--part floor`): bare relays over the control channel and over a prototype

/** What the floor's child reports once listening. */
interface FloorEndpoints extends Endpoints {
  controlRelayUrl: string
  channelRelayUrl: string
}

/** The floor's paths, in the order each repeat runs them. */
const floorPaths = ['router', 'control_relay', 'channel_relay', 'direct'] as const

async function benchFloor(repeats: number, seconds: number, numClients: number): Promise<object> {
  const child = fork(fileURLToPath(import.meta.url), ['--serve-floor'], {
    stdio: ['ignore', 'ignore', 'inherit', 'ipc'],
  })
  try {
    const e = await new Promise<FloorEndpoints>((resolve, reject) => {
      child.once('message', (m) => resolve(m as FloorEndpoints))
      child.once('exit', (code) => reject(new Error(`stand-in process exited with ${code}`)))
    })
    const agent = new http.Agent({ keepAlive: true, maxSockets: Infinity, timeout: idleSocketMs })
    const channels = await openDirectChannels(e)
    const requests = {
      router: () => routerRequest(agent, e, true),
      control_relay: () => routerRequest(agent, { ...e, routerUrl: e.controlRelayUrl }, true),
      channel_relay: () => routerRequest(agent, { ...e, routerUrl: e.channelRelayUrl }, true),
      direct: () => directRequest(channels, e),
    }
    for (let i = 0; i < 200; i++) await Promise.all(floorPaths.map((path) => requests[path]()))
    const runs = floorPaths.map(() => [] as { rate: number; cpuMs: number }[])
    for (let r = 0; r < repeats; r++) {
      // Forward in even repeats, reversed in odd ones: drift weighs on every path alike.
      const inTurn = [...floorPaths.entries()]
      for (const [i, path] of r % 2 === 0 ? inTurn : inTurn.reverse()) {
        const before = await childCounts(child)
        const run = await closedLoopRate(requests[path], numClients, seconds)
        const after = await childCounts(child)
        runs[i].push({ rate: run.rate, cpuMs: (after.cpuMs - before.cpuMs) / run.numDone })
      }
    }
    agent.destroy()
    channels.decode.close()
    channels.prefill.close()
    const med = (values: number[]) => round(quantile(values, 0.5), 3)
    const direct = runs[floorPaths.indexOf('direct')]
    const figures: Record<string, unknown> = {}
    for (const [i, path] of floorPaths.entries()) {
      figures[`floor_child_cpu_ms_per_request_${path}`] = med(runs[i].map((x) => x.cpuMs))
      figures[`floor_requests_per_s_${path}`] = med(runs[i].map((x) => x.rate))
      if (path !== 'direct') {
        Object.assign(
          figures,
          ratioFields(
            `floor_${path}_to_direct_throughput_ratio`,
            runs[i].map((x, r) => x.rate / direct[r].rate),
          ),
        )
      }
    }
    return {
      ...figures,
      clients: numClients,
      repeats,
      throughput_seconds: seconds,
      note: 'bare relays (no router checks) and the router in one child; channel_relay is a prototype',
    }
  } finally {
    await stop(child)
  }
}

/** The floor's child: the stand-ins and a router (as `serve`), a bare relay over their control
 *  channel, and a bare relay over the prototype's channel stand-ins. */
async function serveFloor(): Promise<void> {
  const h = await startBenchHarness()
  const target = { transferPort: h.workers.transferPort }
  const ownChannels = await openDirectChannels({ ...h.workers, routerUrl: '', httpsRouterUrl: '' })
  const controlRelay = http.createServer(bareRelay(controlChannelPlane(ownChannels), target))
  const channels = await startChannelStandIns()
  const channelRelay = http.createServer(bareRelay(channelControlPlane(channels), target))
  const [controlPort, channelPort] = await Promise.all(
    [controlRelay, channelRelay].map((server) => listenLocal(server)),
  )
  answerCounts(() => 0)
  const endpoints: FloorEndpoints = {
    routerUrl: h.router.url,
    httpsRouterUrl: '',
    prefillUrl: h.workers.prefillUrl,
    decodeUrl: h.workers.decodeUrl,
    transferPort: h.workers.transferPort,
    controlRelayUrl: `http://127.0.0.1:${controlPort}`,
    channelRelayUrl: `http://127.0.0.1:${channelPort}`,
  }
  process.send?.(endpoints)
  process.on('disconnect', () => {
    channels.close()
    ownChannels.decode.close()
    ownChannels.prefill.close()
    void h.close().finally(() => process.exit(0))
  })
}

/** One generation on a control plane, as a bare relay drives it: `onEvent` hears D's events
 *  (`reserved`, `token`, `done`); `prefill` asks P. */
interface BareControlPlane {
  generate(request: GenerateRequest, onEvent: (event: BareEvent) => void): void
  prefill(request: PrefillRequest): void
}

type BareEvent = { type: 'reserved' } | { type: 'token'; tokenId: number } | { type: 'done' }

/** A relay with none of the router's work: the body parsed, the prompt's ids by the stand-ins'
 *  char-level vocabulary, the two control-plane steps, and an SSE chunk per token. */
function bareRelay(
  plane: BareControlPlane,
  target: { transferPort: number },
): http.RequestListener {
  const chunk = sseTemplate((text) => textCompletion(floorHeader, text, null, undefined))
  return (req, res) => {
    void readAll(req).then((text) => {
      const body = JSON.parse(text) as { prompt: string; max_tokens: number }
      const request: GenerateRequest = {
        requestId: randomBytes(16).toString('hex'),
        tenant: 'alpha',
        promptTokenIds: [bosId, ...charIds(body.prompt)],
        maxTokens: body.max_tokens,
        sampling: { temperature: 0, topP: 1, seed: null },
        stopTokenIds: [],
        transferSecret: randomBytes(32).toString('hex'),
      }
      let isStarted = false
      plane.generate(request, (event) => {
        if (event.type === 'reserved') {
          const { maxTokens: _, stopTokenIds: __, ...rest } = request
          plane.prefill({ ...rest, decode: { host: '127.0.0.1', port: target.transferPort } })
        } else if (event.type === 'token') {
          if (!isStarted) res.writeHead(200, { 'content-type': 'text/event-stream; charset=utf-8' })
          isStarted = true
          res.write(chunk(String.fromCharCode(event.tokenId)))
        } else res.end('data: [DONE]\n\n')
      })
    })
  }
}

const floorHeader = { id: 'cmpl-floor', created: 0, model: 'echo-test' }

/** The control plane as the router speaks it: its control channel to each stand-in. */
function controlChannelPlane(channels: DirectChannels): BareControlPlane {
  // Never aborted; one per stream, as the router gives each request its own.
  const signal = () => new AbortController().signal
  return {
    generate(request, onEvent) {
      void (async () => {
        for await (const event of channels.decode.generate(request, signal())) {
          if (event.type === 'reserved' || event.type === 'token' || event.type === 'done')
            onEvent(event)
        }
      })()
    },
    prefill(request) {
      void channels.prefill.prefill(request, signal())
    },
  }
}

/** Frame kinds of the channel prototype. A frame: u32 LE length of what follows | u8 kind |
 *  u32 LE stream | payload (a token: its id, u32 LE; anything else: JSON). */
const frameKinds = { generate: 1, prefill: 2, reserved: 3, token: 4, done: 5, result: 6 } as const
const frameHeaderBytes = 9

function encodeFrame(kind: number, stream: number, payload: object | number): Buffer {
  const json = typeof payload === 'number' ? null : Buffer.from(JSON.stringify(payload))
  const frame = Buffer.allocUnsafe(frameHeaderBytes + (json === null ? 4 : json.length))
  frame.writeUInt32LE(frame.length - 4, 0)
  frame[4] = kind
  frame.writeUInt32LE(stream, 5)
  if (json === null) frame.writeUInt32LE(payload as number, frameHeaderBytes)
  else json.copy(frame, frameHeaderBytes)
  return frame
}

/** Calls `onFrame` for each whole frame read from `socket` (frames may split across reads). */
function readFrames(
  socket: net.Socket,
  onFrame: (kind: number, stream: number, payload: Buffer) => void,
): void {
  let buffered: Buffer | null = null
  socket.on('data', (data: Buffer) => {
    const bytes: Buffer = buffered === null ? data : Buffer.concat([buffered, data])
    let at = 0
    while (bytes.length - at >= 4) {
      const length = bytes.readUInt32LE(at)
      if (bytes.length - at - 4 < length) break
      onFrame(
        bytes[at + 4],
        bytes.readUInt32LE(at + 5),
        bytes.subarray(at + frameHeaderBytes, at + 4 + length),
      )
      at += 4 + length
    }
    buffered = at === bytes.length ? null : bytes.subarray(at)
  })
}

/** Writes frames to `socket`, all those of one event-loop turn in one socket write. */
function frameWriter(socket: net.Socket): (frame: Buffer) => void {
  let pending: Buffer[] = []
  const flush = () => {
    const frames = pending
    pending = []
    socket.write(frames.length === 1 ? frames[0] : Buffer.concat(frames))
  }
  return (frame) => {
    if (pending.length === 0) setImmediate(flush)
    pending.push(frame)
  }
}

/** Stand-ins doing the control-channel ones' work (a parsed request, the same reply, one token per turn)
 *  behind the channel; the relay's two connections to them. */
async function startChannelStandIns(): Promise<{
  decode: net.Socket
  prefill: net.Socket
  close(): void
}> {
  const reply = [...charIds(defaultReplyText), eosId]
  const prefilled = new Map<string, () => void>()
  const decode = net.createServer((socket) => {
    socket.setNoDelay(true) // as the relay's end: no token waits on Nagle's delay
    const write = frameWriter(socket)
    readFrames(socket, (kind, stream, payload) => {
      const request = GenerateRequest.parse(JSON.parse(payload.toString()))
      write(encodeFrame(frameKinds.reserved, stream, { type: 'reserved' }))
      void new Promise<void>((resolve) => prefilled.set(request.requestId, resolve)).then(
        async () => {
          let numTokens = 0
          for (const tokenId of reply.slice(0, request.maxTokens)) {
            write(encodeFrame(frameKinds.token, stream, tokenId))
            numTokens++
            await new Promise((resolve) => setImmediate(resolve))
          }
          write(encodeFrame(frameKinds.done, stream, { type: 'done', completionTokens: numTokens }))
        },
      )
    })
  })
  const prefill = net.createServer((socket) => {
    socket.setNoDelay(true)
    const write = frameWriter(socket)
    readFrames(socket, (kind, stream, payload) => {
      const request = PrefillRequest.parse(JSON.parse(payload.toString()))
      prefilled.get(request.requestId)?.()
      prefilled.delete(request.requestId)
      write(encodeFrame(frameKinds.result, stream, { requestId: request.requestId }))
    })
  })
  const [decodePort, prefillPort] = await Promise.all([decode, prefill].map(listenLocal))
  const connect = (port: number) => net.connect(port, '127.0.0.1').setNoDelay(true)
  const sockets = { decode: connect(decodePort), prefill: connect(prefillPort) }
  return {
    ...sockets,
    close() {
      for (const socket of Object.values(sockets)) socket.destroy()
      for (const server of [decode, prefill]) server.close()
    },
  }
}

/** The control plane over the channel: one connection per worker, requests told apart by
 *  stream number. */
function channelControlPlane(channels: {
  decode: net.Socket
  prefill: net.Socket
}): BareControlPlane {
  const streams = new Map<number, (event: BareEvent) => void>()
  let nextStream = 1
  const toDecode = frameWriter(channels.decode)
  const toPrefill = frameWriter(channels.prefill)
  readFrames(channels.decode, (kind, stream, payload) => {
    const onEvent = streams.get(stream)
    if (onEvent === undefined) return
    if (kind === frameKinds.token)
      return onEvent({ type: 'token', tokenId: payload.readUInt32LE(0) })
    // Parsed as JSON, as the control relay parses its events, though only the kind is used here.
    const event = JSON.parse(payload.toString()) as BareEvent
    if (event.type === 'done') streams.delete(stream)
    onEvent(event)
  })
  readFrames(channels.prefill, () => {}) // the result: read and dropped, as the control relay does
  return {
    generate(request, onEvent) {
      const stream = nextStream++
      streams.set(stream, onEvent)
      toDecode(encodeFrame(frameKinds.generate, stream, request))
    },
    prefill(request) {
      toPrefill(encodeFrame(frameKinds.prefill, nextStream++, request))
    },
  }
}

function listenLocal(server: net.Server): Promise<number> {
  return new Promise((resolve) =>
    server.listen(0, '127.0.0.1', () => resolve((server.address() as net.AddressInfo).port)),
  )
}

if (process.argv[1] === fileURLToPath(import.meta.url) && process.argv[2] === '--serve-floor') {
  serveFloor().catch((err: unknown) => {
    process.stderr.write(`bench router: ${err instanceof Error ? err.message : String(err)}\n`)
    process.exit(2)
  })
}

if (process.argv[1] === fileURLToPath(import.meta.url) && process.argv[2] === '--serve') {
  serve(process.argv[3]).catch((err: unknown) => {
    process.stderr.write(`bench router: ${err instanceof Error ? err.message : String(err)}\n`)
    process.exit(2)
  })
}
