/** What one tokenizer of the pool (tokenizer-pool.ts) does with one job, wherever it runs (a
 *  tokenizer process, tokenizer-process.ts, or a test's in-process stand-in): the prompt's token
 *  ids, only their number at `keepBelow` or more, or the error tokenizing threw.
 *  Knows the tokenizer and parsed requests; knows nothing of tenants, HTTP or workers. */
import { KvfenceError } from '../../common/errors.js'
import type { Tokenizer } from '../../model/tokenizer.js'
import { checkedPromptTokenIds } from './prompt-ids.js'
import type { ParsedRequest } from '../api/schemas.js'

/** A job for one of the pool's tokenizers: keep the ids only below `keepBelow` tokens. */
export interface TokenizerJob {
  id: number
  parsed: ParsedRequest
  keepBelow: number
}

/** A tokenizer's answer: the ids of job `id` (or only their number, when not kept), or the error
 *  it threw. */
export type TokenizerReply =
  | { id: number; tokenIds: Int32Array }
  | { id: number; numTokens: number }
  | { id: number; error: { code: string; message: string; param: string | null } }

/** Answers `job` with `tokenizer`; never throws (an error is the reply). */
export function answerJob(
  tokenizer: Tokenizer,
  { id, parsed, keepBelow }: TokenizerJob,
): TokenizerReply {
  try {
    const ids = checkedPromptTokenIds(tokenizer, parsed)
    return ids.length >= keepBelow
      ? { id, numTokens: ids.length }
      : { id, tokenIds: Int32Array.from(ids) }
  } catch (err) {
    const e =
      err instanceof KvfenceError ? err : new KvfenceError('internal_error', String(err), null)
    return { id, error: { code: e.code, message: e.message, param: e.param } }
  }
}
