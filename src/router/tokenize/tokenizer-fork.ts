/** The router's tokenizers as child processes (tokenizer-process.ts), one per member of the pool
 *  (tokenizer-pool.ts says why processes and not threads): forked with V8's
 *  `--single-threaded-gc`, over an IPC channel with the `advanced` serialization (the ids come
 *  back as an Int32Array, not a JSON array). The one module of the pool that starts processes, so
 *  that what only needs the pool's queueing (tests, with an in-process tokenizer) starts none.
 *  Knows Node's child processes; knows nothing of prompts or tenants. */
import { fork } from 'node:child_process'
import type { StartTokenizer, TokenizerChild } from './tokenizer-pool.js'

/** Forks one tokenizer process for `modelDir`; see {@link StartTokenizer}. */
export const forkTokenizer: StartTokenizer = (modelDir, events): TokenizerChild => {
  const child = fork(new URL('./tokenizer-process.js', import.meta.url), [modelDir], {
    execArgv: ['--single-threaded-gc'],
    serialization: 'advanced',
    stdio: ['ignore', 'ignore', 'inherit', 'ipc'],
  })
  const exited = new Promise<void>((resolve) => child.once('exit', () => resolve()))
  child.on('message', events.message)
  child.on('error', (err) => events.gone(`failed: ${err.message}`))
  child.on('exit', (code, signal) =>
    events.gone(`exited (${signal ?? `code ${code ?? 'unknown'}`})`),
  )
  return {
    send: (job) => child.send(job),
    hold(isHeld) {
      // Both handles: its channel, and the process itself, whose exit is what answers a prompt
      // when it dies (its channel closes first).
      if (isHeld) {
        child.ref()
        child.channel?.ref()
      } else {
        child.unref()
        child.channel?.unref()
      }
    },
    kill: () => void child.kill('SIGKILL'),
    hasExited: () => child.exitCode !== null || child.signalCode !== null,
    exited,
  }
}
