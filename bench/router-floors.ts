/** The router held against the floor (`bench -- router`): in the same run, the same streamed
 *  request (16 prompt tokens, 15 streamed, SSE) goes three ways — straight to the stand-in workers
 *  over the bench's own control channels (`direct`), through kvfence's router (`router`), and
 *  through a plain reverse proxy in front of that same router (`floor`: nginx, then haproxy; see
 *  relay-floors.ts). Here the router runs in a process of its own (as it is deployed, and as the
 *  proxy does), in front of the stand-ins of the bench's child: in the rest of the bench it shares
 *  the stand-ins' process, where its every turn also delays their next token, which a proxy in a
 *  process of its own does not pay. What a hop adds is then read per triple, the three sent back to back in an
 *  order that cycles through all six permutations:
 *    router added = router − direct   (the router's whole hop: HTTP in, control channel out)
 *    floor added  = floor − router    (one plain HTTP/1.1 relay hop of the same stream)
 *  and `router_minus_floor_p50_ms` is the p50 of the per-triple differences of the two, never a
 *  difference of two percentiles. Goals: ≤ 0.2 ms over the floor, ≤ 0.3 ms added in absolute
 *  terms, on a quiet machine.
 *  CPU per streamed request: closed-loop runs (64 clients) of each path in turn (the order
 *  alternating repeat by repeat); the router's is its
 *  process's own CPU per request, the floor's the proxy process's own; their ratio is taken per
 *  repeat. `KVFENCE_BENCH_CPU_PROF=DIR` writes the router process's V8 CPU profile to DIR. */
import { type ChildProcess, fork } from 'node:child_process'
import { rmSync } from 'node:fs'
import type http from 'node:http'
import { fileURLToPath } from 'node:url'
import { pino } from 'pino'
import { startRouter } from '../src/router/start.js'
import { forkTokenizer } from '../src/router/tokenize/tokenizer-fork.js'
import { apiKeyDigest } from '../src/router/tenants/tenants.js'
import { keys, writeTestTokenizer } from '../test/router/helpers.js'
import { type AbsentFloor, type FloorName, type RelayFloor, startFloor } from './relay-floors.js'
import { quantile, ratioFields, spreadOf } from './ratio.js'
import {
  type DirectChannels,
  type Endpoints,
  childCounts,
  closedLoopRate,
  directRequest,
  round,
  routerRequest,
  stop,
  timed,
} from './router-paths.js'

/** What the floors' measurement needs of the router bench. */
export interface FloorContext {
  child: ChildProcess
  agent: http.Agent
  endpoints: Endpoints
  channels: DirectChannels
  repeats: number
  numRequests: number
  seconds: number
  numClients: number
}

const floorNames: readonly FloorName[] = ['nginx', 'haproxy']
type Path = 'direct' | 'router' | 'floor'
/** The six orders of a triple, cycled request by request. */
const orders: readonly (readonly Path[])[] = [
  ['direct', 'router', 'floor'],
  ['floor', 'router', 'direct'],
  ['router', 'floor', 'direct'],
  ['direct', 'floor', 'router'],
  ['floor', 'direct', 'router'],
  ['router', 'direct', 'floor'],
]

/** Each floor's figures (or why it is absent) and nginx's as the top-level floor fields. */
export async function benchRelayFloors(c: FloorContext): Promise<object> {
  // A CPU profile of the router's process on request (`KVFENCE_BENCH_CPU_PROF=DIR`): the
  // evidence for what its CPU per request goes to, which a shared machine's wall clock is not.
  const profileDir = process.env.KVFENCE_BENCH_CPU_PROF
  const router = fork(fileURLToPath(import.meta.url), [serveFlag, JSON.stringify(c.endpoints)], {
    stdio: ['ignore', 'ignore', 'inherit', 'ipc'],
    execArgv: profileDir ? ['--cpu-prof', `--cpu-prof-dir=${profileDir}`] : [],
  })
  const results: Record<string, object> = {}
  try {
    const routerUrl = await new Promise<string>((resolve, reject) => {
      router.once('message', (m) => resolve((m as { url: string }).url))
      router.once('exit', (code) => reject(new Error(`router process exited with ${code}`)))
    })
    const lone = { ...c, child: router, endpoints: { ...c.endpoints, routerUrl } }
    for (const name of floorNames) {
      const floor = await startFloor(name, Number(new URL(routerUrl).port))
      if ('absent' in floor) {
        results[name] = { absent: floor.absent }
        continue
      }
      try {
        results[name] = await measureFloor(lone, floor)
      } finally {
        await floor.stop()
      }
    }
  } finally {
    await stop(router)
  }
  const nginx = results.nginx as Record<string, unknown>
  return {
    router_minus_floor_p50_ms:
      'absent' in nginx
        ? `no figure: ${String((nginx as unknown as AbsentFloor).absent)}`
        : nginx.router_minus_floor_p50_ms,
    router_minus_floor_goal_ms_p50: 0.2,
    router_added_latency_streamed_goal_ms_p50: 0.3,
    floors: results,
    floors_are:
      'plain HTTP/1.1 reverse proxies (Debian nginx, haproxy; one process, buffering off, keep-alive upstream) in front of the same router, itself in a process of its own; per triple (direct, router, proxy→router) sent back to back in rotating order: router added = router − direct, floor added = floor − router',
  }
}

/** One floor's latency and CPU figures (see the module's header). */
async function measureFloor(c: FloorContext, floor: RelayFloor): Promise<object> {
  const send: Record<Path, () => Promise<void>> = {
    direct: () => directRequest(c.channels, c.endpoints),
    router: () => routerRequest(c.agent, c.endpoints, true),
    floor: () => routerRequest(c.agent, { ...c.endpoints, routerUrl: floor.url }, true),
  }
  for (let i = 0; i < 200; i++) await Promise.all([send.router(), send.floor(), send.direct()])
  const perRepeat: {
    routerAdded: number
    floorAdded: number
    routerMinusFloor: number
    routerCpuMs: number
    floorCpuMs: number
  }[] = []
  for (let r = 0; r < c.repeats; r++) {
    const routerAdded: number[] = []
    const floorAdded: number[] = []
    const minus: number[] = []
    for (let i = 0; i < c.numRequests; i++) {
      const ms: Partial<Record<Path, number>> = {}
      for (const path of orders[i % orders.length]) ms[path] = await timed(send[path])
      routerAdded.push(ms.router! - ms.direct!)
      floorAdded.push(ms.floor! - ms.router!)
      minus.push(ms.router! - ms.direct! - (ms.floor! - ms.router!))
    }
    const cpu = await cpuPerRequest(c, floor, send, r % 2 === 0)
    perRepeat.push({
      routerAdded: quantile(routerAdded, 0.5),
      floorAdded: quantile(floorAdded, 0.5),
      routerMinusFloor: quantile(minus, 0.5),
      ...cpu,
    })
  }
  const spread = (f: (x: (typeof perRepeat)[number]) => number) => spreadOf(perRepeat.map(f), 3)
  const routerAdded = spread((x) => x.routerAdded)
  const floorAdded = spread((x) => x.floorAdded)
  const minus = spread((x) => x.routerMinusFloor)
  return {
    router_added_latency_streamed_ms_p50: routerAdded.median,
    router_added_latency_streamed_ms_p50_spread: routerAdded,
    floor_added_latency_ms_p50: floorAdded.median,
    floor_added_latency_ms_p50_spread: floorAdded,
    router_minus_floor_p50_ms: minus.median,
    router_minus_floor_p50_ms_spread: minus,
    router_cpu_ms_per_streamed_request: spread((x) => x.routerCpuMs).median,
    floor_cpu_ms_per_streamed_request: spread((x) => x.floorCpuMs).median,
    ...ratioFields(
      'router_to_floor_cpu_ratio',
      perRepeat.map((x) => x.routerCpuMs / x.floorCpuMs),
    ),
    latency_is:
      'median over repeats of each repeat’s p50 (ms) of per-triple differences; spread over the repeats',
    cpu_is:
      'the router process’s CPU per request through it (user + system); the proxy process’s per request through it',
    requests_per_repeat: c.numRequests,
  }
}

/** One repeat's CPU per streamed request of the router (its added part) and of the floor, from
 *  closed-loop runs of the three paths, in one order or its reverse. */
async function cpuPerRequest(
  c: FloorContext,
  floor: RelayFloor,
  send: Record<Path, () => Promise<void>>,
  isForward: boolean,
): Promise<{ routerCpuMs: number; floorCpuMs: number }> {
  const paths: Path[] = isForward ? ['direct', 'router', 'floor'] : ['floor', 'router', 'direct']
  let routerCpuMs = 0
  let floorCpuMs = 0
  for (const path of paths) {
    const before = await childCounts(c.child)
    const floorBefore = floor.cpuMs()
    const run = await closedLoopRate(send[path], c.numClients, c.seconds)
    const after = await childCounts(c.child)
    if (path === 'router') routerCpuMs = (after.cpuMs - before.cpuMs) / run.numDone
    if (path === 'floor') floorCpuMs = (floor.cpuMs() - floorBefore) / run.numDone
  }
  return { routerCpuMs: round(routerCpuMs, 4), floorCpuMs: round(floorCpuMs, 4) }
}

const serveFlag = '--serve-lone-router'

/** The router's process: kvfence's router (as the bench's child starts its own, logging at
 *  `warn`) in front of the stand-ins at `e`, answering {@link childCounts} with its CPU. */
async function serveLoneRouter(e: Endpoints): Promise<void> {
  const tokenizerDir = writeTestTokenizer()
  const router = await startRouter({
    modelDir: tokenizerDir,
    prefillUrls: [e.prefillUrl],
    decodeUrls: [e.decodeUrl],
    tenants: [{ name: 'alpha', keySha256: apiKeyDigest(keys.alpha) }],
    port: 0,
    log: pino({ level: 'warn' }),
    workerWaitMs: 0,
    tokenizerProcessesOnDemand: true,
    startTokenizer: forkTokenizer, // as `kvfence router` starts them
    queue: { maxConcurrentRequests: 256, maxQueuedRequests: 1024 },
    logContent: false,
  })
  process.on('message', (m: { type?: string }) => {
    if (m.type !== 'writes') return
    const cpu = process.cpuUsage()
    process.send?.({ type: 'writes', numWrites: 0, cpuMs: (cpu.user + cpu.system) / 1000 })
  })
  process.send?.({ url: router.url })
  process.on('disconnect', () => {
    void router.close().finally(() => {
      rmSync(tokenizerDir, { recursive: true, force: true })
      process.exit(0)
    })
  })
}

if (process.argv[1] === fileURLToPath(import.meta.url) && process.argv[2] === serveFlag) {
  serveLoneRouter(JSON.parse(process.argv[3]) as Endpoints).catch((err: unknown) => {
    process.stderr.write(`bench router: ${err instanceof Error ? err.message : String(err)}\n`)
    process.exit(2)
  })
}
