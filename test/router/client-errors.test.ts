/** Requests Node's HTTP parser refuses before the router sees them (headers over the limit, a
 *  malformed request) are answered in the OpenAI error shape, not with Node's empty body. */
import assert from 'node:assert/strict'
import http from 'node:http'
import { describe, it } from 'node:test'
import { rawRequest, startHarness } from './helpers.js'

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
})
