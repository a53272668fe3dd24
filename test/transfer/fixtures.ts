/** Shared fixtures of the transfer tests: a recording decode-side pool behind the receiver hooks,
 *  a page source for the sender, frame builders for hand-made (often wrong) streams, and a
 *  socket-free harness around one ReceiveSession. */
import { randomBytes } from 'node:crypto'
import { once } from 'node:events'
import net from 'node:net'
import { KvfenceError } from '../../src/common/errors.js'
import { beginMac, endMac } from '../../src/transfer/auth.js'
import { manifestChecksum, pageChecksum } from '../../src/transfer/checksum.js'
import {
  PROTOCOL_VERSION,
  encodeBegin,
  encodeEnd,
  encodeHello,
  encodePages,
  newTransferId,
  ZERO_TRANSFER_ID,
  type Frame,
  type PageEntry,
} from '../../src/transfer/frames.js'
import { FrameParser } from '../../src/transfer/parser.js'
import {
  receiverConfig,
  TransferServer,
  type TransferServerOptions,
} from '../../src/transfer/receiver.js'
import {
  TransferClient,
  type OutgoingTransfer,
  type TransferClientOptions,
} from '../../src/transfer/sender.js'
import {
  ReceiveSession,
  type BeginInfo,
  type ReceiverCounters,
  type ReceiverHooks,
  type Reservation,
} from '../../src/transfer/receive-session.js'
import { waitUntil } from '../helpers/poll.js'

// ─── Fixed frames ───────────────────────────────────────────────────────────────────────────────

export const tid = '0123456789abcdef0123456789abcdef'
export const rid = 'fedcba9876543210fedcba9876543210'

/** One frame of every kind (payload and MAC are plain Uint8Arrays so deepEqual compares bytes). */
export function oneOfEachKind(): Frame[] {
  return [
    { kind: 'hello', version: PROTOCOL_VERSION },
    {
      kind: 'begin',
      transferId: tid,
      requestId: rid,
      tenant: 'tenant-ü',
      numTokens: 70,
      numPages: 5,
      pageBytes: 3,
      mac: new Uint8Array(32).fill(7),
    },
    {
      kind: 'pages',
      transferId: tid,
      requestId: rid,
      pages: [
        {
          ordinal: 0,
          tokensOnPage: 16,
          checksum: 0xffff_ffff_ffff_ffffn,
          payload: new Uint8Array([1, 2, 3]),
        },
        { ordinal: 4, tokensOnPage: 6, checksum: 5n, payload: new Uint8Array([9, 8, 7]) },
      ],
    },
    {
      kind: 'end',
      transferId: tid,
      requestId: rid,
      manifestChecksum: 0x1234_5678_9abc_def0n,
      firstTokenId: 0xffff_ffff,
      mac: new Uint8Array(32).fill(9),
    },
    { kind: 'ack', transferId: tid },
    {
      kind: 'nack',
      transferId: ZERO_TRANSFER_ID,
      code: 'capacity_exhausted',
      message: 'pool full — “quoted”',
    },
    { kind: 'abort', transferId: tid, reason: '' },
  ]
}

// ─── A transfer's content ───────────────────────────────────────────────────────────────────────

/** Everything both sides need to know about one test transfer. */
export interface TransferSpec {
  transferId: string
  requestId: string
  tenant: string
  numTokens: number
  numPages: number
  pageBytes: number
  /** Tokens per page of the receiving pool. */
  pageSize: number
  secret: Buffer
  firstTokenId: number
  /** pages[ordinal]: the payload P holds. */
  pages: Uint8Array[]
}

/** A transfer of `numTokens` tokens in pages of `pageSize` tokens and `pageBytes` random bytes. */
export function makeSpec(
  numTokens = 10,
  pageSize = 4,
  pageBytes = 32,
  tenant = 'tenant-a',
): TransferSpec {
  const numPages = Math.ceil(numTokens / pageSize)
  return {
    transferId: newTransferId(),
    requestId: randomBytes(16).toString('hex'),
    tenant,
    numTokens,
    numPages,
    pageBytes,
    pageSize,
    secret: randomBytes(32),
    firstTokenId: 1 + Math.floor(Math.random() * 1000),
    pages: Array.from({ length: numPages }, () => new Uint8Array(randomBytes(pageBytes))),
  }
}

/** Tokens on page `ordinal` of a well-formed transfer. */
export function tokensOn(spec: TransferSpec, ordinal: number): number {
  return Math.min(spec.pageSize, spec.numTokens - ordinal * spec.pageSize)
}

// ─── D side: recording hooks ────────────────────────────────────────────────────────────────────

/** One reservation and everything that happened to it. */
export class RecordingReservation implements Reservation {
  readonly written = new Map<number, { tokensOnPage: number; payload: Uint8Array }>()
  readonly events: string[] = []
  /** Contract breaches seen (writePage after the end, abort twice, ...): tests assert it is empty. */
  readonly violations: string[] = []
  completedWith: number | null = null
  abortedWith: KvfenceError | null = null
  numAborts = 0
  /** Test hooks: run inside writePage / complete (e.g. to tear things down re-entrantly). */
  onWrite: ((ordinal: number) => void) | null = null
  onComplete: (() => void) | null = null
  completeThrows: KvfenceError | null = null

  constructor(
    readonly info: BeginInfo,
    readonly pageSize: number,
  ) {}

  get isEnded(): boolean {
    return this.completedWith !== null || this.numAborts > 0
  }

  writePage(ordinal: number, tokensOnPage: number, payload: Uint8Array): void {
    if (this.isEnded) this.violations.push(`writePage(${ordinal}) after the transfer ended`)
    if (ordinal >= this.info.numPages)
      this.violations.push(`writePage(${ordinal}) outside ${this.info.numPages} pages`)
    if (payload.length !== this.info.pageBytes)
      this.violations.push(`writePage(${ordinal}) of ${payload.length} bytes`)
    this.events.push(`write ${ordinal}`)
    this.written.set(ordinal, { tokensOnPage, payload: Uint8Array.from(payload) })
    this.onWrite?.(ordinal)
  }

  complete(firstTokenId: number): void {
    if (this.isEnded) this.violations.push('complete after the transfer ended')
    this.events.push('complete')
    this.onComplete?.()
    if (this.completeThrows) throw this.completeThrows
    this.completedWith = firstTokenId
  }

  abort(reason: KvfenceError): void {
    if (this.numAborts > 0) this.violations.push('abort called twice')
    if (this.completedWith !== null) this.violations.push('abort after a completed transfer')
    this.events.push(`abort ${reason.message.split(':')[0]}`)
    this.numAborts++
    this.abortedWith = reason
  }
}

/** ReceiverHooks over an in-memory "pool" that records every call. */
export class RecordingHooks implements ReceiverHooks {
  readonly secrets = new Map<string, Buffer>()
  readonly reservations: RecordingReservation[] = []
  pageSize = 4
  /** When set, begin() throws it. */
  refuseBegin: KvfenceError | null = null
  /** Called with each new reservation (to arm its test hooks). */
  onBegin: ((r: RecordingReservation) => void) | null = null

  expect(spec: TransferSpec): this {
    this.secrets.set(spec.requestId, spec.secret)
    this.pageSize = spec.pageSize
    return this
  }

  secretFor(requestId: string): Buffer | undefined {
    return this.secrets.get(requestId)
  }

  begin(info: BeginInfo): Reservation {
    if (this.refuseBegin) throw this.refuseBegin
    const r = new RecordingReservation(info, this.pageSize)
    this.reservations.push(r)
    this.onBegin?.(r)
    return r
  }

  /** The reservation of transfer `id`. @throws if there is none. */
  of(id: string): RecordingReservation {
    const r = this.reservations.find((x) => x.info.transferId === id)
    if (!r) throw new Error(`no reservation for transfer ${id}`)
    return r
  }

  /** Every violation of every reservation. */
  get violations(): string[] {
    return this.reservations.flatMap((r) => r.violations.map((v) => `${r.info.transferId}: ${v}`))
  }
}

// ─── D side: reservations that take payloads in place ───────────────────────────────────────────

/** `bytes` cut into views at `cuts` (offsets modulo its length + 1; empty views included, as a
 *  pool may hand out none). */
export function viewsOf(bytes: Uint8Array, cuts: number[]): Uint8Array[] {
  const at = cuts.map((c) => c % (bytes.length + 1)).sort((a, b) => a - b)
  const views: Uint8Array[] = []
  let from = 0
  for (const cut of [...at, bytes.length]) {
    views.push(bytes.subarray(from, cut))
    from = cut
  }
  return views
}

/** A reservation whose pages are views of its own memory, cut at `cuts` (placePage). */
export class PlacedReservation extends RecordingReservation {
  readonly memory: Uint8Array
  numPlaced = 0
  constructor(
    info: BeginInfo,
    pageSize: number,
    private readonly cuts: number[],
  ) {
    super(info, pageSize)
    this.memory = new Uint8Array(info.numPages * info.pageBytes)
  }

  placePage(ordinal: number, tokensOnPage: number): Uint8Array[] {
    if (this.isEnded) this.violations.push(`placePage(${ordinal}) after the transfer ended`)
    this.events.push(`place ${ordinal}`)
    this.numPlaced++
    const { pageBytes } = this.info
    const page = this.memory.subarray(ordinal * pageBytes, (ordinal + 1) * pageBytes)
    this.written.set(ordinal, { tokensOnPage, payload: page })
    return viewsOf(page, this.cuts)
  }
}

/** RecordingHooks whose reservations take payloads in place, in views cut at `cuts`. */
export class PlacedHooks extends RecordingHooks {
  constructor(public cuts: number[] = []) {
    super()
  }

  override begin(info: BeginInfo): Reservation {
    if (this.refuseBegin) throw this.refuseBegin
    const r = new PlacedReservation(info, this.pageSize, this.cuts)
    this.reservations.push(r)
    return r
  }
}

// ─── P side: a page source ──────────────────────────────────────────────────────────────────────

/** An OutgoingTransfer reading `spec.pages`, counting reads and reads after `markSettled()`. */
export function outgoing(
  spec: TransferSpec,
  extra: Partial<OutgoingTransfer> & {
    onRead?: (ordinal: number) => void
    tokensFor?: (o: number) => number
  } = {},
): OutgoingTransfer & { numReads: number; numReadsAfterSettle: number; markSettled(): void } {
  let isSettled = false
  const { onRead, tokensFor, ...rest } = extra
  const t = {
    transferId: spec.transferId,
    requestId: spec.requestId,
    tenant: spec.tenant,
    numTokens: spec.numTokens,
    numPages: spec.numPages,
    pageBytes: spec.pageBytes,
    secret: spec.secret,
    firstTokenId: spec.firstTokenId,
    numReads: 0,
    numReadsAfterSettle: 0,
    markSettled(): void {
      isSettled = true
    },
    readPage(ordinal: number, dst: Uint8Array): number {
      t.numReads++
      if (isSettled) t.numReadsAfterSettle++
      dst.set(spec.pages[ordinal])
      onRead?.(ordinal)
      return tokensFor ? tokensFor(ordinal) : tokensOn(spec, ordinal)
    },
    ...rest,
  }
  return t
}

/** Send and record the outcome; marks the source settled when the promise settles. */
export async function sendAndSettle(
  client: TransferClient,
  t: ReturnType<typeof outgoing>,
  signal?: AbortSignal,
): Promise<KvfenceError | null> {
  try {
    await client.send(t, signal)
    return null
  } catch (err) {
    if (!(err instanceof KvfenceError)) throw err
    return err
  } finally {
    t.markSettled()
  }
}

// ─── Hand-made frames ───────────────────────────────────────────────────────────────────────────

/** BEGIN for `spec`, MAC'd with `secret` (default: the spec's), fields overridable. */
export function beginBytes(
  spec: TransferSpec,
  override: Partial<TransferSpec> = {},
  secret = spec.secret,
): Buffer {
  const s = { ...spec, ...override }
  const fields = {
    transferId: s.transferId,
    requestId: s.requestId,
    tenant: s.tenant,
    numTokens: s.numTokens,
    numPages: s.numPages,
    pageBytes: s.pageBytes,
  }
  return encodeBegin({ ...fields, mac: beginMac(secret, fields) })
}

/** A well-formed page entry of `spec`, fields overridable. */
export function pageEntry(
  spec: TransferSpec,
  ordinal: number,
  override: Partial<PageEntry> = {},
): PageEntry {
  const payload = spec.pages[ordinal % spec.numPages]
  return {
    ordinal,
    tokensOnPage: tokensOn(spec, ordinal % spec.numPages),
    checksum: pageChecksum(payload),
    payload,
    ...override,
  }
}

/** PAGES carrying `ordinals` of `spec`. */
export function pagesBytes(
  spec: TransferSpec,
  ordinals: number[],
  requestId = spec.requestId,
): Buffer {
  return encodePages({
    transferId: spec.transferId,
    requestId,
    pages: ordinals.map((o) => pageEntry(spec, o)),
  })
}

/** END of `spec` with the manifest and MAC of pages `ordinals` (default: all, in order), as a
 *  sender of those pages would build it. Overrides: the manifest field alone, the request id
 *  (MAC'd as the spec's), the checksums the MAC covers (default: those of the pages sent, i.e. what
 *  a sender claimed in its PAGES), the secret and the first token id. */
export function endBytes(
  spec: TransferSpec,
  ordinals?: number[],
  override: {
    manifest?: bigint
    requestId?: string
    checksums?: bigint[]
    secret?: Buffer
    firstTokenId?: number
  } = {},
): Buffer {
  const sent = ordinals ?? spec.pages.map((_, i) => i)
  const checksums = sent.map((o) => pageChecksum(spec.pages[o % spec.numPages]))
  const firstTokenId = override.firstTokenId ?? spec.firstTokenId
  return encodeEnd({
    transferId: spec.transferId,
    requestId: override.requestId ?? spec.requestId,
    manifestChecksum: override.manifest ?? manifestChecksum(checksums),
    firstTokenId,
    mac: endMac(
      override.secret ?? spec.secret,
      spec,
      override.checksums ?? checksums,
      firstTokenId,
    ),
  })
}

/** HELLO bytes of `version` (default: ours). */
export function helloBytes(version = PROTOCOL_VERSION): Buffer {
  return encodeHello({ version })
}

/** The frames of a whole well-formed transfer of `spec` (without HELLO). */
export function transferBytes(spec: TransferSpec): Buffer[] {
  return [
    beginBytes(spec),
    pagesBytes(
      spec,
      spec.pages.map((_, i) => i),
    ),
    endBytes(spec),
  ]
}

/** Decode a byte stream into frames, copying every view (so frames outlive the parser's buffer). */
export function decodeAll(bytes: Uint8Array): Frame[] {
  const frames: Frame[] = []
  const parser = new FrameParser({
    frame: (f) => frames.push(structuredClone(f)),
    error: (e) => {
      throw new Error(`unexpected frame error ${e.reason}: ${e.message}`)
    },
  })
  parser.push(bytes)
  return frames
}

// ─── A socket-free receiver ─────────────────────────────────────────────────────────────────────

/** One ReceiveSession with its output captured. */
export class SessionHarness {
  readonly hooks: RecordingHooks
  readonly counters: ReceiverCounters = {
    numStarted: 0,
    numCompleted: 0,
    numAborted: 0,
    numRefused: 0,
  }
  readonly session: ReceiveSession
  private readonly output: Buffer[] = []
  isIoClosed = false

  constructor(options: TransferServerOptions = {}, hooks = new RecordingHooks()) {
    this.hooks = hooks
    this.session = new ReceiveSession(
      hooks,
      receiverConfig({ stallTimeoutMs: 60_000, ...options }),
      {
        write: (bytes) => {
          if (this.isIoClosed) throw new Error('write after close')
          this.output.push(Buffer.from(bytes))
        },
        close: () => {
          this.isIoClosed = true
        },
      },
      this.counters,
    )
  }

  /** Feed frames (each pushed as one chunk), after a HELLO unless `withHello` is false. */
  push(...frames: Uint8Array[]): this {
    for (const f of frames) this.session.push(f)
    this.session.check()
    return this
  }

  /** Start the connection with a HELLO. */
  hello(): this {
    return this.push(helloBytes())
  }

  /** Every frame the session wrote so far. */
  get replies(): Frame[] {
    return decodeAll(Buffer.concat(this.output))
  }

  /** The NACK/ACK replies for transfer `id`. */
  repliesFor(id: string): Frame[] {
    return this.replies.filter((f) => 'transferId' in f && f.transferId === id)
  }

  /** The reason slugs of the NACKs for transfer `id`. */
  nackReasonsFor(id: string): string[] {
    return this.repliesFor(id).flatMap((f) => (f.kind === 'nack' ? [f.message.split(':')[0]] : []))
  }

  /** Close the connection (as if the socket closed) and check the invariants. */
  teardown(): void {
    this.session.teardown(new KvfenceError('transfer_failed', 'connection_closed: test teardown'))
    this.session.check()
  }
}

// ─── Real sockets ───────────────────────────────────────────────────────────────────────────────

/** Closers of everything a test opened, so that a failed assertion cannot leave sockets that keep
 *  the test process alive: each TCP test file runs `after(closeEverything)`. */
const openThings = new Set<() => Promise<void> | void>()

/** Register a closer for {@link closeEverything}. */
export function onCleanup(close: () => Promise<void> | void): void {
  openThings.add(close)
}

/** Close every server, client and raw socket the fixtures opened. */
export async function closeEverything(): Promise<void> {
  const closers = [...openThings]
  openThings.clear()
  await Promise.all(closers.map(async (close) => close()))
}

/** A TransferServer listening on 127.0.0.1 at a free port. */
export async function startServer(
  hooks: ReceiverHooks,
  options: TransferServerOptions = {},
): Promise<TransferServer> {
  const server = new TransferServer(hooks, options)
  server.listen(0, '127.0.0.1')
  await once(server, 'listening')
  onCleanup(() => (server.listening ? stopServer(server) : undefined))
  return server
}

/** Close a server and wait until it is closed. */
export function stopServer(server: TransferServer): Promise<void> {
  return new Promise((resolve) => server.close(() => resolve()))
}

/** A TransferClient to `server`. */
export function clientFor(
  server: TransferServer,
  options: Partial<TransferClientOptions> = {},
): TransferClient {
  const client = new TransferClient({ host: '127.0.0.1', port: server.port, ...options })
  onCleanup(() => client.close())
  return client
}

/** A raw TCP connection to `port`, with every frame it receives decoded. */
export async function rawConnect(port: number): Promise<{
  socket: net.Socket
  frames: Frame[]
  isClosed: () => boolean
  waitFor: (pred: (frames: Frame[]) => boolean, ms?: number) => Promise<void>
}> {
  const socket = net.connect({ host: '127.0.0.1', port })
  onCleanup(() => void socket.destroy())
  await once(socket, 'connect')
  const frames: Frame[] = []
  let isClosed = false
  const parser = new FrameParser({
    frame: (f) => frames.push(structuredClone(f)),
    error: () => socket.destroy(),
  })
  socket.on('data', (chunk: Buffer) => parser.push(chunk))
  socket.on('error', () => {})
  socket.on('close', () => {
    isClosed = true
  })
  const waitFor = async (pred: (frames: Frame[]) => boolean, ms = 2_000): Promise<void> => {
    const deadline = Date.now() + ms
    while (!pred(frames)) {
      if (Date.now() > deadline)
        throw new Error(`timed out; frames so far: ${JSON.stringify(frames.map((f) => f.kind))}`)
      await new Promise((r) => setTimeout(r, 2))
    }
  }
  return { socket, frames, isClosed: () => isClosed, waitFor }
}

/** Resolve once `pred()` holds (polling every 2 ms), or reject after `ms`. */
export async function until(pred: () => boolean, ms = 2_000, what = 'condition'): Promise<void> {
  await waitUntil(pred, { timeoutMs: ms, intervalMs: 2, what })
}

/** A TCP relay on 127.0.0.1 in front of the receiver at `port`: each connection it accepts is
 *  relayed both ways over a connection of its own to `port`. `stallNext(numBytes)` makes the next
 *  connection it accepts stop reading from its sender once it relayed that many bytes, as a decode
 *  worker that stops reading does: the receiver gets nothing more on that connection (its replies
 *  still reach the sender), and the sender's writes back up in the kernel. A closed side closes
 *  the other, except on a stalled link, which no longer reads (as a stuck peer would not). */
export async function startRelay(port: number): Promise<{
  port: number
  /** Connections accepted so far. */
  numConnections: () => number
  stallNext: (numBytes: number) => void
  close: () => Promise<void>
}> {
  const stallAfter: number[] = []
  const sockets = new Set<net.Socket>()
  let numConnections = 0
  const server = net.createServer((down) => {
    numConnections++
    const limit = stallAfter.shift() ?? Infinity
    let numRelayed = 0
    const up = net.connect({ host: '127.0.0.1', port })
    for (const socket of [down, up]) {
      sockets.add(socket)
      socket.on('error', () => {})
      socket.on('close', () => {
        sockets.delete(socket)
        down.destroy()
        up.destroy()
      })
    }
    down.on('data', (chunk: Buffer) => {
      const part = chunk.subarray(0, Math.max(0, limit - numRelayed))
      numRelayed += part.length
      if (part.length > 0) up.write(part)
      if (numRelayed >= limit) down.pause()
    })
    up.on('data', (chunk: Buffer) => down.write(chunk))
  })
  server.listen(0, '127.0.0.1')
  await once(server, 'listening')
  const close = async (): Promise<void> => {
    for (const socket of sockets) socket.destroy()
    if (server.listening) await new Promise((r) => server.close(r))
  }
  onCleanup(close)
  return {
    port: (server.address() as net.AddressInfo).port,
    numConnections: () => numConnections,
    stallNext: (numBytes) => stallAfter.push(numBytes),
    close,
  }
}
