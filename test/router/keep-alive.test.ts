/** The router's connections to workers: its probes' pooled HTTP connections (it closes idle ones
 *  before a worker would, and a reset of a reused connection costs a read-only probe one retry —
 *  never a POST), and one control channel per worker for every request step. */
import assert from 'node:assert/strict'
import http from 'node:http'
import type { AddressInfo, Socket } from 'node:net'
import { describe, it } from 'node:test'
import type { ServerInfo } from '../../src/control/messages.js'
import { KvfenceError } from '../../src/common/errors.js'
import { createWorkerClient } from '../../src/control/worker-client.js'
import { type Harness, startHarness, waitFor } from './helpers.js'

const info: ServerInfo = {
  role: 'decode',
  model: 'echo-test',
  pageSize: 16,
  numPages: 64,
  capacityTokens: 1024,
  numPagesFree: 64,
  numPagesUsed: 0,
  maxPositionEmbeddings: 4096,
  guardsEnabled: true,
  faults: [],
  transferPort: 47_001,
}

/** A worker stand-in that resets the connection instead of answering the `resetNth` request on
 *  every connection (1-based) — what a client meets when it reuses a connection the server is
 *  closing. Counts connections and requests by method. */
async function startResettingWorker(resetNth: number) {
  const perSocket = new WeakMap<Socket, number>()
  const seen = { connections: 0, closedByClient: 0, GET: 0, POST: 0 }
  const server = http.createServer((req, res) => {
    const n = (perSocket.get(req.socket) ?? 0) + 1
    perSocket.set(req.socket, n)
    seen[req.method as 'GET' | 'POST']++
    if (n === resetNth) return req.socket.resetAndDestroy()
    if (req.url === '/metrics') return res.end('kvfence_up 1\n')
    res.writeHead(200, { 'content-type': 'application/json' })
    res.end(JSON.stringify(info))
  })
  server.keepAliveTimeout = 65_000
  server.on('connection', (socket: Socket) => {
    seen.connections++
    socket.on('end', () => seen.closedByClient++)
  })
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  const url = `http://127.0.0.1:${(server.address() as AddressInfo).port}`
  return {
    url,
    seen,
    close: () =>
      new Promise<void>((resolve) => (server.closeAllConnections(), server.close(() => resolve()))),
  }
}

/** Three completions through the router, one of them streamed, each read to its end. */
async function threeCompletions(h: Harness): Promise<void> {
  for (const stream of [false, true, false]) {
    const res = await h.post('/v1/completions', { model: 'echo-test', prompt: 'Hi', stream })
    assert.equal(res.status, 200)
    await res.text()
  }
}

describe('keep-alive connections to workers', () => {
  it('a GET on a reused connection that the worker reset is sent once more, on a new connection', async () => {
    const worker = await startResettingWorker(2)
    const client = createWorkerClient({ prefillUrls: [worker.url], decodeUrls: [worker.url] })
    try {
      assert.deepEqual(await client.serverInfo(worker.url), info) // connection 1
      assert.deepEqual(await client.serverInfo(worker.url), info) // 1 reset; retried on 2
      assert.equal(await client.metricsText(worker.url), 'kvfence_up 1\n') // pooled 3
      assert.equal(await client.metricsText(worker.url), 'kvfence_up 1\n') // 3 reset; 4
      assert.equal(worker.seen.GET, 6)
      assert.equal(worker.seen.connections, 4)
      assert.equal(worker.seen.POST, 0)
    } finally {
      client.close()
      await worker.close()
    }
  })

  it('a POST on a reused connection that the worker reset is not repeated', async () => {
    const worker = await startResettingWorker(2)
    const client = createWorkerClient({ prefillUrls: [worker.url], decodeUrls: [worker.url] })
    try {
      await client.serverInfo(worker.url) // leaves a pooled connection behind
      // The token probe, the router's one POST to a worker (request steps take the channel:
      // test/router/control-channel.test.ts checks a reset there is not sent again either).
      await assert.rejects(client.acceptsClusterToken(worker.url), (err: unknown) => {
        assert.ok(err instanceof KvfenceError)
        assert.equal(err.code, 'worker_unavailable')
        assert.match(err.message, /ECONNRESET/)
        return true
      })
      assert.equal(worker.seen.POST, 1)
    } finally {
      client.close()
      await worker.close()
    }
  })

  it('an idle pooled connection is closed by the router after freeSocketTimeoutMs', async () => {
    const worker = await startResettingWorker(Infinity)
    const client = createWorkerClient({
      prefillUrls: [worker.url],
      decodeUrls: [worker.url],
      freeSocketTimeoutMs: 100,
    })
    try {
      await client.serverInfo(worker.url)
      await waitFor(() => worker.seen.closedByClient === 1, 5_000)
      await client.serverInfo(worker.url)
      assert.equal(worker.seen.connections, 2)
    } finally {
      client.close()
      await worker.close()
    }
  })

  it('requests that finish normally share one control channel to the decode worker', async () => {
    const h = await startHarness()
    try {
      const numAtStart = h.workers.numDecodeConnections() // /server_info at start
      await threeCompletions(h)
      assert.ok(numAtStart <= 1)
      assert.equal(
        h.workers.numDecodeConnections(),
        numAtStart + 1,
        'one channel, not one per request',
      )
    } finally {
      await h.close()
    }
  })
})
