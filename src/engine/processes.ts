/** Forking kvfence parts (`kvfence prefill|decode|router …`) as child processes, waiting for the
 *  ready message each sends over IPC once listening, and stopping them again. Used by the cluster
 *  launcher (config/launch.ts); knows nothing of the parts' flags or of requests. */
import { fork, type ChildProcess } from 'node:child_process'
import { createWriteStream } from 'node:fs'
import { dirname } from 'node:path'
import { makeDir } from '../common/make-dir.js'
import { cliEntry } from '../common/paths.js'

/** What a part sends its parent once listening (src/cli/worker.ts, src/cli/router.ts); parts add
 *  more fields (role, transferPort, …). */
export interface ReadyMessage {
  type: 'ready'
  /** The port it listens on. */
  port: number
}

/** Why a part failed to start: it did not report ready in time, or it exited first. */
export type StartFailure = { kind: 'timeout' } | { kind: 'exit'; code: number | null }

/** Options of {@link forkPart}. */
export interface ForkPartOptions {
  env: NodeJS.ProcessEnv
  /** Write the part's stdout and stderr to this file (its folder is made) instead of inheriting
   *  this process's; its last lines then reach `failure`. */
  logFile?: string
  /** How long the part may take to report ready (ms). */
  timeoutMs: number
  /** The error to reject with; `lastLine` is the last log line worth showing (an error if any),
   *  only when `logFile` is set. */
  failure(why: StartFailure, lastLine: string | undefined): Error
}

/** The node flags a part inherits from this process: all but the debugger's (`--inspect*`: every
 *  child would clash on the debug port), the test runner's (`--test*`: a part is not a test file)
 *  and code given on the command line (`-e`/`--eval`/`-p`/`--print` and their script, `-pe`,
 *  `--input-type`): a child would run that code again instead of the part, and a script that
 *  starts parts would start them without end. */
export function partExecArgv(execArgv: readonly string[]): string[] {
  const kept: string[] = []
  for (let i = 0; i < execArgv.length; i++) {
    const a = execArgv[i]
    if (/^--(inspect|test|debug)/.test(a)) continue
    if (/^--(eval|print|input-type)=/.test(a)) continue
    if (/^(-e|-p|-pe|-ep|--eval|--print|--input-type)$/.test(a)) {
      // `--print` may stand alone before `-e`; the others take the next argument as their value.
      if (a !== '--print' && a !== '-p') i++
      else if (i + 1 < execArgv.length && !execArgv[i + 1].startsWith('-')) i++
      continue
    }
    kept.push(a)
  }
  return kept
}

/** Forks `kvfence ...args` and resolves with the child and its ready message. The child is pushed
 *  onto `started` at once, so the caller can stop it (with {@link stopAll}) on any failure.
 *  Rejects with `opts.failure(...)` if the part exits or does not report ready in time. */
export function forkPart(
  args: readonly string[],
  opts: ForkPartOptions,
  started: ChildProcess[],
): Promise<{ child: ChildProcess; ready: ReadyMessage }> {
  const toFile = opts.logFile !== undefined
  const child = fork(cliEntry, args, {
    env: opts.env,
    execArgv: partExecArgv(process.execArgv),
    stdio: toFile ? ['ignore', 'pipe', 'pipe', 'ipc'] : ['ignore', 'inherit', 'inherit', 'ipc'],
  })
  started.push(child)
  // The last few lines, so that a failure to start can say why.
  const tail: string[] = []
  if (toFile) {
    makeDir(dirname(opts.logFile!))
    const log = createWriteStream(opts.logFile!)
    for (const stream of [child.stdout!, child.stderr!]) {
      stream.on('data', (chunk: Buffer) => {
        log.write(chunk)
        tail.push(...chunk.toString('utf8').split('\n').filter(Boolean))
        tail.splice(0, Math.max(0, tail.length - 5))
      })
    }
    // A part killed by a signal (or a native crash) writes nothing itself: say how it ended, after
    // whatever it wrote last ('close' follows the end of its output).
    child.once('close', (code, signal) => {
      log.end(
        `kvfence: process ${child.pid} ended (${signal ? `signal ${signal}` : `exit code ${code}`})\n`,
      )
    })
  }
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => fail({ kind: 'timeout' }), opts.timeoutMs)
    const fail = (why: StartFailure) => {
      clearTimeout(timer)
      const last = tail.find((l) => /error|refus|exceed/i.test(l)) ?? tail.at(-1)
      reject(opts.failure(why, last === undefined ? undefined : oneLine(last)))
    }
    child.once('exit', (code) => fail({ kind: 'exit', code }))
    child.on('message', (msg: Partial<ReadyMessage> | undefined) => {
      if (msg?.type !== 'ready' || msg.port === undefined) return
      clearTimeout(timer)
      child.removeAllListeners('exit')
      resolve({ child, ready: msg as ReadyMessage })
    })
  })
}

/** A log line (pino JSON or text) reduced to its message. */
function oneLine(line: string): string {
  try {
    const parsed = JSON.parse(line) as { msg?: string }
    return parsed.msg ?? line
  } catch {
    return line
  }
}

/** How long a part stopped by {@link stopAll} may take after SIGTERM before SIGKILL, ms. */
export const defaultStopGraceMs = 3_000

/** Stops child processes: SIGTERM, then SIGKILL after `graceMs` (default
 *  {@link defaultStopGraceMs}; a draining router needs its drain time); resolves when every one
 *  has exited. */
export async function stopAll(
  children: readonly ChildProcess[],
  graceMs = defaultStopGraceMs,
): Promise<void> {
  await Promise.all(
    children.map(
      (child) =>
        new Promise<void>((resolve) => {
          if (child.exitCode !== null || child.signalCode !== null) return resolve()
          const timer = setTimeout(() => child.kill('SIGKILL'), graceMs)
          child.once('exit', () => {
            clearTimeout(timer)
            resolve()
          })
          child.kill('SIGTERM')
        }),
    ),
  )
}
