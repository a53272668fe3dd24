/** The caller's side of the compute threads: starts `threads − 1` helper threads over one shared
 *  WebAssembly memory and runs each kernel call cut into chunks that the calling thread (thread 0)
 *  and the helpers claim from a shared counter, synchronised through a shared control block with
 *  Atomics (no message per call).
 *  Knows threads and jobs; knows nothing of models. */
import { Worker } from 'node:worker_threads'
import {
  chunkCount,
  Ctrl,
  ctrlBytes,
  errorBytes,
  maxThreads,
  Op,
  sealedTicket,
  ticket,
  workOn,
  type KernelExports,
} from './protocol.js'

/** How long {@link startTeam} waits for the helpers to start before it throws. */
const startTimeoutMs = 30_000
/** How long the caller spins for the helpers to finish a job before it sleeps (the shares are
 *  about equal, so they usually finish within this; longer spins only waste a loaded machine). */
const spinMs = 0.2
/** A job whose helpers show no progress for this long is declared stuck (a helper died). */
const stallMs = 120_000

/** A started set of compute threads. */
export interface ThreadTeam {
  /** Threads taking part in each job, the caller included. */
  readonly threads: number
  /** Run `op` with `args` (see {@link Op}), its chunks taken by the caller and the helpers.
   *  Returns when every chunk is done. Throws when a helper failed or stopped responding. */
  run(op: number, args: readonly number[]): void
  /** Stop and release the helpers (idempotent). After it, `run` throws. */
  close(): void
}

/** A job could not be completed: a helper failed, a chunk trapped, or a helper stopped
 *  responding. The team is closed by then; a helper may still be running a chunk, so the memory
 *  its job wrote is not to be trusted (a serving process should exit). */
export class ComputeThreadsError extends Error {
  override readonly name = 'ComputeThreadsError'
}

/** Start `threads − 1` helpers (threads ≥ 2) that instantiate `module` over `memory`; `wasm` is the
 *  caller's own instance of the same module. `onFailure` is called once, before `run` throws, when
 *  a job fails ({@link ComputeThreadsError}). Blocks until every helper is ready; throws a one-line
 *  error naming the cause when one fails to start or none starts within 30 s. The helpers are
 *  `unref()`ed: they never keep the process alive. */
export function startTeam(
  threads: number,
  module: object,
  memory: object,
  wasm: KernelExports,
  onFailure?: (err: ComputeThreadsError) => void,
): ThreadTeam {
  const sab = new SharedArrayBuffer(ctrlBytes)
  const ctrl = new Int32Array(sab)
  ctrl[Ctrl.threads] = threads
  ctrl.fill(-1, Ctrl.holding, Ctrl.holding + maxThreads)
  const helpers: Worker[] = []
  const script = new URL('./worker.js', import.meta.url)
  const errorText = (): string =>
    new TextDecoder()
      .decode(new Uint8Array(sab, Ctrl.errorText * 4, errorBytes))
      .replace(/\0+$/, '')
  let closed = false
  const close = (): void => {
    if (closed) return
    closed = true
    ctrl[Ctrl.op] = Op.stop
    Atomics.add(ctrl, Ctrl.generation, 1)
    Atomics.notify(ctrl, Ctrl.generation)
    for (const h of helpers) void h.terminate()
  }
  /** Close the team after a failed job and tell `onFailure` (once); returns the error to throw. */
  const fail = (message: string): ComputeThreadsError => {
    const err = new ComputeThreadsError(message)
    const isFirst = !closed
    close()
    if (isFirst) onFailure?.(err)
    return err
  }

  try {
    for (let index = 1; index < threads; index++) {
      const helper = new Worker(script, {
        workerData: { module, memory, ctrl: sab, index },
        // Not the parent's flags: with `node -e` they would make the helper evaluate the script.
        execArgv: [],
      })
      helper.unref()
      // A helper that dies reports through the control block (or is caught by the start
      // timeout); without a listener its 'error' event would crash this process later.
      helper.on('error', () => {})
      helpers.push(helper)
    }
  } catch (err) {
    close()
    throw new Error(`cannot start compute threads: ${(err as Error).message}`)
  }
  waitForHelpers(ctrl, threads, errorText, close)

  return {
    threads,
    run(op, args) {
      if (closed) throw new Error('the compute threads were closed')
      const chunks = chunkCount(op, args, threads)
      const seq = (ctrl[Ctrl.generation] + 1) & 0x7fffff
      // Seal the ticket first: a helper still looking at the previous job must not claim a chunk
      // while its words are rewritten. Everything the helpers read is written before the
      // generation word publishes the job.
      Atomics.store(ctrl, Ctrl.ticket, sealedTicket)
      ctrl[Ctrl.op] = op
      for (let i = 0; i < args.length; i++) ctrl[Ctrl.args + i] = args[i]
      ctrl[Ctrl.chunks] = chunks
      Atomics.store(ctrl, Ctrl.finished, 0)
      Atomics.store(ctrl, Ctrl.ticket, ticket(seq, 0))
      Atomics.store(ctrl, Ctrl.generation, seq)
      Atomics.notify(ctrl, Ctrl.generation)
      // The caller takes chunks too: if a helper is not running right now (a loaded machine), the
      // caller ends up computing everything rather than waiting for it.
      try {
        workOn(wasm, ctrl, seq, 0)
      } catch (err) {
        // The chunk the caller held will never be counted: waiting for it would stall. Stop the
        // team and report the caller's own error.
        throw fail(err instanceof Error ? err.message : String(err))
      }
      join(chunks)
      if (Atomics.load(ctrl, Ctrl.failed)) throw fail(errorText())
    },
    close,
  }

  /** Wait until every chunk of the current job is computed (the helpers finish the chunks they
   *  took): spin first (chunks are small), then sleep in short slices (a lost wake-up costs one
   *  slice, never a hang). */
  function join(chunks: number): void {
    let done = Atomics.load(ctrl, Ctrl.finished)
    if (done === chunks) return
    const spinUntil = performance.now() + spinMs
    while (done !== chunks && performance.now() < spinUntil)
      done = Atomics.load(ctrl, Ctrl.finished)
    let last = done
    let lastChange = Date.now()
    while (done !== chunks) {
      // A helper whose chunk threw (e.g. a wasm trap) never counts it: fail now with its error,
      // not after the stall timeout.
      if (Atomics.load(ctrl, Ctrl.failed)) throw fail(errorText())
      Atomics.wait(ctrl, Ctrl.finished, done, 1)
      done = Atomics.load(ctrl, Ctrl.finished)
      if (done !== last) {
        last = done
        lastChange = Date.now()
      } else if (Date.now() - lastChange > stallMs) {
        throw fail(
          `a compute thread stopped responding (no progress for ${stallMs / 1000} s; ${stallReport(ctrl, threads, done, chunks)})`,
        )
      }
    }
  }
}

/** Blocks until the `threads − 1` helpers are ready; throws a one-line error (after `close()`)
 *  when one reports a failure (`errorText()`) or not all start within {@link startTimeoutMs}. */
function waitForHelpers(
  ctrl: Int32Array,
  threads: number,
  errorText: () => string,
  close: () => void,
): void {
  // The helpers start on their own threads; the caller blocks (it has nothing else to do before
  // the model is usable) until all are ready or one reports a failure.
  const deadline = Date.now() + startTimeoutMs
  for (;;) {
    const ready = Atomics.load(ctrl, Ctrl.ready)
    if (Atomics.load(ctrl, Ctrl.failed)) {
      close()
      throw new Error(`cannot start compute threads: ${errorText()}`)
    }
    if (ready === threads - 1) break
    if (Date.now() > deadline) {
      close()
      throw new Error(
        `cannot start compute threads: ${threads - 1 - ready} of ${threads - 1} did not start within ${startTimeoutMs / 1000} s`,
      )
    }
    Atomics.wait(ctrl, Ctrl.ready, ready, 50)
  }
}

/** What a stalled job waits for: its chunks finished, and what each helper holds and last saw. */
function stallReport(ctrl: Int32Array, threads: number, done: number, chunks: number): string {
  const gen = ctrl[Ctrl.generation]
  const parts = [`job ${gen} (op ${ctrl[Ctrl.op]}): ${done} of ${chunks} chunks finished`]
  for (let i = 1; i < threads; i++) {
    const held = Atomics.load(ctrl, Ctrl.holding + i)
    const holds = held < 0 ? 'holds no chunk' : `holds chunk ${held & 0xff} of job ${held >>> 8}`
    parts.push(`thread ${i} ${holds}, last woke for job ${Atomics.load(ctrl, Ctrl.lastSeen + i)}`)
  }
  return parts.join('; ')
}
