/** The control channel's wire format: length-prefixed frames of many streams on one connection
 *  between the router and one worker (the connection itself: channel-server.ts on the worker,
 *  channel-client.ts on the router; the protocol: docs/protocol.md "Control channel").
 *
 *  | bytes | field   | meaning                                                          |
 *  | ----- | ------- | ---------------------------------------------------------------- |
 *  | 4     | length  | u32 LE: bytes that follow (kind + stream + payload), 5 … 4 MiB+5 |
 *  | 1     | kind    | one of {@link frameKinds}                                        |
 *  | 4     | stream  | u32 LE: the request's number, chosen by the router               |
 *  | n     | payload | JSON (UTF-8) of the kind's message, a u32 LE token id, or empty  |
 *
 *  Kinds (→W router to worker, →R worker to router):
 *  | kind     | dir | payload                                     | meaning                  |
 *  | -------- | --- | ------------------------------------------- | ------------------------ |
 *  | generate | →W  | JSON `GenerateRequest`                      | opens a decode stream    |
 *  | prefill  | →W  | JSON `PrefillRequest`                       | opens a prefill stream   |
 *  | cancel   | →W  | empty                                       | abort the stream (G8)    |
 *  | event    | →R  | JSON `DecodeEvent` (`done`/`error` end it)  | a decode worker's event  |
 *  | token    | →R  | u32 LE token id                             | `{type:'token',tokenId}` |
 *  | result   | →R  | JSON `PrefillResult` (ends the stream)      | a prefill worker's result |
 *  | failed   | →R  | JSON `{ error: { code, message } }` (ends) | the worker's refusal     |
 *
 *  Pure: encode and decode only; knows nothing of sockets, streams' states or the messages'
 *  schemas. */
import { KvfenceError } from '../common/errors.js'

/** Frame kinds and their byte on the wire. */
export const frameKinds = {
  generate: 1,
  prefill: 2,
  cancel: 3,
  event: 16,
  token: 17,
  result: 18,
  failed: 19,
} as const
export type FrameKind = keyof typeof frameKinds

const kindNames = new Map<number, FrameKind>(
  Object.entries(frameKinds).map(([name, byte]) => [byte, name as FrameKind]),
)

/** Bytes of the length field. */
export const lengthBytes = 4
/** Bytes of kind + stream, counted in the length. */
const headBytes = 5
/** Largest payload accepted or sent, bytes: a prompt of ~500k token ids. */
export const maxPayloadBytes = 4 * 1024 * 1024

/** One decoded frame. `payload` is a view into the bytes read (valid until the next read). */
export interface Frame {
  kind: FrameKind
  /** u32: the request's stream number. */
  stream: number
  payload: Buffer
}

/** A frame that breaks the format: the connection it came on can no longer be read. */
export class ChannelFrameError extends KvfenceError {
  constructor(message: string) {
    super('internal_error', `control channel: ${message}`)
    this.name = 'ChannelFrameError'
  }
}

/** The frame of `kind` on `stream` with `payload` (bytes, or a u32 token id, or none). */
export function encodeFrame(
  kind: FrameKind,
  stream: number,
  payload: Buffer | number | null,
): Buffer {
  const numPayloadBytes = payload === null ? 0 : typeof payload === 'number' ? 4 : payload.length
  const frame = allocFrame(kind, stream, numPayloadBytes)
  if (typeof payload === 'number') frame.writeUInt32LE(payload, 9)
  else if (payload !== null) payload.copy(frame, 9)
  return frame
}

/** The frame of `kind` on `stream` carrying `message` as JSON. */
export function encodeJsonFrame(kind: FrameKind, stream: number, message: unknown): Buffer {
  const json = JSON.stringify(message)
  // Written in place: one buffer per frame, not the JSON's bytes and then a copy of them.
  const frame = allocFrame(kind, stream, Buffer.byteLength(json, 'utf8'))
  frame.write(json, lengthBytes + headBytes, 'utf8')
  return frame
}

/** A frame's bytes with its length, kind and stream written and `numPayloadBytes` left to fill;
 *  throws {@link ChannelFrameError} over {@link maxPayloadBytes}. */
function allocFrame(kind: FrameKind, stream: number, numPayloadBytes: number): Buffer {
  if (numPayloadBytes > maxPayloadBytes) {
    throw new ChannelFrameError(
      `a ${kind} payload of ${numPayloadBytes} bytes is over ${maxPayloadBytes}`,
    )
  }
  const frame = Buffer.allocUnsafe(lengthBytes + headBytes + numPayloadBytes)
  frame.writeUInt32LE(headBytes + numPayloadBytes, 0)
  frame[4] = frameKinds[kind]
  frame.writeUInt32LE(stream, 5)
  return frame
}

/** Reads frames from a byte stream cut anywhere: `push` each chunk read, get the whole frames it
 *  completed. Throws {@link ChannelFrameError} on a frame that breaks the format (a length out of
 *  range, an unknown kind); the reader is then unusable, as is the connection. */
export class FrameReader {
  private buffered: Buffer | null = null
  private isBroken = false

  /** The whole frames completed by `chunk`, in order. */
  push(chunk: Buffer): Frame[] {
    if (this.isBroken) throw new ChannelFrameError('read after a malformed frame')
    const bytes = this.buffered === null ? chunk : Buffer.concat([this.buffered, chunk])
    const frames: Frame[] = []
    let at = 0
    while (bytes.length - at >= lengthBytes) {
      const length = bytes.readUInt32LE(at)
      if (length < headBytes || length > headBytes + maxPayloadBytes) {
        this.isBroken = true
        throw new ChannelFrameError(
          `frame length ${length} outside [${headBytes}, ${headBytes + maxPayloadBytes}]`,
        )
      }
      if (bytes.length - at - lengthBytes < length) break
      const kindByte = bytes[at + 4]
      const kind = kindNames.get(kindByte)
      if (kind === undefined) {
        this.isBroken = true
        throw new ChannelFrameError(`unknown frame kind ${kindByte}`)
      }
      frames.push({
        kind,
        stream: bytes.readUInt32LE(at + 5),
        payload: bytes.subarray(at + lengthBytes + headBytes, at + lengthBytes + length),
      })
      at += lengthBytes + length
    }
    this.buffered = at === bytes.length ? null : bytes.subarray(at)
    return frames
  }

  /** Bytes of a frame begun but not yet complete. */
  get numBufferedBytes(): number {
    return this.buffered?.length ?? 0
  }
}

/** The JSON value of a frame's payload; throws {@link ChannelFrameError} when it is not JSON. */
export function parseJsonPayload(frame: Frame): unknown {
  try {
    return JSON.parse(frame.payload.toString('utf8'))
  } catch {
    throw new ChannelFrameError(`a ${frame.kind} frame on stream ${frame.stream} is not JSON`)
  }
}

/** The token id of a `token` frame; throws {@link ChannelFrameError} when it is not 4 bytes. */
export function tokenIdOf(frame: Frame): number {
  if (frame.payload.length !== 4) {
    throw new ChannelFrameError(
      `a token frame on stream ${frame.stream} has ${frame.payload.length} payload bytes, want 4`,
    )
  }
  return frame.payload.readUInt32LE(0)
}

/** Idle time before TCP keep-alive probes a control channel's connection, ms (Node's HTTP agent's
 *  `keepAliveMsecs`), so a worker cut off by the network fails its streams in about 11 s (then
 *  10 probes 1 s apart), before the prefill worker's transfer gives up on its own
 *  (test/reliability/two-hosts.test.ts). */
export const channelKeepAliveMs = 1_000

/** Tunes a control channel's socket, at either end: tokens leave at once (no Nagle delay), and a
 *  peer gone silently (its host lost) is found by TCP keep-alive. */
export function tuneChannelSocket(socket: import('node:stream').Duplex): void {
  const tcp = socket as import('node:net').Socket
  tcp.setNoDelay?.(true)
  tcp.setKeepAlive?.(true, channelKeepAliveMs)
}
