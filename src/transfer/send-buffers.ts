/** The sender's reusable write buffers for one connection (G9). Frames are built directly in these
 *  buffers and each buffer goes to the socket as one write; the socket's write callback returns it
 *  here for reuse. A byte budget bounds what is outstanding (filling, queued in the socket, or
 *  being written), so memory stays flat however large or slow the transfer is, and nothing is
 *  allocated per page.
 *
 *  Why a set of buffers rather than one: `socket.write` keeps a reference to the bytes until they
 *  reach the kernel, so a single buffer could be refilled only after each write completed, leaving
 *  the socket idle while the next batch is built. A small ring of buffers under a byte budget gives
 *  the same bound with the socket always fed; waiting for a buffer here is waiting for 'drain'.
 *  Knows buffers and a budget; knows nothing of frames or transfers (waiters are opaque owners). */

interface Waiter {
  owner: object
  minBytes: number
  /** Waiting for a byte reservation (views written without a copy), not a buffer. */
  isReservation: boolean
  resolve: (buffer: Buffer | null) => void
}

/** What a reservation waiter is resolved with (it holds no buffer). */
const reserved = Buffer.alloc(0)

/** A byte-budgeted pool of equal-sized send buffers. */
export class SendBuffers {
  private bufferBytesNow: number
  private readonly free: Buffer[] = []
  private readonly waiters: Waiter[] = []
  private numInUseBytesNow = 0
  private numAllocatedNow = 0
  private maxInUseBytesNow = 0
  /** The largest reservation granted (one is allowed even above the budget). */
  private maxReservedNow = 0
  private isClosed = false

  /** @param bufferBytes size of each buffer, bytes (grown when a frame needs more).
   *  @param budgetBytes most bytes outstanding at once; one buffer is always allowed, even if
   *  it alone exceeds the budget, so that a transfer of large pages still progresses.
   *  @param onAllocate called for every buffer allocated (for counters).
   *  @throws RangeError on non-positive sizes. */
  constructor(
    bufferBytes: number,
    private readonly budgetBytes: number,
    private readonly onAllocate: () => void = () => {},
  ) {
    if (!Number.isInteger(bufferBytes) || bufferBytes < 1)
      throw new RangeError(`bufferBytes must be ≥ 1, got ${bufferBytes}`)
    if (!Number.isInteger(budgetBytes) || budgetBytes < 1)
      throw new RangeError(`budgetBytes must be ≥ 1, got ${budgetBytes}`)
    this.bufferBytesNow = bufferBytes
  }

  /** Count `numBytes` of the caller's own memory (page views written without a copy) against the
   *  budget now, as a buffer of that size would be; false if the budget is spent, others are
   *  waiting first, or the pool is closed. As with buffers, one reservation is always allowed. */
  tryReserve(numBytes: number): boolean {
    if (this.isClosed || this.waiters.length > 0) return false
    return this.takeBytes(numBytes)
  }

  /** {@link tryReserve}, waiting (first come, first served) while the budget is spent. Resolves
   *  false if `cancel(owner)` or `close()` is called first. */
  async reserve(numBytes: number, owner: object): Promise<boolean> {
    if (this.tryReserve(numBytes)) return true
    if (this.isClosed) return false
    const got = await new Promise<Buffer | null>((resolve) =>
      this.waiters.push({ owner, minBytes: numBytes, isReservation: true, resolve }),
    )
    return got !== null
  }

  /** Give back a reservation from `tryReserve`/`reserve`, once its bytes were written. */
  unreserve(numBytes: number): void {
    this.numInUseBytesNow -= numBytes
    this.serveWaiters()
  }

  /** Size of the buffers handed out now, bytes. */
  get bufferBytes(): number {
    return this.bufferBytesNow
  }

  /** Bytes handed out and not yet released. */
  get numInUseBytes(): number {
    return this.numInUseBytesNow
  }

  /** Most bytes ever handed out at once. */
  get maxInUseBytes(): number {
    return this.maxInUseBytesNow
  }

  /** Buffers allocated since creation (flat once the pool is warm). */
  get numAllocated(): number {
    return this.numAllocatedNow
  }

  /** A buffer of at least `minBytes` bytes now, or null if the budget is spent, others are
   *  waiting first, or the pool is closed. */
  tryAcquire(minBytes: number): Buffer | null {
    if (this.isClosed || this.waiters.length > 0) return null
    return this.take(minBytes)
  }

  /** A buffer of at least `minBytes` bytes, waiting (first come, first served) while the budget is
   *  spent. Resolves null if `cancel(owner)` or `close()` is called first. */
  acquire(minBytes: number, owner: object): Promise<Buffer | null> {
    const now = this.tryAcquire(minBytes)
    if (now !== null || this.isClosed) return Promise.resolve(now)
    return new Promise((resolve) =>
      this.waiters.push({ owner, minBytes, isReservation: false, resolve }),
    )
  }

  /** Give back a buffer from `tryAcquire`/`acquire` (after its write completed, or unused). */
  release(buffer: Buffer): void {
    this.numInUseBytesNow -= buffer.length
    if (!this.isClosed && buffer.length === this.bufferBytesNow) this.free.push(buffer)
    this.serveWaiters()
  }

  /** Stop `owner` waiting: its pending `acquire` resolves null. */
  cancel(owner: object): void {
    const i = this.waiters.findIndex((w) => w.owner === owner)
    if (i < 0) return
    const [waiter] = this.waiters.splice(i, 1)
    waiter.resolve(null)
    this.serveWaiters()
  }

  /** Resolve every waiter with null and drop the free buffers; later acquires get null. */
  close(): void {
    this.isClosed = true
    this.free.length = 0
    for (const waiter of this.waiters.splice(0)) waiter.resolve(null)
  }

  /** Assert the pool's invariants. @throws Error naming the broken one. */
  check(): void {
    if (this.numInUseBytesNow < 0)
      throw new Error(`buffers released twice: ${this.numInUseBytesNow} bytes in use`)
    const limit = Math.max(this.budgetBytes, this.bufferBytesNow, this.maxReservedNow)
    if (this.numInUseBytesNow > limit)
      throw new Error(`${this.numInUseBytesNow} bytes in use exceed the budget of ${limit}`)
    if (this.free.some((b) => b.length !== this.bufferBytesNow))
      throw new Error('a free buffer has a stale size')
  }

  private take(minBytes: number): Buffer | null {
    if (minBytes > this.bufferBytesNow) {
      this.bufferBytesNow = minBytes
      this.free.length = 0
    }
    if (this.numInUseBytesNow > 0 && this.numInUseBytesNow + this.bufferBytesNow > this.budgetBytes)
      return null
    let buffer = this.free.pop()
    if (buffer === undefined) {
      buffer = Buffer.allocUnsafe(this.bufferBytesNow)
      this.numAllocatedNow++
      this.onAllocate()
    }
    this.numInUseBytesNow += buffer.length
    this.maxInUseBytesNow = Math.max(this.maxInUseBytesNow, this.numInUseBytesNow)
    return buffer
  }

  private serveWaiters(): void {
    while (!this.isClosed && this.waiters.length > 0) {
      const { minBytes, isReservation } = this.waiters[0]
      const got = isReservation ? (this.takeBytes(minBytes) ? reserved : null) : this.take(minBytes)
      if (got === null) return
      this.waiters.shift()!.resolve(got)
    }
  }

  private takeBytes(numBytes: number): boolean {
    if (this.numInUseBytesNow > 0 && this.numInUseBytesNow + numBytes > this.budgetBytes)
      return false
    this.numInUseBytesNow += numBytes
    this.maxInUseBytesNow = Math.max(this.maxInUseBytesNow, this.numInUseBytesNow)
    this.maxReservedNow = Math.max(this.maxReservedNow, numBytes)
    return true
  }
}
