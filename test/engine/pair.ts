/** An in-process prefill + decode pair over real loopback TCP, driven by the router's own hand-off
 *  (`handOff` of src/control/handoff.ts: D reserves first, then P prefills with D's address).
 *  Used by the worker tests; each pair has its own pools, guards and faults. */
import { randomBytes } from 'node:crypto'
import { KvfenceError } from '../../src/common/errors.js'
import type { DecodeEvent, GenerateRequest } from '../../src/control/messages.js'
import { DecodeWorker } from '../../src/engine/decode-worker.js'
import { buildFaultConfig } from '../../src/engine/faults.js'
import {
  handOff,
  type DecodeSide,
  type GenerationEvent,
  type PrefillSide,
} from '../../src/control/handoff.js'
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
  /** Every event D emitted, as it emitted it (the hand-off may hold the first token back). */
  events: DecodeEvent[]
  /** The tokens of {@link Outcome.events}. */
  tokenIds: number[]
  /** D's error, or null when generate() resolved. */
  decodeError: KvfenceError | null
  /** P's error, null when prefill() resolved, undefined when it never ran. */
  prefillError: KvfenceError | null | undefined
  /** What the hand-off let out, as the router's client would see it. */
  released: GenerationEvent[]
  /** The hand-off's error (how the router would end the request), or null. */
  error: KvfenceError | null
}

/** Run `req` through the pair with the router's hand-off. `hooks.decodeSignal` aborts D alone,
 *  `hooks.prefillSignal` P alone; `hooks.onToken(n)` runs as D emits its n-th token, before the
 *  hand-off releases it. P is given only `hooks.prefillSignal`, never the hand-off's: the worker
 *  tests observe how P's transfer ends on its own (a NACK, a stall), which an abort from the
 *  hand-off on D's failure would pre-empt. D gets the hand-off's, so a failed prefill aborts it.
 *  The hand-off's own checks are on, as in the router as shipped. */
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
  let decodeRun: Promise<KvfenceError | null> = Promise.resolve(null)
  let prefillRun: Promise<KvfenceError | null> | undefined
  const decode: DecodeSide = {
    name: 'in-process D',
    generate: (request, signal) => {
      const stream = new EventStream()
      const decodeSignal =
        hooks.decodeSignal === undefined ? signal : AbortSignal.any([hooks.decodeSignal, signal])
      decodeRun = pair.decode
        .generate(request, decodeSignal, (e) => {
          events.push(e)
          stream.push(e)
          if (e.type === 'token') hooks.onToken?.(events.filter((x) => x.type === 'token').length)
        })
        .then(
          () => {
            stream.end()
            return null
          },
          (err: unknown) => {
            stream.fail(err)
            return asError(err)
          },
        )
      return stream
    },
    transferAddress: () => Promise.resolve({ host: '127.0.0.1', port: pair.port }),
  }
  const prefill: PrefillSide = {
    name: 'in-process P',
    prefill: (request) => {
      const run = pair.prefill.prefill(request, hooks.prefillSignal ?? new AbortController().signal)
      prefillRun = run.then(
        () => null,
        (err: unknown) => asError(err),
      )
      return run
    },
  }
  const released: GenerationEvent[] = []
  let error: KvfenceError | null = null
  try {
    for await (const e of handOff(req, decode, prefill, { signal: new AbortController().signal }))
      released.push(e)
  } catch (err) {
    error = asError(err)
  }
  const decodeError = await decodeRun
  const prefillError = prefillRun === undefined ? undefined : await prefillRun
  return {
    events,
    tokenIds: events.flatMap((e) => (e.type === 'token' ? [e.tokenId] : [])),
    decodeError,
    prefillError,
    released,
    error,
  }
}

/** D's events, pushed by its `emit` callback, as the async iterable a {@link DecodeSide} yields:
 *  D never waits for its reader, so events queue here while the hand-off holds a token. */
class EventStream implements AsyncIterable<DecodeEvent> {
  private readonly queue: DecodeEvent[] = []
  private ending: { error: unknown } | 'done' | null = null
  private wake: (() => void) | null = null

  push(e: DecodeEvent): void {
    this.queue.push(e)
    this.wake?.()
  }
  end(): void {
    this.ending ??= 'done'
    this.wake?.()
  }
  fail(error: unknown): void {
    this.ending ??= { error }
    this.wake?.()
  }

  async *[Symbol.asyncIterator](): AsyncGenerator<DecodeEvent> {
    for (;;) {
      const e = this.queue.shift()
      if (e !== undefined) {
        yield e
        continue
      }
      if (this.ending === 'done') return
      if (this.ending !== null) throw this.ending.error
      await new Promise<void>((resolve) => (this.wake = resolve))
      this.wake = null
    }
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
