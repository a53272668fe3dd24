/** Generated tokens' log-probabilities in OpenAI's two shapes: chat's `logprobs.content` entries
 *  (`ChatCompletionTokenLogprob`: token, logprob, bytes, top_logprobs) and the legacy completions
 *  object (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`).
 *  A token's text is the token decoded on its own with special tokens kept (as vLLM reports it), so
 *  a token holding part of a multi-byte character reads as U+FFFD and its `bytes` are those of
 *  that text. Knows token ids, a decode function and the shapes; knows nothing of HTTP or workers. */
import type { TokenLogprobs } from '../../control/messages.js'

/** One generated token with the log-probabilities a worker reported for it. */
export interface GeneratedLogprobs {
  tokenId: number
  logprobs: TokenLogprobs
}

/** The text of one token id. */
export type TokenText = (tokenId: number) => string

/** A {@link TokenText} over `decode`, memoized per id: special tokens kept (their names, for
 *  `tokens`), or with `skipSpecialTokens` skipped as in the completion text (for offsets). */
export function tokenTextOf(
  decode: (ids: readonly number[], options: { skipSpecialTokens: boolean }) => string,
  skipSpecialTokens = false,
): TokenText {
  const cache = new Map<number, string>()
  return (id) => {
    let text = cache.get(id)
    if (text === undefined) {
      text = decode([id], { skipSpecialTokens })
      cache.set(id, text)
    }
    return text
  }
}

/** One `ChatCompletionTokenLogprob`. */
export interface ChatTokenLogprob {
  token: string
  logprob: number
  bytes: number[]
  top_logprobs: { token: string; logprob: number; bytes: number[] }[]
}

/** Chat's `choices[].logprobs` (kvfence never refuses, so `refusal` is null). */
export interface ChatLogprobs {
  content: ChatTokenLogprob[]
  refusal: null
}

/** Chat's `logprobs` for `entries`: one content entry per token, `top_logprobs` exactly the
 *  requested number of alternatives, most likely first. */
export function chatLogprobs(
  entries: readonly GeneratedLogprobs[],
  tokenText: TokenText,
): ChatLogprobs {
  const item = (tokenId: number, logprob: number) => {
    const token = tokenText(tokenId)
    return { token, logprob, bytes: [...Buffer.from(token, 'utf8')] }
  }
  return {
    content: entries.map((e) => ({
      ...item(e.tokenId, e.logprobs.logprob),
      top_logprobs: e.logprobs.top.map((t) => item(t.tokenId, t.logprob)),
    })),
    refusal: null,
  }
}

/** The completions endpoint's `choices[].logprobs`. */
export interface CompletionLogprobs {
  tokens: string[]
  token_logprobs: number[]
  /** Per token: the requested top alternatives and the sampled token (OpenAI: "up to
   *  logprobs + 1 elements"), keyed by token text (the first, more likely, wins a shared text). */
  top_logprobs: Record<string, number>[]
  /** Per token: where its text starts in the completion text, in Unicode code points (as vLLM
   *  counts Python characters). */
  text_offset: number[]
}

/** Builds the completions `logprobs` of a response in pieces (one per streamed chunk), keeping
 *  `text_offset` running across them. */
export class CompletionLogprobsBuilder {
  /** Code points of the completion text so far. */
  private offset = 0

  /** `tokenText` names the tokens (special tokens included); `shownText`, when given, is a
   *  token's text as the completion shows it (special tokens skipped: empty), which is what
   *  `text_offset` counts. Without it the two are the same. */
  constructor(
    private readonly tokenText: TokenText,
    private readonly shownText: TokenText = tokenText,
  ) {}

  /** The `logprobs` object for the next `entries` of the response. */
  next(entries: readonly GeneratedLogprobs[]): CompletionLogprobs {
    const out: CompletionLogprobs = {
      tokens: [],
      token_logprobs: [],
      top_logprobs: [],
      text_offset: [],
    }
    for (const e of entries) {
      const token = this.tokenText(e.tokenId)
      out.tokens.push(token)
      out.token_logprobs.push(e.logprobs.logprob)
      const top = new Map<string, number>()
      for (const t of e.logprobs.top) {
        const text = this.tokenText(t.tokenId)
        if (!top.has(text)) top.set(text, t.logprob)
      }
      if (!top.has(token)) top.set(token, e.logprobs.logprob)
      // fromEntries defines own properties, so even a token "__proto__" is a plain key.
      out.top_logprobs.push(Object.fromEntries(top))
      out.text_offset.push(this.offset)
      this.offset += [...this.shownText(e.tokenId)].length
    }
    return out
  }
}
