/** What the router's worker client says of a worker's `/server_info` that gets no answer: the
 *  deadline named, not the abort that enforces it. */
import assert from 'node:assert/strict'
import net, { type AddressInfo, type Socket } from 'node:net'
import { test } from 'node:test'
import { createWorkerClient } from '../../src/control/worker-client.js'

test('a worker that takes the connection and never answers /server_info: worker_unavailable naming the deadline', async () => {
  // As a stopped worker's kernel does: the connection is accepted, nothing is ever said.
  const sockets: Socket[] = []
  const silent = net.createServer((socket) => void sockets.push(socket))
  await new Promise<void>((resolve) => silent.listen(0, '127.0.0.1', resolve))
  const url = `http://127.0.0.1:${(silent.address() as AddressInfo).port}`
  const client = createWorkerClient({ prefillUrls: [url], decodeUrls: [url], infoTimeoutMs: 200 })
  try {
    await assert.rejects(client.serverInfo(url), {
      code: 'worker_unavailable',
      message: `worker ${url}/server_info: no answer before the deadline (a stopped, stuck or overloaded worker)`,
    })
    // A caller's own deadline reads the same.
    await assert.rejects(client.serverInfo(url, AbortSignal.timeout(50)), {
      message: `worker ${url}/server_info: no answer before the deadline (a stopped, stuck or overloaded worker)`,
    })
  } finally {
    client.close()
    for (const s of sockets) s.destroy()
    await new Promise<void>((resolve) => silent.close(() => resolve()))
  }
})
