/** The single-process engine: prefill and decode in one pool, no transfer. It is the simplest tour of
 *  the engine API (`kvfence generate`) and the oracle the disaggregated path must match token for token.
 *  Knows token ids; knows nothing of tenants' keys, HTTP or text. */
import { randomBytes } from 'node:crypto'
import { KvfenceError } from '../errors.js'
import { forward } from '../model/forward.js'
import { makeRandom, sample } from '../model/sampling.js'
import type { Sampling } from './control.js'
import type { WorkerCore } from './worker-core.js'

/** What {@link generateLocal} returns. */
export interface LocalResult {
  tokenIds: number[]
  finishReason: 'stop' | 'length'
}

/** Prefill `promptTokenIds`, then generate up to `maxTokens` tokens (stopping after a stop token).
 *  Samples exactly as the disaggregated path does (prefill draws with `seed`, decode with `seed + 1`),
 *  so at temperature 0, or with a seed, both emit the same tokens. Throws `context_length_exceeded`
 *  when prompt + max_tokens exceed the pool or the model's positions. */
export function generateLocal(
  core: WorkerCore,
  promptTokenIds: readonly number[],
  opts: { maxTokens: number; sampling: Sampling; stopTokenIds: readonly number[]; tenant?: string },
): LocalResult {
  const { pool, model, rope } = core
  const total = promptTokenIds.length + opts.maxTokens
  const limit = Math.min(pool.capacityTokens, model.config.maxPositionEmbeddings)
  if (total > limit) {
    throw new KvfenceError(
      'context_length_exceeded',
      `prompt of ${promptTokenIds.length} tokens + max_tokens ${opts.maxTokens} exceeds ${limit} tokens`,
      'max_tokens',
    )
  }
  const owner = core.nextOwner()
  const pageTable = pool.allocate(
    pool.pagesFor(total),
    owner,
    core.tenantId(opts.tenant ?? 'local'),
  )
  try {
    const seq = { pageTable, owner }
    const seed = opts.sampling.seed ?? randomBytes(4).readUInt32LE()
    const params = { temperature: opts.sampling.temperature, topP: opts.sampling.topP }
    let logits = forward(model, rope, pool, seq, promptTokenIds, 0)
    let token = sample(logits, { ...params, random: makeRandom(seed) })
    const out = [token]
    const stop = new Set(opts.stopTokenIds)
    const random = makeRandom(
      opts.sampling.seed === null ? randomBytes(4).readUInt32LE() : opts.sampling.seed + 1,
    )
    while (out.length < opts.maxTokens && !stop.has(token)) {
      logits = forward(model, rope, pool, seq, [token], promptTokenIds.length + out.length - 1)
      token = sample(logits, { ...params, random })
      out.push(token)
    }
    return { tokenIds: out, finishReason: stop.has(token) ? 'stop' : 'length' }
  } finally {
    pool.release(pageTable, owner)
  }
}
