/** `ndjsonLines` (src/control/ndjson-lines.ts), the decode worker's reply as parsed lines, over
 *  real HTTP on loopback: lines split anywhere across writes arrive whole and in order (a last
 *  line without a newline too, blank lines skipped); a line over the bound, a parse error and a
 *  reply cut before its end each end the iteration with that error, after the lines before it;
 *  leaving early closes the request (the server sees its response closed before the end). */
import assert from 'node:assert/strict'
import http from 'node:http'
import type { AddressInfo } from 'node:net'
import { after, before, describe, it } from 'node:test'
import { ndjsonLines } from '../../src/control/ndjson-lines.js'

type Handler = (res: http.ServerResponse) => Promise<void>

describe('NDJSON lines of a streamed reply', () => {
  let server: http.Server
  let url = ''
  let handler: Handler = async () => undefined
  before(async () => {
    server = http.createServer((_req, res) => {
      res.writeHead(200, { 'content-type': 'application/x-ndjson' })
      void handler(res)
    })
    await new Promise<void>((r) => server.listen(0, '127.0.0.1', r))
    url = `http://127.0.0.1:${(server.address() as AddressInfo).port}`
  })
  after(async () => {
    server.closeAllConnections()
    await new Promise((r) => server.close(r))
  })

  const turn = () => new Promise((r) => setImmediate(r))
  const get = () =>
    new Promise<http.IncomingMessage>((resolve, reject) =>
      http.get(url, { agent: false }, resolve).on('error', reject),
    )
  const lines = async (maxLineChars = 1024) => {
    const seen: unknown[] = []
    const iterator = ndjsonLines(await get(), {
      parse: (line) => JSON.parse(line) as unknown,
      maxLineChars,
      tooLong: () => new Error('too long'),
      asError: (err) => new Error(`wrapped: ${(err as Error).message}`),
    })
    try {
      for await (const value of iterator) seen.push(value)
      return { seen, error: null }
    } catch (err) {
      return { seen, error: (err as Error).message }
    }
  }

  it('lines split anywhere arrive whole, in order; a last line without a newline counts', async () => {
    handler = async (res) => {
      for (const piece of ['{"a":', '1}\n{"b"', ':2}\n\n  \n{"c":3}\n{"d', '":4}']) {
        res.write(piece)
        await turn()
      }
      res.end()
    }
    assert.deepEqual(await lines(), { seen: [{ a: 1 }, { b: 2 }, { c: 3 }, { d: 4 }], error: null })
  })

  it('a line over the bound, a line that does not parse: the lines before, then the error', async () => {
    handler = async (res) => {
      res.write('{"a":1}\n{"long":"')
      await turn()
      res.end('x'.repeat(64))
    }
    assert.deepEqual(await lines(32), { seen: [{ a: 1 }], error: 'wrapped: too long' })
    handler = async (res) => void res.end('{"a":1}\nnot json\n{"b":2}\n')
    const parsed = await lines()
    assert.deepEqual(parsed.seen, [{ a: 1 }])
    assert.match(parsed.error ?? '', /^wrapped: Unexpected token/)
  })

  it('a reply cut before its end is an error, not an end', async () => {
    handler = async (res) => {
      res.write('{"a":1}\n')
      await turn()
      res.socket?.destroy()
    }
    const cut = await lines()
    assert.deepEqual(cut.seen, [{ a: 1 }])
    assert.match(cut.error ?? '', /^wrapped: /)
  })

  it('leaving early closes the request', async () => {
    let isClosedEarly: Promise<boolean> = Promise.resolve(false)
    handler = async (res) => {
      isClosedEarly = new Promise((r) => res.on('close', () => r(!res.writableEnded)))
      res.write('{"a":1}\n')
      // Never ends on its own: only the client's leaving ends it.
    }
    const iterator = ndjsonLines(await get(), {
      parse: (line) => JSON.parse(line) as unknown,
      maxLineChars: 1024,
      tooLong: () => new Error('too long'),
    })
    assert.deepEqual(await iterator.next(), { value: { a: 1 }, done: false })
    assert.deepEqual(await iterator.return!(), { value: undefined, done: true })
    assert.equal(await isClosedEarly, true)
  })
})
