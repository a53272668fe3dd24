/** A tokenizer pool's thread (tokenizer-pool.ts): loads the model directory's tokenizer once,
 *  then answers each `{ id, parsed }` with the prompt's token ids or the error it threw.
 *  Knows the tokenizer and parsed requests; knows nothing of tenants, HTTP or workers. */
import { parentPort, workerData } from 'node:worker_threads'
import { KvfenceError } from '../errors.js'
import { loadTokenizer } from '../model/tokenizer.js'
import type { ParsedRequest } from './schemas.js'
import { type ThreadReply, checkedPromptTokenIds } from './tokenizer-pool.js'

/** Serves the pool on `port` (the thread's entry point). */
function serve(port: NonNullable<typeof parentPort>, modelDir: string): void {
  const tokenizer = loadTokenizer(modelDir)
  port.on('message', ({ id, parsed }: { id: number; parsed: ParsedRequest }) => {
    let reply: ThreadReply
    try {
      const tokenIds = Int32Array.from(checkedPromptTokenIds(tokenizer, parsed))
      port.postMessage({ id, tokenIds } satisfies ThreadReply, [tokenIds.buffer])
      return
    } catch (err) {
      const e =
        err instanceof KvfenceError ? err : new KvfenceError('internal_error', String(err), null)
      reply = { id, error: { code: e.code, message: e.message, param: e.param } }
    }
    port.postMessage(reply)
  })
}

if (parentPort !== null) serve(parentPort, (workerData as { modelDir: string }).modelDir)
