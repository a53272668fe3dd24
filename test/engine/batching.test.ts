/** Continuous batching and chunked prefill, in process, on the bundled model: a batched forward
 *  step gives every sequence exactly the logits of a forward pass over it alone; the decode loop
 *  emits exactly the single-process engine's tokens for every sequence however they share steps;
 *  a failure or abort in one sequence ends that sequence only; the prefill loop keeps its step
 *  budget and shares it fairly. The oracles are `forward()` on one sequence and `generateLocal`. */
import assert from 'node:assert/strict'
import { spawnSync } from 'node:child_process'
import { describe, it } from 'node:test'
import { DecodeScheduler, type DecodeJob } from '../../src/engine/decode-scheduler.js'
import type { DecodeEvent, GenerateRequest } from '../../src/control/messages.js'
import { DecodeWorker } from '../../src/engine/decode-worker.js'
import { buildFaultConfig } from '../../src/engine/faults.js'
import { generateLocal } from '../../src/engine/local-engine.js'
import { fairShares, PrefillScheduler } from '../../src/engine/prefill-scheduler.js'
import { Sequence } from '../../src/engine/sequence.js'
import { createWorkerCore, type WorkerCore } from '../../src/engine/worker-core.js'
import { GuardError } from '../../src/kv/guards.js'
import { leasePrefix, type PageLease } from '../../src/kv/pool.js'
import { forward, forwardBatch, makeRope } from '../../src/model/forward.js'
import { createTsKernels } from '../../src/model/kernels.js'
import { makeRandom, sample } from '../../src/model/sampling.js'
import { loadTokenizer } from '../../src/model/tokenizer.js'
import { loadModel, type Model } from '../../src/model/weights.js'
import { cliPath, echoModelDir } from '../helpers/paths.js'

const tokenizer = loadTokenizer(echoModelDir)
const wasmModel = loadModel(echoModelDir)
const { vocabSize } = wasmModel.config
const eos = tokenizer.eosTokenId === null ? [] : [tokenizer.eosTokenId]

const texts = [
  'the quiet river Zk3pQ9 runs past the mill',
  'hello',
  'a market opens before the morning bread and the baker sings 7Yt2mW0q loudly',
  'stone garden, green field, summer rain; stone garden, green field',
  'Rv8',
  'one two three four five six seven eight nine ten eleven twelve',
]
const prompts = texts.map((t) => tokenizer.encode(t))

function makeCore(model: Model = wasmModel, numPages = 128): WorkerCore {
  return createWorkerCore({
    model,
    numPages,
    pageSize: 16,
    faults: buildFaultConfig([], false, {}),
  })
}

function own(core: WorkerCore, numTokens: number): { lease: PageLease } {
  const owner = core.nextOwner()
  return { lease: core.pool.allocate(core.pool.pagesFor(numTokens), owner, 1) }
}

/** A sequence of prompt `ids` over `lease` (sampling and stop tokens are the loops' callers' concern
 *  in these tests). */
function sequenceOf(ids: readonly number[], lease: PageLease, maxTokens = 1): Sequence {
  return new Sequence({
    id: `r${lease.owner}`,
    tenant: 'alpha',
    promptTokenIds: ids,
    sampling: { temperature: 0, topP: 1, seed: null },
    maxTokens,
    stopTokenIds: new Set(eos),
    lease,
  })
}

/** Logits of every prompt token and of `steps` greedy decode steps, one sequence at a time. */
function aloneLogits(model: Model, ids: number[], steps: number): Float32Array[] {
  const core = makeCore(model)
  const seq = own(core, ids.length + steps)
  const out = [forward(model, core.rope, core.pool, seq, ids, 0, true)]
  let token = 2
  for (let i = 0; i < steps; i++) {
    out.push(forward(model, core.rope, core.pool, seq, [token], ids.length + i))
    token = (token * 7 + i) % model.config.vocabSize
  }
  return out
}

describe('forwardBatch', () => {
  for (const [name, model] of [
    ['WebAssembly SIMD', wasmModel],
    ['plain TypeScript', loadModel(echoModelDir, { kernels: createTsKernels() })],
  ] as const) {
    it(`gives each sequence bit-identical logits to forward() on it alone (${name} kernels)`, () => {
      const steps = 3
      const chosen = prompts.slice(0, 4)
      const oracle = chosen.map((ids) => aloneLogits(model, ids, steps))
      const core = makeCore(model)
      const seqs = chosen.map((ids) => own(core, ids.length + steps))
      // Prefill of all prompts in one step, then batched decode steps.
      const prefilled = forwardBatch(
        model,
        core.rope,
        core.pool,
        seqs.map((s, i) => ({ ...s, tokenIds: chosen[i], startPos: 0, allLogits: true })),
      )
      prefilled.forEach((r, i) => assert.deepEqual(r, { logits: oracle[i][0] }))
      let token = 2
      for (let step = 0; step < steps; step++) {
        const results = forwardBatch(
          model,
          core.rope,
          core.pool,
          seqs.map((s, i) => ({ ...s, tokenIds: [token], startPos: chosen[i].length + step })),
        )
        results.forEach((r, i) => assert.deepEqual(r, { logits: oracle[i][step + 1] }))
        token = (token * 7 + step) % model.config.vocabSize
      }
      core.pool.check()
    })
  }

  it('fails only the sequence whose pages are not its own (G5), and counts one trip', () => {
    const core = makeCore()
    const [a, b, c] = prompts
    const oracleA = aloneLogits(wasmModel, a, 0)[0]
    const oracleC = aloneLogits(wasmModel, c, 0)[0]
    const seqA = own(core, a.length)
    const seqB = own(core, b.length)
    const seqC = own(core, c.length)
    // B's pages were freed and handed to another request: B's page table is stale.
    core.pool.release(seqB.lease)
    own(core, b.length)
    const results = forwardBatch(wasmModel, core.rope, core.pool, [
      { ...seqA, tokenIds: a, startPos: 0, allLogits: true },
      { ...seqB, tokenIds: b, startPos: 0 },
      { ...seqC, tokenIds: c, startPos: 0, allLogits: true },
    ])
    assert.deepEqual(results[0], { logits: oracleA })
    assert.deepEqual(results[2], { logits: oracleC })
    const err = (results[1] as { error: Error }).error
    assert.ok(err instanceof GuardError)
    assert.equal(err.guard, 'G5')
    assert.equal(core.trips.counts.G5, 1)
  })

  it('fails only a sequence that would leave a hole in its KV (G5 write claim)', () => {
    const core = makeCore()
    const [a, b] = prompts
    const seqA = own(core, a.length)
    const seqB = own(core, 40)
    // B claims to continue at position 20 of pages that hold nothing: the write claim is refused.
    const results = forwardBatch(wasmModel, core.rope, core.pool, [
      { ...seqA, tokenIds: a, startPos: 0, allLogits: true },
      { ...seqB, tokenIds: b, startPos: 20 },
    ])
    assert.deepEqual(results[0], { logits: aloneLogits(wasmModel, a, 0)[0] })
    assert.match(
      (results[1] as { error: Error }).error.message,
      /^G5: write at position 20 leaves positions 16\.\.19 of page \d+ unwritten$/,
    )
  })

  it('fails only a sequence whose read is refused mid-step (unwritten KV), the others go on', () => {
    const core = makeCore()
    const [a, b] = prompts
    const seqA = own(core, a.length)
    const seqB = own(core, 40)
    // B writes at the start of its second page (allowed) but would read its empty first page.
    const results = forwardBatch(wasmModel, core.rope, core.pool, [
      { ...seqA, tokenIds: a, startPos: 0, allLogits: true },
      { ...seqB, tokenIds: b, startPos: 16 },
    ])
    assert.deepEqual(results[0], { logits: aloneLogits(wasmModel, a, 0)[0] })
    const page = seqB.lease.pages[0].page
    assert.equal(
      (results[1] as { error: Error }).error.message,
      `G5: page ${page} holds 0 tokens; owner ${seqB.lease.owner} reads 16 (unwritten KV)`,
    )
  })

  it('fails only the sequence whose positions exceed max_position_embeddings', () => {
    const core = makeCore(wasmModel, 80)
    const [a] = prompts
    const seqA = own(core, a.length)
    const seqB = own(core, 1040)
    const results = forwardBatch(wasmModel, core.rope, core.pool, [
      { ...seqB, tokenIds: [5, 6], startPos: 1023 },
      { ...seqA, tokenIds: a, startPos: 0, allLogits: true },
    ])
    const err = (results[0] as { error: Error }).error
    assert.ok(err instanceof RangeError)
    assert.equal(err.message, 'positions up to 1025 exceed max_position_embeddings 1024')
    assert.deepEqual(results[1], { logits: aloneLogits(wasmModel, a, 0)[0] })
  })
})

// -------------------------------------------------------------------------------------------------
// The decode loop

interface Spec {
  ids: number[]
  maxTokens: number
  temperature: number
  seed: number | null
}

/** Prefill `spec.ids` into fresh pages as the prefill worker would (first token drawn with `seed`),
 *  and describe the sequence for the decode loop (decode draws with `seed + 1`). */
function prepare(
  core: WorkerCore,
  spec: Spec,
  hooks: { signal?: AbortSignal; onToken?: (n: number) => void } = {},
): { job: DecodeJob; tokens: number[]; events: DecodeEvent[]; lease: PageLease } {
  const { ids, maxTokens, temperature, seed } = spec
  const { lease } = own(core, ids.length + maxTokens)
  const logits = forward(core.model, core.rope, core.pool, { lease }, ids, 0)
  const params = { temperature, topP: 1 }
  const firstTokenId = sample(logits, { ...params, random: makeRandom(seed ?? 0) })
  core.pool.seal(leasePrefix(lease, Math.floor(ids.length / 16)))
  const random = makeRandom((seed ?? 0) + 1)
  const tokens: number[] = []
  const events: DecodeEvent[] = []
  return {
    tokens,
    events,
    lease,
    job: {
      seq: sequenceOf(ids, lease, maxTokens),
      firstTokenId,
      sampleNext: (l) => ({ tokenId: sample(l, { ...params, random }) }),
      signal: hooks.signal ?? new AbortController().signal,
      emit: (e) => {
        events.push(e)
        if (e.type === 'token') {
          tokens.push(e.tokenId)
          hooks.onToken?.(tokens.length)
        }
      },
    },
  }
}

function local(spec: Spec): number[] {
  return generateLocal(makeCore(), spec.ids, {
    maxTokens: spec.maxTokens,
    sampling: { temperature: spec.temperature, topP: 1, seed: spec.seed },
    stopTokenIds: eos,
  }).tokenIds
}

const specs: Spec[] = prompts.map((ids, i) => ({
  ids,
  maxTokens: 6 + 5 * i,
  temperature: i % 2 === 0 ? 0 : 0.8,
  seed: 1000 + i,
}))

describe('DecodeScheduler (continuous batching)', () => {
  it('emits exactly the single-process tokens for every sequence while they share steps', async () => {
    const core = makeCore()
    const sizes: number[] = []
    const loop = new DecodeScheduler(core.model, core.rope, core.pool, {
      maxBatch: 4,
      onStep: (n) => sizes.push(n),
    })
    const runs = specs.map((s) => prepare(core, s))
    await Promise.all(runs.map((r) => loop.run(r.job)))
    runs.forEach((r, i) => {
      assert.deepEqual(r.tokens, local(specs[i]), `sequence ${i}`)
      const done = r.events.at(-1)
      assert.deepEqual(done, {
        type: 'done',
        finishReason: eos.includes(r.tokens.at(-1)!) ? 'stop' : 'length',
        promptTokens: specs[i].ids.length,
        completionTokens: r.tokens.length,
      })
      core.pool.release(r.lease)
    })
    // Six sequences, at most four per step: the batch was full, and the last ones joined later.
    assert.equal(Math.max(...sizes), 4)
    assert.equal(loop.numRunning + loop.numWaiting, 0)
    core.pool.check()
    assert.equal(core.pool.numUsed, 0)
  })

  it('lets a sequence join a running batch between steps and still emits its exact tokens', async () => {
    const core = makeCore()
    const loop = new DecodeScheduler(core.model, core.rope, core.pool, { maxBatch: 8 })
    const late = prepare(core, specs[2])
    let joined: Promise<void> | undefined
    const early = prepare(core, specs[5], {
      onToken: (n) => {
        if (n === 3) joined = loop.run(late.job) // while the first is mid-decode
      },
    })
    await loop.run(early.job)
    await joined
    assert.deepEqual(early.tokens, local(specs[5]))
    assert.deepEqual(late.tokens, local(specs[2]))
  })

  it('ends only the sequence whose pages were freed under it (G5), the others finish exactly', async () => {
    const core = makeCore()
    const loop = new DecodeScheduler(core.model, core.rope, core.pool, { maxBatch: 8 })
    const runs = specs.slice(0, 3).map((s, i) =>
      prepare(
        core,
        { ...s, maxTokens: 20 },
        {
          onToken: (n) => {
            // An early-release bug: after its 3rd token, sequence 1's pages go to another request.
            if (i === 1 && n === 3) {
              core.pool.release(runs[1].lease)
              own(core, 16)
            }
          },
        },
      ),
    )
    const outcomes = await Promise.allSettled(runs.map((r) => loop.run(r.job)))
    assert.equal(outcomes[0].status, 'fulfilled')
    assert.equal(outcomes[2].status, 'fulfilled')
    const reason = (outcomes[1] as PromiseRejectedResult).reason as GuardError
    assert.ok(reason instanceof GuardError)
    assert.equal(reason.guard, 'G5')
    assert.equal(runs[1].tokens.length, 3) // no token after the pages were lost
    assert.equal(runs[1].events.filter((e) => e.type === 'done').length, 0)
    assert.deepEqual(runs[0].tokens, local({ ...specs[0], maxTokens: 20 }))
    assert.deepEqual(runs[2].tokens, local({ ...specs[2], maxTokens: 20 }))
  })

  it('ends an aborted sequence with request_aborted at the next step, the others finish exactly', async () => {
    const core = makeCore()
    const loop = new DecodeScheduler(core.model, core.rope, core.pool, { maxBatch: 8 })
    const abort = new AbortController()
    const spec = { ...specs[3], maxTokens: 30 }
    const aborted = prepare(core, spec, {
      signal: abort.signal,
      onToken: (n) => n === 2 && abort.abort(),
    })
    const other = prepare(core, specs[4])
    const [a, b] = await Promise.allSettled([loop.run(aborted.job), loop.run(other.job)])
    assert.equal(b.status, 'fulfilled')
    assert.equal((a as PromiseRejectedResult).reason.code, 'request_aborted')
    assert.equal(aborted.tokens.length, 2)
    assert.deepEqual(other.tokens, local(specs[4]))
  })

  it('refuses a sequence with capacity_exhausted when the batch is full and the queue is at its bound', async () => {
    const core = makeCore()
    const loop = new DecodeScheduler(core.model, core.rope, core.pool, {
      maxBatch: 1,
      maxWaiting: 1,
    })
    const runs = specs.slice(0, 3).map((s) => prepare(core, { ...s, maxTokens: 8 }))
    const first = loop.run(runs[0].job)
    const second = loop.run(runs[1].job)
    await new Promise((r) => setImmediate(r)) // the loop admits the first sequence
    await assert.rejects(loop.run(runs[2].job), {
      code: 'capacity_exhausted',
      message: 'decode worker busy: 1 sequences running and 1 waiting',
    })
    assert.deepEqual(runs[2].events, []) // refused before any event
    await Promise.all([first, second])
    assert.deepEqual(runs[1].tokens, local({ ...specs[1], maxTokens: 8 }))
  })

  it('`kvfence decode --max-batch 0` exits 2 with a one-line error', () => {
    const run = spawnSync(process.execPath, [cliPath, 'decode', '--max-batch', '0'], {
      encoding: 'utf8',
    })
    assert.equal(run.status, 2)
    assert.equal(
      run.stderr,
      `error: option '--max-batch <n>' argument '0' is invalid. expected an integer ≥ 1, got "0"\n`,
    )
  })

  it('rejects a batch bound below 1', () => {
    assert.throws(
      () => new DecodeScheduler(wasmModel, makeRope(wasmModel), makeCore().pool, { maxBatch: 0 }),
      { name: 'RangeError', message: 'max batch must be an integer ≥ 1, got 0' },
    )
  })
})

// -------------------------------------------------------------------------------------------------
// The prefill loop

describe('PrefillScheduler (chunked prefill)', () => {
  it('splits each step budget fairly (water filling, leftovers in turn)', () => {
    assert.deepEqual(fairShares([20, 6], 8, 0), [4, 4])
    assert.deepEqual(fairShares([16, 2], 8, 1), [6, 2])
    assert.deepEqual(fairShares([5, 5, 5], 8, 0), [3, 3, 2])
    assert.deepEqual(fairShares([5, 5, 5], 8, 1), [2, 3, 3])
    assert.deepEqual(fairShares([5, 5, 5], 2, 0), [1, 1, 0])
    assert.deepEqual(fairShares([5, 5, 5], 2, 1), [0, 1, 1])
    assert.deepEqual(fairShares([3, 1], 256, 0), [3, 1])
    assert.deepEqual(fairShares([], 8, 0), [])
  })

  it('prefills concurrent prompts within the step budget to exactly the logits of one forward each', async () => {
    const core = makeCore()
    const steps: number[][] = []
    const loop = new PrefillScheduler(core.model, core.rope, core.pool, {
      maxTokensPerStep: 8,
      onStep: (s) => steps.push(s),
    })
    const long = prompts[2].slice(0, 20)
    const short = prompts[0].slice(0, 6)
    const order: string[] = []
    const [logitsLong, logitsShort] = await Promise.all(
      [
        ['long', long],
        ['short', short],
      ].map(([name, ids]) =>
        loop
          .run({
            seq: sequenceOf(ids as number[], own(core, ids.length).lease),
            signal: new AbortController().signal,
          })
          .then((l) => (order.push(name as string), l)),
      ),
    )
    assert.deepEqual(steps, [[4, 4], [6, 2], [8], [2]])
    assert.deepEqual(order, ['short', 'long']) // the short prompt did not wait for the long one
    assert.deepEqual(logitsLong, aloneLogits(wasmModel, long, 0)[0].subarray(19 * vocabSize))
    assert.deepEqual(logitsShort, aloneLogits(wasmModel, short, 0)[0].subarray(5 * vocabSize))
  })

  it('ends an aborted prompt with request_aborted and a failed one with its guard error, the other completes', async () => {
    const core = makeCore()
    const loop = new PrefillScheduler(core.model, core.rope, core.pool, { maxTokensPerStep: 4 })
    const abort = new AbortController()
    const ok = prompts[3]
    const stale = own(core, 10)
    core.pool.release(stale.lease) // freed: the job's page table is stale
    const runs = [
      loop.run({
        seq: sequenceOf(prompts[2], own(core, prompts[2].length).lease),
        signal: abort.signal,
      }),
      loop.run({ seq: sequenceOf(prompts[1], stale.lease), signal: new AbortController().signal }),
      loop.run({
        seq: sequenceOf(ok, own(core, ok.length).lease),
        signal: new AbortController().signal,
      }),
    ]
    setImmediate(() => abort.abort())
    const [a, b, c] = await Promise.allSettled(runs)
    assert.equal((a as PromiseRejectedResult).reason.code, 'request_aborted')
    assert.equal(((b as PromiseRejectedResult).reason as GuardError).guard, 'G5')
    assert.deepEqual(
      (c as PromiseFulfilledResult<Float32Array>).value,
      aloneLogits(wasmModel, ok, 0)[0].subarray((ok.length - 1) * vocabSize),
    )
  })
})

describe('DecodeWorker: a full decode loop refuses before reserving', () => {
  const request = (n: number): GenerateRequest => ({
    requestId: n.toString(16).padStart(32, '0'),
    tenant: 'alpha',
    promptTokenIds: [5, 6, 7, 8],
    maxTokens: 4,
    sampling: { temperature: 0, topP: 1, seed: null },
    stopTokenIds: [],
    transferSecret: 'ab'.repeat(32),
  })

  it('with room for one sequence, a second request gets capacity_exhausted and no page', async () => {
    const core = makeCore()
    const decode = new DecodeWorker(core, { maxBatch: 1, maxWaiting: 0 })
    const first = new AbortController()
    const firstEvents: DecodeEvent[] = []
    const firstDone = decode
      .generate(request(1), first.signal, (e) => firstEvents.push(e))
      .catch((e: unknown) => e)
    // The first holds its reservation, waiting for its transfer (1 prompt page + room to decode).
    assert.deepEqual(firstEvents, [{ type: 'reserved', numPages: 1 }])
    const usedByFirst = core.pool.numUsed

    const secondEvents: DecodeEvent[] = []
    await assert.rejects(
      decode.generate(request(2), new AbortController().signal, (e) => secondEvents.push(e)),
      { code: 'capacity_exhausted' },
    )
    assert.deepEqual(secondEvents, [], 'refused before its reserved event')
    assert.equal(core.pool.numUsed, usedByFirst, 'the refused request reserved no page')

    first.abort()
    assert.equal(((await firstDone) as { code?: string }).code, 'request_aborted')
    assert.equal(core.pool.numUsed, 0)
    // Room again: the next request is reserved.
    const third = new AbortController()
    const thirdEvents: DecodeEvent[] = []
    const thirdDone = decode.generate(request(3), third.signal, (e) => thirdEvents.push(e))
    assert.equal(thirdEvents[0]?.type, 'reserved')
    third.abort()
    await thirdDone.catch(() => {})
    assert.equal(core.pool.numUsed, 0)
  })
})
