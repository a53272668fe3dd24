/** The auditor's HTTP client against servers that stall: every request settles by its deadline
 *  or its cut, whatever the server does (a pending request once ended an audit with exit 13). */
import assert from 'node:assert/strict'
import http from 'node:http'
import type { AddressInfo } from 'node:net'
import { after, before, describe, it } from 'node:test'
import { Budget } from '../../src/audit/budget.js'
import { createTarget } from '../../src/audit/target.js'

describe('audit target: stalled servers', () => {
  let server: http.Server
  let baseUrl = ''
  before(async () => {
    // /stall-headers never answers; /stall-body sends its headers and one event, then nothing.
    server = http.createServer((req, res) => {
      if (req.url === '/stall-body') {
        res.writeHead(200, { 'content-type': 'text/event-stream' })
        res.write('data: {"choices":[{"text":"a"}]}\n\n')
      }
    })
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
    baseUrl = `http://127.0.0.1:${(server.address() as AddressInfo).port}`
  })
  after(() => {
    server.closeAllConnections()
    server.close()
  })

  const target = (requestTimeoutMs: number) =>
    createTarget({
      baseUrl,
      model: null,
      tenants: [{ name: 'a', key: 'sk-test-a' }],
      budget: new Budget({ maxRequests: 10, maxSeconds: 30, concurrency: 2 }),
      requestTimeoutMs,
    })

  it('a server that never answers: failure "timeout" at the request deadline', async () => {
    const r = await target(300).get('/stall-headers')
    assert.equal(r.status, null)
    assert.equal(r.failure, 'timeout')
  })

  it('a body that stalls after its first chunk: the timeout keeps what arrived', async () => {
    const r = await target(300).get('/stall-body')
    assert.equal(r.failure, 'timeout')
    assert.equal(r.body, 'data: {"choices":[{"text":"a"}]}\n\n')
  })

  it('a cut after the first chunk ends the request at once, as "aborted", with that chunk', async () => {
    const startedAt = performance.now()
    const r = await target(20_000).get('/stall-body', { abortAfterChunks: 1 })
    assert.equal(r.failure, 'aborted')
    assert.equal(r.status, 200)
    assert.equal(r.body, 'data: {"choices":[{"text":"a"}]}\n\n')
    // Not the 20 s deadline: the cut ended it (the grace before the slot is freed is 100 ms).
    assert.ok(performance.now() - startedAt < 10_000)
  })
})
