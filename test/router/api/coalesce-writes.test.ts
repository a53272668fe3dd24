/** `coalesceWrites` (src/router/api/http.ts): the writes a response makes within one event-loop turn,
 *  promise continuations included, reach its socket as one write; a write is never held past the
 *  turn it was made in; `end()` flushes everything. Counted at the socket (`_write`/`_writev`
 *  calls), over real HTTP on loopback. */
import assert from 'node:assert/strict'
import http from 'node:http'
import type { AddressInfo } from 'node:net'
import type { Socket } from 'node:net'
import { after, before, describe, it } from 'node:test'
import { coalesceWrites } from '../../../src/router/api/http.js'

type Handler = (res: http.ServerResponse) => Promise<void>

describe('coalesced streaming writes', () => {
  let server: http.Server
  let url = ''
  let handler: Handler = async () => undefined
  before(async () => {
    server = http.createServer((_req, res) => {
      res.writeHead(200, { 'content-type': 'text/event-stream' })
      res.flushHeaders()
      coalesceWrites(res)
      void handler(res)
    })
    await new Promise<void>((r) => server.listen(0, '127.0.0.1', r))
    url = `http://127.0.0.1:${(server.address() as AddressInfo).port}`
  })
  after(async () => {
    server.closeAllConnections()
    await new Promise((r) => server.close(r))
  })

  /** Counts the socket writes of `res` from now on: one per `_write` or `_writev` call. */
  function countSocketWrites(res: http.ServerResponse): { numWrites: number } {
    const socket = res.socket as Socket & {
      _write: (...args: unknown[]) => void
      _writev: (...args: unknown[]) => void
    }
    const counter = { numWrites: 0 }
    for (const method of ['_write', '_writev'] as const) {
      const original = socket[method].bind(socket)
      socket[method] = (...args: unknown[]) => {
        counter.numWrites++
        original(...args)
      }
    }
    return counter
  }

  it('writes of one turn, across awaits, leave in one socket write', async () => {
    const counts: number[] = []
    handler = async (res) => {
      const counter = countSocketWrites(res)
      res.write('data: 1\n\n')
      await Promise.resolve() // as a caller awaiting each write does
      res.write('data: 2\n\n')
      await Promise.resolve()
      res.write('data: 3\n\n')
      await new Promise((r) => setImmediate(r))
      counts.push(counter.numWrites)
      res.write('data: 4\n\n') // a later turn: its own write
      await new Promise((r) => setImmediate(r))
      counts.push(counter.numWrites)
      res.end('data: [DONE]\n\n')
    }
    const text = await (await fetch(url)).text()
    assert.equal(text, 'data: 1\n\ndata: 2\n\ndata: 3\n\ndata: 4\n\ndata: [DONE]\n\n')
    assert.deepEqual(counts, [1, 2])
  })

  it('a lone write reaches the client while the response stays open', async () => {
    let release = () => {}
    const isReleased = new Promise<void>((r) => (release = r))
    handler = async (res) => {
      res.write('data: first\n\n')
      await isReleased // nothing more is written until the client has the first event
      res.end('data: [DONE]\n\n')
    }
    const res = await fetch(url)
    const reader = res.body!.getReader()
    const first = await reader.read()
    assert.equal(new TextDecoder().decode(first.value), 'data: first\n\n')
    release()
    let rest = ''
    for (let r = await reader.read(); !r.done; r = await reader.read()) {
      rest += new TextDecoder().decode(r.value)
    }
    assert.equal(rest, 'data: [DONE]\n\n')
  })
})
