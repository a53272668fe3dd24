/** Large-buffer copy bandwidth with N threads copying at once: the memory-bandwidth bound that
 *  the model benchmark divides decode speed by. Each thread (the calling one and N − 1
 *  worker_threads) copies its own share of the total between two buffers of its own, all starting
 *  together on a shared start word; a round lasts until the last thread is done. Private,
 *  non-shared buffers on purpose: Node copies between SharedArrayBuffer-backed arrays more slowly
 *  (6 against 11 GB/s for 256 MiB on one thread here), which would measure that copy loop, not
 *  the memory. */
import { readFileSync } from 'node:fs'
import { Worker } from 'node:worker_threads'

/** Control words of a measurement (Int32Array over a small SharedArrayBuffer). */
const W = { round: 0, done: 1, ready: 2 } as const
/** `round` value that tells the workers to exit. */
const stopRound = -1
/** Bound on every wait (ms): a lost wake-up costs a slice, never a hang. */
const waitSliceMs = 50
/** How long a worker spins for the next round before it sleeps (ms). */
const spinMs = 5
/** A worker that does not answer for this long fails the measurement. */
const timeoutMs = 60_000

/** The worker's code: allocate its share, report ready, copy once per round until told to stop.
 *  Between the rounds of one measurement (microseconds apart) it spins, so that every thread starts
 *  copying at once; between measurements (a benchmark repeat apart) it sleeps in bounded slices
 *  (a futex wake-up of ~50 µs is nothing next to a round of tens of milliseconds). */
const workerCode = `
const { workerData } = require('node:worker_threads')
const ctrl = new Int32Array(workerData.ctrl)
const src = new Uint8Array(workerData.bytes).fill(1)
const dst = new Uint8Array(workerData.bytes)
let seen = 0
Atomics.add(ctrl, ${W.ready}, 1)
Atomics.notify(ctrl, ${W.ready})
for (;;) {
  let r = Atomics.load(ctrl, ${W.round})
  const spinUntil = Date.now() + ${spinMs}
  while (r === seen && Date.now() < spinUntil) r = Atomics.load(ctrl, ${W.round})
  while (r === seen) {
    Atomics.wait(ctrl, ${W.round}, seen, ${waitSliceMs})
    r = Atomics.load(ctrl, ${W.round})
  }
  if (r === ${stopRound}) break
  seen = r
  dst.set(src)
  Atomics.add(ctrl, ${W.done}, 1)
  Atomics.notify(ctrl, ${W.done})
}
`

/** Size of the last-level cache in bytes (Linux sysfs), or 0 when unknown. */
export function lastLevelCacheBytes(): number {
  let best = 0
  for (let i = 0; i < 8; i++) {
    try {
      const text = readFileSync(`/sys/devices/system/cpu/cpu0/cache/index${i}/size`, 'utf8').trim()
      const m = /^(\d+)([KMG]?)$/.exec(text)
      if (m)
        best = Math.max(best, Number(m[1]) * { '': 1, K: 1024, M: 1024 ** 2, G: 1024 ** 3 }[m[2]]!)
    } catch {
      break
    }
  }
  return best
}

/** Copy bandwidth of a fixed number of threads, measurable again and again (the buffers stay
 *  allocated and the worker threads running between measurements), so that it can be measured
 *  next to each timed repeat of a benchmark, under the same load. */
export interface CopyMeter {
  /** Threads copying at once, the caller included. */
  readonly threads: number
  /** Bytes copied per round, over all threads. */
  readonly bytes: number
  /** Median over `rounds` rounds of bytes copied ÷ time until the last thread finished, in GB/s
   *  (10⁹ B/s; each byte counted once, as memcpy figures are, though it is read and written).
   *  Throws when a worker does not finish a round within 60 s. */
  measure(rounds: number): number
  /** Stop the worker threads and release the buffers. */
  close(): Promise<void>
}

/** Start a {@link CopyMeter} of `threads` threads copying `totalBytes` in all (each its own equal
 *  share), after one round that faults the pages in. Throws when a worker fails to start within
 *  60 s. */
export async function openCopyMeter(threads: number, totalBytes: number): Promise<CopyMeter> {
  const share = Math.floor(totalBytes / threads / 4096) * 4096
  const sab = new SharedArrayBuffer(16)
  const ctrl = new Int32Array(sab)
  const workers: Worker[] = []
  const failures: Error[] = []
  let round = 0
  const close = async (): Promise<void> => {
    Atomics.store(ctrl, W.round, stopRound)
    Atomics.notify(ctrl, W.round)
    await Promise.all(workers.map((w) => w.terminate()))
  }
  try {
    for (let i = 1; i < threads; i++) {
      const w = new Worker(workerCode, { eval: true, workerData: { ctrl: sab, bytes: share } })
      w.on('error', (err) => failures.push(err))
      w.unref()
      workers.push(w)
    }
    const src = new Uint8Array(share).fill(1)
    const dst = new Uint8Array(share)
    // Let the event loop run while the workers start (their 'error' events arrive through it).
    const deadline = Date.now() + timeoutMs
    while (Atomics.load(ctrl, W.ready) < threads - 1) {
      if (failures.length) throw failures[0]
      if (Date.now() > deadline) throw new Error('copy bandwidth: worker threads did not start')
      await new Promise((resolve) => setTimeout(resolve, 5))
    }
    /** One round: seconds until every thread has copied its share. */
    const once = (): number => {
      round++
      Atomics.store(ctrl, W.done, 0)
      const t0 = process.hrtime.bigint()
      Atomics.store(ctrl, W.round, round)
      Atomics.notify(ctrl, W.round)
      dst.set(src)
      const until = Date.now() + timeoutMs
      for (let done = Atomics.load(ctrl, W.done); done < threads - 1;) {
        if (failures.length) throw failures[0]
        if (Date.now() > until)
          throw new Error('copy bandwidth: a worker thread stopped responding')
        Atomics.wait(ctrl, W.done, done, waitSliceMs)
        done = Atomics.load(ctrl, W.done)
      }
      return Number(process.hrtime.bigint() - t0) / 1e9
    }
    once() // faults the pages in
    return {
      threads,
      bytes: share * threads,
      measure(rounds) {
        const rates: number[] = []
        for (let r = 0; r < rounds; r++) rates.push((share * threads) / once() / 1e9)
        rates.sort((a, b) => a - b)
        const m = rates.length >> 1
        return rates.length % 2 ? rates[m] : (rates[m - 1] + rates[m]) / 2
      },
      close,
    }
  } catch (err) {
    await close()
    throw err
  }
}
