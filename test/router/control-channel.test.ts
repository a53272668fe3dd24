/** The router's end of the control channel (src/control/channel-client.ts) against peers that
 *  are not today's workers: a peer without the channel (the upgrade answered 404) gets no request
 *  and the client a 503; a peer that resets the connection under a request step fails it without
 *  the step being sent again; a peer that sends a frame breaking the format fails every open
 *  stream of that connection with a clear error, after which the next request opens a new
 *  connection. */
import assert from 'node:assert/strict'
import { randomBytes } from 'node:crypto'
import http from 'node:http'
import net, { type AddressInfo, type Socket } from 'node:net'
import { describe, it } from 'node:test'
import { encodeFrame, FrameReader } from '../../src/control/channel-frames.js'
import type { GenerateRequest } from '../../src/control/messages.js'
import { KvfenceError } from '../../src/common/errors.js'
import { createWorkerClient } from '../../src/control/worker-client.js'
import { charIds, defaultReplyText, startHarness, waitFor } from './helpers.js'

function generateRequest(maxTokens = 4): GenerateRequest {
  return {
    requestId: randomBytes(16).toString('hex'),
    tenant: 'alpha',
    promptTokenIds: [1, 72, 73],
    maxTokens,
    sampling: { temperature: 0, topP: 1, seed: null },
    stopTokenIds: [],
    transferSecret: randomBytes(32).toString('hex'),
  }
}

describe('control channel: fallback and broken peers', () => {
  it('a worker that answers the upgrade 404 (no control channel) gets no request: 503 worker_unavailable, the cause logged', async () => {
    // Before the channel was the one transport, such a worker was sent its requests over HTTP.
    const h = await startHarness({ isChannelServed: false })
    try {
      const res = await h.post('/v1/completions', {
        model: 'echo-test',
        prompt: 'Hi',
        stream: true,
      })
      assert.equal(res.status, 503)
      assert.equal(
        ((await res.json()) as { error: { code: string } }).error.code,
        'worker_unavailable',
      )
      assert.equal(h.workers.numDecodeChannels(), 0)
      assert.equal(h.workers.numInternalRequests(), 0, 'no request step reached a worker')
      assert.ok(
        h.logs
          .text()
          .includes(
            `decode worker ${h.workers.decodeUrl} does not serve the control channel (HTTP 404 to its upgrade)`,
          ),
        h.logs.text(),
      )
    } finally {
      await h.close()
    }
  })

  it('the same stand-ins serving the channel get the request over it', async () => {
    const h = await startHarness()
    try {
      const completion = await h.client().completions.create({
        model: 'echo-test',
        prompt: 'Hi',
        max_tokens: 20,
      })
      assert.equal(completion.choices[0].text, defaultReplyText)
      assert.equal(completion.usage?.completion_tokens, charIds(defaultReplyText).length + 1)
      assert.equal(h.workers.numDecodeChannels(), 1)
    } finally {
      await h.close()
    }
  })

  it('a request over the frame cap fails alone; the connection carries the next one', async () => {
    const h = await startHarness()
    const workers = createWorkerClient({
      prefillUrls: [h.workers.prefillUrl],
      decodeUrls: [h.workers.decodeUrl],
    })
    try {
      // 700,000 ids of 6 digits and a comma: over the 4 MiB cap as JSON.
      const huge = { ...generateRequest(), promptTokenIds: Array<number>(700_000).fill(100_000) }
      const numBytes = Buffer.byteLength(JSON.stringify(huge))
      await assert.rejects(
        async () => {
          for await (const _ of workers.generate(huge, AbortSignal.timeout(10_000))) {
            // nothing arrives
          }
        },
        (err: unknown) =>
          err instanceof KvfenceError &&
          err.code === 'internal_error' &&
          err.message ===
            `control channel: a generate payload of ${numBytes} bytes is over ${4 * 1024 * 1024}`,
      )
      const tokenIds: number[] = []
      for await (const e of workers.generate(generateRequest(20), AbortSignal.timeout(10_000)))
        if (e.type === 'token') tokenIds.push(e.tokenId)
      assert.deepEqual(tokenIds, [...charIds(defaultReplyText), 2])
      assert.equal(h.workers.numDecodeChannels(), 1)
      assert.equal(h.workers.generateRequests.length, 1, 'the request over the cap never left')
    } finally {
      workers.close()
      await h.close()
    }
  })

  /** A decode-worker impostor: switches to the channel, then answers the `numStreams`-th
   *  `generate` frame with `reply` (raw bytes), or resets the connection (`'reset'`). Counts
   *  upgrades, `generate` frames and closed connections. */
  async function startImpostor(numStreams: number, reply: Buffer | 'reset') {
    const seen = { upgrades: 0, closed: 0, generates: 0 }
    const server = http.createServer((_req, res) => res.writeHead(404).end())
    server.on('upgrade', (_req, socket: Socket) => {
      seen.upgrades++
      socket.write(
        'HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: kvfence-control/1\r\n\r\n',
      )
      const reader = new FrameReader()
      let numOnThis = 0
      socket.on('data', (chunk: Buffer) => {
        for (const frame of reader.push(chunk)) {
          if (frame.kind !== 'generate') continue
          seen.generates++
          if (++numOnThis !== numStreams) continue
          if (reply === 'reset') socket.resetAndDestroy()
          else socket.write(reply)
        }
      })
      socket.on('close', () => seen.closed++)
      socket.on('end', () => socket.destroy()) // never half-open
    })
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
    return {
      url: `http://127.0.0.1:${(server.address() as AddressInfo).port}`,
      seen,
      close: () =>
        new Promise<void>(
          (resolve) => (server.closeAllConnections(), server.close(() => resolve())),
        ),
    }
  }

  it('a request step whose connection the worker reset fails worker_unavailable and is not sent again', async () => {
    // As a POST on a reset keep-alive connection was never repeated: a worker may have acted on it.
    const impostor = await startImpostor(1, 'reset')
    const workers = createWorkerClient({ prefillUrls: [impostor.url], decodeUrls: [impostor.url] })
    try {
      const events = workers.generate(generateRequest(), AbortSignal.timeout(10_000))
      await assert.rejects(events.next(), (err: unknown) => {
        assert.ok(err instanceof KvfenceError)
        assert.equal(err.code, 'worker_unavailable')
        assert.match(err.message, /ECONNRESET/)
        return true
      })
      assert.equal(impostor.seen.generates, 1)
      assert.equal(impostor.seen.upgrades, 1)
    } finally {
      workers.close()
      await impostor.close()
    }
  })

  const cases: [string, Buffer, RegExp][] = [
    [
      'an unknown kind',
      Buffer.from('05000000' + '63' + '01000000', 'hex'),
      /control channel: unknown frame kind 99$/,
    ],
    [
      'a length over the cap',
      Buffer.from('ffffff7f', 'hex'),
      /control channel: frame length 2147483647 outside \[5, 4194309\]$/,
    ],
    [
      'an event that is not a DecodeEvent',
      encodeFrame('event', 1, Buffer.from('{"type":"reserved"}')),
      /control channel: an invalid event on stream 1 \(numPages: /,
    ],
  ]
  for (const [what, bytes, message] of cases) {
    it(`a frame with ${what} fails every open stream of the connection; the next request reconnects`, async () => {
      const impostor = await startImpostor(2, bytes)
      const workers = createWorkerClient({
        prefillUrls: [impostor.url],
        decodeUrls: [impostor.url],
      })
      try {
        const run = async () => {
          for await (const _ of workers.generate(generateRequest(), AbortSignal.timeout(10_000))) {
            // no event arrives before the broken frame
          }
        }
        const results = await Promise.allSettled([run(), run()])
        for (const r of results) {
          assert.equal(r.status, 'rejected')
          const err = (r as PromiseRejectedResult).reason as unknown
          assert.ok(err instanceof KvfenceError, String(err))
          assert.equal(err.code, 'internal_error')
          assert.ok(err.message.startsWith(`decode worker ${impostor.url}: `), err.message)
          assert.match(err.message, message)
        }
        assert.equal(impostor.seen.upgrades, 1)
        await waitFor(() => impostor.seen.closed === 1) // the router closed the connection
        // A new connection for the next request (which fails the same way).
        await Promise.allSettled([run(), run()])
        assert.equal(impostor.seen.upgrades, 2)
        assert.equal(impostor.seen.generates, 4)
      } finally {
        workers.close()
        await impostor.close()
      }
    })
  }
})

describe('control channel: a worker that takes the connection and never answers the upgrade', () => {
  /** A peer that accepts TCP connections and holds them without a byte in reply (as a stopped
   *  worker's kernel does): the channel's opening waits for it. */
  async function startSilent() {
    const sockets: Socket[] = []
    const server = net.createServer((socket) => sockets.push(socket))
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
    return {
      url: `http://127.0.0.1:${(server.address() as AddressInfo).port}`,
      numConnections: () => sockets.length,
      close: () =>
        new Promise<void>((resolve) => {
          for (const s of sockets) s.destroy()
          server.close(() => resolve())
        }),
    }
  }

  for (const side of ['prefill', 'decode'] as const) {
    it(`a request waiting for the ${side} worker's channel ends when its signal aborts, not at the connect timeout`, async () => {
      // Found by a trial: the drain's deadline (and a client's disconnect) could not end a request
      // waiting to open the channel of a stopped worker; the client got no reply at all.
      const h = await startHarness()
      const silent = await startSilent()
      const workers = createWorkerClient({
        prefillUrls: [side === 'prefill' ? silent.url : h.workers.prefillUrl],
        decodeUrls: [side === 'decode' ? silent.url : h.workers.decodeUrl],
        // Without the fix the wait ended only here, with worker_unavailable (a stopped worker).
        infoTimeoutMs: 30_000,
      })
      const abort = new AbortController()
      try {
        const run = (async () => {
          for await (const _ of workers.generate(generateRequest(), abort.signal)) {
            // no event can arrive
          }
        })()
        await waitFor(() => silent.numConnections() === 1)
        abort.abort()
        await assert.rejects(
          run,
          (err: unknown) => err instanceof KvfenceError && err.code === 'request_aborted',
        )
      } finally {
        workers.close()
        await silent.close()
        await h.close()
      }
    })
  }
})
