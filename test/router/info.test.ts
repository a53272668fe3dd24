/** The router's read-only endpoints: `/v1/models`, `/health`, `/server_info`, `/metrics`. */
import assert from 'node:assert/strict'
import { after, before, describe, it } from 'node:test'
import { type Harness, startHarness } from './helpers.js'

describe('read-only endpoints', () => {
  let h: Harness
  before(async () => {
    h = await startHarness({ faults: ['skip-scrub'] })
  })
  after(() => h.close())

  it('GET /v1/models lists the one served model with max_model_len', async () => {
    const res = await fetch(`${h.router.url}/v1/models`, {
      headers: { authorization: `Bearer sk-alpha-7f3e9c1d2b` },
    })
    assert.equal(res.status, 200)
    assert.deepEqual(await res.json(), {
      object: 'list',
      data: [
        {
          id: 'echo-test',
          object: 'model',
          created: h.router.config.createdAtSec,
          owned_by: 'kvfence',
          max_model_len: 1024,
        },
      ],
    })
    const model = await h.client().models.retrieve('echo-test')
    assert.equal(model.id, 'echo-test')
  })

  it('GET /health answers without a key', async () => {
    const res = await fetch(`${h.router.url}/health`)
    assert.equal(res.status, 200)
  })

  it('GET /server_info reports the window, capacity, guards, faults and live worker states', async () => {
    const res = await fetch(`${h.router.url}/server_info`)
    assert.equal(res.status, 200)
    const info = (await res.json()) as Record<string, unknown> & { workers: { role: string }[] }
    assert.equal(info.model, 'echo-test')
    assert.equal(info.contextWindow, 1024)
    assert.equal(info.effectiveCapacityTokens, 1024)
    assert.equal(info.pageSize, 16)
    assert.equal(info.guardsEnabled, true)
    assert.deepEqual(info.faults, ['skip-scrub'])
    assert.deepEqual(
      info.workers.map((w) => w.role),
      ['prefill', 'decode'],
    )
  })

  it('GET /metrics counts requests', async () => {
    await h.client().completions.create({ model: 'echo-test', prompt: 'Hi', max_tokens: 2 })
    const text = await (await fetch(`${h.router.url}/metrics`)).text()
    assert.match(
      text,
      /kvfence_router_requests_total\{endpoint="completion",tenant="alpha",status="200"\} 1/,
    )
    assert.match(text, /kvfence_router_completion_tokens_total 2/)
    // The router's own memory, as prom-client's default metrics name it, from this process.
    const rss = /^process_resident_memory_bytes (\d+)$/m.exec(text)
    assert.ok(rss && Number(rss[1]) > 1024 * 1024, 'no process_resident_memory_bytes')
    assert.match(text, /^nodejs_heap_size_used_bytes \d+$/m)
  })
})
