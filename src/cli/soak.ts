/** `kvfence soak`: start a cluster on loopback and drive it with K tenants sending random prompts,
 *  aborts and disconnects for a bounded time; check every answer against the single-process oracle
 *  and every other tenant's canaries; sample RSS and pool usage; write the JSON report. Exit code 1
 *  when an invariant breaks (contamination, oracle mismatch, page leak, hang, RSS growth), 2 for a
 *  tool error (one line on stderr), 0 otherwise. Never prints a key, a prompt or a completion. */
import { writeFileSync } from 'node:fs'
import { InvalidArgumentError, type Command } from 'commander'
import { bundledModelDir } from '../common/paths.js'
import {
  runSoak,
  soakDefaults,
  soakSentinelWindowSeconds,
  startSoakCluster,
  type SoakReport,
} from '../soak/index.js'
import { intOption, intRangeOption, secondsOption } from './options.js'
import { exitOnStopSignals, unlessStopped } from './stop-children.js'

interface SoakFlags {
  minutes?: number
  seconds?: number
  tenants: number
  loops: number
  maxRequests: number
  seed: number
  warmup: number
  json?: string
  model: string
  logDir?: string
  watchCycleSeconds: number
  sentinelWindowSeconds?: number
}

/** Parse a positive decimal number flag value (minutes may be fractional). */
function positiveNumber(value: string): number {
  const n = Number(value)
  if (!/^\d+(\.\d+)?$/.test(value) || !(n > 0))
    throw new InvalidArgumentError(`expected a positive number, got "${value}"`)
  return n
}

/** Parse a fraction in [0, 0.8] (the RSS windows need the rest of the run). */
function fraction(value: string): number {
  const n = Number(value)
  if (!/^\d*\.?\d+$/.test(value) || !(n >= 0 && n <= 0.8))
    throw new InvalidArgumentError(`expected a fraction between 0 and 0.8, got "${value}"`)
  return n
}

/** Register `kvfence soak`. */
export function registerSoak(program: Command): void {
  program
    .command('soak')
    .description(
      'soak a local cluster: tenants, random prompts, aborts and disconnects; check every answer (oracle, canaries), pool drain and RSS',
    )
    .option('--minutes <n>', 'how long to send load (fractions allowed)', positiveNumber)
    .option(
      '--seconds <n>',
      'how long to send load, in seconds (instead of --minutes)',
      positiveNumber,
    )
    .option('--tenants <k>', 'number of tenants (≥ 2)', intOption, soakDefaults.numTenants)
    .option(
      '--loops <n>',
      'concurrent request loops per tenant',
      intOption,
      soakDefaults.loopsPerTenant,
    )
    .option(
      '--max-requests <n>',
      'stop after this many requests',
      intOption,
      soakDefaults.maxRequests,
    )
    .option('--seed <n>', 'seed of every random choice', intOption, soakDefaults.seed)
    .option(
      '--warmup <fraction>',
      'share of the load window whose RSS is ignored (V8 heaps grow to their steady size first)',
      fraction,
      soakDefaults.warmupFraction,
    )
    .option('--json <file>', 'write the JSON report here')
    .option(
      '--model <dir>',
      'model directory served by the cluster and loaded by the oracle',
      bundledModelDir,
    )
    .option('--log-dir <dir>', 'keep the cluster parts’ logs in this folder')
    .option(
      '--watch-cycle-seconds <s>',
      'run kvfence watch (two canary tenants) against the cluster at this cycle; 0: no watch',
      secondsOption,
      30,
    )
    .option(
      '--sentinel-window-seconds <n>',
      'the router sentinel’s window (default: the warm-up, 30 to 600 s, so its bounded memory is full before RSS is judged)',
      intRangeOption(1, 86_400),
    )
    .action(async (flags: SoakFlags) => {
      if (flags.tenants < 2) throw new Error(`--tenants must be at least 2, got ${flags.tenants}`)
      if (flags.loops < 1) throw new Error(`--loops must be at least 1, got ${flags.loops}`)
      if (flags.minutes !== undefined && flags.seconds !== undefined)
        throw new Error('give --minutes or --seconds, not both')
      const durationMs =
        flags.seconds !== undefined
          ? flags.seconds * 1000
          : (flags.minutes ?? soakDefaults.durationMs / 60_000) * 60_000
      const log = (line: string) => process.stderr.write(`${line}\n`)
      exitOnStopSignals('kvfence soak')
      const soak = await unlessStopped(() =>
        startSoakCluster({
          modelDir: flags.model,
          numTenants: flags.tenants,
          keepLogsIn: flags.logDir,
          watchCycleSeconds: flags.watchCycleSeconds,
          sentinelWindowSeconds:
            flags.sentinelWindowSeconds ?? soakSentinelWindowSeconds(durationMs, flags.warmup),
        }),
      )
      let report: SoakReport
      try {
        log(
          `soak: cluster up at ${soak.cluster.routerUrl}; ${flags.tenants} tenants for ${Math.round(durationMs / 1000)} s`,
        )
        report = await unlessStopped(() =>
          runSoak(
            soak.target,
            {
              ...soakDefaults,
              durationMs,
              numTenants: flags.tenants,
              loopsPerTenant: flags.loops,
              maxRequests: flags.maxRequests,
              seed: flags.seed,
              warmupFraction: flags.warmup,
            },
            log,
          ),
        )
      } finally {
        await soak.stop()
      }
      if (flags.json) writeFileSync(flags.json, `${JSON.stringify(report, null, 2)}\n`)
      process.stdout.write(summary(report))
      if (!report.ok) process.exitCode = 1
    })
}

/** The report in a few lines for a terminal. */
function summary(r: SoakReport): string {
  const errors = Object.entries(r.errors)
    .map(([k, v]) => `${k} ${v}`)
    .join(', ')
  return [
    `soak ${r.ok ? 'PASSED' : 'FAILED'}: ${r.requests} requests in ${r.duration_s} s, ${r.tenants} tenants`,
    `  completed ${r.completed} (streamed ${r.streamed} of all), rejected over context ${r.rejected_over_context}, aborted ${r.aborts.client_abort}, disconnected ${r.aborts.client_disconnect}`,
    `  errors: ${errors || 'none'}`,
    `  contaminated ${r.contaminated_responses}, oracle mismatches ${r.oracle_mismatches}, over-context answered ${r.over_context_accepted}, hung ${r.hung_requests}`,
    `  page leaks ${r.page_leaks} (max used: prefill ${r.max_pages_used.prefill}, decode ${r.max_pages_used.decode}), RSS growth ${r.rss_growth_ratio}${r.rss_judged ? '' : ' (not judged: run ≥ 3 minutes)'} (${r.rss_mb.after_warmup} → ${r.rss_mb.at_end} MB)`,
    `  false alarms: sentinel ${r.sentinel === null ? 'unread' : `${r.sentinel.suspected} suspected, ${r.sentinel.confirmed} confirmed`}, watch ${r.watch === null ? 'not run' : `${r.watch.findings} findings in ${r.watch.cycles} cycles`}`,
    `  heap retained after major GCs (reported, not judged): ${heapLine(r) || 'fewer than 3 collections after warm-up'}`,
    ...r.failures.map((f) => `  FAIL: ${f}`),
    '',
  ].join('\n')
}

/** `prefill 18.1 → 18.3 MB (+0.03 MB/min, 6 GCs), …` for processes with a fitted line. */
function heapLine(r: SoakReport): string {
  return Object.entries(r.heap_after_gc_mb)
    .filter(([, h]) => h.collections >= 3)
    .map(
      ([name, h]) =>
        `${name} ${h.after_warmup} → ${h.at_end} MB (${h.slope_mb_per_min >= 0 ? '+' : ''}${h.slope_mb_per_min} MB/min, ${h.collections} GCs)`,
    )
    .join(', ')
}
