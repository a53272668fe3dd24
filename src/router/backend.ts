/** Where the router's requests run, as the router sees it: one interface with two
 *  implementations — kvfence's own prefill and decode workers (native/), and another engine's
 *  OpenAI API (gateway/). The router authenticates, parses, admits and accounts; a backend knows
 *  its window, counts prompts and answers the admitted request on the client's response.
 *  Knows parsed requests, token counts and the response; knows nothing of keys, routes or limits. */
import type { ServerResponse } from 'node:http'
import { performance } from 'node:perf_hooks'
import type { Logger } from 'pino'
import type { KvfenceError } from '../common/errors.js'
import type { PrefixCachePartition } from '../control/messages.js'
import type { FinishReason, ResponseHeader } from './api/responses.js'
import type { ParsedRequest } from './api/schemas.js'
import type { AnswerCheck, SentinelUnit } from './sentinel/sentinel.js'

/** A backend: see the module's header. */
export interface Backend {
  /** What runs the requests, for logs: `kvfence`, `sglang` or `vllm`. */
  readonly name: string
  /** The advertised context window now, tokens (G1: ≤ what the backend holds, guards on). */
  contextWindow(): number
  /** Set while every new request must be refused (G1 no longer holds, or a worker refuses the
   *  router's cluster token); the error to answer with. */
  refusal(): KvfenceError | null
  /** Null when requests can be served now, else why not (`/health`'s `reason`). */
  unavailableReason(): Promise<string | null>
  /** The backend's fields of `/server_info` (the router adds the model, window and queue).
   *  Throws `worker_unavailable` when a part does not report. */
  serverInfo(): Promise<Record<string, unknown>>
  /** Characters the longest token stands for, when known: a prompt longer than
   *  window × this × 4 characters cannot fit and is refused before it is counted. */
  readonly maxTokenChars: number | null
  /** What the response sentinel matches: `token` when the backend hands the answer's token ids
   *  to {@link GenerationJob.answerCheck} (and prepares prompts with token ids), else
   *  `character`. */
  readonly sentinelUnit: SentinelUnit
  /** Gateway mode: runs the engine's isolation self-check now and applies it at once (paths
   *  refused or served from its result on), resolving with its report — the value of
   *  `/server_info`'s `isolationSelfCheck`. Null where there is none (kvfence's own workers). */
  readonly runIsolationSelfCheck: (() => Promise<object>) | null
  /** Text of token ids by the model's tokenizer, when the router holds it; else null. */
  readonly detokenize: ((ids: readonly number[]) => string) | null
  /** Counts (and when the backend needs them, tokenizes) a request's prompt; `tenant` (its name)
   *  is the queue the prompt waits in for a tokenizer process, taken in turn with other tenants'.
   *  `contextWindow` (tokens) is the most admission will allow: the ids of a prompt of at least
   *  that many tokens (refused) need not be kept.
   *  Throws `invalid_request`, `context_length_exceeded` or `worker_unavailable`. */
  preparePrompt(
    parsed: ParsedRequest,
    tenant: string,
    signal: AbortSignal,
    contextWindow: number,
  ): Promise<PreparedPrompt>
  /** Runs an admitted request and answers it on `job.res` (plain or SSE), filling
   *  `job.outcome`. Throws before the answer has started (the router sends the error); after
   *  that, a failure ends the stream with an error event and goes to `job.logFailure`. */
  generate(job: GenerationJob): Promise<void>
  /** Hears of every failed request (a failed worker may call for a re-check of G1). */
  noteFailure(error: KvfenceError): void
  /** Stops timers, closes connections and stops the backend's processes (kvfence's tokenizer
   *  processes); resolves once they have exited. */
  close(): Promise<void>
}

/** A prompt counted by {@link Backend.preparePrompt}. */
export interface PreparedPrompt {
  readonly numPromptTokens: number
  /** The prompt's token ids, when the backend runs on ids (kvfence workers); null when it only
   *  counts them (gateway mode). Throws `internal_error` for a prompt of at least the
   *  `contextWindow` it was prepared for (its ids were not kept: admission refuses it). */
  readonly tokenIds: number[] | null
}

/** An authenticated, parsed and admitted request, for {@link Backend.generate}. */
export interface GenerationJob {
  readonly parsed: ParsedRequest
  /** The client's body as validated (no internal fields). */
  readonly body: Record<string, unknown>
  /** The router's request id (128 random bits, hex). */
  readonly rid: string
  readonly tenant: string
  /** The tenant's prefix-cache partition under the tenants file it was admitted with. */
  readonly prefixCachePartition?: PrefixCachePartition
  readonly prompt: PreparedPrompt
  /** Completion tokens admitted at most. */
  readonly maxTokens: number
  /** The id, `created` and model of the response bodies. */
  readonly header: ResponseHeader
  readonly res: ServerResponse
  /** Fires when the client goes away (G8). */
  readonly signal: AbortSignal
  readonly log: Logger
  /** What the request log and the metrics report; the backend fills it as it goes. */
  readonly outcome: Outcome
  /** Logs (and counts) a failure that ended an answer already started. */
  logFailure(error: KvfenceError): void
  /** The response sentinel's check: every piece of the answer goes through it before the client,
   *  with its token ids when the backend's `sentinelUnit` is `token` (src/router/sentinel/). */
  readonly answerCheck: AnswerCheck
  /** Set when the endpoint writes its own bodies from the answer's text (the Responses API):
   *  the backend then runs the request as chat and hands the writer its text, piece by piece,
   *  instead of writing chat bodies itself. */
  readonly writer?: AnswerWriter
}

/** Receives one piece of an answer's text (with its token ids when the backend has them);
 *  returns a promise only when the client's socket is full. */
export type OnAnswerText = (
  piece: string,
  tokenIds?: readonly number[],
) => Promise<void> | undefined

/** How a generation ended, as a {@link AnswerWriter} learns it. */
export interface AnswerEnd {
  finishReason: FinishReason
  numCompletionTokens: number
  /** Prompt tokens whose KV came from a prefix cache (0 when unknown). */
  cachedTokens: number
}

/** Runs an admitted request, giving each piece of its answer to `onText`; resolves with how it
 *  ended. Throws as {@link Backend.generate} does (`request_aborted`, `worker_unavailable`, …). */
export type AnswerGeneration = (onText: OnAnswerText) => Promise<AnswerEnd>

/** Writes a request's answer on `job.res` in the endpoint's own shape, from the text a backend
 *  generates; fills `job.outcome` (completion tokens, finish reason) and passes every piece
 *  through `job.answerCheck` before the client sees it. */
export interface AnswerWriter {
  write(job: GenerationJob, generate: AnswerGeneration): Promise<void>
}

/** What the request log line and the metrics report of one request. */
export interface Outcome {
  status: number
  numPromptTokens: number
  numCompletionTokens: number
  finishReason: FinishReason | null
  /** `performance.now()` of the first and the last generated token. */
  firstTokenMs: number | null
  lastTokenMs: number | null
  /** Prompt and completion, kept only with `logContent`. */
  content: { prompt: unknown; completion: string } | null
}

/** Records a generated token's time (for TTFT and TPOT). */
export function markToken(outcome: Outcome): void {
  const now = performance.now()
  outcome.firstTokenMs ??= now
  outcome.lastTokenMs = now
}
