/** A worker's control server closed in process (`server.close()` on createWorkerServer's server,
 *  as an embedder or a test closes it) closes the control channels it accepted, over real
 *  loopback sockets: the router's channel closes, a stream open on it fails `worker_unavailable`
 *  as for a lost worker, the worker aborts that stream's request (G8: its pages are freed), and
 *  the server's close callback runs. Each test waits on those events; a regression hangs until
 *  the test's timeout. */
import assert from 'node:assert/strict'
import { once } from 'node:events'
import net from 'node:net'
import { after, describe, it } from 'node:test'
import { pino } from 'pino'
import type { PrefillRequest } from '../../src/control/messages.js'
import { DecodeWorker } from '../../src/engine/decode-worker.js'
import { buildFaultConfig } from '../../src/engine/faults.js'
import { PrefillWorker } from '../../src/engine/prefill-worker.js'
import { createWorkerCore, type WorkerCore } from '../../src/engine/worker-core.js'
import { createWorkerServer, listen } from '../../src/engine/worker-server.js'
import { KvfenceError } from '../../src/common/errors.js'
import { openChannel, type ControlChannel } from '../../src/control/channel-client.js'
import { captureLogs } from '../helpers/logs.js'
import { waitUntil } from '../helpers/poll.js'
import { echoModel, makeRequest, tokensOf } from './pair.js'

const log = pino({ level: 'silent' })
const timeout = 20_000
const closers: (() => void)[] = []
after(() => closers.forEach((close) => close()))

function core(): WorkerCore {
  return createWorkerCore({
    model: echoModel(),
    numPages: 32,
    pageSize: 16,
    faults: buildFaultConfig([], false, {}),
  })
}

/** The router's channel to the worker at `port`. */
function channelTo(port: number, role: 'prefill' | 'decode'): Promise<ControlChannel> {
  return openChannel({
    url: `http://127.0.0.1:${port}`,
    role,
    tls: null,
    clusterToken: null,
    connectTimeoutMs: 5_000,
    refusal: (status, body) =>
      new KvfenceError('internal_error', `refused (${status}): ${JSON.stringify(body)}`),
  })
}

/** Resolves when `server.close()` called back. */
function closeServer(server: net.Server): Promise<void> {
  return new Promise((resolve, reject) => server.close((err) => (err ? reject(err) : resolve())))
}

/** `stream` fails as the router fails a stream of a lost worker, and the channel is closed. */
async function assertLostWorker(
  stream: Promise<unknown>,
  role: 'prefill' | 'decode',
  port: number,
  channel: ControlChannel,
): Promise<void> {
  await assert.rejects(
    stream,
    (err: unknown) =>
      err instanceof KvfenceError &&
      err.code === 'worker_unavailable' &&
      err.message === `${role} worker http://127.0.0.1:${port}: control channel closed`,
  )
  assert.equal(channel.isOpen, false)
}

describe('closing a worker server in process', () => {
  it(
    'a decode worker: the router channel closes, its open stream fails worker_unavailable, the request’s pages are freed',
    { timeout },
    async () => {
      const d = core()
      const server = createWorkerServer(
        { role: 'decode', worker: new DecodeWorker(d), transferPort: () => 1 },
        log,
      )
      const port = await listen(server, '127.0.0.1', 0)
      closers.push(() => server.close())
      const channel = await channelTo(port, 'decode')
      const request = makeRequest('tenant-a', tokensOf('the code is Qx7vR2mK9pLt4Wz8. '), 8)
      const events = channel.generate(request, new AbortController().signal)
      // `reserved`: D holds pages for the prompt and waits for a transfer that never comes.
      const first = await events.next()
      // Pages for the prompt and every token it may generate: 31 + 8 tokens in pages of 16.
      assert.equal(request.promptTokenIds.length, 31)
      assert.deepEqual(first.value, { type: 'reserved', numPages: 3, transferPort: 1 })
      assert.equal(d.pool.numUsed, 3)
      const closed = closeServer(server)
      await assertLostWorker(events.next(), 'decode', port, channel)
      await closed
      // The stream's request was aborted with its connection (G8).
      assert.equal(d.pool.numUsed, 0)
      d.pool.check()
    },
  )

  it(
    'a prefill worker: its stream waiting on a transfer fails worker_unavailable and the server closes',
    { timeout },
    async () => {
      // A decode worker's transfer port that accepts and never answers: the transfer waits.
      const silent = net.createServer((socket) => socket.on('error', () => {}))
      const silentPort = await listen(silent, '127.0.0.1', 0)
      closers.push(() => silent.close())
      const accepted = once(silent, 'connection')
      const worker = new PrefillWorker(core())
      closers.push(() => worker.close())
      const server = createWorkerServer({ role: 'prefill', worker }, log)
      const port = await listen(server, '127.0.0.1', 0)
      closers.push(() => server.close())
      const channel = await channelTo(port, 'prefill')
      const generate = makeRequest('tenant-a', tokensOf('the code is Qx7vR2mK9pLt4Wz8. '), 8)
      const request: PrefillRequest = {
        requestId: generate.requestId,
        tenant: generate.tenant,
        promptTokenIds: generate.promptTokenIds,
        sampling: generate.sampling,
        transferSecret: generate.transferSecret,
        decode: { host: '127.0.0.1', port: silentPort },
      }
      const result = channel.prefill(request, new AbortController().signal)
      const [socket] = (await accepted) as [net.Socket]
      const closed = closeServer(server)
      await assertLostWorker(result, 'prefill', port, channel)
      await closed
      socket.destroy()
    },
  )
})

describe('a router that resets its control channel', () => {
  it('is logged at info as the router leaving, not as a failure (a trial saw a warn at every router stop)', async () => {
    const logs = captureLogs()
    const worker = new PrefillWorker(core())
    const server = createWorkerServer({ role: 'prefill', worker }, logs.log)
    const port = await listen(server, '127.0.0.1', 0)
    closers.push(() => server.close())
    const socket = net.connect(port, '127.0.0.1')
    socket.write(
      'GET /internal/channel HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: kvfence-control/1\r\n\r\n',
    )
    const [head] = (await once(socket, 'data')) as [Buffer]
    assert.match(head.toString('latin1'), /^HTTP\/1\.1 101 /)
    socket.resetAndDestroy() // RST, as a router process that exits with bytes unread
    await waitUntil(() => logs.records().some((r) => r.msg.startsWith('control channel')), {
      timeoutMs: 5_000,
      intervalMs: 10,
    })
    const channelLines = logs
      .records()
      .filter((r) => r.msg.startsWith('control channel'))
      .map((r) => [r.level, r.msg, r.err])
    assert.deepEqual(channelLines, [
      [30, 'control channel closed by the router', 'read ECONNRESET'],
    ])
  })
})
