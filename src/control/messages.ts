/** The control plane between the router and the workers: message shapes and their parsers.
 *
 *  Transport: the control channel, `GET /internal/channel` upgraded to `kvfence-control/1` on
 *  each worker's control port (loopback, or mutual TLS between hosts): many request steps on one
 *  connection, each a stream (channel-frames.ts; docs/protocol.md "The router ↔ worker control
 *  channel").
 *  - decode worker   a `generate` stream: {@link GenerateRequest}, answered with
 *    {@link DecodeEvent}s, or a refusal (`failed`, `{ error: { code, message } }`) when it
 *    refuses the request outright. The first event is always `reserved` (pages are held for the
 *    prompt); only then may the router ask the prefill worker to prefill.
 *  - prefill worker  a `prefill` stream: {@link PrefillRequest}, answered with
 *    {@link PrefillResult} once the decode worker has acknowledged every page, or a refusal.
 *  - both            a `cancel` frame, or the channel closing, aborts the request (G8).
 *  - both, over HTTP `GET /server_info` → {@link ServerInfo}, `GET /health`, `GET /metrics`
 *    (probes and operators), `POST /internal/cluster_token_check` (the router's token probe).
 *
 *  Knows message shapes only; knows nothing of pools, models or tenants' keys. */
import { z } from 'zod'

/** Sampling parameters as the workers receive them (already validated by the router, which
 *  names the OpenAI field of any refusal). The steps and their order: src/model/sampling.ts. */
export const Sampling = z.object({
  /** 0 means greedy. */
  temperature: z.number().min(0).max(2),
  topP: z.number().gt(0).max(1),
  /** Keep the k most probable tokens; null or absent = off (the API's top_k -1 or 0). */
  topK: z.number().int().min(1).nullish(),
  /** Keep tokens at least min_p × the top token's probability; 0 or absent = off. */
  minP: z.number().min(0).max(1).optional(),
  /** OpenAI's presence and frequency penalties over the tokens generated so far; absent = 0. */
  presencePenalty: z.number().min(-2).max(2).optional(),
  frequencyPenalty: z.number().min(-2).max(2).optional(),
  /** Seed of the request's random stream; null draws one. */
  seed: z.number().int().nullable(),
  /** Report each generated token's log-probability and this many top alternatives (raw model
   *  log-softmax, see `tokenLogprobs` in src/model/sampling.ts); null or absent = none. */
  numLogprobs: z.number().int().min(0).max(20).nullish(),
})
export type Sampling = z.infer<typeof Sampling>

/** A generated token's log-probabilities (natural log, ≥ −9999): the token's own and its `top`
 *  alternatives, most likely first. Present only when the request's `numLogprobs` is not null. */
export const TokenLogprobs = z.object({
  logprob: z.number(),
  top: z.array(z.object({ tokenId: z.number().int().min(0), logprob: z.number() })).max(20),
})
export type TokenLogprobs = z.infer<typeof TokenLogprobs>

const requestId = z.string().regex(/^[0-9a-f]{32}$/, 'request id must be 32 hex digits')
const secret = z.string().regex(/^[0-9a-f]{64}$/, 'transfer secret must be 64 hex digits')
const tokenIds = z.array(z.number().int().min(0)).min(1)

/** The tenant's prefix-cache partition as the router's tenants file describes it (see
 *  `PartitionSpec` in src/kv/prefix-cache.ts): its own `prefixCachePages` if any, the sum of
 *  every tenant's, and the number of tenants without one. Pages, integers ≥ 0. */
export const PrefixCachePartition = z.strictObject({
  pages: z.number().int().min(0).optional(),
  reservedPages: z.number().int().min(0),
  numDefaultTenants: z.number().int().min(0),
})
export type PrefixCachePartition = z.infer<typeof PrefixCachePartition>

/** Router → decode worker: reserve pages for a prompt, receive its KV, decode. */
export const GenerateRequest = z.object({
  requestId,
  tenant: z.string().min(1),
  promptTokenIds: tokenIds,
  /** Tokens to generate at most, the first token (sampled by prefill) included. */
  maxTokens: z.number().int().min(1),
  sampling: Sampling,
  stopTokenIds: z.array(z.number().int().min(0)),
  /** Per-request secret issued by the router; the transfer's BEGIN frame must carry its HMAC (G10). */
  transferSecret: secret,
  /** For the prefill worker (the decode worker ignores it): see {@link PrefillRequest}. */
  prefixCachePartition: PrefixCachePartition.optional(),
})
export type GenerateRequest = z.infer<typeof GenerateRequest>

/** Router → prefill worker: prefill a prompt and send its KV to a decode worker. */
export const PrefillRequest = z.object({
  requestId,
  tenant: z.string().min(1),
  promptTokenIds: tokenIds,
  sampling: Sampling,
  transferSecret: secret,
  /** The tenant's prefix-cache partition; absent: the tenant caches nothing in a partitioned
   *  cache (a router that sends none, or a request sent to the worker by hand). */
  prefixCachePartition: PrefixCachePartition.optional(),
  /** The decode worker's transfer (data-plane) address. */
  decode: z.object({ host: z.string().min(1), port: z.number().int().min(1).max(65535) }),
})
export type PrefillRequest = z.infer<typeof PrefillRequest>

/** Prefill worker's answer once the decode worker acknowledged the transfer. */
export const PrefillResult = z.object({
  requestId: z.string(),
  numPages: z.number().int().min(0),
  numTokens: z.number().int().min(0),
  firstTokenId: z.number().int().min(0),
  /** The first token's log-probabilities, when the request asked for them (the decode worker
   *  never sees the prompt's logits, so they reach the router here). */
  firstTokenLogprobs: TokenLogprobs.optional(),
  /** Leading prompt tokens whose KV came from the prefill worker's prefix cache (OpenAI's
   *  `cached_tokens`); absent = 0. */
  cachedTokens: z.number().int().min(0).optional(),
})
export type PrefillResult = z.infer<typeof PrefillResult>

/** One event of the decode worker's stream. */
export const DecodeEvent = z.discriminatedUnion('type', [
  z.object({
    type: z.literal('reserved'),
    numPages: z.number().int().min(0),
    /** Decode worker: the port its transfer receiver listens on now. Sent with each request so a
     *  router never sends a prefill worker to a port from before a restart; absent = the
     *  `transferPort` of its `/server_info`. */
    transferPort: z.number().int().min(1).max(65535).optional(),
    /** Decode worker: the host its transfer receiver is reached at (`--transfer-host`); absent =
     *  the host of its control URL. */
    transferHost: z.string().min(1).optional(),
  }),
  z.object({
    type: z.literal('token'),
    tokenId: z.number().int().min(0),
    /** Only when asked for; absent on the first token, whose come in {@link PrefillResult}. */
    logprobs: TokenLogprobs.optional(),
  }),
  z.object({
    type: z.literal('done'),
    finishReason: z.enum(['stop', 'length']),
    promptTokens: z.number().int().min(0),
    completionTokens: z.number().int().min(0),
    /** Prompt tokens whose KV came from a prefix cache (OpenAI's `cached_tokens`); absent = 0. */
    cachedTokens: z.number().int().min(0).optional(),
  }),
  z.object({ type: z.literal('error'), code: z.string(), message: z.string() }),
])
export type DecodeEvent = z.infer<typeof DecodeEvent>

/** What every worker reports at `GET /server_info` (also read by `kvfence audit` from outside). */
export const ServerInfo = z.object({
  role: z.enum(['prefill', 'decode']),
  model: z.string(),
  /** Tokens per page. */
  pageSize: z.number().int().min(1),
  numPages: z.number().int().min(0),
  /** Effective KV capacity in tokens = numPages × pageSize. */
  capacityTokens: z.number().int().min(0),
  numPagesFree: z.number().int().min(0),
  /** Pages owned by requests (prefix-cache pages not included). */
  numPagesUsed: z.number().int().min(0),
  /** Prefill worker only: pages held by its prefix cache (evicted on demand). */
  numPagesCached: z.number().int().min(0).optional(),
  /** Prefill worker only: prompt tokens per prefill step (chunked prefill; SGLang reports the
   *  same as `chunked_prefill_size`). An abort is seen between steps. */
  prefillChunkTokens: z.number().int().min(1).optional(),
  /** Longest sequence (prompt + generated tokens) the model's positions allow. */
  maxPositionEmbeddings: z.number().int().min(1),
  guardsEnabled: z.boolean(),
  faults: z.array(z.string()),
  /** Decode worker only: the TCP port its transfer receiver listens on. */
  transferPort: z.number().int().min(1).max(65535).optional(),
  /** Decode worker only: the host its transfer receiver is reached at (`--transfer-host`);
   *  absent = the host of its control URL. */
  transferHost: z.string().min(1).optional(),
})
export type ServerInfo = z.infer<typeof ServerInfo>
