/** The single-process engine: prefill and decode in one pool, no transfer. It is the simplest tour of
 *  the engine API (`kvfence generate`) and the oracle the disaggregated path must match token for token.
 *  Knows token ids; knows nothing of tenants' keys, HTTP or text. */
import { KvfenceError } from '../common/errors.js'
import { forward } from '../model/forward.js'
import type { TokenLogprobs } from '../model/sampling.js'
import type { Sampling } from '../control/messages.js'
import { RequestSampler } from './request-sampler.js'
import { Sequence } from './sequence.js'
import type { WorkerCore } from './worker-core.js'

/** What {@link generateLocal} returns. */
export interface LocalResult {
  tokenIds: number[]
  finishReason: 'stop' | 'length'
  /** Per token of `tokenIds`, when `sampling.numLogprobs` is set; else absent. */
  logprobs?: TokenLogprobs[]
}

/** Prefill `promptTokenIds`, then generate up to `maxTokens` tokens (stopping after a stop token).
 *  Samples exactly as the disaggregated path does (the same {@link RequestSampler} pipeline: the
 *  first token with the `prefill` stream, the rest with the `decode` stream, penalties counting
 *  every generated token), so at temperature 0, or with a seed, both emit the same tokens and the
 *  same log-probabilities. Throws `context_length_exceeded` when prompt + max_tokens exceed the
 *  pool or the model's positions. */
export function generateLocal(
  core: WorkerCore,
  promptTokenIds: readonly number[],
  opts: { maxTokens: number; sampling: Sampling; stopTokenIds: readonly number[]; tenant?: string },
): LocalResult {
  const { pool, model, rope, maxSequenceTokens: limit } = core
  const numPromptTokens = promptTokenIds.length
  const total = numPromptTokens + opts.maxTokens
  if (total > limit) {
    throw new KvfenceError(
      'context_length_exceeded',
      `prompt of ${numPromptTokens} tokens + max_tokens ${opts.maxTokens} exceeds ${limit} tokens`,
      'max_tokens',
    )
  }
  const tenant = opts.tenant ?? 'local'
  const seq = new Sequence({
    id: 'local',
    tenant,
    promptTokenIds,
    sampling: opts.sampling,
    maxTokens: opts.maxTokens,
    stopTokenIds: new Set(opts.stopTokenIds),
    lease: pool.allocate(pool.pagesFor(total), core.nextOwner(), core.tenantId(tenant)),
  })
  try {
    let logits = forward(model, rope, pool, seq, promptTokenIds, 0)
    const first = new RequestSampler(seq.sampling, 'prefill').next(logits)
    const out = [first]
    const decode = new RequestSampler(seq.sampling, 'decode')
    decode.record(first.tokenId)
    const stop = seq.stopTokenIds
    let token = first.tokenId
    while (out.length < seq.maxTokens && !stop.has(token)) {
      logits = forward(model, rope, pool, seq, [token], numPromptTokens + out.length - 1)
      const next = decode.next(logits)
      token = next.tokenId
      out.push(next)
    }
    return {
      tokenIds: out.map((t) => t.tokenId),
      finishReason: stop.has(token) ? 'stop' : 'length',
      ...(opts.sampling.numLogprobs == null ? {} : { logprobs: out.map((t) => t.logprobs!) }),
    }
  } finally {
    pool.release(seq.lease)
  }
}
