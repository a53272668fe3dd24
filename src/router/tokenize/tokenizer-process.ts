/** A tokenizer pool's process (tokenizer-pool.ts): lowers its own scheduling priority, loads the
 *  model directory's tokenizer once, says it is ready, then answers each {@link TokenizerJob}
 *  with the prompt's token ids (only their number at `keepBelow` or more) or the error it threw.
 *  Run by `fork` with V8's `--single-threaded-gc`, so that all its work (its garbage collection
 *  too) runs on its one niced thread.
 *  Knows the tokenizer and parsed requests; knows nothing of tenants, HTTP or workers. */
import { setPriority } from 'node:os'
import { loadTokenizer } from '../../model/tokenizer.js'
import { type TokenizerJob, type TokenizerReply, answerJob } from './tokenizer-job.js'
import { tokenizerNiceness } from './tokenizer-pool.js'

/** Serves the pool over the IPC channel (the process's entry point). */
function serve(modelDir: string): void {
  // The router gone (its channel closed): nothing is left to answer.
  process.once('disconnect', () => process.exit(0))
  // Ignored: Ctrl-C reaches the whole process group (and systemd's stop the whole cgroup), and
  // the prompt held here must still be answered while the router drains. The router ends this
  // process (SIGKILL), or its going does (above).
  for (const signal of ['SIGINT', 'SIGTERM'] as const) process.on(signal, () => {})
  const send = (message: TokenizerReply | { ready: true }) => {
    // A send failing on a channel closing under it is that same end, not an error to throw.
    if (process.connected) process.send!(message, undefined, undefined, () => {})
  }
  try {
    // Below the router's loop: a long prompt's tokenizing yields the CPU to the loop's turns.
    setPriority(0, tokenizerNiceness)
  } catch {
    // Not allowed here (a sandbox): the process still keeps its load off the router's thread.
  }
  const tokenizer = loadTokenizer(modelDir)
  process.on('message', (job: TokenizerJob) => send(answerJob(tokenizer, job)))
  send({ ready: true })
}

const modelDir = process.argv[2]
if (process.send !== undefined && modelDir !== undefined) serve(modelDir)
