/** `bench -- router --baseline DIR`: this build's router held against another build's, in the same
 *  run (issue #27's "no slower": CPU per streamed request through the router). DIR is the root of
 *  a kvfence checkout built with `tsc` (its `dist/bench/router.js` is run as that build's own
 *  bench child: its stand-in workers and its router in one process, as here). Both children run
 *  at once; the streamed closed-loop runs alternate between them (this build first in even
 *  repeats, the baseline first in odd ones), and each figure is the median of per-repeat ratios
 *  with its spread. The child's CPU holds the stand-ins' work as well as the router's, each build
 *  with its own stand-ins: the ratio is of the whole child, a conservative reading of the
 *  router's share. */
import { type ChildProcess, fork } from 'node:child_process'
import { existsSync, mkdtempSync, rmSync } from 'node:fs'
import http from 'node:http'
import { tmpdir } from 'node:os'
import { join, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'
import { initCerts } from '../src/cli/certs.js'
import { ratioFields, spreadOf } from './ratio.js'
import {
  type Endpoints,
  childCounts,
  closedLoopRate,
  idleSocketMs,
  routerRequest,
  stop,
} from './router-paths.js'

/** One closed-loop run's rate (requests/s) and the child's CPU per request (ms). */
interface Run {
  rate: number
  cpuMs: number
}

/** The run's sizes. */
interface BaselineOptions {
  repeats: number
  seconds: number
  numClients: number
}

/** The CPU-per-request and throughput ratios of this build's router to `dir`'s. */
export async function benchBaseline(dir: string, o: BaselineOptions): Promise<object> {
  const baselineBench = join(resolve(dir), 'dist', 'bench', 'router.js')
  if (!existsSync(baselineBench)) {
    throw new Error(`--baseline ${dir}: no ${baselineBench} (build that checkout with tsc first)`)
  }
  const certs = mkdtempSync(join(tmpdir(), 'kvfence-bench-baseline-'))
  await initCerts(certs)
  const children: ChildProcess[] = []
  try {
    const start = (file: string, args: string[]) => {
      const child = fork(file, args, { stdio: ['ignore', 'ignore', 'inherit', 'ipc'] })
      children.push(child)
      return new Promise<{ child: ChildProcess; e: Endpoints }>((resolve, reject) => {
        child.once('message', (m) => resolve({ child, e: m as Endpoints }))
        child.once('exit', (code) => reject(new Error(`${file} exited with ${code}`)))
      })
    }
    const current = await start(fileURLToPath(new URL('./router.js', import.meta.url)), [
      '--serve',
      certs,
    ])
    // The baseline's child took the control plane as its second argument then; `channel` is the
    // one that became the only one.
    const baseline = await start(baselineBench, ['--serve', certs, 'channel'])
    const agent = new http.Agent({ keepAlive: true, maxSockets: Infinity, timeout: idleSocketMs })
    try {
      const run = async (side: typeof current): Promise<Run> => {
        const send = () => routerRequest(agent, side.e, true)
        const before = await childCounts(side.child)
        const r = await closedLoopRate(send, o.numClients, o.seconds)
        const after = await childCounts(side.child)
        return { rate: r.rate, cpuMs: (after.cpuMs - before.cpuMs) / r.numDone }
      }
      for (const side of [current, baseline]) {
        for (let i = 0; i < 200; i++) await routerRequest(agent, side.e, true)
      }
      const pairs: { current: Run; baseline: Run }[] = []
      for (let r = 0; r < o.repeats; r++) {
        if (r % 2 === 0) {
          const c = await run(current)
          pairs.push({ current: c, baseline: await run(baseline) })
        } else {
          const b = await run(baseline)
          pairs.push({ current: await run(current), baseline: b })
        }
      }
      return {
        baseline_dir: resolve(dir),
        baseline_child_cpu_ms_per_streamed_request: spreadOf(
          pairs.map((p) => p.baseline.cpuMs),
          4,
        ),
        current_child_cpu_ms_per_streamed_request: spreadOf(
          pairs.map((p) => p.current.cpuMs),
          4,
        ),
        ...ratioFields(
          'current_to_baseline_cpu_per_request_ratio',
          pairs.map((p) => p.current.cpuMs / p.baseline.cpuMs),
        ),
        ...ratioFields(
          'current_to_baseline_throughput_ratio',
          pairs.map((p) => p.current.rate / p.baseline.rate),
        ),
        baseline_is:
          'each build’s own bench child (its stand-ins and its router, one process); streamed closed-loop runs alternating between the builds; CPU ratio < 1: this build costs less per request',
      }
    } finally {
      agent.destroy()
    }
  } finally {
    for (const child of children) await stop(child)
    rmSync(certs, { recursive: true, force: true })
  }
}
