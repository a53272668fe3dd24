/** The router held against the floor (`bench -- router`): in the same run, the same streamed
 *  request (16 prompt tokens, 15 streamed, SSE) goes three ways — straight to the stand-in workers
 *  over the bench's own control channels (`direct`), through kvfence's router (`router`), and
 *  through a plain reverse proxy in front of that same router (`floor`: nginx, then haproxy; see
 *  relay-floors.ts). What a hop adds is then read per triple, the three sent back to back in an
 *  order that cycles through all six permutations:
 *    router added = router − direct   (the router's whole hop: HTTP in, control channel out)
 *    floor added  = floor − router    (one plain HTTP/1.1 relay hop of the same stream)
 *  and `router_minus_floor_p50_ms` is the p50 of the per-triple differences of the two, never a
 *  difference of two percentiles. Goals: ≤ 0.2 ms over the floor, ≤ 0.3 ms added in absolute
 *  terms, on a quiet machine.
 *  CPU per streamed request: closed-loop runs (64 clients) of each path in turn (the order
 *  alternating repeat by repeat); the router's is the child's CPU per request through the router
 *  minus the child's per request direct (the stand-ins' own work), the floor's is the proxy
 *  process's own CPU per request through it; their ratio is taken per repeat. */
import type { ChildProcess } from 'node:child_process'
import type http from 'node:http'
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
  const routerPort = Number(new URL(c.endpoints.routerUrl).port)
  const results: Record<string, object> = {}
  for (const name of floorNames) {
    const floor = await startFloor(name, routerPort)
    if ('absent' in floor) {
      results[name] = { absent: floor.absent }
      continue
    }
    try {
      results[name] = await measureFloor(c, floor)
    } finally {
      await floor.stop()
    }
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
      'plain HTTP/1.1 reverse proxies (Debian nginx, haproxy; one process, buffering off, keep-alive upstream) in front of the same router; per triple (direct, router, proxy→router) sent back to back in rotating order: router added = router − direct, floor added = floor − router',
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
    router_added_cpu_ms_per_streamed_request: spread((x) => x.routerCpuMs).median,
    floor_cpu_ms_per_streamed_request: spread((x) => x.floorCpuMs).median,
    ...ratioFields(
      'router_to_floor_cpu_ratio',
      perRepeat.map((x) => x.routerCpuMs / x.floorCpuMs),
    ),
    latency_is:
      'median over repeats of each repeat’s p50 (ms) of per-triple differences; spread over the repeats',
    cpu_is:
      'router: child CPU per request via router − via direct; floor: the proxy process’s CPU per request through it',
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
  const childMs: Partial<Record<Path, number>> = {}
  let floorCpuMs = 0
  for (const path of paths) {
    const before = await childCounts(c.child)
    const floorBefore = floor.cpuMs()
    const run = await closedLoopRate(send[path], c.numClients, c.seconds)
    const after = await childCounts(c.child)
    childMs[path] = (after.cpuMs - before.cpuMs) / run.numDone
    if (path === 'floor') floorCpuMs = (floor.cpuMs() - floorBefore) / run.numDone
  }
  return {
    routerCpuMs: round(childMs.router! - childMs.direct!, 4),
    floorCpuMs: round(floorCpuMs, 4),
  }
}
