/** Processes in tests: whether one still runs, for tests that check what a stopped or killed part
 *  leaves behind, and the whole log of a stopped part. Not a test file itself. */
import type { ChildProcess } from 'node:child_process'
import { readFileSync } from 'node:fs'
import { stopAll } from '../../src/engine/processes.js'
import { waitUntil } from './poll.js'

/** Whether process `pid` exists (signal 0 probes without signalling). `pid` must be a real
 *  process id: 0 or a negative number would probe a whole process group. */
export function isRunning(pid: number): boolean {
  if (!Number.isInteger(pid) || pid <= 0) throw new RangeError(`not a process id: ${pid}`)
  try {
    process.kill(pid, 0)
    return true
  } catch {
    return false
  }
}

/** Stops the parts in `started` and returns the whole log `forkPart` wrote to `logFile` once it
 *  has ended (its last line is the parent's "ended (…)"). A part's ready message comes over IPC
 *  and its log lines over a stdout pipe, so a log read while the part runs may miss lines it has
 *  already written (CI read an empty log once; a full run missed a router's error line). */
export async function stoppedPartLog(started: ChildProcess[], logFile: string): Promise<string> {
  await stopAll(started)
  await waitUntil(() => readFileSync(logFile, 'utf8').includes('ended ('), {
    timeoutMs: 10_000,
    intervalMs: 50,
    what: 'the log of the stopped part ends',
  })
  return readFileSync(logFile, 'utf8')
}
