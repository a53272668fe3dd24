/** SIGINT/SIGTERM for a command that starts child processes itself (`kvfence demo`, `kvfence
 *  soak`): every child still running is stopped (SIGTERM, SIGKILL after a grace), then this process
 *  exits with the conventional code (130 / 143) and one line saying so. Node's default would end
 *  only this process: the workers, routers and watch it started were left running under PID 1.
 *  The children are read from /proc (Linux), so that a part still starting (not yet handed to
 *  its caller) is stopped too. Knows processes and signals; knows nothing of what the children do. */
import { readdirSync, readFileSync } from 'node:fs'
import { setTimeout as sleep } from 'node:timers/promises'

/** How long stopped children may take after SIGTERM before SIGKILL, ms: a router drains on SIGTERM,
 *  and an interrupted command has no requests worth finishing. */
export const childStopGraceMs = 3_000

/** Exit codes by signal: 128 + its number. */
const exitCodes = { SIGINT: 130, SIGTERM: 143 } as const

/** Ids of the processes whose parent is `pid`, from /proc (empty where /proc is not). */
export function childPids(pid: number = process.pid): number[] {
  let entries: string[]
  try {
    entries = readdirSync('/proc')
  } catch {
    return []
  }
  const pids: number[] = []
  for (const entry of entries) {
    if (!/^\d+$/.test(entry)) continue
    try {
      // `pid (comm) state ppid …`: comm may hold spaces and parentheses, so split after the last ')'.
      const stat = readFileSync(`/proc/${entry}/stat`, 'utf8')
      const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ')
      if (Number(fields[1]) === pid && fields[0] !== 'Z') pids.push(Number(entry))
    } catch {
      // It exited while being read.
    }
  }
  return pids
}

/** SIGTERM to every child of this process, SIGKILL after `graceMs` to those still running; resolves
 *  once none is left (a child started meanwhile is stopped too). */
export async function stopChildren(graceMs = childStopGraceMs): Promise<void> {
  const deadline = Date.now() + graceMs
  const signalled = new Set<number>()
  for (;;) {
    const pids = childPids()
    if (pids.length === 0) return
    const signal = Date.now() > deadline ? 'SIGKILL' : 'SIGTERM'
    for (const pid of pids) {
      if (signal === 'SIGTERM' && signalled.has(pid)) continue
      signalled.add(pid)
      try {
        process.kill(pid, signal)
      } catch {
        // Gone already.
      }
    }
    // Node reaps its children (and so drops them from /proc) while this loop sleeps.
    await sleep(50)
  }
}

/** On SIGINT or SIGTERM: stop every child ({@link stopChildren}), write `NAME: stopped by SIGNAL`
 *  to stderr and exit with 130 / 143. A second signal while stopping is ignored (the children get
 *  their SIGKILL after the grace anyway). Temporary folders are removed by the 'exit' listeners of
 *  whoever made them. */
export function exitOnStopSignals(name: string): void {
  const onSignal = (signal: keyof typeof exitCodes) => {
    if (stopping !== null) return
    stopping = stopChildren().then(() => {
      process.stderr.write(`${name}: stopped by ${signal}\n`)
      process.exit(exitCodes[signal])
    })
  }
  process.on('SIGINT', () => onSignal('SIGINT'))
  process.on('SIGTERM', () => onSignal('SIGTERM'))
}

/** Set once a stop signal arrived; settles only by exiting. */
let stopping: Promise<never> | null = null

/** The exit a stop signal has begun ({@link exitOnStopSignals}), or null when none arrived. A
 *  command that expects a failure (the demo's G1 refusal) awaits it before reading a failure as
 *  its own: a part stopped under it fails too. */
export function stopInProgress(): Promise<never> | null {
  return stopping
}

/** Runs `command`; if it fails after a stop signal (its children were stopped under it), waits for
 *  the signal's exit instead of reporting that failure as the command's error. */
export async function unlessStopped<T>(command: () => Promise<T>): Promise<T> {
  try {
    return await command()
  } catch (err) {
    if (stopping !== null) return stopping
    throw err
  }
}
