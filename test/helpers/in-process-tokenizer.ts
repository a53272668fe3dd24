/** A router tokenizer that runs in the test's own process: the same {@link answerJob} as a
 *  tokenizer process (src/router/tokenize/tokenizer-process.ts), answered on a later turn of the
 *  event loop as a process's message would be, so that a router test exercises the pool's queue,
 *  turns and abort handling without starting a process (and so counts in the unit tier,
 *  scripts/tiers.ts). What only a process shows (its own thread and priority, SIGKILL, a parent
 *  killed) is tested with `forkTokenizer` in test/router/tokenize/tokenizer-pool.test.ts.
 *  Not a test file itself. */
import { loadTokenizer } from '../../src/model/tokenizer.js'
import { answerJob } from '../../src/router/tokenize/tokenizer-job.js'
import type { StartTokenizer, TokenizerChild } from '../../src/router/tokenize/tokenizer-pool.js'

/** Starts an in-process tokenizer for `modelDir`; see {@link StartTokenizer}. Killing it ends it
 *  as SIGKILL ends a process: jobs sent after are never answered, and `gone` says
 *  `exited (SIGKILL)`. */
export const inProcessTokenizer: StartTokenizer = (modelDir, events): TokenizerChild => {
  let isGone = false
  let markExited: () => void = () => {}
  const exited = new Promise<void>((resolve) => (markExited = resolve))
  // Loaded now, as a process loads it before its first answer; a bad directory ends it as a
  // process that failed to start does.
  let tokenizer: ReturnType<typeof loadTokenizer> | null = null
  let loadError: string | null = null
  try {
    tokenizer = loadTokenizer(modelDir)
  } catch (err) {
    loadError = err instanceof Error ? err.message : String(err)
  }
  const end = (how: string) => {
    if (isGone) return
    isGone = true
    markExited()
    setImmediate(() => events.gone(how))
  }
  setImmediate(() => {
    if (isGone) return
    if (tokenizer === null) end(`exited (code 1: ${loadError})`)
    else events.message({ ready: true })
  })
  return {
    send(job) {
      if (isGone || tokenizer === null) return
      const t = tokenizer
      setImmediate(() => {
        if (!isGone) events.message(answerJob(t, job))
      })
    },
    hold: () => {}, // it holds no handle of its own: a pending answer is a queued callback
    kill: () => end('exited (SIGKILL)'),
    hasExited: () => isGone,
    exited,
  }
}
