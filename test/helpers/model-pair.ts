/** The in-process prefill + decode pair of test/engine/pair.ts, over any model instead of the
 *  bundled echo model only, and the single-process greedy answer for that model.
 *  `startPair` there always loads echo-tiny; this variant takes the model as a parameter and
 *  otherwise builds the pair the same way (D's transfer server on 127.0.0.1, G4/G10 following D's
 *  guards, `lost-ack` dropping D's ACKs), so `runRequest` and `makeRequest` of pair.ts drive it. */
import { DecodeWorker } from '../../src/engine/decode-worker.js'
import { buildFaultConfig } from '../../src/engine/faults.js'
import { generateLocal } from '../../src/engine/local-engine.js'
import { PrefillWorker } from '../../src/engine/prefill-worker.js'
import { createWorkerCore } from '../../src/engine/worker-core.js'
import { listen } from '../../src/engine/worker-server.js'
import type { GuardId } from '../../src/kv/guards.js'
import type { Model } from '../../src/model/weights.js'
import { TransferServer } from '../../src/transfer/index.js'
import type { Pair } from '../engine/pair.js'

/** Options of {@link startModelPair}; pages are counted per pool, page size in tokens. */
export interface ModelPairOptions {
  pageSize: number
  prefillPages: number
  decodePages: number
  prefillFaults?: readonly string[]
  decodeFaults?: readonly string[]
  /** Guards off in both workers. */
  off?: readonly GuardId[]
  /** P's transfer timeout (no progress, or no ACK after END), ms; default the sender's. */
  transferTimeoutMs?: number
}

/** Build P and D over `model` and start D's transfer server on 127.0.0.1 (port 0). Faults are
 *  allowed as KVFENCE_ALLOW_FAULTS=1 would allow them; throws as `buildFaultConfig` does for an
 *  unknown fault or guard. */
export async function startModelPair(model: Model, opts: ModelPairOptions): Promise<Pair> {
  const core = (numPages: number, faults: readonly string[] | undefined) =>
    createWorkerCore({
      model,
      numPages,
      pageSize: opts.pageSize,
      faults: buildFaultConfig(faults ?? [], false, { KVFENCE_ALLOW_FAULTS: '1' }, opts.off ?? []),
    })
  const p = core(opts.prefillPages, opts.prefillFaults)
  const d = core(opts.decodePages, opts.decodeFaults)
  const decode = new DecodeWorker(d)
  const receiver = new TransferServer(decode.receiverHooks, {
    verifyManifest: d.guards.G4,
    verifyAuth: d.guards.G10,
    dropAcks: d.hasFault('lost-ack'),
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

/** What the single-process engine (`generateLocal`: one 64-page pool of `pageSize`-token pages,
 *  no faults, every guard on) generates greedily for `promptTokenIds` with `model`, exactly
 *  `maxTokens` tokens (no stop tokens): the answer a pair's tokens are compared with. */
export function greedyTokens(
  model: Model,
  promptTokenIds: readonly number[],
  maxTokens: number,
  pageSize: number,
): number[] {
  const core = createWorkerCore({
    model,
    numPages: 64,
    pageSize,
    faults: buildFaultConfig([], false, {}),
  })
  return generateLocal(core, [...promptTokenIds], {
    maxTokens,
    sampling: { temperature: 0, topP: 1, seed: null },
    stopTokenIds: [],
  }).tokenIds
}
