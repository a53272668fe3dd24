/** Gateway mode's prompt count (for G2): by the engine's own tokenizer — a local copy of its
 *  `tokenizer.json` when one is configured, else the engine's `POST /tokenize`
 *  `{model, prompt|messages}` → `{count}` (or `tokens`), or llama.cpp's (`/apply-template` for
 *  messages, then `/tokenize {content}` → `{tokens}`). A prompt given as token ids is its length.
 *  Knows parsed requests and the engine's `/tokenize`; knows nothing of tenants or limits. */
import { KvfenceError } from '../../common/errors.js'
import type { Tokenizer } from '../../model/tokenizer.js'
import { checkedPromptTokenIds } from '../tokenize/prompt-ids.js'
import { type ParsedRequest, promptParamOf } from '../api/schemas.js'
import { type EngineHttp, asObject, json, messageOf, positive } from './engine-http.js'

/** What counting needs to know of the engine. */
export interface PromptCountContext {
  http: EngineHttp
  /** A local copy of the engine's tokenizer, or null to ask the engine. */
  tokenizer: Tokenizer | null
  backendModel: string
  /** How the engine counts (engines.ts); null: it cannot, and `tokenizer` is set. */
  engineTokenize: 'openai' | 'llamacpp' | null
  /** The engine's longest accepted prompt (null: not reported). */
  maxInputTokens: number | null
  guardsEnabled: boolean
}

/** The prompt's token count; throws `context_length_exceeded` (400) when it exceeds the engine's
 *  longest accepted input (guards on), `invalid_request` when the local tokenizer would drop
 *  characters of it (as the native router does: never a silently shortened prompt) or it encodes
 *  to nothing, `worker_unavailable` when the engine cannot count it. */
export async function countPromptTokens(
  c: PromptCountContext,
  parsed: ParsedRequest,
  signal: AbortSignal,
): Promise<number> {
  const numPromptTokens =
    parsed.endpoint === 'completion' && 'tokenIds' in parsed.prompt
      ? parsed.prompt.tokenIds.length
      : c.tokenizer !== null
        ? checkedPromptTokenIds(c.tokenizer, parsed).length
        : c.engineTokenize === 'llamacpp'
          ? await countByLlamaCpp(c, parsed, signal)
          : await countByEngine(c, tokenizeBody(parsed, c.backendModel), signal)
  if (c.guardsEnabled && c.maxInputTokens !== null && numPromptTokens > c.maxInputTokens) {
    throw new KvfenceError(
      'context_length_exceeded',
      `This model accepts at most ${c.maxInputTokens} prompt tokens; your prompt has ${numPromptTokens}. Please shorten it.`,
      promptParamOf(parsed),
    )
  }
  return numPromptTokens
}

/** The `/tokenize` body of a prompt given as messages or text (token ids are sent as ids). */
function tokenizeBody(parsed: ParsedRequest, model: string): Record<string, unknown> {
  if (parsed.endpoint === 'chat') return { model, messages: parsed.messages }
  return { model, prompt: 'text' in parsed.prompt ? parsed.prompt.text : parsed.prompt.tokenIds }
}

/** llama.cpp's count: a chat's messages rendered by its own template first. */
async function countByLlamaCpp(
  c: PromptCountContext,
  parsed: ParsedRequest,
  signal: AbortSignal,
): Promise<number> {
  if (parsed.endpoint === 'completion' && 'tokenIds' in parsed.prompt) {
    return parsed.prompt.tokenIds.length
  }
  let content: string
  if (parsed.endpoint === 'chat') {
    const res = await callEngine(c, '/apply-template', { messages: parsed.messages }, signal)
    const rendered = res.status === 200 ? asObject(json(res.body))?.prompt : undefined
    if (typeof rendered !== 'string') {
      throw new KvfenceError(
        'worker_unavailable',
        `backend ${c.http.base}/apply-template did not render the messages (HTTP ${res.status}); configure tokenizerDir`,
      )
    }
    content = rendered
  } else content = 'text' in parsed.prompt ? parsed.prompt.text : ''
  return countByEngine(c, { content }, signal)
}

/** One call of the engine's tokenizer endpoints under the request's signal and the deadline. */
async function callEngine(
  c: PromptCountContext,
  path: string,
  body: Record<string, unknown>,
  signal: AbortSignal,
) {
  try {
    return await c.http.call(
      path,
      'POST',
      body,
      AbortSignal.any([signal, AbortSignal.timeout(c.http.timeoutMs)]),
    )
  } catch (err) {
    throw new KvfenceError('worker_unavailable', `backend ${c.http.base}${path}: ${messageOf(err)}`)
  }
}

/** The engine's `/tokenize` count of a prompt. */
async function countByEngine(
  c: PromptCountContext,
  body: Record<string, unknown>,
  signal: AbortSignal,
): Promise<number> {
  const res = await callEngine(c, '/tokenize', body, signal)
  const reply = res.status === 200 ? asObject(json(res.body)) : null
  const count =
    positive(reply?.count) ?? (Array.isArray(reply?.tokens) ? reply.tokens.length : null)
  if (count === null) {
    throw new KvfenceError(
      'worker_unavailable',
      `backend ${c.http.base}/tokenize did not count the prompt (HTTP ${res.status}); configure tokenizerDir`,
    )
  }
  return count
}
