/** Requests Node's HTTP parser refuses before the router sees them (headers over the limit, a
 *  malformed request), and plain HTTP sent to the router's HTTPS port, are answered in the
 *  OpenAI error shape, not with Node's empty body or a closed connection. */
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { readFileSync } from 'node:fs'
import http from 'node:http'
import { join } from 'node:path'
import { describe, it } from 'node:test'
import { promisify } from 'node:util'
import OpenAI from 'openai'
import { Agent, fetch as undiciFetch } from 'undici'
import { cliEntry } from '../../../src/common/paths.js'
import { tempDir } from '../../helpers/temp-dir.js'
import { keys, rawRequest, startHarness } from '../helpers.js'

describe("Node's own HTTP refusals", () => {
  it('headers over the size limit: 431 with an OpenAI error body', async () => {
    const h = await startHarness()
    try {
      const huge = 'x'.repeat(http.maxHeaderSize + 1)
      const answer = await rawRequest(
        h.router.url,
        `GET /v1/models HTTP/1.1\r\nhost: x\r\nx-filler: ${huge}\r\n\r\n`,
      )
      assert.equal(answer.status, 431, answer.body)
      assert.match(answer.head, /content-type: application\/json/)
      assert.match(answer.head, /connection: close/)
      assert.deepEqual(JSON.parse(answer.body), {
        error: {
          message: `the request's headers exceed the limit of ${http.maxHeaderSize} bytes`,
          type: 'invalid_request_error',
          param: null,
          code: 'headers_too_large',
        },
      })
      assert.equal(h.workers.numInternalRequests(), 0)
    } finally {
      await h.close()
    }
  })

  it('a malformed request: 400 invalid_request naming the parser’s reason, never the bytes', async () => {
    const h = await startHarness()
    try {
      const answer = await rawRequest(
        h.router.url,
        'POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk-secret\u0001\r\n\r\n',
      )
      assert.equal(answer.status, 400, answer.body)
      assert.match(answer.head, /content-length: \d+/)
      assert.deepEqual(JSON.parse(answer.body), {
        error: {
          message:
            'the request is not valid HTTP/1.1 (HPE_INVALID_HEADER_TOKEN: Invalid header value char)',
          type: 'invalid_request_error',
          param: null,
          code: 'invalid_request',
        },
      })
      assert.doesNotMatch(answer.body, /sk-secret/)
    } finally {
      await h.close()
    }
  })

  it('plain HTTP sent to the HTTPS port: 400 saying the port speaks HTTPS; HTTPS still served', async () => {
    const certs = tempDir('kvfence-plain-on-https-')
    await promisify(execFile)(process.execPath, [cliEntry, 'certs', 'init', certs])
    const h = await startHarness(
      {},
      { https: { cert: join(certs, 'router.crt'), key: join(certs, 'router.key') } },
    )
    try {
      const { port } = h.router
      // A client configured with http:// for the router's https:// URL.
      const answer = await new Promise<{ status?: number; head: string; body: string }>(
        (resolve, reject) => {
          const req = http.request(
            {
              host: '127.0.0.1',
              port,
              method: 'POST',
              path: '/v1/completions',
              headers: {
                authorization: `Bearer ${keys.alpha}`,
                'content-type': 'application/json',
              },
            },
            (res) => {
              let body = ''
              res.setEncoding('utf8').on('data', (s: string) => (body += s))
              res.on('end', () =>
                resolve({
                  status: res.statusCode,
                  head: JSON.stringify(res.headers),
                  body,
                }),
              )
            },
          )
          req.on('error', reject)
          req.end(JSON.stringify({ model: 'echo-test', prompt: 'Hi' }))
        },
      )
      assert.equal(answer.status, 400, answer.body)
      assert.match(answer.head, /"content-type":"application\/json"/)
      assert.match(answer.head, /"connection":"close"/)
      assert.deepEqual(JSON.parse(answer.body), {
        error: {
          message:
            'The plain HTTP request was sent to an HTTPS port: this router speaks HTTPS only; use an https:// URL',
          type: 'invalid_request_error',
          param: null,
          code: 'invalid_request',
        },
      })
      // The same port goes on serving HTTPS, through the openai client (the CA of `certs init`).
      const agent = new Agent({ connect: { ca: readFileSync(join(certs, 'ca.crt')) } })
      const client = new OpenAI({
        baseURL: `https://127.0.0.1:${port}/v1`,
        apiKey: keys.alpha,
        maxRetries: 0,
        fetch: ((url: string, init: RequestInit) =>
          undiciFetch(url, { ...(init as object), dispatcher: agent })) as unknown as typeof fetch,
      })
      try {
        const completion = await client.completions.create({ model: 'echo-test', prompt: 'Hi' })
        assert.equal(completion.choices[0].finish_reason, 'stop')
      } finally {
        await agent.close()
      }
      assert.equal(h.workers.generateRequests.length, 1, 'the plain request reached no worker')
    } finally {
      await h.close()
    }
  })
})
