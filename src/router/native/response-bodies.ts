/** The OpenAI bodies of a natively generated answer, one builder per endpoint, chosen once per
 *  request (../api/responses.ts builds the bodies, ../api/logprobs.ts their log-probabilities).
 *  Knows the endpoints' body shapes and log-probability formats; knows nothing of workers. */
import type { Tokenizer } from '../../model/tokenizer.js'
import {
  CompletionLogprobsBuilder,
  type GeneratedLogprobs,
  chatLogprobs,
  tokenTextOf,
} from '../api/logprobs.js'
import {
  type FinishReason,
  type ResponseHeader,
  type Usage,
  chatChunk,
  chatCompletion,
  chatUsageChunk,
  textCompletion,
  textUsageChunk,
} from '../api/responses.js'
import type { Endpoint } from '../api/schemas.js'

/** The bodies of one response. `entries` are the log-probabilities of the tokens whose text the
 *  body carries (ignored when the client did not ask for them). */
export interface ResponseBodies {
  /** The whole, non-streamed answer. */
  whole(text: string, finish: FinishReason, usage: Usage, entries: GeneratedLogprobs[]): unknown
  /** The chunk that opens a stream, or null when the endpoint has none. */
  opening(): unknown
  /** A chunk carrying a piece of text. */
  piece(text: string, entries: GeneratedLogprobs[]): unknown
  /** The chunk carrying the finish reason (and the log-probabilities of tokens whose text was
   *  held back or empty: a stop string, an end-of-sequence token). */
  last(finish: FinishReason, entries: GeneratedLogprobs[]): unknown
  /** The usage chunk (`stream_options.include_usage`). */
  usage(usage: Usage): unknown
}

/** What a response's bodies depend on. */
export interface ResponseBodiesOptions {
  header: ResponseHeader
  /** `stream_options.include_usage`. */
  isUsageStreamed: boolean
  /** Names tokens in log-probabilities; null when the client did not ask for them. */
  logprobsTokenizer: Tokenizer | null
}

/** Builds one response's {@link ResponseBodies}. */
export type ResponseBodiesOf = (options: ResponseBodiesOptions) => ResponseBodies

/** The text of a token id by `tokenizer`; with `shown`, as the completion text shows it
 *  (special tokens skipped). */
function tokenText(tokenizer: Tokenizer, shown = false) {
  return tokenTextOf((ids, options) => tokenizer.decode(ids, options), shown)
}

function chatResponseBodies({
  header: h,
  isUsageStreamed,
  logprobsTokenizer,
}: ResponseBodiesOptions): ResponseBodies {
  const texts = logprobsTokenizer === null ? null : tokenText(logprobsTokenizer)
  const logprobs = (entries: GeneratedLogprobs[]) =>
    texts === null ? null : chatLogprobs(entries, texts)
  return {
    whole: (text, finish, usage, entries) =>
      chatCompletion(h, text, finish, usage, logprobs(entries)),
    opening: () => chatChunk(h, { role: 'assistant', content: '' }, null, isUsageStreamed),
    piece: (text, entries) =>
      chatChunk(h, { content: text }, null, isUsageStreamed, logprobs(entries)),
    last: (finish, entries) => chatChunk(h, {}, finish, isUsageStreamed, logprobs(entries)),
    usage: (usage) => chatUsageChunk(h, usage),
  }
}

function completionResponseBodies({
  header: h,
  logprobsTokenizer: t,
}: ResponseBodiesOptions): ResponseBodies {
  const builder =
    t === null ? null : new CompletionLogprobsBuilder(tokenText(t), tokenText(t, true))
  const logprobs = (entries: GeneratedLogprobs[]) =>
    builder === null ? null : builder.next(entries)
  return {
    whole: (text, finish, usage, entries) =>
      textCompletion(h, text, finish, usage, logprobs(entries)),
    opening: () => null,
    piece: (text, entries) => textCompletion(h, text, null, undefined, logprobs(entries)),
    last: (finish, entries) => textCompletion(h, '', finish, undefined, logprobs(entries)),
    usage: (usage) => textUsageChunk(h, usage),
  }
}

/** Each endpoint's builder. */
export const responseBodiesOf: { readonly [E in Endpoint]: ResponseBodiesOf } = {
  chat: chatResponseBodies,
  completion: completionResponseBodies,
}
