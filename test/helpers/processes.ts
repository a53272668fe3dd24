/** Whether a process still runs, for tests that check what a stopped or killed part leaves
 *  behind. Not a test file itself. */

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
