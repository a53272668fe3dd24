/** readBodyText: a request body read over real HTTP, cut into chunks anywhere, gives the same text
 *  as decoding it whole, and counts its objects and arrays as a parse of it finds them. */
import assert from 'node:assert/strict'
import http from 'node:http'
import type { AddressInfo } from 'node:net'
import { after, before, describe, it } from 'node:test'
import fc from 'fast-check'
import { KvfenceError } from '../../../src/common/errors.js'
import { readBodyText, streamedBodyBytes } from '../../../src/router/api/body-text.js'

let server: http.Server
let url = ''

before(async () => {
  server = http.createServer((req, res) => {
    const tooLarge = () => new KvfenceError('payload_too_large', 'too large')
    const tooManyContainers = () => new KvfenceError('invalid_request', 'too many containers')
    const maxContainers = Number(req.headers['x-max-containers'] ?? Infinity)
    readBodyText(
      req,
      { maxBytes: 4 * 1024 * 1024, maxContainers },
      { tooLarge, tooManyContainers },
    ).then(
      (read) => res.end(JSON.stringify(read)),
      (err: Error) => res.end(JSON.stringify({ error: err.message })),
    )
  })
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  url = `http://127.0.0.1:${(server.address() as AddressInfo).port}/`
})
after(() => server.close())

/** Sends `bytes` in pieces cut at `cuts` (offsets), one write each, a turn apart. */
function send(
  bytes: Buffer,
  cuts: readonly number[],
  headers: http.OutgoingHttpHeaders = {},
): Promise<Record<string, unknown>> {
  return new Promise((resolve, reject) => {
    const req = http.request(url, { method: 'POST', headers }, (res) => {
      let text = ''
      res.setEncoding('utf8')
      res.on('data', (c: string) => (text += c))
      res.on('end', () => resolve(JSON.parse(text) as Record<string, unknown>))
    })
    req.on('error', reject)
    const points = [...new Set([0, ...cuts.filter((c) => c > 0 && c < bytes.length), bytes.length])]
    points.sort((a, b) => a - b)
    void (async () => {
      for (let i = 0; i + 1 < points.length; i++) {
        req.write(bytes.subarray(points[i], points[i + 1]))
        await new Promise((r) => setImmediate(r))
      }
      req.end()
    })()
  })
}

/** Objects and arrays in a parsed JSON value (the reference count). */
function numContainersOf(value: unknown): number {
  if (Array.isArray(value)) return 1 + value.reduce((n: number, v) => n + numContainersOf(v), 0)
  if (value !== null && typeof value === 'object') {
    return 1 + Object.values(value).reduce((n: number, v) => n + numContainersOf(v), 0)
  }
  return 0
}

describe('readBodyText', () => {
  it('a large body cut anywhere: the whole text, and the containers a parse finds', async () => {
    await fc.assert(
      fc.asyncProperty(
        fc.jsonValue({ maxDepth: 4 }),
        fc.array(fc.nat(), { maxLength: 12 }),
        async (value, rawCuts) => {
          // Padded past the streamed size with a string of escapes and multi-byte characters,
          // so that cuts fall inside them too.
          const pad = '\\"{[é🙂'.repeat(Math.ceil(streamedBodyBytes / 8))
          const json = JSON.stringify({ value, pad })
          const bytes = Buffer.from(json, 'utf8')
          const cuts = rawCuts.map((c) => c % bytes.length)
          const read = await send(bytes, cuts)
          assert.equal(read.text, json)
          assert.equal(read.numBytes, bytes.length)
          assert.equal(read.numContainers, numContainersOf(JSON.parse(json)))
        },
      ),
      { numRuns: 40 },
    )
  })

  it('escapes cut at every byte: quotes after odd and even runs of backslashes, brackets inside strings', async () => {
    // '\\"' in the text is `\\\"` in JSON: an escaped backslash, then an escaped quote.
    const tricky = '\\\\"{[\\' + '\\'.repeat(3) + '"]}'
    const pad = 'x'.repeat(streamedBodyBytes)
    const json = JSON.stringify({ s: tricky, t: [{ u: [] }, tricky], pad })
    const bytes = Buffer.from(json, 'utf8')
    for (let cut = 1; cut < 60; cut++) {
      const read = await send(bytes, [cut])
      assert.equal(read.text, json, `cut at ${cut}`)
      assert.equal(read.numContainers, 4, `cut at ${cut}`) // the body, t, {u}, []
    }
  })

  it('a large body past the container limit is refused as soon as it passes it', async () => {
    // 30 000 empty messages (the fairness bench's 870 KB chat): refused at container 8 193,
    // about a quarter of the way in; the server answers before the client has sent the rest.
    const json = JSON.stringify({
      messages: Array.from({ length: 30_000 }, () => ({ role: 'user', content: '' })),
    })
    const read = await send(Buffer.from(json), [70_000, 200_000, 400_000], {
      'x-max-containers': '8192',
    })
    assert.deepEqual(read, { error: 'too many containers' })
    // At the limit exactly, the body is read whole.
    const atLimit = JSON.stringify({ pad: 'x'.repeat(streamedBodyBytes), a: Array(8190).fill([]) })
    const whole = await send(Buffer.from(atLimit), [], { 'x-max-containers': '8192' })
    assert.equal(whole.numContainers, 8192)
    assert.equal(whole.text, atLimit)
  })

  it('a small body is read whole and not counted', async () => {
    const json = '{"a":[{},{}],"b":"é"}'
    assert.deepEqual(await send(Buffer.from(json), [3, 13, 19]), {
      text: json,
      numBytes: Buffer.byteLength(json),
      numContainers: 0,
    })
  })

  it('bytes that are not UTF-8 give no text, small or large, and a character cut at the end too', async () => {
    const large = Buffer.concat([
      Buffer.from(`"${'x'.repeat(streamedBodyBytes)}`),
      Buffer.from([0xff, 0x22]),
    ])
    const cutAtEnd = Buffer.concat([
      Buffer.from(`"${'x'.repeat(streamedBodyBytes)}`),
      Buffer.from('é').subarray(0, 1),
    ])
    for (const bytes of [Buffer.from([0x22, 0xc3, 0x28, 0x22]), large, cutAtEnd]) {
      const read = await send(bytes, [1, 2, streamedBodyBytes])
      assert.equal(read.text, null)
      assert.equal(read.numBytes, bytes.length)
    }
  })
})
