/** The native backend: kvfence's own prefill and decode workers. The router tokenizes prompts
 *  here and detokenizes the workers' tokens into text; G1 is the capacity monitor's
 *  (capacity-monitor.ts), the workers' events and their retries are worker-run.ts's, and the
 *  answer's bodies write-response.ts's.
 *  Knows the tokenizer, the worker client and the capacity monitor; knows nothing of keys or
 *  limits. */
import assert from 'node:assert/strict'
import { randomHex } from '../../common/random-hex.js'
import type { Logger } from 'pino'
import type { GenerateRequest } from '../../control/messages.js'
import { KvfenceError } from '../../common/errors.js'
import type { Tokenizer } from '../../model/tokenizer.js'
import type { Backend, GenerationJob } from '../backend.js'
import type { Limiter } from '../admission/limits.js'
import type { RouterMetrics } from '../metrics/metrics.js'
import { messageOf } from '../api/public-errors.js'
import { checkStopTokenIds } from '../api/schemas.js'
import type { WorkerClient } from '../../control/worker-client.js'
import type { TokenizerPool } from '../tokenize/tokenizer-pool.js'
import type { CapacityMonitor } from './capacity-monitor.js'
import { type WorkerRunDeps, runGeneration } from './worker-run.js'
import { responseBodiesOf } from './response-bodies.js'
import { writeStreamedResponse, writeWholeResponse } from './write-response.js'

/** Options of {@link createNativeBackend}. */
export interface NativeBackendOptions {
  tokenizer: Tokenizer
  /** Tokenizes prompts (long ones off the event loop); closed with the backend. */
  tokenizerPool: TokenizerPool
  workers: WorkerClient
  /** G1 re-checked while running. */
  capacity: CapacityMonitor
  /** Tokens per KV page, as the workers report (for `/server_info`). */
  pageSize: number
  /** The router's guards (false only in the incident's configuration). */
  guardsEnabled: boolean
  /** For waiting on a full KV pool. */
  limiter: Pick<Limiter, 'maxQueueWaitMs' | 'waitForRoom'>
  metrics: RouterMetrics
  log: Logger
}

/** How long `/health` waits for the workers' `/server_info` (ms). */
const healthTimeoutMs = 2_000

/** The native {@link Backend}; `close` stops the capacity monitor and the worker client. */
export function createNativeBackend(options: NativeBackendOptions): Backend {
  const { tokenizer, workers, capacity, metrics } = options
  const deps: WorkerRunDeps = { tokenizer, workers, limiter: options.limiter, metrics }
  return {
    name: 'kvfence',
    contextWindow: () => capacity.current().contextWindow,
    refusal: () => capacity.current().refusal,
    async unavailableReason() {
      const now = capacity.current()
      // G1, or a worker that refuses the router's cluster token (the operator's to fix).
      if (now.refusal !== null) return now.refusalReason ?? 'G1'
      try {
        await workers.serverInfoAll(AbortSignal.timeout(healthTimeoutMs))
        return null
      } catch {
        return 'a worker is unreachable'
      }
    },
    serverInfo: () => serverInfo(options),
    maxTokenChars: tokenizer.maxTokenChars,
    sentinelUnit: 'token',
    runIsolationSelfCheck: null,
    detokenize: (ids) => tokenizer.decode(ids),
    async preparePrompt(parsed, tenant, signal, contextWindow) {
      const { numTokens, ids } = await options.tokenizerPool.tokenize(parsed, tenant, signal, {
        keepBelow: contextWindow,
      })
      let tokenIds: number[] | null = null
      // An array only when asked for: a prompt refused for its length (G2) never becomes one.
      return {
        numPromptTokens: numTokens,
        get tokenIds() {
          if (ids === null) {
            throw new KvfenceError(
              'internal_error',
              `the ids of a prompt of ${numTokens} tokens were not kept (its window: ${contextWindow} tokens)`,
            )
          }
          return (tokenIds ??= Array.isArray(ids) ? (ids as number[]) : Array.from(ids))
        },
      }
    },
    async generate(job) {
      const run = {
        request: workerRequest(tokenizer, job),
        stop: job.parsed.stop,
        signal: job.signal,
        log: job.log,
        outcome: job.outcome,
      }
      if (job.writer !== undefined) {
        return job.writer.write(job, (onText) =>
          runGeneration(deps, run, (piece, _logprobs, tokenIds) => onText(piece, tokenIds)),
        )
      }
      const bodies = responseBodiesOf[job.parsed.endpoint]({
        header: job.header,
        isUsageStreamed: job.parsed.isUsageStreamed,
        logprobsTokenizer: run.request.sampling.numLogprobs != null ? tokenizer : null,
      })
      const writeResponse = job.parsed.isStream ? writeStreamedResponse : writeWholeResponse
      await writeResponse(job, bodies, (onText) => runGeneration(deps, run, onText))
    },
    noteFailure(error) {
      if (error.code === 'transfer_failed') metrics.transfers.inc({ status: 'failed' })
      const isWorkerFailure =
        error.code === 'worker_unavailable' || error.code === 'transfer_failed'
      // A worker that failed may have restarted with a smaller pool: re-check G1 now.
      if (isWorkerFailure && error !== capacity.current().refusal) capacity.recheckSoon()
    },
    async close() {
      capacity.close()
      workers.close()
      await options.tokenizerPool.close()
    },
  }
}

/** The request the workers run for `job`: its prompt's ids, sampling, the stop token ids (EOS
 *  unless ignored) and a fresh transfer secret (256 bits). Throws `invalid_request` for a stop
 *  token id outside the vocabulary. */
function workerRequest(tokenizer: Tokenizer, job: GenerationJob): GenerateRequest {
  const { parsed } = job
  checkStopTokenIds(parsed.stopTokenIds, tokenizer.vocabSize)
  const eos = tokenizer.eosTokenId === null || parsed.ignoreEos ? [] : [tokenizer.eosTokenId]
  const { tokenIds } = job.prompt
  assert(tokenIds !== null, `request ${job.rid}: a prompt prepared without token ids`)
  return {
    requestId: job.rid,
    tenant: job.tenant,
    promptTokenIds: tokenIds,
    maxTokens: job.maxTokens,
    sampling: parsed.sampling,
    stopTokenIds: [...new Set([...eos, ...parsed.stopTokenIds])],
    transferSecret: randomHex(32),
    ...(job.prefixCachePartition && { prefixCachePartition: job.prefixCachePartition }),
  }
}

/** The workers' fields of `/server_info`; `worker_unavailable` when one does not answer. */
async function serverInfo(options: NativeBackendOptions): Promise<Record<string, unknown>> {
  let reports
  try {
    reports = await options.workers.serverInfoAll()
  } catch (err) {
    options.log.warn({ detail: messageOf(err) }, 'server_info: a worker did not answer')
    throw new KvfenceError('worker_unavailable', 'a worker did not report its state')
  }
  const infos = reports.map((r) => r.info)
  const now = options.capacity.current()
  return {
    effectiveCapacityTokens: now.effectiveCapacityTokens,
    ...(now.refusal ? { refusing: now.refusal.message } : {}),
    pageSize: options.pageSize,
    guardsEnabled: options.guardsEnabled && infos.every((i) => i.guardsEnabled),
    faults: [...new Set(infos.flatMap((i) => i.faults))].sort(),
    workers: infos,
  }
}
