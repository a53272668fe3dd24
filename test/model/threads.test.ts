/** Compute threads: a model whose kernels split every call between 2 (or 3) threads gives logits
 *  bit-identical to the same model on one thread (F32 and BF16 storage, multi-token prefill,
 *  batched and single decode), on every checkpoint of models/test/ (and within 1e-4 of their
 *  float64 PyTorch references) and on the bundled echo model; helper threads stop on close. What
 *  needs a process of its own (a stall, the exit with helpers running) is in
 *  threads-process.test.ts. No timing here: speed is in `npm run bench -- model`. */
import assert from 'node:assert/strict'
import { readdirSync, readFileSync } from 'node:fs'
import { join } from 'node:path'
import { after, describe, it } from 'node:test'
import { forward, forwardBatch, makeRope } from '../../src/model/forward.js'
import { createWasmKernels, kernelsWasmPath } from '../../src/model/kernels-wasm.js'
import { Op } from '../../src/model/threads/protocol.js'
import { ComputeThreadsError, startTeam } from '../../src/model/threads/team.js'
import { loadModel, type Model } from '../../src/model/weights.js'
import { echoModelDir, repoRoot } from '../helpers/paths.js'
import { maxAbsDiff, scatteredSequence } from './helpers.js'

const testModels = join(repoRoot, 'models', 'test')

/** Bit patterns of a logits array: equal arrays of these mean bit-identical floats. */
const bits = (a: Float32Array) => new Uint32Array(a.buffer, a.byteOffset, a.length)

/** A model on kernels with `threads` threads that split every call, however small. */
function load(dir: string, threads: number, keepBf16: boolean): Model {
  const kernels = createWasmKernels({ threads, parallelMinWork: 0 })
  return loadModel(dir, { kernels, keepBf16 })
}

/** Logits of: a 23-token prefill (every position), two decode steps, and one batched decode step
 *  of three sequences over their own pages. */
function logitsOf(model: Model): Float32Array[] {
  const rope = makeRope(model)
  const vocab = model.config.vocabSize
  const ids = Array.from({ length: 23 }, (_, i) => (i * 37 + 11) % vocab)
  const { pool, seq } = scatteredSequence(model, 4, 26)
  const out = [forward(model, rope, pool, seq, ids, 0, true)]
  out.push(forward(model, rope, pool, seq, [5 % vocab], 23))
  out.push(forward(model, rope, pool, seq, [9 % vocab], 24))
  const seqs = [0, 1, 2].map((i) => ({ lease: pool.allocate(pool.pagesFor(6), 100 + i, 1) }))
  seqs.forEach((s, i) => forward(model, rope, pool, s, ids.slice(i, i + 5), 0))
  const step = forwardBatch(
    model,
    rope,
    pool,
    seqs.map((s, i) => ({ ...s, tokenIds: [(i + 3) % vocab], startPos: 5 })),
  )
  for (const r of step) {
    if ('error' in r) throw r.error
    out.push(r.logits)
  }
  return out.map((l) => l.slice())
}

/** The compiled kernels over a fresh one-page (64 KiB) shared memory: module, memory, and the
 *  calling thread's own instance. */
function oneKernelInstance(): { memory: object; module: object; own: never } {
  const { WebAssembly: wa } = globalThis as unknown as {
    WebAssembly: {
      Memory: new (d: object) => object
      Module: new (b: Uint8Array) => object
      Instance: new (m: object, i: object) => { exports: object }
    }
  }
  const memory = new wa.Memory({ initial: 1, maximum: 16, shared: true })
  const module = new wa.Module(readFileSync(kernelsWasmPath))
  return { memory, module, own: new wa.Instance(module, { env: { memory } }).exports as never }
}

describe('compute threads give bit-identical logits', () => {
  const cases: { name: string; dir: string; keepBf16: boolean; reference: boolean }[] = [
    { name: 'echo-tiny (F32)', dir: echoModelDir, keepBf16: true, reference: false },
  ]
  for (const name of readdirSync(testModels).sort()) {
    const dir = join(testModels, name)
    cases.push({ name, dir, keepBf16: true, reference: true })
    if (name.includes('bf16'))
      cases.push({ name: `${name} widened to F32`, dir, keepBf16: false, reference: true })
  }
  for (const c of cases) {
    it(`${c.name}: 2 and 3 threads equal 1 thread bit for bit`, () => {
      const models = [1, 2, 3].map((t) => load(c.dir, t, c.keepBf16))
      try {
        assert.equal(
          models[0].layers[0].wq.dtype,
          c.keepBf16 && c.name.includes('bf16') ? 'bf16' : 'f32',
        )
        const [one, ...more] = models.map(logitsOf)
        for (const [i, other] of more.entries())
          for (const [j, logits] of other.entries())
            assert.deepEqual(bits(logits), bits(one[j]), `${i + 2} threads, output ${j}`)
        if (c.reference) {
          const ref = JSON.parse(readFileSync(join(c.dir, 'reference.json'), 'utf8')) as {
            ids: number[]
            logits: number[][]
          }
          const m = models[1]
          const { pool, seq } = scatteredSequence(m, 4, ref.ids.length)
          const got = forward(m, makeRope(m), pool, seq, ref.ids, 0, true)
          const v = m.config.vocabSize
          for (const [p, want] of ref.logits.entries())
            assert.ok(maxAbsDiff(got.subarray(p * v, (p + 1) * v), want) <= 1e-4, `position ${p}`)
        }
      } finally {
        for (const m of models) m.kernels.close()
      }
    })
  }
})

describe('compute thread life cycle', () => {
  const kernels: { close(): void }[] = []
  after(() => kernels.forEach((k) => k.close()))

  it('keeps computing the same values on the calling thread after close', () => {
    const model = load(echoModelDir, 2, true)
    kernels.push(model.kernels)
    assert.equal(model.kernels.threads, 2)
    const before = logitsOf(model)
    model.kernels.close()
    model.kernels.close() // idempotent
    const afterClose = logitsOf(model)
    for (const [j, l] of afterClose.entries()) assert.deepEqual(bits(l), bits(before[j]))
  })

  it('refuses a thread count that is not an integer from 1 to 64', () => {
    for (const threads of [0, -1, 1.5, 65, Number.NaN])
      assert.throws(() => createWasmKernels({ threads }), /threads must be an integer from 1 to 64/)
    assert.throws(
      () => loadModel(echoModelDir, { threads: 2, kernels: createWasmKernels() }),
      /either kernels or threads/,
    )
  })

  it('fails loudly, naming the cause, when a helper thread cannot start', () => {
    const { memory, own } = oneKernelInstance()
    // Not a WebAssembly module: the helper cannot instantiate it.
    assert.throws(
      () => startTeam(2, { notAModule: true }, memory, own),
      /^Error: cannot start compute threads: compute thread 1: .*WebAssembly\.Module/,
    )
  })

  it(
    'a job whose chunks trap fails at once with the trap, not after the stall timeout, and tells the owner once',
    { timeout: 60_000 },
    () => {
      const { memory, module, own } = oneKernelInstance()
      const failures: Error[] = []
      const team = startTeam(2, module, memory, own, (err) => failures.push(err))
      // A 64 × 4096 F32 weight read from a one-page (64 KiB) memory: every chunk traps. The
      // caller's own chunk is never counted as finished, so waiting for it used to stall 120 s.
      assert.throws(
        () => team.run(Op.linearF32, [0, 0, 0, 0, 4, 4096, 64]),
        (err: Error) => err instanceof ComputeThreadsError && /out of bounds/.test(err.message),
      )
      assert.throws(() => team.run(Op.linearF32, [0, 0, 0, 0, 4, 4096, 64]), /were closed/)
      team.close()
      // The owner is told once (a serving worker exits on it), with the error that was thrown.
      assert.equal(failures.length, 1)
      assert.match(failures[0].message, /out of bounds/)
    },
  )
})
