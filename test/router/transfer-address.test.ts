/** The transfer address the router gives a prefill worker is the decode worker's current one, even
 *  right after that worker restarted its transfer receiver on another port. */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import { defaultReplyText, startHarness } from './helpers.js'

const request = { model: 'echo-test', messages: [{ role: 'user' as const, content: 'Hi' }] }

describe('the decode worker’s transfer address', () => {
  it('a decode worker that names its transfer port in `reserved` is served on the first request after moving', async () => {
    const h = await startHarness({ isTransferPortReserved: true })
    try {
      await h.client().chat.completions.create(request) // the /server_info address is cached
      const newPort = h.workers.transferPort + 1
      h.workers.setTransferPort(newPort)
      const completion = await h.client().chat.completions.create(request)
      assert.equal(completion.choices[0].message.content, defaultReplyText)
      assert.deepEqual(h.workers.prefillRequests.at(-1)!.decode, {
        host: '127.0.0.1',
        port: newPort,
      })
    } finally {
      await h.close()
    }
  })

  it('without it, any failed request makes the router ask /server_info again', async () => {
    // A decode worker that ends its first request with an error event (not a transfer failure)
    // and then moves: the cached address must not outlive that failure.
    const h = await startHarness({ decodeErrorAfterTokens: 0 })
    try {
      const failed = await h.post('/v1/chat/completions', request)
      assert.equal(failed.status, 500)
      h.workers.setTransferPort(h.workers.transferPort + 1)
      const res = await h.post('/v1/completions', { model: 'echo-test', prompt: 'Hi' })
      // The stand-in still fails every request at its first token, so a 500 guard_violation (and
      // not a 502 transfer_failed) shows the prefill worker was sent to the new port.
      assert.equal(
        ((await res.json()) as { error: { code: string } }).error.code,
        'guard_violation',
      )
      assert.equal(h.workers.prefillRequests.at(-1)!.decode.port, h.workers.transferPort)
    } finally {
      await h.close()
    }
  })

  it('without it, a restarted decode worker (new connection, new port) is asked again before the first request after', async () => {
    const h = await startHarness()
    try {
      await h.client().chat.completions.create(request) // cached; connection kept alive
      h.workers.closeDecodeConnections()
      h.workers.setTransferPort(h.workers.transferPort + 1)
      const completion = await h.client().chat.completions.create(request)
      assert.equal(completion.choices[0].message.content, defaultReplyText)
      assert.equal(h.workers.prefillRequests.at(-1)!.decode.port, h.workers.transferPort)
    } finally {
      await h.close()
    }
  })
  it('without it, over the control channel the address is read once, not for every request', async () => {
    // Found by the router bench: the channel's decode side dropped the cached address before
    // every request, so each one cost a /server_info round trip over HTTP.
    const h = await startHarness()
    try {
      await h.client().chat.completions.create(request) // read and cached
      const numReads = h.workers.numDecodeInfoReads()
      for (let i = 0; i < 5; i++) await h.client().chat.completions.create(request)
      assert.equal(h.workers.numDecodeChannels(), 1)
      assert.equal(h.workers.numDecodeInfoReads(), numReads)
      assert.equal(h.workers.prefillRequests.at(-1)!.decode.port, h.workers.transferPort)
    } finally {
      await h.close()
    }
  })
})
