/** Property-based fuzzing (fast-check) of the real router over real TCP: random bodies, headers
 *  and framing (split writes, slow bodies, abandoned and oversized requests, invalid UTF-8). Every
 *  input gets a well-formed HTTP response or a clean close, the router stays up, and nothing reaches
 *  the decode worker unless the request was valid (a counting proxy sits in front of its control
 *  port). */
import assert from 'node:assert/strict'
import type { ChildProcess } from 'node:child_process'
import net from 'node:net'
import { FrameReader } from '../../src/control/channel-frames.js'
import { setTimeout as sleep } from 'node:timers/promises'
import { after, before, describe, it } from 'node:test'
import fc from 'fast-check'
import {
  allocatePorts,
  freePort,
  makeTenants,
  pagesUsed,
  startDecode,
  startPrefill,
  startRouterPart,
  stopAll,
  type Ports,
} from './helpers.js'

const tenants = makeTenants()
const paths = ['/v1/completions', '/v1/chat/completions']

/** A reply as raw bytes: `null` status when the router closed without answering. */
interface RawReply {
  status: number | null
  headers: string
  body: string
}

/** Write `chunks` (with `gapMs` between them) on a fresh socket, then read until the router closes
 *  or `waitMs` of silence; parse the first response if there is one. */
function rawExchange(
  port: number,
  chunks: Buffer[],
  opts: { gapMs?: number; waitMs?: number; endAfter?: boolean } = {},
): Promise<RawReply> {
  return new Promise((resolve, reject) => {
    const socket = net.connect({ host: '127.0.0.1', port })
    const received: Buffer[] = []
    let idle: NodeJS.Timeout | undefined
    const finish = () => {
      clearTimeout(idle)
      socket.destroy()
      const text = Buffer.concat(received).toString('latin1')
      const match = /^HTTP\/1\.1 (\d{3}) [^\r\n]*\r\n([\s\S]*?)\r\n\r\n([\s\S]*)$/.exec(text)
      if (text === '') resolve({ status: null, headers: '', body: '' })
      else if (match) resolve({ status: Number(match[1]), headers: match[2], body: match[3] })
      else reject(new Error(`not an HTTP response: ${JSON.stringify(text.slice(0, 200))}`))
    }
    const arm = () => {
      clearTimeout(idle)
      idle = setTimeout(finish, opts.waitMs ?? 1_500)
    }
    socket.on('data', (chunk: Buffer) => {
      received.push(chunk)
      arm()
    })
    socket.on('error', () => {}) // a reset after the reply is a close
    socket.on('close', finish)
    socket.once('connect', async () => {
      for (const chunk of chunks) {
        if (socket.destroyed) return
        socket.write(chunk)
        if (opts.gapMs) await sleep(opts.gapMs)
      }
      if (opts.endAfter) socket.end()
      arm()
    })
  })
}

/** The body of a JSON error reply must be OpenAI's error shape. */
function assertOpenAiError(reply: RawReply): void {
  const body = reply.body.includes('\r\n') ? dechunk(reply.body) : reply.body
  const parsed = JSON.parse(body) as {
    error?: { message?: unknown; type?: unknown; code?: unknown }
  }
  assert.equal(typeof parsed.error?.message, 'string', `no error.message in ${body}`)
  assert.equal(typeof parsed.error?.type, 'string')
  assert.equal(typeof parsed.error?.code, 'string')
}

function dechunk(body: string): string {
  let out = ''
  let rest = body
  for (;;) {
    const eol = rest.indexOf('\r\n')
    const size = parseInt(rest.slice(0, eol), 16)
    if (!(size > 0)) return out
    out += rest.slice(eol + 2, eol + 2 + size)
    rest = rest.slice(eol + 2 + size + 2)
  }
}

function request(path: string, body: Buffer, headers: Record<string, string> = {}): Buffer {
  const head =
    `POST ${path} HTTP/1.1\r\nhost: fuzz\r\nauthorization: Bearer ${tenants.a.key}\r\n` +
    `content-type: application/json\r\ncontent-length: ${body.length}\r\n` +
    Object.entries(headers)
      .map(([k, v]) => `${k}: ${v}\r\n`)
      .join('') +
    'connection: close\r\n\r\n'
  return Buffer.concat([Buffer.from(head, 'latin1'), body])
}

/** Calls `count` for each request for generation the router sends on `inbound`: a `generate`
 *  frame, once the connection switched to the control channel (`GET /internal/channel` and its
 *  blank line). Other connections carry the router's probes (`GET /server_info`, …): no
 *  generation. */
function onGenerate(inbound: net.Socket, count: () => void): void {
  let frames: FrameReader | null = null
  let head: string | null = '' // the channel's upgrade request so far; null: a probe's connection
  inbound.on('data', (chunk: Buffer) => {
    if (frames === null) {
      const text = chunk.toString('latin1')
      if (head === '' && !text.startsWith('GET /internal/channel ')) head = null
      if (head === null) return
      head += text
      const end = head.indexOf('\r\n\r\n')
      if (end === -1) return
      frames = new FrameReader()
      chunk = Buffer.from(head.slice(end + 4), 'latin1')
    }
    for (const frame of frames.push(chunk)) if (frame.kind === 'generate') count()
  })
}

describe('HTTP fuzzing against the real router', () => {
  let ports: Ports
  let children: ChildProcess[] = []
  let proxy: net.Server
  /** Requests that reached the decode worker's control port (i.e. the router let them through):
   *  `generate` frames on its control channel. */
  let numDecodePosts = 0

  before(async () => {
    ports = await allocatePorts()
    const [prefill, decode] = await Promise.all([startPrefill(ports), startDecode(ports)])
    // The router reaches the decode worker through this counting proxy.
    const proxyPort = await freePort()
    proxy = net.createServer((inbound) => {
      const outbound = net.connect({ host: '127.0.0.1', port: ports.decode })
      onGenerate(inbound, () => numDecodePosts++)
      inbound.pipe(outbound).pipe(inbound)
      inbound.on('error', () => outbound.destroy())
      outbound.on('error', () => inbound.destroy())
    })
    await new Promise<void>((resolve) => proxy.listen(proxyPort, '127.0.0.1', resolve))
    const router = await startRouterPart({ ...ports, decode: proxyPort }, tenants.file)
    children = [prefill, decode, router]
  })
  after(async () => {
    proxy?.close()
    await stopAll(children)
  })

  const healthy = async () => {
    const res = await fetch(`http://127.0.0.1:${ports.router}/health`)
    assert.equal(res.status, 200, 'the router is down')
  }

  it('random bytes and random JSON as a body: a 4xx in OpenAI’s error shape, nothing reaches a worker', async () => {
    const before = numDecodePosts
    await fc.assert(
      fc.asyncProperty(
        fc.constantFrom(...paths),
        fc.oneof(
          fc.uint8Array({ maxLength: 300 }).map((b) => Buffer.from(b)),
          fc.json({ maxDepth: 3 }).map((j) => Buffer.from(j)),
          fc
            .dictionary(
              fc.constantFrom(
                'model',
                'prompt',
                'messages',
                'max_tokens',
                'stream',
                'temperature',
                'n',
              ),
              fc.jsonValue({ maxDepth: 2 }),
            )
            .map((o) => Buffer.from(JSON.stringify(o))),
        ),
        async (path, body) => {
          const reply = await rawExchange(ports.router, [request(path, body)])
          assert.ok(reply.status !== null, 'closed without a reply')
          assert.ok(reply.status >= 400 && reply.status < 500, `status ${reply.status}`)
          assertOpenAiError(reply)
        },
      ),
      { numRuns: 150, seed: 7 },
    )
    assert.equal(numDecodePosts, before, 'an invalid request reached the decode worker')
    await healthy()
  })

  it('mutated valid requests: 200 or a 4xx, never a 5xx; only the 200s reach the decode worker', async () => {
    const before = numDecodePosts
    let num200 = 0
    const value = fc.oneof(
      fc.jsonValue({ maxDepth: 1 }),
      fc.integer({ min: -5, max: 2_000 }),
      fc.constantFrom(null, true, '', 'echo-tiny', 0.5, -1, 1e300),
    )
    await fc.assert(
      fc.asyncProperty(
        fc.boolean(),
        fc.constantFrom(
          'model',
          'prompt',
          'messages',
          'max_tokens',
          'stream',
          'temperature',
          'top_p',
          'stop',
          'seed',
          'user',
          'extra',
        ),
        value,
        async (isChat, field, v) => {
          const valid: Record<string, unknown> = isChat
            ? {
                model: 'echo-tiny',
                messages: [{ role: 'user', content: 'the river' }],
                max_tokens: 4,
              }
            : { model: 'echo-tiny', prompt: 'the river', max_tokens: 4 }
          valid[field] = v
          const reply = await rawExchange(ports.router, [
            request(isChat ? paths[1] : paths[0], Buffer.from(JSON.stringify(valid))),
          ])
          assert.ok(reply.status !== null, 'closed without a reply')
          assert.ok(
            reply.status === 200 || (reply.status >= 400 && reply.status < 500),
            `status ${reply.status}`,
          )
          if (reply.status === 200) num200++
          else assertOpenAiError(reply)
        },
      ),
      { numRuns: 120, seed: 11 },
    )
    assert.equal(numDecodePosts - before, num200, 'a refused request reached the decode worker')
    await healthy()
  })

  it('random headers, oversized headers and invalid UTF-8: a well-formed reply or a clean close', async () => {
    const before = numDecodePosts
    await fc.assert(
      fc.asyncProperty(
        fc.dictionary(
          fc.stringMatching(/^x-[a-z0-9-]{1,20}$/),
          fc.string({ unit: 'binary-ascii', maxLength: 40 }).map((s) => s.replace(/[\r\n]/g, ' ')),
          { maxKeys: 6 },
        ),
        fc.integer({ min: 0, max: 3 }),
        async (headers, variant) => {
          const extra: Record<string, string> = { ...headers }
          if (variant === 1) extra['x-huge'] = 'a'.repeat(70_000) // past Node's 16 KiB header cap
          if (variant === 2) extra['authorization2'] = '\u00ff\u00fe'
          const body =
            variant === 3
              ? Buffer.concat([
                  Buffer.from('{"model":"echo-tiny","prompt":"'),
                  Buffer.from([0xc3, 0x28, 0xff, 0xfe]),
                  Buffer.from('"'),
                  Buffer.from([0x80]),
                ])
              : Buffer.from('{"model":"nope","prompt":"x"}')
          const reply = await rawExchange(ports.router, [request(paths[0], body, extra)])
          if (reply.status !== null) {
            assert.ok(reply.status >= 400 && reply.status < 500, `status ${reply.status}`)
            if (/content-type: application\/json/i.test(reply.headers)) assertOpenAiError(reply)
          }
        },
      ),
      { numRuns: 60, seed: 13 },
    )
    assert.equal(numDecodePosts, before)
    await healthy()
  })

  it('split writes and a slow body still get the right answer; abandoned requests are dropped cleanly', async () => {
    const body = Buffer.from(
      JSON.stringify({ model: 'echo-tiny', prompt: 'the river', max_tokens: 3 }),
    )
    await fc.assert(
      fc.asyncProperty(fc.array(fc.nat(), { minLength: 1, maxLength: 8 }), async (cuts) => {
        const bytes = request(paths[0], body)
        const at = [...new Set(cuts.map((c) => c % bytes.length))].sort((a, b) => a - b)
        const pieces = [0, ...at, bytes.length]
          .slice(1)
          .map((end, i, ends) => bytes.subarray(i === 0 ? 0 : ends[i - 1], end))
        const reply = await rawExchange(ports.router, pieces, { gapMs: 5 })
        assert.equal(reply.status, 200)
      }),
      { numRuns: 25, seed: 17 },
    )
    // A slowloris-style request: one byte at a time, 2 ms apart.
    const slow = request(paths[0], body)
    const reply = await rawExchange(
      ports.router,
      [...slow].map((b) => Buffer.from([b])),
      { gapMs: 2 },
    )
    assert.equal(reply.status, 200)
    // Abandoned: headers promise a body that never comes, or stop halfway.
    const beforeAbandoned = numDecodePosts
    const sockets = await Promise.all(
      Array.from({ length: 40 }, () => {
        const s = net.connect({ host: '127.0.0.1', port: ports.router })
        s.on('error', () => {})
        return new Promise<net.Socket>((resolve) =>
          s.once('connect', () => {
            s.write(request(paths[0], body).subarray(0, 60 + Math.floor(Math.random() * 150)))
            resolve(s)
          }),
        )
      }),
    )
    // Forty stalled connections do not stop others from being served.
    const served = await rawExchange(ports.router, [request(paths[0], body)])
    assert.equal(served.status, 200)
    for (const s of sockets) s.destroy()
    assert.equal(
      numDecodePosts - beforeAbandoned,
      1,
      'an abandoned request reached the decode worker',
    )
    await healthy()
    assert.equal(await pagesUsed(`http://127.0.0.1:${ports.prefill}`), 0)
  })
})
