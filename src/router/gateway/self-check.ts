/** The gateway's isolation self-check of the engine behind it: does the engine keep one tenant's
 *  prefix cache from another on each path the gateway proxies? Two internal tenants, each with a
 *  salt of its own (as a real tenant's `cache_salt`), send the same fresh prompt:
 *    1. tenant A sends it (the engine may now cache its pages);
 *    2. tenant A sends it again: its `cached_tokens` must show reuse — the positive control;
 *    3. tenant B sends it: under its own salt it must reuse nothing.
 *  Without the positive control the result is `cannot-tell`, never `isolated`. An engine that
 *  refuses the salt field itself (Hugging Face `transformers serve` answers 422 "Unexpected fields
 *  in the request") is found here, before any tenant's request meets that 422.
 *  The engines' public reports behind it: the salt dropped on one entrypoint (vLLM PR #51818,
 *  vllm#46688, dynamo PR #11082).
 *  Knows the engine's OpenAI endpoints and `usage.prompt_tokens_details.cached_tokens`; knows
 *  nothing of real tenants, keys or admission. */
import { randomBytes } from 'node:crypto'
import type { Endpoint } from '../api/schemas.js'
import { type EngineHttp, asObject, json, messageOf } from './engine-http.js'

/** What the self-check concluded of one path:
 *  - `isolated`: tenant A reused its own prefix and tenant B, under another salt, did not;
 *  - `shared`: tenant B reused tenant A's prefix: the engine ignores the salt on this path;
 *  - `salt-refused`: the engine refuses a request that carries `cache_salt`;
 *  - `cannot-tell`: no reuse was seen even for tenant A (no prefix cache, or no `cached_tokens`
 *    reported), or the engine failed: nothing about isolation can be said. */
export type PathIsolation = 'isolated' | 'shared' | 'salt-refused' | 'cannot-tell'

/** The self-check's result on one path. */
export interface PathCheck {
  readonly endpoint: Endpoint
  readonly result: PathIsolation
  /** One sentence: the numbers behind the result. */
  readonly detail: string
  /** `cached_tokens` of tenant A's second request and of tenant B's (null: not reported). */
  readonly ownCachedTokens: number | null
  readonly otherCachedTokens: number | null
  /** True when the engine gave no HTTP answer at all (refused or dropped the connection). */
  readonly isUnanswered: boolean
}

/** One run of the self-check over every path, and what it cost. */
export interface SelfCheckReport {
  /** ISO-8601 time of the run's start. */
  readonly at: string
  readonly paths: readonly PathCheck[]
  /** Requests sent to the engine. */
  readonly numRequests: number
  /** Prompt and completion tokens the engine reported for them (prompts counted by the engine's
   *  own usage; a request without usage counts nothing). */
  readonly numTokens: number
  readonly durationMs: number
}

/** Words in the self-check's prompt: long enough to fill several pages of any engine's prefix
 *  cache (vLLM 16 tokens a page, `transformers serve` 32, SGLang 1), short enough for the
 *  smallest real window. */
const promptWords = 96
/** Completion tokens of each request: more than one, since `transformers serve`'s batching cache
 *  shares a request's pages only after its second generated token. */
const completionTokens = 4

/** The engine's path of each endpoint. */
export const enginePaths: { readonly [E in Endpoint]: string } = {
  chat: '/v1/chat/completions',
  completion: '/v1/completions',
}

/** What a self-check needs of the gateway. */
export interface SelfCheckContext {
  http: EngineHttp
  backendModel: string
  /** Names each request as the gateway names tenants' requests on this engine (SGLang's `rid`),
   *  so that the check sends what tenants' requests will carry. */
  nameRequest(body: Record<string, unknown>, rid: string): void
  /** The advertised window, tokens: the prompt's words are at most an eighth of it. */
  contextWindow: number
}

/** Runs the self-check on each of `endpoints`, one after another (never in parallel: the engine
 *  is serving tenants meanwhile, and the check must cost it little). Never rejects. */
export async function runSelfCheck(
  c: SelfCheckContext,
  endpoints: readonly Endpoint[],
): Promise<SelfCheckReport> {
  const started = performance.now()
  const at = new Date().toISOString()
  const cost = { numRequests: 0, numTokens: 0 }
  const paths: PathCheck[] = []
  for (const endpoint of endpoints) paths.push(await checkPath(c, endpoint, cost))
  return { at, paths, ...cost, durationMs: Math.round(performance.now() - started) }
}

/** One engine answer as the self-check reads it. */
interface Probed {
  status: number
  /** `usage.prompt_tokens_details.cached_tokens` (null: not reported). */
  cachedTokens: number | null
  /** The engine's words, for a refusal's detail. */
  text: string
}

/** A failed answer in words: no answer at all (status 0: the connection failed) is said as such,
 *  not as an HTTP status. */
function whatCameBack(p: Probed): string {
  return p.status === 0
    ? `the engine did not answer (${p.text})`
    : `the engine answered HTTP ${p.status}: ${p.text}`
}

/** The three requests of one path, and its result. */
async function checkPath(
  c: SelfCheckContext,
  endpoint: Endpoint,
  cost: { numRequests: number; numTokens: number },
): Promise<PathCheck> {
  const prompt = freshPrompt(c.contextWindow)
  const [saltA, saltB] = [drawSalt(), drawSalt()]
  const send = async (salt: string | null): Promise<Probed> => {
    cost.numRequests++
    const reply = await c.http
      .call(enginePaths[endpoint], 'POST', requestBody(c, endpoint, prompt, salt))
      .catch((err: unknown) => ({ status: 0, body: messageOf(err) }))
    const value = asObject(json(reply.body))
    const usage = asObject(value?.usage)
    cost.numTokens += count(usage?.prompt_tokens) + count(usage?.completion_tokens)
    const details = asObject(usage?.prompt_tokens_details)
    const cached = details?.cached_tokens
    return {
      status: reply.status,
      cachedTokens: typeof cached === 'number' && cached >= 0 ? cached : null,
      text: reply.body.slice(0, 200),
    }
  }

  const first = await send(saltA)
  const result = (
    r: PathIsolation,
    detail: string,
    own: number | null = null,
    other: number | null = null,
  ): PathCheck => ({
    endpoint,
    result: r,
    detail,
    ownCachedTokens: own,
    otherCachedTokens: other,
    isUnanswered: first.status === 0,
  })
  if (first.status !== 200) {
    if (first.status < 400 || first.status >= 500) {
      return result('cannot-tell', whatCameBack(first))
    }
    const unsalted = await send(null)
    return unsalted.status === 200
      ? result(
          'salt-refused',
          `the engine refuses cache_salt (HTTP ${first.status}: ${first.text}) and answers without it`,
        )
      : result('cannot-tell', `the engine answered HTTP ${first.status} with or without a salt`)
  }
  const own = await send(saltA)
  const other = await send(saltB)
  if (own.status !== 200 || other.status !== 200) {
    const failed = own.status !== 200 ? own : other
    return result('cannot-tell', whatCameBack(failed))
  }
  if (own.cachedTokens === null || own.cachedTokens === 0) {
    const why = own.cachedTokens === null ? 'reports no cached_tokens' : 'reused nothing'
    return result(
      'cannot-tell',
      `the same tenant's repeat ${why}: no prefix cache was seen, so isolation could not be tested`,
      own.cachedTokens,
      other.cachedTokens,
    )
  }
  return (other.cachedTokens ?? 0) > 0
    ? result(
        'shared',
        `another salt reused ${other.cachedTokens} cached tokens of the same tenant's ${own.cachedTokens}: the engine ignores cache_salt here`,
        own.cachedTokens,
        other.cachedTokens,
      )
    : result(
        'isolated',
        `the same salt reused ${own.cachedTokens} cached tokens, another salt ${other.cachedTokens ?? 0}`,
        own.cachedTokens,
        other.cachedTokens,
      )
}

/** The body of one self-check request: greedy, a few tokens, salted unless `salt` is null. */
function requestBody(
  c: SelfCheckContext,
  endpoint: Endpoint,
  prompt: string,
  salt: string | null,
): Record<string, unknown> {
  const body: Record<string, unknown> =
    endpoint === 'chat'
      ? { model: c.backendModel, messages: [{ role: 'user', content: prompt }] }
      : { model: c.backendModel, prompt }
  body.max_tokens = completionTokens
  body.temperature = 0
  if (salt !== null) body.cache_salt = salt
  c.nameRequest(body, randomBytes(16).toString('hex'))
  return body
}

/** A prompt no tenant has sent (random words, so nothing cached can match it before step 1):
 *  {@link promptWords} words, fewer in a window under eight times that (a random word may be
 *  several tokens). */
function freshPrompt(contextWindow: number): string {
  const numWords = Math.max(8, Math.min(promptWords, Math.floor(contextWindow / 8)))
  const words = randomBytes(numWords * 3)
    .toString('base64url')
    .match(/.{4}/g)!
    .slice(0, numWords)
  return `kvfence isolation self-check ${words.join(' ')}`
}

/** A salt of the shape the gateway gives tenants (HMAC-SHA-256, base64url), unrelated to any. */
function drawSalt(): string {
  return randomBytes(32).toString('base64url')
}

function count(value: unknown): number {
  return typeof value === 'number' && Number.isFinite(value) && value > 0 ? value : 0
}
