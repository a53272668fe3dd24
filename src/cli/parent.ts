/** A part's link to the process that forked it (`kvfence serve`, a test, a supervisor using
 *  Node's IPC): report ready over the IPC channel, and stop when that channel closes, so that a
 *  part never outlives its parent. Without it, `kill -9` of `serve` left the router and both
 *  workers running with parent PID 1, holding their ports.
 *  Knows Node's IPC channel; knows nothing of what the part serves. */

/** Send `message` to the parent when this process was forked with an IPC channel, and call
 *  `onParentGone` once if that channel is closed now or closes later (the parent exited, was
 *  killed, or disconnected). A process started without IPC (from a shell) does nothing here. */
export function reportReadyToParent(message: object, onParentGone: () => void): void {
  if (process.send === undefined) return
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
