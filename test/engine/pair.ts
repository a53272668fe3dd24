/** An in-process prefill + decode pair over real loopback TCP, driven the way the router drives the
 *  real processes: decode `generate()` first, and on its `reserved` event, prefill `prefill()`.
 *  Used by the worker tests; each pair has its own pools, guards and faults. */
import { randomBytes } from 'node:crypto'
import { KvfenceError } from '../../src/errors.js'
import type { DecodeEvent, GenerateRequest } from '../../src/engine/control.js'
import { DecodeWorker } from '../../src/engine/decode-worker.js'
import { buildFaultConfig } from '../../src/engine/faults.js'
import { generateLocal } from '../../src/engine/local-engine.js'
import { PrefillWorker } from '../../src/engine/prefill-worker.js'
import { createWorkerCore, type WorkerCore } from '../../src/engine/worker-core.js'
import { listen } from '../../src/engine/worker-server.js'
import type { GuardId } from '../../src/kv/guards.js'
import { loadModel, type Model } from '../../src/model/weights.js'
import { TransferServer, type TransferServerOptions } from '../../src/transfer/index.js'
import { echoModelDir } from '../helpers/paths.js'
import { waitUntil } from '../helpers/poll.js'

let model: Model | null = null
/** The bundled echo model, loaded once per test file. */
export function echoModel(): Model {
  model ??= loadModel(echoModelDir)
  return model
}

/** What the single-process engine (`generateLocal`: one 64-page pool of 16-token pages, no
 *  faults) generates greedily for `promptTokenIds`, up to `maxTokens` tokens and with no stop
 *  tokens: the independent answer a pair's tokens are compared with. */
export function greedyOracle(promptTokenIds: number[], maxTokens: number): number[] {
  const core = createWorkerCore({
    model: echoModel(),
    numPages: 64,
    pageSize: 16,
    faults: buildFaultConfig([], false, {}),
  })
  return generateLocal(core, promptTokenIds, {
    maxTokens,
    sampling: { temperature: 0, topP: 1, seed: null },
    stopTokenIds: [],
  }).tokenIds
}

/** Options of {@link startPair}. */
export interface PairOptions {
  pageSize?: number
  prefillPages?: number
  decodePages?: number
  prefillFaults?: string[]
  decodeFaults?: string[]
  /** Guards off in both workers. */
  off?: GuardId[]
  /** Extra options for D's transfer server (G4/G10 follow D's guards unless given here). */
  receiver?: TransferServerOptions
  transferTimeoutMs?: number
}

/** A running pair. */
export interface Pair {
  prefill: PrefillWorker
  decode: DecodeWorker
  receiver: TransferServer
  p: WorkerCore
  d: WorkerCore
  port: number
  close(): Promise<void>
}

const allowFaults = { KVFENCE_ALLOW_FAULTS: '1' }

/** Build P and D and start D's transfer server on 127.0.0.1 (port 0). */
export async function startPair(opts: PairOptions = {}): Promise<Pair> {
  const pageSize = opts.pageSize ?? 16
  const core = (pages: number, faults: string[] | undefined) =>
    createWorkerCore({
      model: echoModel(),
      numPages: pages,
      pageSize,
      faults: buildFaultConfig(faults ?? [], false, allowFaults, opts.off ?? []),
    })
  const p = core(opts.prefillPages ?? 24, opts.prefillFaults)
  const d = core(opts.decodePages ?? 32, opts.decodeFaults)
  const decode = new DecodeWorker(d)
  const receiver = new TransferServer(decode.receiverHooks, {
    verifyManifest: d.guards.G4,
    verifyAuth: d.guards.G10,
    dropAcks: d.hasFault('lost-ack'),
    ...opts.receiver,
  })
  const port = await listen(receiver, '127.0.0.1', 0)
  const prefill = new PrefillWorker(p, { transferTimeoutMs: opts.transferTimeoutMs })
  return {
    prefill,
    decode,
    receiver,
    p,
    d,
    port,
    close: async () => {
      prefill.close()
      await new Promise<void>((resolve) => receiver.close(() => resolve()))
    },
  }
}

/** A fresh request for `tenant`: greedy sampling, a new id and secret. */
export function makeRequest(
  tenant: string,
  promptTokenIds: number[],
  maxTokens: number,
): GenerateRequest {
  return {
    requestId: randomBytes(16).toString('hex'),
    tenant,
    promptTokenIds,
    maxTokens,
    sampling: { temperature: 0, topP: 1, seed: null },
    stopTokenIds: [],
    transferSecret: randomBytes(32).toString('hex'),
  }
}

/** How one request ended on each side. */
export interface Outcome {
  events: DecodeEvent[]
  tokenIds: number[]
  /** D's error, or null when generate() resolved. */
  decodeError: KvfenceError | null
  /** P's error, null when prefill() resolved, undefined when it never ran. */
  prefillError: KvfenceError | null | undefined
}

/** Run `req` through the pair as the router does. `hooks.onReserved` runs on D's `reserved`
 *  event (before prefill starts); `hooks.onToken` on each token. Both signals default to fresh ones. */
export async function runRequest(
  pair: Pair,
  req: GenerateRequest,
  hooks: {
    decodeSignal?: AbortSignal
    prefillSignal?: AbortSignal
    onToken?: (n: number) => void
  } = {},
): Promise<Outcome> {
  const events: DecodeEvent[] = []
  let prefillRun: Promise<KvfenceError | null> | undefined
  // As the router does: a failed prefill aborts the decode request too.
  const routerAbort = new AbortController()
  const decodeSignal =
    hooks.decodeSignal === undefined
      ? routerAbort.signal
      : AbortSignal.any([hooks.decodeSignal, routerAbort.signal])
  const decodeError = await pair.decode
    .generate(req, decodeSignal, (e) => {
      events.push(e)
      if (e.type === 'reserved') {
        prefillRun = pair.prefill
          .prefill(
            {
              requestId: req.requestId,
              tenant: req.tenant,
              promptTokenIds: req.promptTokenIds,
              sampling: req.sampling,
              transferSecret: req.transferSecret,
              decode: { host: '127.0.0.1', port: pair.port },
            },
            hooks.prefillSignal ?? new AbortController().signal,
          )
          .then(
            () => null,
            (err: unknown) => {
              routerAbort.abort()
              return asError(err)
            },
          )
      }
      if (e.type === 'token') hooks.onToken?.(events.filter((x) => x.type === 'token').length)
    })
    .then(
      () => null,
      (err: unknown) => asError(err),
    )
  const prefillError = prefillRun === undefined ? undefined : await prefillRun
  return {
    events,
    tokenIds: events.flatMap((e) => (e.type === 'token' ? [e.tokenId] : [])),
    decodeError,
    prefillError,
  }
}

function asError(err: unknown): KvfenceError {
  if (err instanceof KvfenceError) return err
  throw err // anything else is a bug in the code under test: let the test fail on it
}

/** Wait until `cond()` holds (polling every 5 ms), at most `ms`. */
export async function until(cond: () => boolean, ms = 5_000): Promise<void> {
  await waitUntil(cond, { timeoutMs: ms, intervalMs: 5 })
}

/** `text` as the echo model's token ids (char-level: BOS, then one id per character). */
export function tokensOf(text: string): number[] {
  return [1, ...[...text].map((c) => c.charCodeAt(0) - 32 + 5)]
}
