/** The router's idle client connections: kept open 65 s (routerKeepAliveTimeoutMs), past Node's
 *  5 s default, so a client or load balancer that reuses a connection after a few seconds of
 *  silence does not send its request into a connection the router is closing. */
import assert from 'node:assert/strict'
import { connect } from 'node:net'
import { after, before, it } from 'node:test'
import { setTimeout as sleep } from 'node:timers/promises'
import { routerKeepAliveTimeoutMs } from '../../src/router/start.js'
import { type Harness, startHarness } from './helpers.js'

let harness: Harness
before(async () => (harness = await startHarness()))
after(() => harness.close())

/** Sends `GET /health` on `socket` and resolves with the response's head (status line and headers). */
function getHealth(socket: ReturnType<typeof connect>): Promise<string> {
  return new Promise((resolve, reject) => {
    let text = ''
    const onData = (chunk: Buffer) => {
      text += chunk.toString('latin1')
      const end = text.indexOf('\r\n\r\n')
      if (end < 0) return
      const length = Number(/\r\ncontent-length: (\d+)/i.exec(text)?.[1] ?? 0)
      if (text.length < end + 4 + length) return
      socket.off('data', onData)
      socket.off('close', onClose)
      resolve(text.slice(0, end))
    }
    const onClose = () => reject(new Error(`the router closed the connection (read: ${text})`))
    socket.on('data', onData)
    socket.once('close', onClose)
    socket.write('GET /health HTTP/1.1\r\nhost: router\r\nconnection: keep-alive\r\n\r\n')
  })
}

it('says timeout=65 in Keep-Alive and answers on a connection left idle past Node’s 5 s default', async () => {
  assert.equal(routerKeepAliveTimeoutMs, 65_000)
  const port = Number(new URL(harness.router.url).port)
  const socket = connect(port, '127.0.0.1')
  try {
    const first = await getHealth(socket)
    assert.match(first, /^HTTP\/1\.1 200 /)
    assert.match(first, /\r\nkeep-alive: timeout=65(\r\n|$)/i)
    await sleep(5_500) // past Node's default keepAliveTimeout (5 s), where the router closed it
    assert.match(await getHealth(socket), /^HTTP\/1\.1 200 /)
  } finally {
    socket.destroy()
  }
})
