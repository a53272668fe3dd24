/** A man-in-the-middle on the transfer data plane, run as its own process by middlebox.test.ts:
 *  `node middlebox-process.js --kvfence-middlebox <decode transfer port>`. It listens on a free
 *  loopback port, relays each prefill connection to the decode worker's transfer port, records
 *  every transfer it sees (BEGIN, PAGES, END as raw frames), and tampers with the next transfers
 *  as the parent asks over IPC. It knows the frame layout from docs/protocol.md and no secret:
 *  everything it sends is either copied off the wire or relabelled (ids rewritten in place).
 *
 *  Attacks (the mode applies to every transfer whose BEGIN arrives while it is set):
 *  | mode        | what the middlebox does                                                      |
 *  | ----------- | ---------------------------------------------------------------------------- |
 *  | `pass`      | relays everything (and records it: the first transfer is "the earlier one")  |
 *  | `duplicate` | relays the transfer, then once D ACKed it sends its frames again on the same |
 *  |             | connection and on a second connection of its own                             |
 *  | `replay`    | relays BEGIN, drops P's PAGES and END, sends the earlier transfer's recorded |
 *  |             | PAGES and END relabelled with this transfer's ids, on the same connection    |
 *  | `splice`    | answers P itself (ACKs its END) and sends D, on a connection of its own, the |
 *  |             | genuine BEGIN followed by the earlier transfer's PAGES and END, relabelled   |
 *  | `race`      | sends the genuine BEGIN first on a connection of its own, then relays P's    |
 *  |             | frames; once D refused P's BEGIN it sends, on its own connection, the earlier |
 *  |             | transfer's pages and manifest with the MAC copied from P's genuine END        |
 *
 *  To the parent: `{ type: 'listening', port }`, `{ type: 'begin', transferId, requestId }` for
 *  every BEGIN P sends, and for every ACK or NACK D sends,
 *  `{ type: 'reply', link: 'relay' | 'own', kind: 'ack' | 'nack', transferId, message }`.
 *  From the parent: `{ type: 'mode', mode }`. It exits when the parent disconnects. */
import net from 'node:net'

type Mode = 'pass' | 'duplicate' | 'replay' | 'splice' | 'race'

/** Message the parent receives for each BEGIN P sends. */
export interface MiddleboxBegin {
  type: 'begin'
  transferId: string
  requestId: string
}

/** Message the parent receives for each ACK/NACK from D. */
export interface MiddleboxReply {
  type: 'reply'
  link: 'relay' | 'own'
  kind: 'ack' | 'nack'
  transferId: string
  message: string
}

const HEADER = 8
const KIND_HELLO = 1
const KIND_BEGIN = 2
const KIND_PAGES = 3
const KIND_END = 4
const KIND_ACK = 5
const KIND_NACK = 6

interface Recorded {
  readonly transferId: string
  readonly mode: Mode
  readonly begin: Buffer
  readonly pages: Buffer[]
  end: Buffer | null
  /** race only: P's frames held until the genuine BEGIN may go to D. */
  held: Buffer[] | null
  own: net.Socket | null
  /** race only: D refused P's genuine BEGIN. */
  isGenuineRefused: boolean
}

/** Splits a byte stream into whole frames (header + body), by the header's length field. */
class Framer {
  private pending = Buffer.alloc(0)
  constructor(private readonly onFrame: (frame: Buffer) => void) {}

  push(chunk: Buffer): void {
    this.pending = Buffer.concat([this.pending, chunk])
    while (this.pending.length >= HEADER) {
      const total = HEADER + this.pending.readUInt32BE(4)
      if (this.pending.length < total) return
      const frame = Buffer.from(this.pending.subarray(0, total))
      this.pending = this.pending.subarray(total)
      this.onFrame(frame)
    }
  }
}

const kindOf = (frame: Buffer): number => frame[2]
const transferIdOf = (frame: Buffer): string => frame.toString('hex', HEADER, HEADER + 16)

/** `frame` (PAGES or END) with the transfer and request ids of `begin` written over its own. */
function relabel(frame: Buffer, begin: Buffer): Buffer {
  const out = Buffer.from(frame)
  begin.copy(out, HEADER, HEADER, HEADER + 32)
  return out
}

function ackFrame(transferId: string): Buffer {
  const out = Buffer.alloc(HEADER + 16)
  out.writeUInt16BE(0x4b56, 0)
  out[2] = KIND_ACK
  out.writeUInt32BE(16, 4)
  out.write(transferId, HEADER, 'hex')
  return out
}

function nackMessage(frame: Buffer): string {
  const codeBytes = frame[HEADER + 16]
  const at = HEADER + 17 + codeBytes
  return frame.toString('utf8', at + 2, at + 2 + frame.readUInt16BE(at))
}

function main(upstreamPort: number): void {
  let mode: Mode = 'pass'
  const transfers = new Map<string, Recorded>()
  /** The first transfer recorded with its END: what replay, splice and race send as "earlier". */
  let earlier: Recorded | null = null

  const report = (link: 'relay' | 'own', frame: Buffer): void => {
    const kind = kindOf(frame)
    if (kind !== KIND_ACK && kind !== KIND_NACK) return
    const reply: MiddleboxReply = {
      type: 'reply',
      link,
      kind: kind === KIND_ACK ? 'ack' : 'nack',
      transferId: transferIdOf(frame),
      message: kind === KIND_NACK ? nackMessage(frame) : '',
    }
    process.send?.(reply)
  }

  /** A connection of the middlebox's own to D, HELLO already sent (copied from P's). */
  const openOwn = (hello: Buffer, onReply: (frame: Buffer) => void): net.Socket => {
    const own = net.connect({ host: '127.0.0.1', port: upstreamPort })
    own.on('error', () => {})
    const framer = new Framer((frame) => {
      report('own', frame)
      onReply(frame)
    })
    own.on('data', (chunk: Buffer) => framer.push(chunk))
    own.write(hello)
    return own
  }

  const server = net.createServer((p) => {
    const d = net.connect({ host: '127.0.0.1', port: upstreamPort })
    let hello: Buffer | null = null
    p.on('error', () => d.destroy())
    d.on('error', () => p.destroy())
    p.on('close', () => d.destroy())
    d.on('close', () => p.destroy())

    /** race: once D refused P's BEGIN and P's END is known, send the altered pages on our own
     *  connection, with the manifest they match and the MAC of P's genuine END. */
    const tryRace = (t: Recorded): void => {
      if (!t.isGenuineRefused || t.end === null || t.own === null || earlier === null) return
      const end = relabel(earlier.end!, t.begin)
      t.end.copy(end, HEADER + 44, HEADER + 44, HEADER + 76)
      t.own.write(Buffer.concat([...earlier.pages.map((f) => relabel(f, t.begin)), end]))
      t.own = null
    }

    const fromD = new Framer((frame) => {
      report('relay', frame)
      p.write(frame)
      const t = transfers.get(transferIdOf(frame))
      if (t === undefined) return
      if (t.mode === 'duplicate' && kindOf(frame) === KIND_ACK && t.end !== null) {
        const all = Buffer.concat([t.begin, ...t.pages, t.end])
        d.write(all)
        openOwn(hello!, () => {}).write(all)
      }
      if (t.mode === 'race' && kindOf(frame) === KIND_NACK) {
        t.isGenuineRefused = true
        tryRace(t)
      }
    })
    d.on('data', (chunk: Buffer) => fromD.push(chunk))

    const framer = new Framer((frame) => {
      const kind = kindOf(frame)
      if (kind === KIND_HELLO) {
        hello = frame
        d.write(frame)
        return
      }
      const id = transferIdOf(frame)
      if (kind === KIND_BEGIN) {
        const t: Recorded = {
          transferId: id,
          mode,
          begin: frame,
          pages: [],
          end: null,
          held: mode === 'race' ? [] : null,
          own: null,
          isGenuineRefused: false,
        }
        transfers.set(id, t)
        const seen: MiddleboxBegin = {
          type: 'begin',
          transferId: id,
          requestId: frame.toString('hex', HEADER + 16, HEADER + 32),
        }
        process.send?.(seen)
        if (t.mode === 'splice') return
        if (t.mode !== 'race') return void d.write(frame)
        t.own = openOwn(hello!, (reply) => {
          if (kindOf(reply) !== KIND_HELLO || t.held === null) return
          // D answered our HELLO, so our BEGIN came first: relay P's frames now.
          setTimeout(() => {
            d.write(Buffer.concat([frame, ...t.held!]))
            t.held = null
          }, 20)
        })
        t.own.write(frame)
        return
      }
      const t = transfers.get(id)
      if (t === undefined) return void d.write(frame)
      if (kind === KIND_PAGES) t.pages.push(frame)
      if (kind === KIND_END) {
        t.end = frame
        earlier ??= t
      }
      switch (t.mode) {
        case 'pass':
        case 'duplicate':
          return void d.write(frame)
        case 'race':
          if (t.held !== null) t.held.push(frame)
          else d.write(frame)
          return tryRace(t)
        case 'replay':
          if (kind === KIND_END && earlier !== null && earlier !== t)
            d.write(Buffer.concat([...earlier.pages, earlier.end!].map((f) => relabel(f, t.begin))))
          return
        case 'splice':
          if (kind === KIND_END && earlier !== null && earlier !== t) {
            const forged = [...earlier.pages, earlier.end!].map((f) => relabel(f, t.begin))
            openOwn(hello!, () => {}).write(Buffer.concat([t.begin, ...forged]))
            p.write(ackFrame(id))
          }
          return
      }
    })
    p.on('data', (chunk: Buffer) => framer.push(chunk))
  })

  process.on('message', (msg: { type: string; mode?: Mode }) => {
    if (msg.type === 'mode' && msg.mode !== undefined) mode = msg.mode
  })
  process.on('disconnect', () => process.exit(0))
  server.listen(0, '127.0.0.1', () => {
    const address = server.address() as net.AddressInfo
    process.send?.({ type: 'listening', port: address.port })
  })
}

// Only as the test's child: imported or run by a test runner, this file does nothing.
const at = process.argv.indexOf('--kvfence-middlebox')
if (at >= 0 && process.send !== undefined) main(Number(process.argv[at + 1]))
