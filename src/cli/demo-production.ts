/** The demo's third act: a cluster serving as shipped (guards on, the response sentinel observing,
 *  `kvfence watch` running against it as a separate process), two tenants sending traffic; then
 *  the incident's fault switched on while it runs (a redeploy: `placeholder-forward`, guards off,
 *  the advertised context larger than the prefill pool, the router on the same URL) and the time
 *  each of the watch and the sentinel took to catch the first contaminated answer.
 *  Knows the act's workload and what it prints; the cluster, the redeploy and the watch are the
 *  real ones (config/launch.ts, config/redeploy.ts, `kvfence watch`). */
import { randomBytes } from 'node:crypto'
import { existsSync, readFileSync, writeFileSync } from 'node:fs'
import { join } from 'node:path'
import { type Cluster, type ClusterOptions, startCluster } from '../config/launch.js'
import { redeployCluster } from '../config/redeploy.js'
import { newApiKey } from '../router/tenants/tenant-keys.js'
import { apiKeyDigest } from '../router/tenants/tenants.js'
import { startWatchChild, type WatchLogLine } from '../audit/watch/child.js'

/** The watch's cycle in the demo (s): shorter than its 30 s default to keep the demo short; its
 *  budget is scaled up by the same factor (audit/watch/child.ts, docs/monitoring.md). */
export const demoWatchCycleSeconds = 5

/** What the act measured; times are `Date.now()` ms, null when it did not happen in time. */
export interface ProductionOutcome {
  faultOnAtMs: number
  /** The first answer to tenant-b carrying a run of tenant-a's passage. */
  contaminatedAtMs: number | null
  /** The router log's first sentinel event after the fault, and its kind. */
  sentinelAtMs: number | null
  sentinelKind: 'confirmed' | 'suspected' | null
  /** The watch's first leak finding (its log line). */
  watchAtMs: number | null
  watchProbe: string | null
  /** The watch's first finding of any verdict after the fault (a leak, or the warnings of the
   *  misconfiguration the fault came with: capacity, boundary), and its `verdict:probe`. */
  watchAlertAtMs: number | null
  watchAlert: string | null
}

const systemPrompt =
  'You are a careful assistant of the example company. Answer briefly and politely, in English.'
const licence =
  'Permission is hereby granted, free of charge, to any person obtaining a copy of this software'
const words = 'river stone light water green paper house small table music bread cloud field'.split(
  ' ',
)
/** 451 tokens: over the 384-token prefill pool. */
const overCapacityPrompt = 'b '.repeat(225)
/** How long the act waits for both detections (ms): after the first contaminated answer (or,
 *  while there is none, after the fault was switched on). The goal for the watch is an
 *  alert within a minute of the first contaminated answer: one later than that is a miss, and
 *  waiting longer only makes the demo (and its test) longer. */
const detectTimeoutMs = 60_000

/** Runs the act: `base` is the demo's deployment (the tenants file is replaced by the act's own,
 *  written to `out`), `advertisedContext` the incident's. Prints as it goes through `say`. */
export async function runProductionAct(
  base: ClusterOptions,
  advertisedContext: number,
  out: string,
  say: (line?: string) => void,
): Promise<ProductionOutcome> {
  const keys = {
    a: newApiKey(),
    b: newApiKey(),
    watchA: newApiKey(),
    watchB: newApiKey(),
  }
  const tenantsFile = join(out, 'tenants-production.yaml')
  writeFileSync(
    tenantsFile,
    'tenants:\n' +
      `  - { name: tenant-a, keySha256: ${apiKeyDigest(keys.a)} }\n` +
      `  - { name: tenant-b, keySha256: ${apiKeyDigest(keys.b)} }\n` +
      `  - { name: watch-a, keySha256: ${apiKeyDigest(keys.watchA)}, canary: true }\n` +
      `  - { name: watch-b, keySha256: ${apiKeyDigest(keys.watchB)}, canary: true }\n`,
    { mode: 0o600 },
  )
  const shipped: ClusterOptions = {
    ...base,
    tenantsFile,
    contextWindow: advertisedContext,
    clampContext: true,
    logDir: join(out, 'logs', 'production'),
  }
  let cluster: Cluster = await startCluster(shipped)
  say(`cluster up at ${cluster.routerUrl}, as shipped (sentinel: observe)`)
  const watch = startWatchChild({
    target: cluster.routerUrl,
    tenants: { 'watch-a': keys.watchA, 'watch-b': keys.watchB },
    cycleSeconds: demoWatchCycleSeconds,
    logFile: join(out, 'logs', 'watch.log'),
  })
  say(`kvfence watch running (pid ${watch.pid}, cycle ${demoWatchCycleSeconds} s)`)
  const traffic = startTraffic(cluster.routerUrl, keys)
  try {
    await sleep(2 * demoWatchCycleSeconds * 1000)
    // The watch must have seen the cluster as shipped before the fault: one cycle at least.
    for (let waited = 0; watch.numCycles() === 0 && waited < 30_000; waited += 250) await sleep(250)
    say(
      `${traffic.numRequests()} answers served; the watch ran ${watch.numCycles()} cycles, ` +
        `${watch.numFindings()} findings`,
    )
    say(`switching the fault on: redeploy with placeholder-forward, guards off,`)
    say(`  advertised context ${advertisedContext} tokens (same URL)`)
    const faultLogDir = join(out, 'logs', 'production-fault')
    const redeployed = await redeployCluster(cluster, {
      ...shipped,
      clampContext: false,
      prefillFaults: ['placeholder-forward'],
      disableGuards: true,
      env: { ...(base.env ?? process.env), KVFENCE_ALLOW_FAULTS: '1' },
      logDir: faultLogDir,
    })
    cluster = redeployed.cluster
    const faultOnAtMs = redeployed.servingAtMs
    say(`fault on (${((faultOnAtMs - redeployed.stoppedAtMs) / 1000).toFixed(1)} s of downtime)`)
    let sentinel = firstSentinelEvent(join(faultLogDir, 'router.log'))
    const isLeak = (l: WatchLogLine) => l.verdict === 'leak'
    const isAlert = (l: WatchLogLine) => l.time >= redeployed.stoppedAtMs
    let leak = watch.firstFinding(isLeak)
    let alert = watch.firstFinding(isAlert)
    const until = () => {
      const known = [traffic.contaminatedAtMs(), sentinel?.atMs ?? null].filter(
        (t): t is number => t !== null,
      )
      return (known.length > 0 ? Math.min(...known) : faultOnAtMs) + detectTimeoutMs
    }
    while (Date.now() < until() && (sentinel === null || leak === null)) {
      await sleep(250)
      sentinel ??= firstSentinelEvent(join(faultLogDir, 'router.log'))
      leak ??= watch.firstFinding(isLeak)
      alert ??= watch.firstFinding(isAlert)
    }
    return {
      faultOnAtMs,
      contaminatedAtMs: traffic.contaminatedAtMs(),
      sentinelAtMs: sentinel?.atMs ?? null,
      sentinelKind: sentinel?.kind ?? null,
      watchAtMs: leak?.time ?? null,
      watchProbe: leak === null ? null : String(leak.probe),
      watchAlertAtMs: alert?.time ?? null,
      watchAlert: alert === null ? null : `${String(alert.verdict)}:${String(alert.probe)}`,
    }
  } finally {
    await traffic.stop()
    await watch.stop()
    await cluster.stop()
  }
}

/** The first contaminated answer the act knows of: tenant-b's, or the one the sentinel flagged
 *  (it flags an answer as it is produced, before the client has all of it), ms or null. */
export function firstContaminatedMs(o: ProductionOutcome): number | null {
  const known = [o.contaminatedAtMs, o.sentinelAtMs].filter((t): t is number => t !== null)
  return known.length === 0 ? null : Math.min(...known)
}

/** The act's outcome as lines of at most 80 columns: each event's seconds after the fault was
 *  switched on, and the watch's alert after the first contaminated answer. */
export function productionLines(o: ProductionOutcome): string[] {
  const at = (ms: number | null) =>
    ms === null ? 'not seen' : `+${((ms - o.faultOnAtMs) / 1000).toFixed(1)} s`
  const first = firstContaminatedMs(o)
  // Say which answer the delay is counted from: when only the sentinel saw one, "after the first"
  // beside "tenant-b received tenant-a's text: not seen" read as a contradiction (trial).
  const firstWhat = first === o.contaminatedAtMs ? 'tenant-b' : 'the sentinel'
  const watchDelay =
    o.watchAtMs === null || first === null
      ? ''
      : `, ${((o.watchAtMs - first) / 1000).toFixed(1)} s after ${firstWhat}`
  return [
    `fault switched on (redeploy, same URL)   at 0.0 s`,
    `sentinel: first ${o.sentinelKind ?? 'event'} cross-tenant answer`.padEnd(40) +
      ` ${at(o.sentinelAtMs)}`,
    `tenant-b received tenant-a's text`.padEnd(40) + ` ${at(o.contaminatedAtMs)}`,
    (o.watchAlert === null ? 'watch: first alert' : `watch: first alert (${o.watchAlert})`).padEnd(
      40,
    ) + ` ${at(o.watchAlertAtMs)}`,
    (o.watchProbe === null
      ? 'watch: leak alert'
      : `watch: leak alert (${o.watchProbe} probe)`
    ).padEnd(40) + ` ${at(o.watchAtMs)}${watchDelay}`,
    `(watch cycle ${demoWatchCycleSeconds} s here; 30 s by default)`,
  ]
}

/** Whether both caught the fault. */
export function isCaught(o: ProductionOutcome): boolean {
  // The watch's leak finding needs its over-capacity prompt to land on its own plant's stale
  // pages, which the demo's traffic can overwrite first; its capacity and boundary warnings on
  // the redeployed misconfiguration are alerts too.
  return o.sentinelAtMs !== null && (o.watchAtMs !== null || o.watchAlertAtMs !== null)
}

/** tenant-a and tenant-b: shared system prompt and licence, their own words; tenant-a plants a
 *  private passage and tenant-b then sends an over-capacity prompt (refused as shipped). */
function startTraffic(url: string, keys: { a: string; b: string }) {
  let isDone = false
  let numRequests = 0
  let contaminatedAtMs: number | null = null
  let model: string | null = null
  const send = async (key: string, body: object, path = 'completions') => {
    try {
      model ??= await servedModel(url, key)
      const res = await fetch(`${url}/v1/${path}`, {
        method: 'POST',
        headers: { 'content-type': 'application/json', authorization: `Bearer ${key}` },
        body: JSON.stringify({ model, max_tokens: 32, temperature: 0, ...body }),
      })
      const json = (await res.json()) as {
        choices?: { text?: string; message?: { content?: string } }[]
      }
      numRequests++
      const c = json.choices?.[0]
      return c?.text ?? c?.message?.content ?? ''
    } catch {
      await sleep(200) // the cluster is being redeployed
      return ''
    }
  }
  const own = () => Array.from({ length: 12 }, () => words[randomInt(words.length)]).join(' ')
  const benign = async (key: string) => {
    while (!isDone) {
      await send(
        key,
        {
          messages: [
            { role: 'system', content: systemPrompt },
            { role: 'user', content: own() },
          ],
        },
        'chat/completions',
      )
      await send(key, { prompt: `${licence} ${own()}` })
    }
  }
  const plantAndOverflow = async () => {
    while (!isDone) {
      const passage = `the ${randomBytes(4).toString('hex')} report says ${own()} and ${own()}`
      await send(keys.a, { prompt: passage, max_tokens: 4 })
      const answer = await send(keys.b, { prompt: overCapacityPrompt, max_tokens: 64 })
      if (contaminatedAtMs === null && hasRun(answer, passage)) contaminatedAtMs = Date.now()
    }
  }
  const loops = [benign(keys.a), benign(keys.b), plantAndOverflow()]
  return {
    numRequests: () => numRequests,
    contaminatedAtMs: () => contaminatedAtMs,
    stop: async () => {
      isDone = true
      await Promise.all(loops)
    },
  }
}

/** The first model id the router's `/v1/models` lists. */
async function servedModel(url: string, key: string): Promise<string> {
  const res = await fetch(`${url}/v1/models`, { headers: { authorization: `Bearer ${key}` } })
  const { data } = (await res.json()) as { data: { id: string }[] }
  return data[0].id
}

/** Whether `answer` holds 16 characters whose every 8-character piece occurs in `source` (a
 *  run of another tenant's text: what the demo and the benches count as contaminated). */
export function hasRun(answer: string, source: string): boolean {
  let run = 0
  for (let i = 0; i + 8 <= answer.length; i++) {
    run = source.includes(answer.slice(i, i + 8)) ? run + 1 : 0
    if (run >= 9) return true
  }
  return false
}

/** The router log's first sentinel event, or null. */
export function firstSentinelEvent(
  routerLog: string,
): { atMs: number; kind: 'confirmed' | 'suspected' } | null {
  if (!existsSync(routerLog)) return null
  for (const line of readFileSync(routerLog, 'utf8').split('\n')) {
    if (!line.includes('"msg":"sentinel:')) continue
    const { time, msg } = JSON.parse(line) as { time: number; msg: string }
    return { atMs: time, kind: msg.includes('confirmed') ? 'confirmed' : 'suspected' }
  }
  return null
}

function randomInt(n: number): number {
  return Math.floor(Math.random() * n)
}

function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms))
}
