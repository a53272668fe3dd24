/** The watch's and the sentinel's time to detect a fault switched on in production, and the
 *  watch's cost (part of `npm run bench -- sentinel`). For each fault (`placeholder-forward`,
 *  then `early-release`), on a fresh cluster:
 *  - A real kvfence cluster (bundled echo model, prefill, decode and router processes) serving as
 *    shipped (guards on, advertised context clamped to the pool, the sentinel observing), four
 *    tenants sending a benign workload (mixed sizes: a shared system prompt, a shared licence
 *    paragraph, each tenant's own text of 4–60 words; a third streamed, a tenth of those aborted
 *    after the first chunk; tenant-2 now and then sends a prompt over the pool, which the shipped
 *    cluster refuses; test/helpers/workload.ts), and `kvfence watch` (a real process:
 *    src/audit/watch/child.ts) with two canary tenants at a cycle of `cycleSeconds` (the bench's
 *    default: the watch's own 30 s and
 *    its default budget; another cycle scales the budget by 30 ÷ cycle, so that each cycle runs
 *    what a default cycle runs, and its figures are then for that cycle, not the default's).
 *  - Once the watch has completed 3 cycles, the fault is switched on by a redeploy (the router on
 *    the same URL: config/redeploy.ts) — `placeholder-forward` with guards off and the incident's
 *    advertised context of 1024 tokens, or `early-release` with guards off — and the workload goes
 *    on until both have fired or `detectTimeoutSeconds` passed.
 *  Figures per fault (`<fault>.…`), times in seconds:
 *  - `first_contaminated_s`: after the fault was on, the first answer known to be contaminated:
 *    the earlier of a workload answer holding a 16-character run of another tenant's own text, and
 *    the sentinel's first event (it flags an answer while it is produced, before a client has it);
 *    null when neither happened within the timeout.
 *  - `sentinel_time_to_detect_s`: the router log's first sentinel event after the first
 *    contaminated answer a client received (negative: the sentinel flagged it first; null: no
 *    client saw contaminated text).
 *  - `watch_time_to_detect_s`: from the first contaminated answer to the watch's first alert the
 *    fault itself causes (`watch_finding`: for `placeholder-forward` a leak, or `boundary` — a
 *    prompt over the pool answered 200; for `early-release` any but the capacity warning, such
 *    as `availability`); null when no answer was contaminated or no such alert came;
 *    `watch_time_from_fault_s`: the same alert from the moment the fault was on (defined even
 *    when nothing was contaminated); `watch_time_to_leak_s` / `watch_leak`: its first leak alert;
 *    `watch_first_alert_after_fault_s` / `watch_first_alert`: its first alert of any kind (the
 *    capacity warning of the redeployed misconfiguration, say); `watch_cycles_after_fault`: its
 *    cycles from the fault to the fault's alert (or to the end).
 *  - `watch_token_share`: the watch's tokens (its `kvfence_watch_tokens_spent_total`: prompt +
 *    max_tokens of what the endpoint took, an upper bound; prompts it refused with a 4xx count
 *    nothing, as the workload's refused prompts count nothing) ÷ the workload's (the answers'
 *    `usage`; aborted streams count nothing, so this is an upper bound too) while the cluster
 *    served as shipped (the watch's first `shippedCycles` cycles, calibration included): what
 *    monitoring costs all the time. `watch_token_share_whole_run` is over the whole run, the
 *    fault's stretch included (a faulty endpoint answers the over-pool prompt, which then
 *    counts, and the watch runs its follow-up rounds — a plant and an over-pool prompt each —
 *    in a cycle where such a prompt was answered 200), and `…_counting_refused` counts the
 *    watch's refused prompts at their bound too. With `--keep-logs` the watch logs at debug
 *    level: each cycle's completions (trigger, tenant, status, whether the answer carried a
 *    canary; no text) are in the kept `watch.log`.
 *  - `workload_outcomes_before_fault` (the redeploy's downtime included) / `…_after_fault`: what
 *    became of the workload's requests
 *    (JSON: `ok`, `HTTP <status>`, `stream error`, `aborted`, `network`).
 *  The top-level `watch_time_to_detect_s` / `watch_token_share` are `placeholder-forward`'s (the
 *  incident's fault); `false_alarms_as_shipped` counts the watch's findings and the sentinel's
 *  events before either fault was on (log level warn: the shipped router's log holds only
 *  those lines that matter), and is added to the bench's `false_alarms`. */
import { existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { type Cluster, type ClusterOptions, startCluster } from '../src/config/launch.js'
import { redeployCluster } from '../src/config/redeploy.js'
import { firstSentinelEvent } from '../src/cli/demo-production.js'
import { startWatchChild, type WatchChild, type WatchLogLine } from '../src/audit/watch/child.js'
import { newApiKey } from '../src/router/tenants/tenant-keys.js'
import { apiKeyDigest } from '../src/router/tenants/tenants.js'
import { incidentShape } from '../test/helpers/cluster.js'
import { echoModelDir } from '../test/helpers/paths.js'
import { startWorkload } from '../test/helpers/workload.js'

const faults = ['placeholder-forward', 'early-release'] as const
/** Watch cycles while the cluster serves as shipped, before the fault: the steady state whose
 *  cost an operator pays all the time (the first cycle's calibration included). */
const shippedCycles = 3
type Fault = (typeof faults)[number]

/** How {@link benchWatchDetection} runs. */
export interface WatchBenchOptions {
  /** The watch's mean cycle (s); its budget is the default scaled by 30 ÷ this. */
  readonly cycleSeconds: number
  /** How long after the fault to wait for both detectors (s). */
  readonly detectTimeoutSeconds: number
  /** Some of {@link faults} only (default: all). */
  readonly faults?: readonly string[]
  /** Keep each fault's folder of logs (its path is printed to stderr). */
  readonly keepLogs?: boolean
}

/** Runs the faults and returns their figures, and the incident's at the top level. */
export async function benchWatchDetection(
  options: WatchBenchOptions,
): Promise<{ false_alarms_as_shipped: number } & Record<string, unknown>> {
  const chosen = faults.filter((f) => options.faults === undefined || options.faults.includes(f))
  const unknown = (options.faults ?? []).filter((f) => !(faults as readonly string[]).includes(f))
  if (unknown.length > 0 || chosen.length === 0)
    throw new Error(`--faults takes some of ${faults.join(', ')}; got ${String(options.faults)}`)
  const byFault: Record<string, Record<string, number | string | null>> = {}
  for (const fault of chosen) byFault[fault] = await measureFault(fault, options)
  const incident = byFault['placeholder-forward'] ?? {}
  const before = (f: string) =>
    Number(byFault[f].watch_findings_before_fault) + Number(byFault[f].sentinel_events_before_fault)
  return {
    /** Watch findings and sentinel events while the clusters served as shipped. */
    false_alarms_as_shipped: chosen.reduce((n, f) => n + before(f), 0),
    watch_time_to_detect_s: incident.watch_time_to_detect_s ?? null,
    watch_token_share: incident.watch_token_share ?? null,
    watch_cycle_s: options.cycleSeconds,
    faults_switched_on: byFault,
  }
}

async function measureFault(fault: Fault, options: WatchBenchOptions) {
  const { cycleSeconds, detectTimeoutSeconds } = options
  const dir = mkdtempSync(join(tmpdir(), `kvfence-bench-watch-${fault}-`))
  const tenants = Array.from({ length: 4 }, (_, i) => ({
    name: `tenant-${i + 1}`,
    key: newApiKey(),
  }))
  const watchKeys = { 'watch-a': newApiKey(), 'watch-b': newApiKey() }
  const tenantsFile = join(dir, 'tenants.yaml')
  writeFileSync(
    tenantsFile,
    'tenants:\n' +
      tenants.map((t) => `  - { name: ${t.name}, keySha256: ${apiKeyDigest(t.key)} }\n`).join('') +
      Object.entries(watchKeys)
        .map(
          ([name, key]) => `  - { name: ${name}, keySha256: ${apiKeyDigest(key)}, canary: true }\n`,
        )
        .join(''),
  )
  const shipped: ClusterOptions = {
    modelDir: echoModelDir,
    ...incidentShape,
    tenantsFile,
    contextWindow: 1024,
    clampContext: true,
    logDir: join(dir, 'logs-shipped'),
    logLevel: 'warn',
    env: { ...process.env, KVFENCE_ALLOW_FAULTS: '' },
  }
  let cluster: Cluster = await startCluster(shipped)
  const watch = startWatchChild({
    target: cluster.routerUrl,
    tenants: watchKeys,
    cycleSeconds,
    logFile: join(dir, 'watch.log'),
    seed: 15,
    logLevel: options.keepLogs === true ? 'debug' : undefined,
  })
  const workload = startWorkload(
    cluster.routerUrl,
    tenants.map((t) => t.key),
  )
  try {
    while (watch.numCycles() < shippedCycles) await sleep(250)
    const watchTokensShipped = await watchTokensSpent(watch)
    const workloadTokensShipped = workload.tokens()
    const faultLogDir = join(dir, 'logs-fault')
    const redeployed = await redeployCluster(cluster, {
      ...shipped,
      ...(fault === 'placeholder-forward'
        ? { prefillFaults: [fault], clampContext: false }
        : { decodeFaults: [fault] }),
      disableGuards: true,
      logDir: faultLogDir,
      env: { ...process.env, KVFENCE_ALLOW_FAULTS: '1' },
    })
    cluster = redeployed.cluster
    const faultOnMs = redeployed.servingAtMs
    const routerLog = join(faultLogDir, 'router.log')
    const findingsBefore = watch.numFindings()
    const outcomesBefore = workload.outcomes()
    const newFinding = (isWanted: (l: WatchLogLine) => boolean) => () =>
      watch.lines
        .filter((l) => l.msg === 'finding')
        .slice(findingsBefore)
        .find(isWanted) ?? null
    // The alerts the fault itself causes: for the incident, a leak, or a prompt over the pool
    // answered 200 (`boundary`: its rejection path is broken); for early-release whatever it
    // makes (failing valid requests: `availability`). Not the capacity warning, which is the
    // redeployed configuration's.
    const faultAlert = newFinding((l) =>
      fault === 'placeholder-forward'
        ? l.verdict === 'leak' || l.probe === 'boundary'
        : l.probe !== 'capacity',
    )
    const leakAlert = newFinding((l) => l.verdict === 'leak')
    let sentinel = firstSentinelEvent(routerLog)
    let alert = faultAlert()
    let leak = leakAlert()
    while (
      Date.now() < faultOnMs + detectTimeoutSeconds * 1000 &&
      (!sentinel || !alert || (!leak && fault === 'placeholder-forward'))
    ) {
      await sleep(250)
      sentinel ??= firstSentinelEvent(routerLog)
      alert ??= faultAlert()
      leak ??= leakAlert()
    }
    const outcomesAfter = workload.outcomes()
    const watchTokens = await watchTokensSpent(watch)
    const refusedTokens = watch.lines
      .filter((l) => l.msg === 'cycle')
      .reduce((n, l) => n + Number(l.refusedTokens ?? 0), 0)
    const seen = workload.contaminatedAtMs()
    const first = Math.min(...[seen, sentinel?.atMs ?? null].filter((t): t is number => t !== null))
    const secondsFrom = (from: number | null, to: number | null) =>
      from === null || to === null || !Number.isFinite(from) ? null : round((to - from) / 1000, 3)
    const anyAlert = watch.lines.filter((l) => l.msg === 'finding')[findingsBefore] ?? null
    return {
      first_contaminated_s: secondsFrom(faultOnMs, Number.isFinite(first) ? first : null),
      sentinel_time_to_detect_s: secondsFrom(seen, sentinel?.atMs ?? null),
      sentinel_event: sentinel?.kind ?? null,
      watch_time_to_detect_s: secondsFrom(first, alert?.time ?? null),
      watch_finding: alert === null ? null : `${String(alert.verdict)}:${String(alert.probe)}`,
      watch_time_from_fault_s: secondsFrom(faultOnMs, alert?.time ?? null),
      watch_time_to_leak_s: secondsFrom(first, leak?.time ?? null),
      watch_leak: leak === null ? null : `${String(leak.verdict)}:${String(leak.probe)}`,
      watch_first_alert_after_fault_s: secondsFrom(faultOnMs, anyAlert?.time ?? null),
      watch_first_alert:
        anyAlert === null ? null : `${String(anyAlert.verdict)}:${String(anyAlert.probe)}`,
      watch_cycles_after_fault: watch.lines.filter(
        (l) => l.msg === 'cycle' && l.time > faultOnMs && l.time <= (alert?.time ?? Infinity),
      ).length,
      watch_findings_before_fault: findingsBefore,
      sentinel_events_before_fault: countSentinelEvents(join(dir, 'logs-shipped', 'router.log')),
      watch_findings_after_fault: watch.numFindings() - findingsBefore,
      watch_tokens: watchTokens,
      watch_refused_prompt_tokens: refusedTokens,
      workload_tokens: workload.tokens(),
      watch_tokens_as_shipped: watchTokensShipped,
      workload_tokens_as_shipped: workloadTokensShipped,
      watch_token_share:
        watchTokensShipped === null
          ? null
          : round(watchTokensShipped / Math.max(1, workloadTokensShipped), 4),
      watch_token_share_whole_run:
        watchTokens === null ? null : round(watchTokens / Math.max(1, workload.tokens()), 4),
      watch_token_share_whole_run_counting_refused:
        watchTokens === null
          ? null
          : round((watchTokens + refusedTokens) / Math.max(1, workload.tokens()), 4),
      workload_outcomes_before_fault: JSON.stringify(outcomesBefore),
      workload_outcomes_after_fault: JSON.stringify(
        Object.fromEntries(
          Object.entries(outcomesAfter).map(([k, n]) => [k, n - (outcomesBefore[k] ?? 0)]),
        ),
      ),
      redeploy_downtime_s: round((faultOnMs - redeployed.stoppedAtMs) / 1000, 1),
    }
  } finally {
    await workload.stop()
    await watch.stop()
    await cluster.stop()
    if (options.keepLogs === true)
      process.stderr.write(`bench sentinel: ${fault}'s logs in ${dir}\n`)
    else rmSync(dir, { recursive: true, force: true })
  }
}

/** Sentinel log lines in `routerLog` (0 when there is no such file). */
function countSentinelEvents(routerLog: string): number {
  if (!existsSync(routerLog)) return 0
  return readFileSync(routerLog, 'utf8')
    .split('\n')
    .filter((l) => l.includes('"msg":"sentinel:')).length
}

/** The watch's `kvfence_watch_tokens_spent_total`, or null when its /metrics cannot be read. */
async function watchTokensSpent(watch: WatchChild): Promise<number | null> {
  const url = watch.metricsUrl()
  if (url === null) return null
  const text = await (await fetch(url)).text()
  const line = text.split('\n').find((l) => l.startsWith('kvfence_watch_tokens_spent_total'))
  return line === undefined ? null : Number(line.slice(line.lastIndexOf(' ') + 1))
}

function round(value: number, digits: number): number {
  return Number(value.toFixed(digits))
}

function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms))
}
