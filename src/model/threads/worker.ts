/** Entry point of a helper compute thread (worker_threads): instantiates the kernels over the
 *  caller's shared WebAssembly memory, reports ready in the control block, then takes chunks of
 *  every published job until none is left, and waits for the next, until told to stop. Never posts messages per job: the control block and
 *  Atomics.wait/notify carry everything (a message round trip is far too slow per matmul).
 *  A failure (at start or in a job) is written to the control block for the caller to throw. */
import { workerData } from 'node:worker_threads'
import { Ctrl, errorBytes, Op, workOn, type KernelExports } from './protocol.js'

/** What the caller passes in `workerData`. */
interface HelperData {
  module: object
  memory: object
  ctrl: SharedArrayBuffer
  index: number
}

const WebAssembly = (
  globalThis as unknown as {
    WebAssembly: { Instance: new (m: object, i: object) => { exports: object } }
  }
).WebAssembly

/** How long a helper spins on the generation word before sleeping: covers the gaps between the
 *  matmuls of one forward step, so that a job does not pay a futex wake-up. */
const spinMs = 0.3
/** First sleep slice after the spin; each further slice of the same idle spell is twice as long,
 *  up to {@link maxSleepMs}. Every wait stays bounded because a wake-up can be lost (seen once
 *  when the memory grew, STACK.md). A lost wake-up never stalls a job: the caller claims every
 *  chunk nobody else took, so a helper that oversleeps only leaves the caller computing alone
 *  until its slice ends. */
const firstSleepMs = 20
/** Longest sleep slice: an idle helper wakes about once a second (the 20 ms slice it had before
 *  cost 50 wake-ups a second, 16× the idle CPU of a process without helpers). */
const maxSleepMs = 1000

const data = workerData as HelperData
const ctrl = new Int32Array(data.ctrl)

function fail(err: unknown): void {
  const text = new TextEncoder().encode(
    `compute thread ${data.index}: ${err instanceof Error ? err.message : String(err)}`,
  )
  new Uint8Array(data.ctrl, Ctrl.errorText * 4, errorBytes).set(text.subarray(0, errorBytes))
  Atomics.store(ctrl, Ctrl.failed, 1)
}

function serve(wasm: KernelExports): void {
  let seen = Atomics.load(ctrl, Ctrl.generation)
  Atomics.add(ctrl, Ctrl.ready, 1)
  Atomics.notify(ctrl, Ctrl.ready)
  for (;;) {
    let gen = Atomics.load(ctrl, Ctrl.generation)
    if (gen === seen) {
      const until = performance.now() + spinMs
      while (gen === seen && performance.now() < until) gen = Atomics.load(ctrl, Ctrl.generation)
      for (let sleepMs = firstSleepMs; gen === seen; sleepMs = Math.min(maxSleepMs, sleepMs * 2)) {
        Atomics.wait(ctrl, Ctrl.generation, seen, sleepMs)
        gen = Atomics.load(ctrl, Ctrl.generation)
      }
    }
    seen = gen
    Atomics.store(ctrl, Ctrl.lastSeen + data.index, gen)
    if (ctrl[Ctrl.op] === Op.stop) return
    try {
      workOn(wasm, ctrl, gen, data.index)
    } catch (err) {
      fail(err)
    }
  }
}

let exports: KernelExports | undefined
try {
  const instance = new WebAssembly.Instance(data.module, { env: { memory: data.memory } })
  exports = instance.exports as unknown as KernelExports
} catch (err) {
  fail(err)
  Atomics.notify(ctrl, Ctrl.ready)
}
if (exports) serve(exports)
