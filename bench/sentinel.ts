/** Response sentinel benchmark, in one bounded run (about a minute and a half):
 *  - Throughput: the router in front of fast stand-in workers (test/router/helpers.ts; the decode
 *    worker echoes the prompt's first 64 tokens, one per event-loop turn), twice in one child
 *    process — sentinel `off` and `observe` — with `--clients` (default 32) clients sending
 *    streamed completions (a shared licence paragraph plus a unique tail) back to back for
 *    `--seconds` (default 2) on each, in alternating order, `--repeats` (default 9) times.
 *    `sentinel_throughput_ratio` is the median of the per-repeat ratios observe ÷ off (goal ≥ 0.95);
 *    on a machine shared with other work it swings by ±20 % either way (an A/A run, both routers
 *    off, gave 1.02 and an A/B run 1.21 within minutes), so `sentinel_cpu_ratio` — the child's CPU
 *    time per request, off ÷ observe, per repeat — is given beside it: it does not depend on
 *    how much of the CPU the child got.
 *  - Fingerprint work per token: the sentinel alone (token mode, observe), in this process, over
 *    the throughput part's workload — each request's prompt (BOS and the licence paragraph with a
 *    unique tail, one token a character as the stand-ins' tokenizer has it) admitted, and its
 *    64-token answer (the prompt's first 64 tokens, as the stand-in echoes them) checked token by
 *    token. `sentinel_ns_per_token`: the median over `--repeats` rounds of 2,000 requests of the
 *    process's CPU time ÷ (prompt + answer tokens); `sentinel_us_per_request` the same per
 *    request. The store
 *    keeps every round's fingerprints (as a router's does within its window).
 *  - A real kvfence cluster (bundled echo model, real prefill and decode processes) with
 *    `placeholder-forward` injected and guards off; three tenants (tenant-a a canary tenant):
 *    first a benign run of `--benign-seconds` (default 15) — a shared system prompt, a shared
 *    licence paragraph, each tenant's own passages — whose sentinel events are `false_alarms`;
 *    `sentinel_fingerprint_bytes` is the router's gauge after it (`sentinel_requests` requests).
 *    Then, with tenant-c still sending benign requests, tenant-a plants a passage with a canary
 *    and tenant-b sends an over-capacity prompt (streamed), until an answer is contaminated — a
 *    16-character run of the passage or 8 characters of the canary (at most 20 tries).
 *    `sentinel_time_to_detect_s`: from the client's receipt of the first contaminated chunk to
 *    the router's log line of the first sentinel event (the log's own clock; negative when the
 *    router noticed before the chunk arrived);
 *    `sentinel_time_to_metric_s`: until `/metrics` shows it (polled every 10 ms).
 *  - The watch's figures (`watch_time_to_detect_s`, `watch_token_share`) and both detectors'
 *    with each fault switched on while the cluster serves: bench/sentinel-watch.ts.
 *  Args: `--repeats N`, `--seconds S`, `--clients N`, `--benign-seconds S`,
 *  `--watch-cycle-seconds S` (default 30, the watch's own), `--detect-timeout-seconds S` (default
 *  150); `--watch-only` runs the watch part alone, `--faults a,b` some of its faults only,
 *  `--keep-logs` keeps its clusters' and watches' logs (the folder is printed to stderr). */
import { fork, type ChildProcess } from 'node:child_process'
import { createHash, randomBytes } from 'node:crypto'
import { mkdtempSync, readFileSync, writeFileSync } from 'node:fs'
import http from 'node:http'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { performance } from 'node:perf_hooks'
import { fileURLToPath } from 'node:url'
import { startCluster, type Cluster } from '../src/config/launch.js'
import { hasRun } from '../src/cli/demo-production.js'
import { newApiKey } from '../src/router/tenants/tenant-keys.js'
import { incidentShape } from '../test/helpers/cluster.js'
import { echoModelDir } from '../test/helpers/paths.js'
import { ownText } from '../test/helpers/workload.js'
import { bosId, charIds, keys, startHarness } from '../test/router/helpers.js'
import { buildSentinelSettings, createSentinel } from '../src/router/sentinel/sentinel.js'
import { ratioFields } from './ratio.js'
import { benchWatchDetection } from './sentinel-watch.js'

const licence =
  'Permission is hereby granted, free of charge, to any person obtaining a copy of this software'
const systemPrompt =
  'You are a careful assistant of the example company. Answer briefly and politely, in English.'
const overCapacityPrompt = 'b '.repeat(225) // 451 tokens: over the prefill pool of 384

/** Runs the benchmark and returns its JSON. */
export async function benchSentinel(args: string[]): Promise<object> {
  const isWatchOnly = args.includes('--watch-only')
  const fingerprintWork = isWatchOnly ? {} : measureFingerprintWork(intFlag(args, '--repeats', 9))
  const throughput = isWatchOnly
    ? {}
    : await measureThroughput(
        intFlag(args, '--repeats', 9),
        intFlag(args, '--seconds', 2),
        intFlag(args, '--clients', 32),
      )
  const cluster = isWatchOnly
    ? { false_alarms: 0 }
    : await measureCluster(intFlag(args, '--benign-seconds', 15))
  const faultsAt = args.indexOf('--faults')
  const watch = await benchWatchDetection({
    cycleSeconds: intFlag(args, '--watch-cycle-seconds', 30),
    detectTimeoutSeconds: intFlag(args, '--detect-timeout-seconds', 150),
    faults: faultsAt === -1 ? undefined : (args[faultsAt + 1] ?? '').split(','),
    keepLogs: args.includes('--keep-logs'),
  })
  // `false_alarms` totals every benign stretch: the faulty cluster's before its fault was
  // triggered, and both shipped clusters' before their faults were switched on.
  return {
    ...throughput,
    ...fingerprintWork,
    ...cluster,
    ...watch,
    false_alarms: cluster.false_alarms + watch.false_alarms_as_shipped,
  }
}

// ---------------------------------------------------------------------------------------------
// Throughput, sentinel off vs observe

async function measureThroughput(repeats: number, seconds: number, numClients: number) {
  const child = fork(fileURLToPath(import.meta.url), ['--serve'], {
    stdio: ['ignore', 'ignore', 'inherit', 'ipc'],
  })
  try {
    const urls = await new Promise<{ off: string; observe: string }>((resolve, reject) => {
      child.once('message', (m) => resolve(m as { off: string; observe: string }))
      child.once('exit', (code) => reject(new Error(`stand-in process exited with ${code}`)))
    })
    const agent = new http.Agent({ keepAlive: true, maxSockets: Infinity })
    for (const url of [urls.off, urls.observe]) await closedLoopRate(agent, url, numClients, 1)
    const ratios: number[] = []
    const cpuRatios: number[] = []
    const cpuMs: { off: number; observe: number }[] = []
    const rates: { off: number; observe: number }[] = []
    for (let r = 0; r < repeats; r++) {
      const order = r % 2 === 0 ? (['off', 'observe'] as const) : (['observe', 'off'] as const)
      const rate = { off: 0, observe: 0 }
      const cpuPerRequest = { off: 0, observe: 0 }
      for (const mode of order) {
        const cpuBefore = await childCpuMs(child)
        const window = await closedLoopRate(agent, urls[mode], numClients, seconds)
        rate[mode] = window.rate
        cpuPerRequest[mode] = ((await childCpuMs(child)) - cpuBefore) / window.numDone
      }
      rates.push(rate)
      ratios.push(rate.observe / rate.off)
      cpuRatios.push(cpuPerRequest.off / cpuPerRequest.observe)
      cpuMs.push(cpuPerRequest)
    }
    agent.destroy()
    return {
      ...ratioFields('sentinel_throughput_ratio', ratios),
      ...ratioFields('sentinel_cpu_ratio', cpuRatios),
      router_cpu_ms_per_request_off: round(median(cpuMs.map((c) => c.off)), 3),
      router_cpu_ms_per_request_observe: round(median(cpuMs.map((c) => c.observe)), 3),
      streamed_requests_per_s_off: round(median(rates.map((r) => r.off)), 1),
      streamed_requests_per_s_observe: round(median(rates.map((r) => r.observe)), 1),
    }
  } finally {
    await stop(child)
  }
}

/** Streamed requests completed per second by `numClients` clients back to back for `seconds`,
 *  and how many completed. */
async function closedLoopRate(
  agent: http.Agent,
  url: string,
  numClients: number,
  seconds: number,
): Promise<{ rate: number; numDone: number }> {
  const startMs = performance.now()
  const endMs = startMs + seconds * 1000
  let numDone = 0
  await Promise.all(
    Array.from({ length: numClients }, async () => {
      while (performance.now() < endMs) {
        await streamedRequest(agent, url, `${licence} ${randomBytes(24).toString('hex')}`)
        numDone++
      }
    }),
  )
  return { rate: numDone / ((performance.now() - startMs) / 1000), numDone }
}

/** The child's CPU time so far (user + system), ms. */
function childCpuMs(child: ChildProcess): Promise<number> {
  return new Promise((resolve) => {
    const onMessage = (m: { type?: string; cpuMs?: number }) => {
      if (m.type !== 'cpu') return
      child.off('message', onMessage)
      resolve(m.cpuMs ?? 0)
    }
    child.on('message', onMessage)
    child.send({ type: 'cpu' })
  })
}

function streamedRequest(agent: http.Agent, url: string, prompt: string): Promise<void> {
  const body = JSON.stringify({ model: 'echo-test', prompt, max_tokens: 64, stream: true })
  return new Promise((resolve, reject) => {
    const req = http.request(
      `${url}/v1/completions`,
      {
        method: 'POST',
        agent,
        headers: {
          'content-type': 'application/json',
          'content-length': Buffer.byteLength(body),
          authorization: `Bearer ${keys.alpha}`,
        },
      },
      (res) => {
        if (res.statusCode !== 200) reject(new Error(`router: HTTP ${res.statusCode}`))
        res.on('data', () => undefined)
        res.on('end', resolve)
        res.on('error', reject)
      },
    )
    req.on('error', reject)
    req.end(body)
  })
}

/** The child: two routers over stand-ins, sentinel off and observe. */
async function serve(): Promise<void> {
  const urls: Record<string, string> = {}
  for (const mode of ['off', 'observe'] as const) {
    const h = await startHarness(
      { tokenDelayMs: 0, prefillDelayMs: 0, numPages: 4096, reply: (ids) => ids.slice(1, 65) },
      {
        queue: { maxConcurrentRequests: 256, maxQueuedRequests: 1024 },
        sentinel: { mode },
      },
    )
    h.logs.log.level = 'warn'
    setInterval(() => {
      h.workers.generateRequests.length = 0
      h.workers.prefillRequests.length = 0
      h.workers.events.length = 0
    }, 1000).unref()
    urls[mode] = h.router.url
  }
  process.on('message', (m: { type?: string }) => {
    if (m.type !== 'cpu') return
    const { user, system } = process.cpuUsage()
    process.send?.({ type: 'cpu', cpuMs: (user + system) / 1000 })
  })
  process.send?.(urls)
}

// ---------------------------------------------------------------------------------------------
// Fingerprint work per token

/** Requests per round of {@link measureFingerprintWork}. */
const requestsPerRound = 2_000

/** The sentinel's own time per token and per request, on the throughput part's workload. */
function measureFingerprintWork(repeats: number) {
  const sentinel = createSentinel({
    settings: buildSentinelSettings({ mode: 'observe' }),
    unit: 'token',
    onEvent: () => undefined,
  })
  const runRound = (r: number): { nsPerToken: number; usPerRequest: number } => {
    // The prompts are drawn before the clock starts: only the sentinel's work is timed.
    const prompts = Array.from({ length: requestsPerRound }, () => {
      const text = `${licence} ${randomBytes(24).toString('hex')}`
      return { text, ids: [bosId, ...charIds(text)] }
    })
    let numTokens = 0
    // CPU time, not wall time: on a machine shared with other work the wall clock counts the
    // time this process waited for a core.
    const cpuBefore = process.cpuUsage()
    for (const [i, { text, ids }] of prompts.entries()) {
      const check = sentinel.admit('alpha', false, `r${r}-${i}`, {
        texts: [text],
        tokenIds: ids,
        numTokens: ids.length,
      })
      const answer = ids.slice(1, 65)
      for (const id of answer) check.push(String.fromCharCode(id), [id])
      check.finish()
      numTokens += ids.length + answer.length
    }
    const cpu = process.cpuUsage(cpuBefore)
    const ns = (cpu.user + cpu.system) * 1000
    return { nsPerToken: ns / numTokens, usPerRequest: ns / requestsPerRound / 1000 }
  }
  runRound(-1) // warm-up
  const rounds = Array.from({ length: repeats }, (_, r) => runRound(r))
  return {
    sentinel_ns_per_token: round(median(rounds.map((x) => x.nsPerToken)), 1),
    sentinel_us_per_request: round(median(rounds.map((x) => x.usPerRequest)), 2),
  }
}

// ---------------------------------------------------------------------------------------------
// A faulty cluster: false alarms, memory, time to detect

async function measureCluster(benignSeconds: number) {
  const dir = mkdtempSync(join(tmpdir(), 'kvfence-bench-sentinel-'))
  const tenants = { a: newApiKey(), b: newApiKey(), c: newApiKey() }
  const digest = (key: string) => createHash('sha256').update(key).digest('hex')
  const tenantsFile = join(dir, 'tenants.yaml')
  writeFileSync(
    tenantsFile,
    `tenants:\n  - { name: tenant-a, keySha256: ${digest(tenants.a)}, canary: true }\n` +
      `  - { name: tenant-b, keySha256: ${digest(tenants.b)} }\n` +
      `  - { name: tenant-c, keySha256: ${digest(tenants.c)} }\n`,
  )
  const cluster = await startCluster({
    modelDir: echoModelDir,
    ...incidentShape,
    tenantsFile,
    logDir: join(dir, 'logs'),
    contextWindow: 1024,
    prefillFaults: ['placeholder-forward'],
    disableGuards: true,
    env: { ...process.env, KVFENCE_ALLOW_FAULTS: '1' },
  })
  try {
    let numRequests = 0
    const benignEnd = performance.now() + benignSeconds * 1000
    await Promise.all(
      Object.values(tenants).map(async (key) => {
        while (performance.now() < benignEnd) numRequests += await benignRequest(cluster, key)
      }),
    )
    const afterBenign = await sentinelCounts(cluster)
    const detection = await timeToDetect(cluster, tenants, join(dir, 'logs', 'router.log'))
    return {
      false_alarms: afterBenign.suspected + afterBenign.confirmed,
      sentinel_requests: numRequests,
      sentinel_fingerprint_bytes: afterBenign.bytes,
      ...detection,
    }
  } finally {
    await cluster.stop()
  }
}

/** One benign request of a random kind; returns 1. */
async function benignRequest(cluster: Cluster, key: string): Promise<number> {
  // A tenant's own text is its own, as in the watch's workload: 12 words drawn from 13 made every
  // tenant's passage a reshuffle of the others', and the echo model (a token per character) copied
  // 16-character runs of them across word boundaries, one of which another tenant alone had sent
  // (one suspected event in a benign run of 2026-12-02).
  const own = ownText(12)
  const kind = Math.floor(Math.random() * 3)
  const body =
    kind === 0
      ? {
          messages: [
            { role: 'system', content: systemPrompt },
            { role: 'user', content: own },
          ],
        }
      : { prompt: kind === 1 ? `${licence} ${own}` : own }
  const path = kind === 0 ? 'chat/completions' : 'completions'
  const res = await fetch(`${cluster.routerUrl}/v1/${path}`, {
    method: 'POST',
    headers: { 'content-type': 'application/json', authorization: `Bearer ${key}` },
    body: JSON.stringify({ model: 'echo-tiny', max_tokens: 32, temperature: 0, ...body }),
  })
  await res.text()
  return 1
}

/** Plants a passage as tenant-a and streams tenant-b's over-capacity answer until one carries a
 *  16-character run of it, tenant-c sending benign requests meanwhile. */
async function timeToDetect(
  cluster: Cluster,
  tenants: { a: string; b: string; c: string },
  routerLog: string,
) {
  let isDone = false
  const background = (async () => {
    while (!isDone) await benignRequest(cluster, tenants.c)
  })()
  try {
    for (let attempt = 0; attempt < 20; attempt++) {
      const canary = `Qx7v${randomBytes(6).toString('hex')}Lt4W`
      const passage = `the river walks near the stone garden and ${canary} holds the quiet light over the green field after the summer rain, the small market opens`
      await complete(cluster, tenants.a, passage, false)
      const contaminatedAtMs = await complete(cluster, tenants.b, overCapacityPrompt, true, {
        passage,
        canary,
      })
      if (contaminatedAtMs === null) continue
      let metricMs = Date.now()
      const isCounted = (c: { suspected: number; confirmed: number }) =>
        c.suspected + c.confirmed > 0
      while (!isCounted(await sentinelCounts(cluster)) && Date.now() - metricMs < 5_000) {
        await new Promise((r) => setTimeout(r, 10))
      }
      metricMs = Date.now()
      const eventMs = firstEventMs(routerLog)
      return {
        sentinel_time_to_detect_s: eventMs === null ? null : (eventMs - contaminatedAtMs) / 1000,
        sentinel_time_to_metric_s: round((metricMs - contaminatedAtMs) / 1000, 3),
        sentinel_detect_attempts: attempt + 1,
        ...(await sentinelCounts(cluster)),
      }
    }
    return { sentinel_time_to_detect_s: null, note: 'no contaminated answer in 20 tries' }
  } finally {
    isDone = true
    await background
  }
}

/** A completion; streamed with `source`, the `Date.now()` at which the received text was first
 *  contaminated — a 16-character run of the passage or 8 characters of its canary — or null. */
async function complete(
  cluster: Cluster,
  key: string,
  prompt: string,
  isStream: boolean,
  source?: { passage: string; canary: string },
): Promise<number | null> {
  const res = await fetch(`${cluster.routerUrl}/v1/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json', authorization: `Bearer ${key}` },
    body: JSON.stringify({
      model: 'echo-tiny',
      prompt,
      max_tokens: 64,
      temperature: 0,
      stream: isStream,
    }),
  })
  if (!isStream || res.body === null) return (await res.text(), null)
  let received = ''
  let atMs: number | null = null
  let pending = ''
  const decoder = new TextDecoder()
  for await (const bytes of res.body as AsyncIterable<Uint8Array>) {
    pending += decoder.decode(bytes, { stream: true })
    const lines = pending.split('\n')
    pending = lines.pop() ?? ''
    for (const line of lines) {
      if (!line.startsWith('data: {')) continue
      const event = JSON.parse(line.slice(6)) as { choices?: { text?: string }[] }
      received += event.choices?.[0]?.text ?? ''
    }
    const isContaminated =
      source !== undefined &&
      (hasRun(received, source.passage) || hasFragment(received, source.canary))
    if (atMs === null && isContaminated) atMs = Date.now()
  }
  return atMs
}

/** Whether `text` holds 8 consecutive characters of `secret`. */
function hasFragment(text: string, secret: string): boolean {
  for (let i = 0; i + 8 <= secret.length; i++)
    if (text.includes(secret.slice(i, i + 8))) return true
  return false
}

/** The `time` (ms) of the router log's first sentinel line, or null. */
function firstEventMs(routerLog: string): number | null {
  for (const line of readFileSync(routerLog, 'utf8').split('\n')) {
    if (line.includes('"msg":"sentinel:')) return (JSON.parse(line) as { time: number }).time
  }
  return null
}

async function sentinelCounts(cluster: Cluster) {
  const text = await (await fetch(`${cluster.routerUrl}/metrics`)).text()
  const sum = (name: string) =>
    text
      .split('\n')
      .filter((l) => l.startsWith(`${name}{`) || l.startsWith(`${name} `))
      .reduce((n, l) => n + Number(l.slice(l.lastIndexOf(' ') + 1)), 0)
  return {
    suspected: sum('kvfence_sentinel_suspected_total'),
    confirmed: sum('kvfence_sentinel_confirmed_total'),
    bytes: sum('kvfence_sentinel_fingerprint_bytes'),
  }
}

// ---------------------------------------------------------------------------------------------
// Helpers

function median(values: readonly number[]): number {
  const sorted = [...values].sort((a, b) => a - b)
  const mid = Math.floor(sorted.length / 2)
  return sorted.length % 2 === 1 ? sorted[mid] : (sorted[mid - 1] + sorted[mid]) / 2
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

async function stop(child: ChildProcess): Promise<void> {
  if (child.exitCode !== null) return
  const exited = new Promise<void>((resolve) => child.once('exit', () => resolve()))
  child.disconnect()
  const timer = setTimeout(() => child.kill('SIGKILL'), 5_000)
  await exited
  clearTimeout(timer)
}

if (process.argv[1] === fileURLToPath(import.meta.url) && process.argv[2] === '--serve') {
  serve().catch((err: unknown) => {
    process.stderr.write(`bench sentinel: ${err instanceof Error ? err.message : String(err)}\n`)
    process.exit(2)
  })
}
