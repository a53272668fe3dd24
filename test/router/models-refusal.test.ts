/** `/v1/models` never advertises a window the router does not serve: while G1 refuses every
 *  request it answers with the same 503; `HEAD /health` is answered like GET, without a body. */
import assert from 'node:assert/strict'
import { test } from 'node:test'
import OpenAI from 'openai'
import { startHarness, waitFor } from './helpers.js'

test('during a G1 refusal /v1/models is 503 worker_unavailable, and 1024 again once it ends', async () => {
  const h = await startHarness({}, { capacityRecheckMs: 20 })
  try {
    const maxModelLen = async () =>
      ((await h.client().models.list()).data[0] as unknown as { max_model_len: number })
        .max_model_len
    assert.equal(await maxModelLen(), 1024)
    h.workers.setNumPages(32)
    await waitFor(() => h.logs.text().includes('refusing new requests'))
    await assert.rejects(maxModelLen(), (err: unknown) => {
      assert.ok(err instanceof OpenAI.APIError)
      assert.equal(err.status, 503)
      assert.equal(err.code, 'worker_unavailable')
      assert.equal(err.headers?.get('retry-after'), '1')
      return true
    })
    const head = await fetch(`${h.router.url}/health`, { method: 'HEAD' })
    assert.equal(head.status, 503)
    assert.equal((await head.arrayBuffer()).byteLength, 0)
    h.workers.setNumPages(64)
    await waitFor(() => h.logs.text().includes('hold the context window again'))
    assert.equal(await maxModelLen(), 1024)
    const ok = await fetch(`${h.router.url}/health`, { method: 'HEAD' })
    assert.equal(ok.status, 200)
    assert.equal((await ok.arrayBuffer()).byteLength, 0)
  } finally {
    await h.close()
  }
})
