/** Compute threads: a model whose kernels split every call between 2 (or 3) threads gives logits
 *  bit-identical to the same model on one thread (F32 and BF16 storage, multi-token prefill,
 *  batched and single decode), on every checkpoint of models/test/ (and within 1e-4 of their
 *  float64 PyTorch references) and on the bundled echo model; helper threads never keep a process
 *  alive and stop on close. No timing here: speed is in `npm run bench -- model`. */
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { readdirSync, readFileSync } from 'node:fs'
import { join } from 'node:path'
import { after, describe, it } from 'node:test'
import { promisify } from 'node:util'
import { forward, forwardBatch, makeRope } from '../../src/model/forward.js'
import { createWasmKernels, kernelsWasmPath } from '../../src/model/kernels-wasm.js'
import { Op } from '../../src/model/threads/protocol.js'
import { ComputeThreadsError, startTeam } from '../../src/model/threads/team.js'
import { loadModel, type Model } from '../../src/model/weights.js'
import { echoModelDir, repoRoot } from '../helpers/paths.js'
import { maxAbsDiff, scatteredSequence } from './helpers.js'

const run = promisify(execFile)
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

  it(
    'jobs of 1 and 16 chunks back to back never stall and never return before every chunk is done',
    { timeout: 240_000 },
    async () => {
      // Regression: a helper that saw job N published could be overtaken by the caller finishing N
      // alone and writing job N+1; it then read N+1's chunk count with N's last ticket and claimed
      // a chunk that did not exist, counted into N+1. On this machine 4 threads stalled (120 s,
      // "a compute thread stopped responding") after ~27,000 such jobs, and one result in ~10,000
      // came back before its last chunk was computed. Each run checks every result against the
      // same linear on one thread. In a child process: a stalled join blocks its thread.
      const kernelsUrl = new URL('../../src/model/kernels-wasm.js', import.meta.url).href
      for (const threads of [2, 4]) {
        const script = `
          import { createWasmKernels } from ${JSON.stringify(kernelsUrl)}
          const make = (threads) => createWasmKernels({ threads, parallelMinWork: 0 })
          const one = make(1), team = make(${threads})
          function setUp(k) {
            const w = (outDim, inDim) => {
              const data = k.allocF32(outDim * inDim)
              for (let i = 0; i < data.length; i++) data[i] = Math.sin(i * 0.37)
              return { dtype: 'f32', outDim, inDim, data }
            }
            const x = k.allocF32(256)
            for (let i = 0; i < 256; i++) x[i] = Math.cos(i)
            // 4 output rows: 1 chunk; 1,024 × 256: 16 chunks.
            return { k, small: w(4, 16), big: w(1024, 256), x, outS: k.allocF32(4), outB: k.allocF32(1024) }
          }
          const step = (s) => {
            s.outS.fill(0)
            s.outB.fill(0)
            s.k.linear(s.outS, s.x.subarray(0, 16), s.small, null, 1)
            s.k.linear(s.outB, s.x, s.big, null, 1)
          }
          const ref = setUp(one), t = setUp(team)
          step(ref)
          let wrong = 0
          const same = (a, b) => a.every((v, i) => Object.is(v, b[i]))
          for (let i = 0; i < 50000; i++) {
            step(t)
            if (!same(t.outS, ref.outS) || !same(t.outB, ref.outB)) wrong++
          }
          team.close()
          console.log('jobs', 100000, 'wrong', wrong)`
        const { stdout } = await run(process.execPath, ['--input-type=module', '-e', script], {
          timeout: 100_000,
        }).catch((err: { killed?: boolean }) => {
          throw new Error(
            err.killed
              ? `${threads} threads: the jobs stalled (killed after 100 s)`
              : `${threads} threads: ${String(err)}`,
          )
        })
        assert.equal(stdout.trim(), 'jobs 100000 wrong 0', `${threads} threads`)
      }
    },
  )

  it('never keeps a process alive: it exits with the helpers running, and after close', async () => {
    const modelUrl = new URL('../../src/model/weights.js', import.meta.url).href
    const forwardUrl = new URL('../../src/model/forward.js', import.meta.url).href
    const helpersUrl = new URL('./helpers.js', import.meta.url).href
    for (const closeFirst of [false, true]) {
      const script = `
        import { loadModel } from ${JSON.stringify(modelUrl)}
        import { forward, makeRope } from ${JSON.stringify(forwardUrl)}
        import { scatteredSequence } from ${JSON.stringify(helpersUrl)}
        const m = loadModel(${JSON.stringify(echoModelDir)}, { threads: 2 })
        const { pool, seq } = scatteredSequence(m, 4, 40)
        const l = forward(m, makeRope(m), pool, seq, Array.from({ length: 40 }, (_, i) => i % 90), 0)
        ${closeFirst ? 'm.kernels.close()' : ''}
        console.log(m.kernels.threads, l.length)`
      // A helper that kept the process alive would hit this timeout and fail the run.
      const { stdout } = await run(process.execPath, ['--input-type=module', '-e', script], {
        timeout: 60_000,
      })
      assert.equal(stdout.trim(), '2 100')
    }
  })
})
