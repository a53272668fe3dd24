/** A request body read as UTF-8 text, its JSON objects and arrays counted as it arrives (so a
 *  body of too many is refused before the rest is read), then decoded whole at its end (for 1 MB,
 *  a copy and a decode, ~1 ms). Decoding it chunk by chunk, as this once did, left a string per
 *  chunk alive for as long as the body took to arrive: the scavenges copied and promoted them,
 *  and the major collections they brought stalled the event loop every tenant shares (a 1 MB
 *  prompt's effect on another tenant's p99 fell from ~9.5 to ~6 ms without them, measured).
 *  Knows bytes, UTF-8 and JSON's brackets; knows nothing of HTTP responses, tenants or workers. */
import type { IncomingMessage } from 'node:http'
import { TextDecoder } from 'node:util'
import { KvfenceError } from '../../common/errors.js'

/** Bodies up to this many bytes are not counted (a parse of them cannot matter); past it, their
 *  chunks are counted as they arrive. */
export const streamedBodyBytes = 64 * 1024

/** What {@link readBodyText} read. */
export interface BodyText {
  /** The body as text; null when it is not valid UTF-8 (refused, never replaced with U+FFFD). */
  text: string | null
  /** Bytes read. */
  numBytes: number
  /** Objects and arrays the body opens (`{` and `[` outside strings); counted only for bodies
   *  over {@link streamedBodyBytes}, else 0. Meaningless for malformed JSON. */
  numContainers: number
}

/** Counts `{` and `[` outside JSON strings, across chunks (a string or an escape may be cut
 *  anywhere). UTF-8 never has 0x22 or 0x5c inside a multi-byte character. Inside a string it
 *  jumps from one quote or backslash to the next with `Buffer.indexOf` (native) instead of
 *  looking at every byte: a 1 MB prompt is almost all string, and a byte-by-byte loop cost the
 *  event loop ~11 ms of it (measured). */
class ContainerCounter {
  /** Counted so far; counting stops once past `limit` (the body is refused then). */
  numContainers = 0
  constructor(private readonly limit: number) {}

  private isInString = false
  private isEscaped = false

  push(bytes: Buffer): void {
    const n = bytes.length
    let numContainers = this.numContainers
    let isInString = this.isInString
    let isEscaped = this.isEscaped
    // The next quote and backslash at or after where they were last looked for (n: none left);
    // each is searched for again only once passed, so every byte is searched over at most once.
    let nextQuote = -1
    let nextBackslash = -1
    let i = 0
    while (i < n) {
      if (isInString) {
        if (isEscaped) {
          isEscaped = false
          i++ // the escaped byte, whatever it is
          continue
        }
        if (nextQuote < i) nextQuote = indexOrEnd(bytes, 0x22, i)
        if (nextBackslash < i) nextBackslash = indexOrEnd(bytes, 0x5c, i)
        if (nextBackslash < nextQuote) {
          isEscaped = true
          i = nextBackslash + 1
        } else {
          isInString = nextQuote === n // the string goes on into the next chunk
          i = nextQuote + 1
        }
        continue
      }
      const b = bytes[i++]
      if (b === 0x22) isInString = true
      else if ((b === 0x7b || b === 0x5b) && ++numContainers > this.limit) break
    }
    this.numContainers = numContainers
    this.isInString = isInString
    this.isEscaped = isEscaped
  }
}

/** Where `byte` next is in `bytes` from `from`, or `bytes.length` when it is not. */
function indexOrEnd(bytes: Buffer, byte: number, from: number): number {
  const at = bytes.indexOf(byte, from)
  return at === -1 ? bytes.length : at
}

/** A body's chunks as they arrive, counted past {@link streamedBodyBytes}; its text at the end. */
class BodyDecoder {
  constructor(private readonly maxContainers: number) {}
  private kept: Buffer[] = []
  private numKeptBytes = 0
  private counter: ContainerCounter | null = null

  push(chunk: Buffer): void {
    this.kept.push(chunk)
    this.numKeptBytes += chunk.length
    if (this.counter === null) {
      if (this.numKeptBytes <= streamedBodyBytes) return
      this.counter = new ContainerCounter(this.maxContainers)
      for (const piece of this.kept) this.counter.push(piece)
      return
    }
    this.counter.push(chunk)
  }

  /** Whether the body opens more than `maxContainers` objects and arrays (counted only past
   *  {@link streamedBodyBytes}): it is then refused, and needs no more reading. */
  get isOverContainers(): boolean {
    return (this.counter?.numContainers ?? 0) > this.maxContainers
  }

  finish(): { text: string | null; numContainers: number } {
    const bytes =
      this.kept.length === 1 ? this.kept[0] : Buffer.concat(this.kept, this.numKeptBytes)
    this.kept = []
    const numContainers = this.counter?.numContainers ?? 0
    try {
      return { text: strictUtf8.decode(bytes), numContainers }
    } catch {
      return { text: null, numContainers }
    }
  }
}

const strictUtf8 = new TextDecoder('utf-8', { fatal: true })

/** Reads `req`'s body (with listeners: an async iterator over the request costs every request a
 *  few µs more). Past `maxBytes` it stops reading and rejects with `tooLarge()`, and as soon as a
 *  body over {@link streamedBodyBytes} opens more than `maxContainers` objects and arrays, with
 *  `tooManyContainers()` (the rest is left to the error response, which closes the connection after
 *  it); a connection closed before the body's end rejects with `request_aborted`. */
export function readBodyText(
  req: IncomingMessage,
  limits: { maxBytes: number; maxContainers: number },
  errors: { tooLarge: () => KvfenceError; tooManyContainers: () => KvfenceError },
): Promise<BodyText> {
  return new Promise((resolve, reject) => {
    const body = new BodyDecoder(limits.maxContainers)
    let numBytes = 0
    const settle = () => {
      req.off('data', onData)
      req.off('end', onEnd)
      req.off('error', onAborted)
      req.off('close', onAborted)
    }
    const onData = (chunk: Buffer) => {
      numBytes += chunk.length
      if (numBytes > limits.maxBytes) return refuse(errors.tooLarge())
      body.push(chunk)
      if (body.isOverContainers) refuse(errors.tooManyContainers())
    }
    const refuse = (err: KvfenceError) => {
      settle()
      req.pause()
      reject(err)
    }
    const onEnd = () => {
      settle()
      resolve({ ...body.finish(), numBytes })
    }
    // Node fails the read with `aborted` (ECONNRESET) when the connection closes mid-body; a
    // 'close' before 'end' is the same.
    const onAborted = () => {
      settle()
      reject(
        new KvfenceError(
          'request_aborted',
          `the client closed the connection after ${numBytes} bytes of the request body`,
        ),
      )
    }
    if (req.readableEnded) return resolve({ text: '', numBytes: 0, numContainers: 0 })
    req.on('data', onData)
    req.on('end', onEnd)
    req.on('error', onAborted)
    req.on('close', onAborted)
  })
}
