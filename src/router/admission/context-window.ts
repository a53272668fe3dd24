/** G2 admission: a request is admitted only when its prompt and the tokens it may generate fit
 *  the advertised context window (its prompt's tokens are counted in ../tokenize/prompt-ids.ts).
 *  Knows token counts, the context window and parsed requests; knows nothing of workers or HTTP. */
import { KvfenceError } from '../../common/errors.js'
import { type ParsedRequest, promptNumChars, promptParamOf } from '../api/schemas.js'

/** Where the counts came from, for the error's `param` and message. */
export interface AdmissionFields {
  promptParam: 'messages' | 'prompt' | 'input'
  maxTokensParam: 'max_tokens' | 'max_completion_tokens' | 'max_output_tokens'
}

/** G2. Returns the number of tokens the request may generate: `maxTokens`, or when null the rest
 *  of the window. Throws `context_length_exceeded` giving both numbers when
 *  `numPromptTokens + maxTokens` (at least 1 generated token) exceeds `contextWindow`. */
export function admit(
  numPromptTokens: number,
  maxTokens: number | null,
  contextWindow: number,
  fields: AdmissionFields,
): number {
  const numGenerated = maxTokens ?? Math.max(1, contextWindow - numPromptTokens)
  const numRequested = numPromptTokens + numGenerated
  if (numRequested <= contextWindow) return numGenerated
  const where = fields.promptParam
  const completion = maxTokens === null ? 'at least 1' : String(maxTokens)
  // A Responses request names its own fields: its output is bounded by `max_output_tokens`.
  const output = fields.maxTokensParam === 'max_output_tokens' ? 'output' : 'completion'
  const reduce =
    fields.maxTokensParam === 'max_output_tokens' ? 'max_output_tokens' : 'the completion'
  throw new KvfenceError(
    'context_length_exceeded',
    `This model's maximum context length is ${contextWindow} tokens. However, you requested ` +
      `${numRequested} tokens (${numPromptTokens} in the ${where}, ${completion} in the ${output}). ` +
      `Please reduce the length of the ${where} or ${reduce}.`,
    maxTokens === null || numPromptTokens >= contextWindow
      ? fields.promptParam
      : fields.maxTokensParam,
  )
}

/** G2 before counting, for prompts too long to fit in any tokenization: tokenizing runs on the
 *  event loop every tenant shares (a 1 MB prompt takes most of a second), so one that cannot fit
 *  is refused by its length alone. No token stands for more than `maxTokenChars` characters
 *  before normalization, and normalization shrinks text by at most a few times (NFKC composing
 *  Hangul jamo: 3 to 1), so a text over window × maxTokenChars × 4 characters needs more tokens
 *  than the window holds. Anything shorter is counted exactly. Throws `context_length_exceeded`. */
export function refuseUntokenizable(
  parsed: ParsedRequest,
  contextWindow: number,
  maxTokenChars: number,
): void {
  const numChars = promptNumChars(parsed)
  if (numChars <= contextWindow * maxTokenChars * 4) return
  throw new KvfenceError(
    'context_length_exceeded',
    `This model's maximum context length is ${contextWindow} tokens; a prompt of ${numChars} characters cannot fit in it (no token of this model stands for more than ${maxTokenChars} characters).`,
    promptParamOf(parsed),
  )
}
