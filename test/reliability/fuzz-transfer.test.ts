/** Transfer frames fuzzed against a live decode worker's transfer port from a raw TCP client:
 *  random bytes, well-formed headers with random bodies, HELLO followed by random frames, BEGINs
 *  for requests that do not exist and with forged MACs, oversized length fields. The worker stays
 *  up, its pool stays empty, and the cluster still serves a request with the oracle's tokens. */
import assert from 'node:assert/strict'
import type { ChildProcess } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import net from 'node:net'
import { after, before, describe, it } from 'node:test'
import fc from 'fast-check'
import { ServerInfo } from '../../src/control/messages.js'
import { Oracle } from '../../src/soak/oracle.js'
import {
  encodeBegin,
  encodeEnd,
  encodeHello,
  frameKinds,
  MAGIC,
  PROTOCOL_VERSION,
} from '../../src/transfer/frames.js'
import { echoModelDir } from '../helpers/paths.js'
import {
  allocatePorts,
  client,
  makeTenants,
  pagesUsed,
  shape,
  startDecode,
  startPrefill,
  startRouterPart,
  stopAll,
  type Ports,
} from './helpers.js'

const tenants = makeTenants()

/** Write `bytes` to the transfer port, wait for the worker to answer or close (at most 300 ms:
 *  an incomplete frame is only refused at the receiver's stall timeout), then hang up. */
function throwAt(port: number, bytes: Buffer): Promise<void> {
  return new Promise((resolve) => {
    const socket = net.connect({ host: '127.0.0.1', port })
    const done = () => {
      clearTimeout(timer)
      socket.destroy()
      resolve()
    }
    const timer = setTimeout(done, 300)
    socket.on('error', done)
    socket.on('close', done)
    socket.on('data', () => {})
    socket.once('connect', () => socket.write(bytes))
  })
}

function header(kind: number, flags: number, bodyBytes: number): Buffer {
  const h = Buffer.alloc(8)
  h.writeUInt16BE(MAGIC, 0)
  h.writeUInt8(kind, 2)
  h.writeUInt8(flags, 3)
  h.writeUInt32BE(bodyBytes >>> 0, 4)
  return h
}

const hex16 = fc
  .uint8Array({ minLength: 16, maxLength: 16 })
  .map((b) => Buffer.from(b).toString('hex'))
  .filter((id) => id !== '0'.repeat(32)) // the reserved zero id: the encoder refuses it

/** Byte strings a hostile or broken peer could send. */
const frames = fc.oneof(
  fc.uint8Array({ maxLength: 2_000 }).map((b) => Buffer.from(b)),
  fc
    .tuple(
      fc.integer({ min: 0, max: 255 }),
      fc.integer({ min: 0, max: 255 }),
      fc.uint8Array({ maxLength: 400 }),
    )
    .map(([kind, flags, body]) => Buffer.concat([header(kind, flags, body.length), body])),
  fc
    .tuple(fc.integer({ min: 1, max: 7 }), fc.uint8Array({ maxLength: 400 }), fc.nat())
    .map(([kind, body, lie]) =>
      Buffer.concat([
        encodeHello({ version: PROTOCOL_VERSION }),
        header(kind, 0, body.length + (lie % 3) - 1),
        body,
      ]),
    ),
  fc
    .record({
      transferId: hex16,
      requestId: hex16,
      tenant: fc.string({ minLength: 1, maxLength: 40 }).filter((t) => Buffer.byteLength(t) <= 256),
      numTokens: fc.integer({ min: 1, max: 1 << 20 }),
      numPages: fc.integer({ min: 1, max: 1 << 16 }),
      pageBytes: fc.integer({ min: 1, max: 1 << 24 }),
      firstTokenId: fc.nat({ max: 0xffffffff }),
    })
    .map((f) =>
      Buffer.concat([
        encodeHello({ version: PROTOCOL_VERSION }),
        encodeBegin({ ...f, mac: randomBytes(32) }),
        encodeEnd({
          transferId: f.transferId,
          requestId: f.requestId,
          manifestChecksum: 0n,
          firstTokenId: f.firstTokenId,
          mac: randomBytes(32),
        }),
      ]),
    ),
  fc.constant(
    Buffer.concat([
      encodeHello({ version: PROTOCOL_VERSION }),
      header(frameKinds.pages, 0, 0xffffffff),
    ]),
  ),
  fc.constant(encodeHello({ version: 0xffff })),
)

describe('transfer frames fuzzed against a live decode worker', () => {
  let ports: Ports
  let children: ChildProcess[] = []
  let transferPort = 0
  const decodeUrl = () => `http://127.0.0.1:${ports.decode}`

  before(async () => {
    ports = await allocatePorts()
    const [prefill, decode] = await Promise.all([startPrefill(ports), startDecode(ports)])
    const router = await startRouterPart(ports, tenants.file)
    children = [prefill, decode, router]
    const info = ServerInfo.parse(await (await fetch(`${decodeUrl()}/server_info`)).json())
    transferPort = info.transferPort!
  })
  after(async () => stopAll(children))

  it('survives hostile frames and keeps serving with the oracle’s tokens', async () => {
    await fc.assert(
      fc.asyncProperty(frames, async (bytes) => {
        await throwAt(transferPort, bytes)
      }),
      { numRuns: 120, seed: 23 },
    )
    const health = await fetch(`${decodeUrl()}/health`)
    assert.equal(health.status, 200, 'the decode worker is down')
    assert.equal(await pagesUsed(decodeUrl()), 0)
    const prompt = 'the river walks near the stone garden'
    const res = await client(`http://127.0.0.1:${ports.router}`, tenants.a.key).completions.create({
      model: 'echo-tiny',
      prompt,
      max_tokens: 20,
      temperature: 0,
    })
    const oracle = new Oracle(echoModelDir, shape.decodePages, shape.pageSize)
    assert.equal(
      res.choices[0].text,
      oracle.expected({ endpoint: 'completion', prompt, maxTokens: 20 }).text,
    )
    assert.equal(await pagesUsed(decodeUrl()), 0)
  })
})
