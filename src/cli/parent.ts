/** A part's link to the process that forked it (`kvfence serve`, a test, a supervisor using
 *  Node's IPC): report ready over the IPC channel, and stop when that channel closes, so that a
 *  part never outlives its parent. Without it, `kill -9` of `serve` left the router and both
 *  workers running with parent PID 1, holding their ports.
 *  Knows Node's IPC channel; knows nothing of what the part serves. */

/** Exits (code 1) if the parent's IPC channel closes while this part is still starting: a part
 *  whose parent died mid-start has no one to report to and must not linger (a router waiting for
 *  its workers outlived a killed `serve` by ~10 s). {@link reportReadyToParent} replaces it with
 *  the part's own shutdown once it is ready. No-op without IPC. */
export function exitIfParentGoesDuringStart(): void {
  if (process.send === undefined) return
  if (!process.connected) process.exit(1)
  process.once('disconnect', exitDuringStart)
}

function exitDuringStart(): void {
  process.exit(1)
}

/** Send `message` to the parent when this process was forked with an IPC channel, and call
 *  `onParentGone` once if that channel is closed now or closes later (the parent exited, was
 *  killed, or disconnected). A process started without IPC (from a shell) does nothing here. */
export function reportReadyToParent(message: object, onParentGone: () => void): void {
  if (process.send === undefined) return
  process.removeListener('disconnect', exitDuringStart)
  let isGone = false
  const gone = () => {
    if (isGone) return
    isGone = true
    onParentGone()
  }
  if (!process.connected) return gone()
  process.once('disconnect', gone)
  // With a callback a closed channel is reported here instead of as an uncaught error.
  process.send(message, (err: Error | null) => {
    if (err) gone()
  })
}

/** Calls `stop` on SIGTERM, and on SIGINT unless this part was started by a parent over IPC
 *  (`kvfence serve`, a supervisor using Node's IPC). A terminal's Ctrl-C sends SIGINT to every
 *  process of its foreground group; the parent owns the order of the shutdown (the router drains,
 *  then the workers stop) and signals its parts with SIGTERM. A part acting on the terminal's
 *  SIGINT too would break that order: the workers would exit under the draining router's streams,
 *  and the router would take the parent's SIGTERM as a second signal and stop at once. A part
 *  started from a shell (no IPC) stops on either signal; one whose parent dies stops through
 *  {@link reportReadyToParent}. */
export function onStopSignals(stop: () => void): void {
  process.on('SIGTERM', stop)
  // Ignored, not left to Node's default (exit) when a parent owns the shutdown.
  process.on('SIGINT', process.send === undefined ? stop : () => {})
}
