/** The control block shared by the compute threads of one set of WebAssembly kernels, and how a
 *  job's work is split between them. The block is its own small SharedArrayBuffer (not part of the
 *  WebAssembly memory, which grows): i32 words, written by the calling thread before it publishes
 *  a job by bumping {@link Ctrl.generation}, read by the helper threads after they see the bump.
 *  Knows words and ranges; knows nothing of models. */

/** Word indices of the control block (Int32Array). */
export const Ctrl = {
  /** The current job's sequence number, bumped (and notified) by the caller for every job;
   *  helpers wait on it. */
  generation: 0,
  /** Chunks of the current job computed so far (the caller waits for all of them). */
  finished: 1,
  /** Helpers that started and are ready for jobs (set once at start). */
  ready: 2,
  /** Non-zero when a helper failed (at start or in a job); {@link Ctrl.errorText} says why. */
  failed: 3,
  /** What to run: one of {@link Op}. */
  op: 4,
  /** Chunks the current job is cut into (at most {@link maxChunks}). */
  chunks: 5,
  /** The next chunk to claim, tagged with the job's sequence number ({@link ticket}). */
  ticket: 6,
  /** Threads taking part, the caller included (thread 0). */
  threads: 7,
  /** First of the job's i32 arguments (see {@link Op}). */
  args: 8,
  /** Word offset of a UTF-8 error message (up to {@link errorBytes}) written by a failing helper. */
  errorText: 32,
  /** Word `holding + i`: the ticket of the chunk helper i is computing, or −1 (none); only read to
   *  say what a stalled job waits for. */
  holding: 160,
  /** Word `lastSeen + i`: the last job (generation) helper i woke up for. */
  lastSeen: 224,
} as const

/** Bytes reserved for a helper's error message. */
export const errorBytes = 512
/** Most threads of a team (the holding and lastSeen words are one per thread). */
export const maxThreads = 64
/** Size of the control block in bytes. */
export const ctrlBytes = (Ctrl.lastSeen + maxThreads) * 4

/** Jobs. Arguments, in order from {@link Ctrl.args}:
 *  - `linearF32`, `linearBf16`: out, x, w, bias, n, inDim, outDim (byte addresses, counts);
 *  - `attention`: out, q, k, v, scores, n, startPos, numHeads, numKvHeads, headDim, scoresStride
 *    (thread i uses scores + i × scoresStride bytes: two rows of ⌈(startPos + n) / 4⌉ × 4 floats);
 *  - `swiglu`: gate, up, count (in place on gate; split on multiples of 4 elements);
 *  - `sumF32`: out, x, count (chunk c stores the sum of its share of x at out + 4c; split on
 *    multiples of 16 elements): the benchmark's read-bandwidth meter. */
export const Op = {
  stop: 0,
  linearF32: 1,
  linearBf16: 2,
  attention: 3,
  swiglu: 4,
  sumF32: 5,
} as const

/** Most chunks per job: the chunk index lives in the ticket's low 8 bits. */
export const maxChunks = 255
/** Chunks per thread of a linear: enough that a thread the OS does not run right now (a loaded
 *  machine) leaves only small pieces for the others to take over. */
const chunksPerThread = 8
/** Rows a linear's output is split on: a multiple of 8 (the one-token kernels' row group) per chunk. */
const rowAlign = 8

/** The ticket word while the caller writes a job: its tag (0xffffff) is no job's sequence number,
 *  so every claim fails until the job is published. */
export const sealedTicket = -1

/** The ticket word for chunk `chunk` of job `seq`: the job's sequence number (23 bits) above the
 *  chunk index, so that a claim for a finished job can never take a chunk of the next one. */
export function ticket(seq: number, chunk: number): number {
  return ((seq & 0x7fffff) << 8) | chunk
}

/** Fewest multiply-adds per chunk of a linear (a few µs): smaller chunks cost more in claims and
 *  cache misses than they gain in balance. */
const minChunkWork = 65_536

/** Fewest elements per chunk of an element-wise job (each costs tens of operations: the exp). */
const minChunkElements = 16_384

/** Chunks to cut a job into: a linear by groups of output rows, attention by heads and blocks of
 *  tokens. */
export function chunkCount(op: number, args: readonly number[], threads: number): number {
  if (op === Op.attention) {
    // Heads × blocks of tokens (prefill): the causal mask makes later tokens dearer, and nine
    // heads do not split evenly over two threads.
    const heads = Math.min(args[7], maxChunks)
    const blocks = Math.min(
      args[5],
      Math.ceil((chunksPerThread * threads) / heads),
      Math.floor(maxChunks / heads),
    )
    return heads * Math.max(1, blocks)
  }
  if (op === Op.sumF32) return Math.min(chunksPerThread * threads, maxChunks)
  if (op === Op.swiglu)
    return Math.max(1, Math.min(chunksPerThread * threads, Math.ceil(args[2] / minChunkElements)))
  const work = args[4] * args[5] * args[6]
  // A multiple of the thread count: with 5 chunks for 2 threads one of them would do 3 (decode's
  // 576 × 576 projections).
  const byWork = Math.ceil(Math.max(threads, Math.floor(work / minChunkWork)) / threads) * threads
  return Math.min(Math.ceil(args[6] / rowAlign), chunksPerThread * threads, byWork, maxChunks)
}

/** Chunk `index`'s share [start, end) of `count` rows cut into `chunks` chunks, each a multiple of
 *  `align` rows (the last ones may be empty). */
export function share(count: number, index: number, chunks: number, align = 1): [number, number] {
  const size = Math.ceil(count / chunks / align) * align
  return [Math.min(count, index * size), Math.min(count, (index + 1) * size)]
}

/** One linear kernel: output rows [rowStart, rowEnd) of `out[n, outDim] = x[n, inDim] · wᵀ + bias`;
 *  addresses are bytes in the shared memory (bias 0 = none). */
export type LinearExport = (
  out: number,
  x: number,
  w: number,
  bias: number,
  n: number,
  inDim: number,
  outDim: number,
  rowStart: number,
  rowEnd: number,
) => void

/** The exports of the compiled kernels (asm/kernels.ts); addresses are bytes in the shared memory. */
export interface KernelExports {
  linearF32: LinearExport
  linearBf16: LinearExport
  /** out[0] = the sum of the F32 values x[0..count) (byte addresses). */
  sumF32(out: number, x: number, count: number): void
  /** SwiGLU in place: gate[i] = silu(gate[i]) · up[i] for i < count (byte addresses). */
  swiglu(gate: number, up: number, count: number): void
  attention(
    out: number,
    q: number,
    k: number,
    v: number,
    scores: number,
    n: number,
    startPos: number,
    numHeads: number,
    numKvHeads: number,
    headDim: number,
    scale: number,
    headStart: number,
    headEnd: number,
  ): void
}

/** Claim and compute chunks of job `seq` until none is left (every thread, the caller included,
 *  runs this over the same arguments: a chunk is computed by the same code whichever thread
 *  takes it, so the result is bit-identical to one thread running the whole job). `thread` picks
 *  the thread's own attention scores row. A chunk that throws is still counted as finished (so
 *  that nobody waits for it) and the error rethrown. */
export function workOn(wasm: KernelExports, ctrl: Int32Array, seq: number, thread: number): void {
  for (;;) {
    const t = Atomics.load(ctrl, Ctrl.ticket)
    if (t >>> 8 !== (seq & 0x7fffff)) return
    // Read after the ticket showed this job, never before: a helper that saw job `seq` published
    // can be overtaken by the caller finishing it alone and writing the next job's chunk count.
    // A count read then, with this job's last ticket, let a stray claim through (counted into the
    // next job: its caller waited forever, or went on before a chunk was done). The caller seals
    // the ticket before it rewrites anything, so a claim that succeeds saw this job's count.
    const chunks = Atomics.load(ctrl, Ctrl.chunks)
    const chunk = t & 0xff
    if (chunk >= chunks) return
    if (Atomics.compareExchange(ctrl, Ctrl.ticket, t, t + 1) !== t) continue
    Atomics.store(ctrl, Ctrl.holding + thread, t)
    try {
      runChunk(wasm, ctrl, chunk, chunks, thread)
    } finally {
      Atomics.store(ctrl, Ctrl.holding + thread, -1)
      if (Atomics.add(ctrl, Ctrl.finished, 1) + 1 === chunks) Atomics.notify(ctrl, Ctrl.finished)
    }
  }
}

function runChunk(
  wasm: KernelExports,
  ctrl: Int32Array,
  chunk: number,
  chunks: number,
  thread: number,
): void {
  const a = Ctrl.args
  switch (ctrl[Ctrl.op]) {
    case Op.linearF32:
    case Op.linearBf16: {
      const [start, end] = share(ctrl[a + 6], chunk, chunks, rowAlign)
      if (start >= end) return
      const fn = ctrl[Ctrl.op] === Op.linearF32 ? wasm.linearF32 : wasm.linearBf16
      fn(
        ctrl[a],
        ctrl[a + 1],
        ctrl[a + 2],
        ctrl[a + 3],
        ctrl[a + 4],
        ctrl[a + 5],
        ctrl[a + 6],
        start,
        end,
      )
      return
    }
    case Op.attention: {
      const numHeads = ctrl[a + 7]
      const headChunks = Math.min(numHeads, maxChunks)
      const blocks = chunks / headChunks
      const [start, end] = share(numHeads, chunk % headChunks, headChunks)
      // The last (dearest) token block is handed out first.
      const [t0, t1] = share(ctrl[a + 5], blocks - 1 - Math.floor(chunk / headChunks), blocks)
      if (start >= end || t0 >= t1) return
      const headDim = ctrl[a + 9]
      const qRowBytes = numHeads * headDim * 4
      wasm.attention(
        ctrl[a] + t0 * qRowBytes,
        ctrl[a + 1] + t0 * qRowBytes,
        ctrl[a + 2],
        ctrl[a + 3],
        ctrl[a + 4] + thread * ctrl[a + 10],
        t1 - t0,
        ctrl[a + 6] + t0,
        numHeads,
        ctrl[a + 8],
        headDim,
        1 / Math.sqrt(headDim),
        start,
        end,
      )
      return
    }
    case Op.swiglu: {
      const [start, end] = share(ctrl[a + 2], chunk, chunks, 4)
      if (start < end) wasm.swiglu(ctrl[a] + start * 4, ctrl[a + 1] + start * 4, end - start)
      return
    }
    case Op.sumF32: {
      const [start, end] = share(ctrl[a + 2], chunk, chunks, 16)
      wasm.sumF32(ctrl[a] + chunk * 4, ctrl[a + 1] + start * 4, Math.max(0, end - start))
      return
    }
    default:
      throw new Error(`unknown kernel job ${ctrl[Ctrl.op]}`)
  }
}
