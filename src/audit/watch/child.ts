/** `kvfence watch` as a child process of the demo and the bench: started with monitoring tenants'
 *  keys in its environment (never on its command line), its JSON log lines (stdout) kept as they
 *  come, its `/metrics` URL from its start-up line, and stopped with SIGTERM as a service manager
 *  would. Knows the watch's flags and log shape; knows nothing of what it watches. */
import { spawn } from 'node:child_process'
import { writeFileSync } from 'node:fs'
import { watchDefaults } from './options.js'
import { cliEntry } from '../../common/paths.js'

/** One pino line of the watch's log (`time` in ms since the epoch). */
export type WatchLogLine = Record<string, unknown> & { msg: string; time: number }

/** A running watch child. */
export interface WatchChild {
  readonly pid: number | undefined
  /** Every log line so far. */
  readonly lines: readonly WatchLogLine[]
  /** Cycles completed so far (its `cycle` log lines). */
  numCycles(): number
  /** Findings announced so far (its `finding` log lines: one per new finding). */
  numFindings(): number
  /** The first `finding` line for which `isWanted` holds, or null. */
  firstFinding(isWanted?: (line: WatchLogLine) => boolean): WatchLogLine | null
  /** The `/metrics` URL of its start-up line, or null before that line. */
  metricsUrl(): string | null
  /** SIGTERM (SIGKILL after 5 s), waits for the exit, then writes the log to `logFile`. */
  stop(): Promise<void>
}

/** Starts `kvfence watch` against `target` with `tenants` (name → key) at `cycleSeconds`, its
 *  hourly token and request budgets the defaults scaled by 30 s ÷ `cycleSeconds` so that a
 *  shorter cycle runs the same probes per cycle (docs/monitoring.md: a shorter cycle needs a
 *  larger budget); `/metrics` on a free port. */
export function startWatchChild(options: {
  target: string
  tenants: Readonly<Record<string, string>>
  cycleSeconds: number
  logFile: string
  seed?: number
  /** Its `--log-level` (default its own, info). */
  logLevel?: string
}): WatchChild {
  const scale = watchDefaults.cycleSeconds / options.cycleSeconds
  const env: NodeJS.ProcessEnv = { ...process.env }
  const tenantArgs = Object.entries(options.tenants).flatMap(([name, key], i) => {
    env[`KVFENCE_WATCH_KEY_${i}`] = key
    return ['--tenant', `${name}=env:KVFENCE_WATCH_KEY_${i}`]
  })
  const child = spawn(
    process.execPath,
    [
      cliEntry,
      'watch',
      '--target',
      options.target,
      ...tenantArgs,
      '--cycle-seconds',
      String(options.cycleSeconds),
      '--max-tokens-per-hour',
      String(Math.round(watchDefaults.maxTokensPerHour * scale)),
      '--max-requests-per-hour',
      String(Math.round(watchDefaults.maxRequestsPerHour * scale)),
      '--metrics-port',
      '0',
      ...(options.seed === undefined ? [] : ['--seed', String(options.seed)]),
      ...(options.logLevel === undefined ? [] : ['--log-level', options.logLevel]),
    ],
    { env, stdio: ['ignore', 'pipe', 'pipe'] },
  )
  const lines: WatchLogLine[] = []
  let buffered = ''
  let text = ''
  child.stdout.setEncoding('utf8').on('data', (chunk: string) => {
    text += chunk
    buffered += chunk
    const parts = buffered.split('\n')
    buffered = parts.pop() ?? ''
    for (const part of parts) {
      if (part.startsWith('{')) lines.push(JSON.parse(part) as WatchLogLine)
    }
  })
  child.stderr.setEncoding('utf8').on('data', (chunk: string) => (text += chunk))
  const exited = new Promise<void>((resolve) => child.once('exit', () => resolve()))
  const findings = () => lines.filter((l) => l.msg === 'finding')
  return {
    pid: child.pid,
    lines,
    numCycles: () => lines.filter((l) => l.msg === 'cycle').length,
    numFindings: () => findings().length,
    firstFinding: (isWanted = () => true) => findings().find(isWanted) ?? null,
    metricsUrl: () => {
      const start = lines.find((l) => typeof l.metrics === 'string')
      return start === undefined ? null : String(start.metrics)
    },
    async stop() {
      if (child.exitCode === null && child.signalCode === null) child.kill('SIGTERM')
      const timer = setTimeout(() => child.kill('SIGKILL'), 5_000)
      await exited
      clearTimeout(timer)
      writeFileSync(options.logFile, text)
    },
  }
}
