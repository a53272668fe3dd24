/** The surfaces of llama.cpp's server, Hugging Face TGI and a plain OpenAI-compatible server, for
 *  the stand-ins of standins.ts (`flavour`): what each publishes about its capacity and how each
 *  parses and refuses a completion request, as their current versions do (docs/auditing.md,
 *  "Surfaces"). Not a test file itself.
 *  - `llamacpp`: `/v1/models` lists the model with `meta.n_ctx_train` (the training context, far
 *    larger than what is served); `/props` gives one slot's `n_ctx` in
 *    `default_generation_settings` and `total_slots`; `/slots` every slot; `/metrics` `llamacpp:`
 *    gauges. A prompt of `n_ctx` tokens or more is refused 400 `exceed_context_size_error`;
 *    `max_tokens` is not checked against the context (generation stops there); a negative or
 *    wrongly typed `max_tokens` means "no limit"; a body that is not JSON gets 500 (its parser's
 *    exception, as llama-server answers it).
 *  - `tgi`: `/info` with `max_input_tokens`, `max_total_tokens`, `max_batch_total_tokens`; a
 *    prompt over `max_input_tokens` or prompt plus `max_tokens` over `max_total_tokens` is
 *    refused 422 `{error, error_type: "validation"}`; a body it cannot read, 422 (400 when not
 *    JSON).
 *  - `plain`: `/v1/models` lists only ids; nothing else is served; refuses a prompt plus
 *    `max_tokens` over its (unreported) context with 400.
 *  A misconfigured llama.cpp reports a whole cache (`/props` `n_ctx`, as some builds do) smaller
 *  than one slot's `n_ctx`; a misconfigured TGI a `max_total_tokens` over `max_batch_total_tokens`;
 *  a misconfigured plain server cannot be told from a correct one by what it reports. */
import type { ServerResponse } from 'node:http'

export type SurfaceFlavour = 'llamacpp' | 'tgi' | 'plain'

/** The sizes a surface reports (tokens). */
export interface SurfaceSizes {
  /** One request's context: llama.cpp's slot `n_ctx`, TGI's `max_total_tokens`. */
  readonly contextTokens: number
  /** The KV pool: llama.cpp's whole cache, TGI's `max_batch_total_tokens`. */
  readonly poolTokens: number
  readonly numSlots: number
  readonly numRunning: number
  /** llama.cpp: the whole cache as some builds report it (`/props` `n_ctx`), or null. */
  readonly wholeCacheTokens: number | null
}

/** A completion request as the engine reads it, or its refusal. */
export type SurfaceRequest =
  | {
      readonly prompt: string
      /** Tokens to generate at most; null: no limit (to the end of the context). */
      readonly maxTokens: number | null
      readonly stream: boolean
      readonly model?: string
    }
  | { readonly status: number; readonly body: unknown }

/** Answers a discovery GET of the surface; false when the path is not one it serves. */
export function serveSurfaceGet(
  res: ServerResponse,
  flavour: SurfaceFlavour,
  path: string,
  sizes: SurfaceSizes,
): boolean {
  if (path === '/v1/models') {
    const entry =
      flavour === 'llamacpp'
        ? { owned_by: 'llamacpp', meta: { n_ctx_train: 131072, n_vocab: 151936 } }
        : { owned_by: flavour === 'tgi' ? 'tiny-echo' : 'plain' }
    sendJson(res, 200, { object: 'list', data: [{ id: 'tiny-echo', object: 'model', ...entry }] })
    return true
  }
  const body = surfaceBody(flavour, path, sizes)
  if (body === null) return false
  if (typeof body === 'string') {
    res.writeHead(200, { 'content-type': 'text/plain; version=0.0.4' })
    res.end(body)
  } else sendJson(res, 200, body)
  return true
}

function surfaceBody(flavour: SurfaceFlavour, path: string, sizes: SurfaceSizes): unknown {
  const { contextTokens, poolTokens, numSlots, numRunning, wholeCacheTokens } = sizes
  const slot = (id: number) => ({
    id,
    id_task: -1,
    n_ctx: contextTokens,
    speculative: false,
    is_processing: id < numRunning,
    params: { n_predict: -1, temperature: 0.8, max_tokens: -1 },
  })
  if (flavour === 'llamacpp' && path === '/props') {
    return {
      default_generation_settings: { ...slot(0), is_processing: false },
      total_slots: numSlots,
      model_path: 'models/tiny-echo.gguf',
      build_info: 'b7000-0000000',
      ...(wholeCacheTokens === null ? {} : { n_ctx: wholeCacheTokens }),
    }
  }
  if (flavour === 'llamacpp' && path === '/slots')
    return Array.from({ length: numSlots }, (_, i) => slot(i))
  if (flavour === 'llamacpp' && path === '/metrics') {
    return (
      '# HELP llamacpp:requests_processing Number of requests processing.\n' +
      '# TYPE llamacpp:requests_processing gauge\n' +
      `llamacpp:requests_processing ${numRunning}\n` +
      'llamacpp:requests_deferred 0\n' +
      'llamacpp:n_tokens_max 0\n'
    )
  }
  if (flavour === 'tgi' && path === '/info') {
    return {
      model_id: 'tiny-echo',
      model_dtype: 'torch.float16',
      model_device_type: 'cuda',
      max_concurrent_requests: 128,
      max_best_of: 2,
      max_stop_sequences: 4,
      max_input_tokens: contextTokens - 1,
      max_total_tokens: contextTokens,
      validation_workers: 2,
      max_client_batch_size: 4,
      router: 'text-generation-router',
      version: '3.3.6',
      max_batch_total_tokens: poolTokens,
      max_waiting_tokens: 20,
      max_batch_size: null,
      waiting_served_ratio: 0.3,
    }
  }
  if (flavour === 'tgi' && path === '/metrics') return `tgi_batch_current_size ${numRunning}\n`
  return null
}

/** Reads a `/v1/completions` body as the engine does; `countTokens` counts a prompt's tokens. */
export function parseSurfaceRequest(
  flavour: SurfaceFlavour,
  body: string,
  contextTokens: number,
  countTokens: (prompt: string) => number,
): SurfaceRequest {
  let json: Record<string, unknown>
  try {
    json = JSON.parse(body) as Record<string, unknown>
  } catch (err) {
    if (flavour === 'llamacpp') {
      const message = `[json.exception.parse_error.101] parse error: ${(err as Error).message}`
      return { status: 500, body: { error: { code: 500, message, type: 'server_error' } } }
    }
    return refusal(flavour, 400, 'body is not valid JSON')
  }
  const { prompt, max_tokens: maxTokens, stream, model } = json
  if (typeof prompt !== 'string') return refusal(flavour, 422, '"prompt" is required')
  const isLimit = Number.isInteger(maxTokens) && (maxTokens as number) > 0
  if (!isLimit && flavour !== 'llamacpp')
    return refusal(flavour, 422, 'max_tokens must be a positive integer')
  const numTokens = countTokens(prompt)
  if (flavour === 'llamacpp' && numTokens >= contextTokens) {
    return refusal(
      flavour,
      400,
      `request (${numTokens} tokens) exceeds the available context size (${contextTokens} tokens), try increasing it`,
    )
  }
  if (flavour === 'tgi' && numTokens > contextTokens - 1)
    return refusal(
      flavour,
      422,
      `Input validation error: \`inputs\` must have less than ${contextTokens - 1} tokens. Given: ${numTokens}`,
    )
  if (flavour !== 'llamacpp' && numTokens + (maxTokens as number) > contextTokens) {
    return refusal(
      flavour,
      flavour === 'tgi' ? 422 : 400,
      `\`inputs\` tokens + \`max_new_tokens\` must be <= ${contextTokens}. Given: ${numTokens} \`inputs\` tokens and ${maxTokens as number} \`max_new_tokens\``,
    )
  }
  return {
    prompt,
    // llama.cpp: any other value than a positive integer is "no limit" (its default, -1).
    maxTokens: isLimit ? (maxTokens as number) : null,
    stream: stream === true,
    ...(typeof model === 'string' ? { model } : {}),
  }
}

/** Each engine's error body: llama.cpp `{error: {code, message, type}}` (400 for a context it
 *  exceeds: `exceed_context_size_error`), TGI `{error, error_type}`, plain OpenAI's shape. */
function refusal(flavour: SurfaceFlavour, status: number, message: string): SurfaceRequest {
  if (flavour === 'llamacpp') {
    const type = /context size/.test(message)
      ? 'exceed_context_size_error'
      : 'invalid_request_error'
    return { status: 400, body: { error: { code: 400, message, type } } }
  }
  if (flavour === 'tgi') return { status, body: { error: message, error_type: 'validation' } }
  return { status: 400, body: { error: { message, type: 'invalid_request_error', code: null } } }
}

function sendJson(res: ServerResponse, status: number, body: unknown): void {
  res.writeHead(status, { 'content-type': 'application/json' })
  res.end(JSON.stringify(body))
}
