/** Compute threads in a child process, where only a process shows it: jobs of 1 and 16 chunks back
 *  to back never stall (a stalled join blocks its thread) and never return before every chunk is
 *  done, and helper threads never keep a process alive. The in-process cases are in
 *  threads.test.ts. */
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { describe, it } from 'node:test'
import { promisify } from 'node:util'
import { echoModelDir } from '../helpers/paths.js'

const run = promisify(execFile)

describe('compute thread life cycle, in a child process', () => {
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
