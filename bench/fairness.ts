/** Fairness benchmark: what one tenant's load does to another's latency, and how weights split
 *  the service, through the real router (its fair queue) in front of stand-in workers whose
 *  decode worker streams one token every `--token-ms` (default 10) ms, so that the cluster serves
 *  a known number of requests at once (`--slots`, the router's `maxConcurrentRequests`, default
 *  16, one of them reserved for a tenant with none running, the router's default) at a known
 *  speed.
 *  - `fairness_p99_ratio`: tenant `small` sends one request a second (prompt "Hi", 5 tokens
 *    generated) for `--seconds` (default 20), first alone, then while tenant `flood` keeps ten
 *    times as many requests outstanding as the cluster runs (each 25 to 75 tokens generated): small's
 *    p99 latency under the flood ÷ its p99 alone. Goal ≤ 2. `small_queue_wait_ms_mean` is how
 *    much of small's latency its waits in the router queue account for (the warm-up and alone
 *    phases included: their waits are ~0).
 *  - `weighted_share_max_error`: four tenants of weights 1, 1, 2, 4 each keep `--slots` × 4 such
 *    requests outstanding for `--weighted-seconds` (default 60); each tenant's share of the tokens
 *    served (prompt + completion of the requests that ended after the first 3 s and before the
 *    clients stop) against its weight's share; the largest gap, relative to the weight's share.
 *    Goal ≤ 0.10. Longer than the other phases: a whole request counts where it ends, and in 20 s
 *    a weight-1 tenant ends only ~64, so the requests cut by the window's edges moved the figure
 *    between 0.06 and 0.15 from run to run of the same code (60 s: ~0.02).
 *  - `big_prompt_p99_rise_ms`: what tenant `big` sending a 1 MB prompt (999,000 characters,
 *    read, parsed, tokenized in the router's tokenizer processes, then refused for the window) does
 *    to the p99 latency of tenant `small`'s small requests (prompt "Hi", 1 token, one every
 *    `--small-every-ms`, default 20, open loop). Measured in `--pairs` (default 8) pairs of
 *    windows of `--window-ms` (default 3000) each, one with `big` sending its bodies back to back
 *    and one without, in alternating order (so drift and the machine's other load weigh on both
 *    alike); the figure is the median over pairs of (p99 with − p99 without). Goal ≤ 10 ms.
 *    `big_chat_p99_rise_ms` is the same for a chat body of 30,000 empty messages (870 KB, refused
 *    for its message count), and `*_p50_rise_ms` the same for the p50s.
 *  - `pool_fairness_p99_ratio`: the same as `fairness_p99_ratio` with the KV pool as the limit
 *    instead of the router's slots: the stand-in decode worker holds `--slots` requests at once
 *    and refuses more as a full pool, the router runs 20 × `--slots`. Small's p99 under a flood of
 *    10 × `--slots` outstanding ÷ alone; `small_pool_wait_ms_mean` and `flood_pool_wait_ms_mean`
 *    are the tenants' mean waits for KV room under the flood (`kvfence_router_pool_wait_seconds`).
 *  The router and stand-ins run in a child process (test/router/helpers.ts `startHarness`, the
 *  real `startRouter`, a tokenizer with one long token so that a 1 MB prompt is tokenized rather
 *  than refused by its length alone); the clients run here over keep-alive `node:http`.
 *
 *  Args: `--seconds S` per phase (default 20), `--slots N` (default 16), `--token-ms MS`
 *  (default 10), `--weighted-seconds S`, `--pairs N`, `--window-ms MS`, `--small-every-ms MS`,
 *  `--part fairness|big|pool|all` (default all: `big` runs only the big-body pairs, `pool` only
 *  the KV pool's figures). */
import { type ChildProcess, fork } from 'node:child_process'
import http from 'node:http'
import { performance } from 'node:perf_hooks'
import { setTimeout as delay } from 'node:timers/promises'
import { fileURLToPath } from 'node:url'
import { charIds, startHarness, tokenizerWithLongToken } from '../test/router/helpers.js'
import { apiKeyDigest } from '../src/router/tenants/tenants.js'

/** The tenants: name → weight (absent: the default, 1). */
const tenantWeights: Readonly<Record<string, number | undefined>> = {
  small: undefined,
  flood: undefined,
  w1a: 1,
  w1b: 1,
  w2: 2,
  w4: 4,
  big: undefined,
}
const keyOf = (tenant: string) => `sk-bench-${tenant}-0123456789`

/** Tokens a flooding request generates: 25 to 75, so that running requests do not all end at
 *  once (a batch of equal requests started together would free its slots in bursts). */
const floodLength = () => 25 + Math.floor(Math.random() * 51)
const smallTokens = 5
/** Requests that ended in a phase's first this many ms are not counted in shares (warm-up). */
const warmUpMs = 3_000

/** One finished request. */
interface Served {
  tenant: string
  endedMs: number
  latencyMs: number
  numTokens: number
  status: number
}

/** Runs the benchmark and returns its JSON. */
export async function benchFairness(args: string[]): Promise<object> {
  const seconds = intFlag(args, '--seconds', 20)
  const numSlots = intFlag(args, '--slots', 16)
  const tokenMs = intFlag(args, '--token-ms', 10)
  const weightedSeconds = intFlag(args, '--weighted-seconds', 60)
  const part = stringFlag(args, '--part', ['all', 'fairness', 'big', 'pool'])
  const pairs: PairsOptions = {
    numPairs: intFlag(args, '--pairs', 8),
    windowMs: intFlag(args, '--window-ms', 3000),
    smallEveryMs: intFlag(args, '--small-every-ms', 20),
  }
  if (part === 'pool') return benchPool(seconds, numSlots, tokenMs)
  const pool = part === 'all' ? await benchPool(seconds, numSlots, tokenMs) : {}
  const child = forkServer('slots', numSlots, tokenMs)
  const agent = new http.Agent({ keepAlive: true, maxSockets: Infinity })
  try {
    const url = await urlOf(child)
    const send = (tenant: string, prompt: string, maxTokens: number) =>
      complete(agent, url, tenant, prompt, maxTokens)
    for (let i = 0; i < 20; i++) await send('small', 'Hi', smallTokens) // warm up
    const big = part === 'fairness' ? {} : await benchBigBodies(agent, url, pairs)
    if (part === 'big') return { ...big, token_ms: tokenMs, note }
    const alone = await everySecond(() => send('small', 'Hi', smallTokens), seconds)
    const flood = closedLoop(() => send('flood', 'Flood', floodLength()), numSlots * 10)
    await delay(warmUpMs)
    const underFlood = await everySecond(() => send('small', 'Hi', smallTokens), seconds)
    const smallQueueWaitMs = await meanQueueWaitMs(url, 'small')
    const flooded = await flood.stop()

    const weighted = ['w1a', 'w1b', 'w2', 'w4'].map((tenant) =>
      closedLoop(() => send(tenant, 'Share', floodLength()), numSlots * 4),
    )
    const startedMs = performance.now()
    await delay(weightedSeconds * 1000)
    const stoppedMs = performance.now()
    const served = (await Promise.all(weighted.map((w) => w.stop()))).flat()
    // The backlogs left at the stop drain in about equal numbers per tenant: not counted.
    const counted = served.filter(
      (s) => s.status === 200 && s.endedMs - startedMs >= warmUpMs && s.endedMs <= stoppedMs,
    )
    const shares = shareErrors(counted)

    const p99 = (values: Served[]) =>
      quantile(
        values.map((s) => s.latencyMs),
        0.99,
      )
    const p99Alone = p99(alone)
    const p99Flood = p99(underFlood)
    return {
      ...big,
      ...pool,
      fairness_p99_ratio: round(p99Flood / p99Alone, 3),
      fairness_p99_ratio_goal: 2,
      small_p99_ms_alone: round(p99Alone, 1),
      small_p99_ms_under_flood: round(p99Flood, 1),
      small_p50_ms_alone: round(
        quantile(
          alone.map((s) => s.latencyMs),
          0.5,
        ),
        1,
      ),
      small_p50_ms_under_flood: round(
        quantile(
          underFlood.map((s) => s.latencyMs),
          0.5,
        ),
        1,
      ),
      small_queue_wait_ms_mean: round(smallQueueWaitMs, 1),
      small_failed_under_flood: underFlood.filter((s) => s.status !== 200).length,
      flood_requests_served: flooded.filter((s) => s.status === 200).length,
      weighted_requests_failed: served.filter((s) => s.status !== 200).length,
      weighted_share_max_error: round(shares.maxError, 4),
      weighted_share_max_error_goal: 0.1,
      weighted_shares: shares.byTenant,
      weighted_requests_counted: counted.length,
      slots: numSlots,
      token_ms: tokenMs,
      seconds_per_phase: seconds,
      weighted_seconds: weightedSeconds,
      flood_outstanding: numSlots * 10,
      weighted_outstanding_per_tenant: numSlots * 4,
      note,
    }
  } finally {
    agent.destroy()
    await stop(child)
  }
}

const note =
  'stand-in workers (one token per token_ms) and the router in one child process; clients here'

/** The child process serving the router and stand-ins (see {@link serve}). */
function forkServer(mode: ServeMode, numSlots: number, tokenMs: number): ChildProcess {
  return fork(
    fileURLToPath(import.meta.url),
    ['--serve', mode, String(numSlots), String(tokenMs)],
    {
      stdio: ['ignore', 'ignore', 'inherit', 'ipc'],
    },
  )
}

/** The router's URL, once the child reports it. */
function urlOf(child: ChildProcess): Promise<string> {
  return new Promise<string>((resolve, reject) => {
    child.once('message', (m) => resolve((m as { url: string }).url))
    child.once('exit', (code) => reject(new Error(`router process exited with ${code}`)))
  })
}

/** `pool_fairness_p99_ratio` and the pool waits: see the module's header. */
async function benchPool(seconds: number, numSlots: number, tokenMs: number): Promise<object> {
  const child = forkServer('pool', numSlots, tokenMs)
  const agent = new http.Agent({ keepAlive: true, maxSockets: Infinity })
  try {
    const url = await urlOf(child)
    const send = (tenant: string, prompt: string, maxTokens: number) =>
      complete(agent, url, tenant, prompt, maxTokens)
    for (let i = 0; i < 20; i++) await send('small', 'Hi', smallTokens) // warm up
    const alone = await everySecond(() => send('small', 'Hi', smallTokens), seconds)
    const smallWaitAlone = await waitTotals(url, 'small', 'pool_wait')
    const flood = closedLoop(() => send('flood', 'Flood', floodLength()), numSlots * 10)
    await delay(warmUpMs)
    const floodWaitBefore = await waitTotals(url, 'flood', 'pool_wait')
    const underFlood = await everySecond(() => send('small', 'Hi', smallTokens), seconds)
    const smallWait = await waitTotals(url, 'small', 'pool_wait')
    const floodWait = await waitTotals(url, 'flood', 'pool_wait')
    const flooded = await flood.stop()
    const latencies = (values: Served[]) => values.map((s) => s.latencyMs)
    const p99Alone = quantile(latencies(alone), 0.99)
    const p99Flood = quantile(latencies(underFlood), 0.99)
    const meanMs = (after: WaitTotals, before: WaitTotals) =>
      round(((after.sum - before.sum) / (after.count - before.count)) * 1000, 1)
    return {
      pool_fairness_p99_ratio: round(p99Flood / p99Alone, 3),
      pool_fairness_p99_ratio_goal: 2,
      small_pool_p99_ms_alone: round(p99Alone, 1),
      small_pool_p99_ms_under_flood: round(p99Flood, 1),
      small_pool_wait_ms_mean: meanMs(smallWait, smallWaitAlone),
      flood_pool_wait_ms_mean: meanMs(floodWait, floodWaitBefore),
      small_failed_under_pool_flood: underFlood.filter((s) => s.status !== 200).length,
      pool_flood_requests_served: flooded.filter((s) => s.status === 200).length,
      pool_requests_at_once: numSlots,
    }
  } finally {
    agent.destroy()
    await stop(child)
  }
}

/** How the big-body figures are measured (see the module's header). */
interface PairsOptions {
  numPairs: number
  windowMs: number
  smallEveryMs: number
}

/** `big_prompt_*` and `big_chat_*`: see the module's header. */
async function benchBigBodies(
  agent: http.Agent,
  url: string,
  options: PairsOptions,
): Promise<object> {
  const prompt = JSON.stringify({
    model: 'echo-test',
    prompt: 'ab '.repeat(333_000),
    max_tokens: 1,
  })
  const chat = JSON.stringify({
    model: 'echo-test',
    messages: Array.from({ length: 30_000 }, () => ({ role: 'user', content: '' })),
    max_tokens: 1,
  })
  const out: Record<string, unknown> = {}
  for (const [name, body] of [
    ['big_prompt', prompt],
    ['big_chat', chat],
  ] as const) {
    const rises = await pairedRises(agent, url, body, options)
    out[`${name}_p99_rise_ms`] = round(quantile(rises.p99, 0.5), 1)
    out[`${name}_p50_rise_ms`] = round(quantile(rises.p50, 0.5), 1)
    out[`${name}_p99_rises_ms`] = rises.p99.map((r) => round(r, 1))
    out[`${name}_small_p99_ms_without`] = round(quantile(rises.p99Without, 0.5), 1)
    out[`${name}_body_bytes`] = Buffer.byteLength(body)
    out[`${name}_bodies_sent_per_window`] = round(quantile(rises.numBig, 0.5), 1)
    out[`${name}_statuses`] = rises.statuses
  }
  return {
    ...out,
    big_prompt_p99_rise_goal_ms: 10,
    big_pairs: options.numPairs,
    big_window_ms: options.windowMs,
    big_small_every_ms: options.smallEveryMs,
    big_rise_is:
      'median over pairs of (small p99 in a window with big bodies sent back to back − in a window without)',
  }
}

/** Per pair of windows (which one goes first alternates): small's p99 and p50 with the big body
 *  sent back to back minus without, how many big bodies went out, and their statuses. */
async function pairedRises(agent: http.Agent, url: string, body: string, o: PairsOptions) {
  const p99: number[] = []
  const p50: number[] = []
  const p99Without: number[] = []
  const numBig: number[] = []
  const statuses: Record<string, number> = {}
  const window = async (withBig: boolean) => {
    const big = withBig ? closedLoopRaw(agent, url, 'big', body) : null
    const small: Promise<Served>[] = []
    const endMs = performance.now() + o.windowMs
    while (performance.now() < endMs) {
      small.push(complete(agent, url, 'small', 'Hi', 1))
      await delay(o.smallEveryMs)
    }
    const latencies = (await Promise.all(small)).map((s) => s.latencyMs)
    const sent = (await big?.stop()) ?? []
    for (const status of sent) statuses[status] = (statuses[status] ?? 0) + 1
    if (withBig) numBig.push(sent.length)
    await delay(200) // whatever the last big body left behind settles before the next window
    return { p99: quantile(latencies, 0.99), p50: quantile(latencies, 0.5) }
  }
  await window(true) // warm up the big body's path
  for (let i = 0; i < o.numPairs; i++) {
    const first = await window(i % 2 === 0)
    const second = await window(i % 2 !== 0)
    const [withBig, without] = i % 2 === 0 ? [first, second] : [second, first]
    p99.push(withBig.p99 - without.p99)
    p50.push(withBig.p50 - without.p50)
    p99Without.push(without.p99)
  }
  return { p99, p50, p99Without, numBig, statuses }
}

/** One client sending `body` to `/v1/chat/completions` or `/v1/completions` (by its fields) back
 *  to back until `stop`, which resolves to the statuses it got. */
function closedLoopRaw(agent: http.Agent, url: string, tenant: string, body: string) {
  let isStopped = false
  const statuses: number[] = []
  const path = body.includes('"messages"') ? '/v1/chat/completions' : '/v1/completions'
  const client = (async () => {
    while (!isStopped) statuses.push(await postRaw(agent, `${url}${path}`, tenant, body))
  })()
  return {
    async stop(): Promise<number[]> {
      isStopped = true
      await client
      return statuses
    },
  }
}

/** Posts `body` as `tenant`; its status (0 on a connection error), the reply read to its end. */
async function postRaw(agent: http.Agent, url: string, tenant: string, body: string) {
  try {
    const res = await new Promise<http.IncomingMessage>((resolve, reject) => {
      const req = http.request(
        url,
        {
          method: 'POST',
          agent,
          headers: {
            authorization: `Bearer ${keyOf(tenant)}`,
            'content-type': 'application/json',
            'content-length': Buffer.byteLength(body),
          },
        },
        resolve,
      )
      req.on('error', reject)
      req.end(body)
    })
    for await (const chunk of res as AsyncIterable<Buffer>) void chunk
    return res.statusCode ?? 0
  } catch {
    return 0
  }
}

/** Each weighted tenant's share of the served tokens against its weight's share; the largest
 *  relative gap. */
function shareErrors(served: readonly Served[]) {
  const tokens = new Map<string, number>()
  for (const s of served) tokens.set(s.tenant, (tokens.get(s.tenant) ?? 0) + s.numTokens)
  const numTotal = [...tokens.values()].reduce((a, b) => a + b, 0)
  const weights = ['w1a', 'w1b', 'w2', 'w4'].map((t) => [t, tenantWeights[t] ?? 1] as const)
  const weightTotal = weights.reduce((a, [, w]) => a + w, 0)
  let maxError = 0
  const byTenant: Record<string, { share: number; weight_share: number }> = {}
  for (const [tenant, weight] of weights) {
    const share = (tokens.get(tenant) ?? 0) / numTotal
    const weightShare = weight / weightTotal
    maxError = Math.max(maxError, Math.abs(share - weightShare) / weightShare)
    byTenant[tenant] = { share: round(share, 4), weight_share: round(weightShare, 4) }
  }
  return { maxError, byTenant }
}

/** The mean of `tenant`'s waits in the router queue so far (its
 *  `kvfence_router_queue_wait_seconds`), ms: what of its latency the queue accounts for. */
async function meanQueueWaitMs(url: string, tenant: string): Promise<number> {
  const { sum, count } = await waitTotals(url, tenant, 'queue_wait')
  return (sum / count) * 1000
}

/** A wait histogram's totals: seconds and waits. */
interface WaitTotals {
  sum: number
  count: number
}

/** `tenant`'s `kvfence_router_{metric}_seconds` sum and count so far (0 for a tenant without). */
async function waitTotals(
  url: string,
  tenant: string,
  metric: 'queue_wait' | 'pool_wait',
): Promise<WaitTotals> {
  const text = await (await fetch(`${url}/metrics`)).text()
  const read = (suffix: string) =>
    Number(
      new RegExp(`kvfence_router_${metric}_seconds_${suffix}\\{tenant="${tenant}"\\} (\\S+)`).exec(
        text,
      )?.[1] ?? 0,
    )
  return { sum: read('sum'), count: read('count') }
}

/** Sends one request a second for `seconds`, without waiting for the previous one. */
async function everySecond(send: () => Promise<Served>, seconds: number): Promise<Served[]> {
  const pending: Promise<Served>[] = []
  for (let i = 0; i < seconds; i++) {
    pending.push(send())
    await delay(1000)
  }
  return Promise.all(pending)
}

/** `numOutstanding` clients sending back to back until `stop`, which resolves to what was
 *  served. */
function closedLoop(send: () => Promise<Served>, numOutstanding: number) {
  let isStopped = false
  const served: Served[] = []
  const clients = Array.from({ length: numOutstanding }, async () => {
    while (!isStopped) served.push(await send())
  })
  return {
    async stop(): Promise<Served[]> {
      isStopped = true
      await Promise.all(clients)
      return served
    },
  }
}

/** One non-streamed completion of `tenant`; its latency and tokens (prompt + completion). A
 *  connection error (a keep-alive socket the router closed as it was reused) is status 0. */
async function complete(
  agent: http.Agent,
  url: string,
  tenant: string,
  prompt: string,
  maxTokens: number,
): Promise<Served> {
  const startedMs = performance.now()
  try {
    return await completeOnce(agent, url, tenant, prompt, maxTokens, startedMs)
  } catch {
    const endedMs = performance.now()
    return { tenant, endedMs, latencyMs: endedMs - startedMs, numTokens: 0, status: 0 }
  }
}

async function completeOnce(
  agent: http.Agent,
  url: string,
  tenant: string,
  prompt: string,
  maxTokens: number,
  startedMs: number,
): Promise<Served> {
  const body = JSON.stringify({ model: 'echo-test', prompt, max_tokens: maxTokens })
  const res = await new Promise<http.IncomingMessage>((resolve, reject) => {
    const req = http.request(
      `${url}/v1/completions`,
      {
        method: 'POST',
        agent,
        headers: {
          authorization: `Bearer ${keyOf(tenant)}`,
          'content-type': 'application/json',
          'content-length': Buffer.byteLength(body),
        },
      },
      resolve,
    )
    req.on('error', reject)
    req.end(body)
  })
  let text = ''
  res.setEncoding('utf8')
  for await (const chunk of res as AsyncIterable<string>) text += chunk
  const endedMs = performance.now()
  const status = res.statusCode ?? 0
  let numTokens = 0
  if (status === 200) {
    const { usage } = JSON.parse(text) as { usage: { total_tokens: number } }
    numTokens = usage.total_tokens
  }
  return { tenant, endedMs, latencyMs: endedMs - startedMs, numTokens, status }
}

/** What limits the served requests: the router's slots, or the decode worker's KV pool. */
type ServeMode = 'slots' | 'pool'

/** The child: stand-ins streaming `a` until max_tokens, and the router with `numSlots` slots
 *  (mode `slots`), or with 20 × as many and a decode pool holding `numSlots` (mode `pool`). */
async function serve(mode: ServeMode, numSlots: number, tokenMs: number): Promise<void> {
  const a = charIds('a')[0]
  const isPool = mode === 'pool'
  const h = await startHarness(
    {
      tokenDelayMs: tokenMs,
      numPages: 4096,
      reply: () => Array<number>(256).fill(a),
      ...(isPool && { maxRunningDecodes: numSlots }),
    },
    {
      modelDir: tokenizerWithLongToken(),
      queue: {
        maxConcurrentRequests: isPool ? numSlots * 20 : numSlots,
        maxQueuedRequests: 4096,
        maxQueueWaitMs: 120_000,
      },
      tenants: Object.entries(tenantWeights).map(([name, weight]) => ({
        name,
        keySha256: apiKeyDigest(keyOf(name)),
        ...(weight !== undefined && { weight }),
      })),
      logContent: false,
    },
  )
  h.logs.log.level = 'warn'
  // The stand-ins record every request for tests; a benchmark only needs them to answer.
  setInterval(() => {
    h.workers.generateRequests.length = 0
    h.workers.takenRequests.length = 0
    h.workers.prefillRequests.length = 0
    h.workers.events.length = 0
    h.logs.lines.length = 0
  }, 1000).unref()
  process.send?.({ url: h.router.url })
  process.on('disconnect', () => void h.close().finally(() => process.exit(0)))
}

/** The `q` quantile of `values` (nearest rank), in their unit. */
function quantile(values: readonly number[], q: number): number {
  const sorted = [...values].sort((x, y) => x - y)
  return sorted[Math.min(sorted.length - 1, Math.max(0, Math.ceil(q * sorted.length) - 1))]
}

function round(value: number, digits: number): number {
  return Number(value.toFixed(digits))
}

function intFlag(args: readonly string[], name: string, fallback: number): number {
  const at = args.indexOf(name)
  if (at === -1) return fallback
  const value = Number(args[at + 1])
  if (!Number.isSafeInteger(value) || value < 1) {
    throw new Error(`${name} needs a positive integer, got ${String(args[at + 1])}`)
  }
  return value
}

function stringFlag<T extends string>(args: readonly string[], name: string, values: T[]): T {
  const at = args.indexOf(name)
  if (at === -1) return values[0]
  const value = args[at + 1] as T
  if (!values.includes(value)) {
    throw new Error(`${name} needs one of ${values.join(', ')}, got ${String(args[at + 1])}`)
  }
  return value
}

async function stop(child: ChildProcess): Promise<void> {
  if (child.exitCode !== null) return
  const exited = new Promise<void>((resolve) => child.once('exit', () => resolve()))
  child.disconnect()
  const timer = setTimeout(() => child.kill('SIGKILL'), 5_000)
  await exited
  clearTimeout(timer)
}

if (process.argv[1] === fileURLToPath(import.meta.url) && process.argv[2] === '--serve') {
  const mode = process.argv[3] === 'pool' ? 'pool' : 'slots'
  serve(mode, Number(process.argv[4]), Number(process.argv[5])).catch((err: unknown) => {
    process.stderr.write(`bench fairness: ${err instanceof Error ? err.message : String(err)}\n`)
    process.exit(2)
  })
}
