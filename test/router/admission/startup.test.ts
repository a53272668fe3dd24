/** G1 at start: the router advertises no more context than every worker can hold. */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import { KvfenceError } from '../../../src/common/errors.js'
import { decideContextWindow } from '../../../src/router/admission/capacity.js'
import type { ServerInfo } from '../../../src/control/messages.js'
import { startHarness } from '../helpers.js'

// Stand-ins: 64 pages × 16 tokens = 1024 tokens of KV; positions 4096.

describe('G1: context window vs effective capacity at start', () => {
  it('defaults the context window to the effective capacity', async () => {
    const h = await startHarness()
    try {
      assert.equal(h.router.config.contextWindow, 1024)
      assert.equal(h.router.config.effectiveCapacityTokens, 1024)
      const models = await h.client().models.list()
      assert.equal((models.data[0] as unknown as { max_model_len: number }).max_model_len, 1024)
    } finally {
      await h.close()
    }
  })

  it('takes max_position_embeddings when it is the smaller limit', async () => {
    const h = await startHarness({ maxPositionEmbeddings: 512 })
    try {
      assert.equal(h.router.config.contextWindow, 512)
    } finally {
      await h.close()
    }
  })

  it('accepts a context window below the capacity', async () => {
    const h = await startHarness({}, { contextWindow: 800 })
    try {
      assert.equal(h.router.config.contextWindow, 800)
      assert.equal(h.router.config.effectiveCapacityTokens, 1024)
    } finally {
      await h.close()
    }
  })

  it('refuses to start when the context window exceeds the capacity, naming both numbers', async () => {
    await assert.rejects(startHarness({}, { contextWindow: 1_048_576 }), (err: unknown) => {
      assert.ok(err instanceof KvfenceError)
      assert.equal(err.code, 'guard_violation')
      assert.match(
        err.message,
        /context window 1048576 exceeds the effective KV capacity 1024 tokens/,
      )
      assert.doesNotMatch(err.message, /\n/)
      return true
    })
  })

  it('clamps with clampContext, and says so in the log', async () => {
    const h = await startHarness({}, { contextWindow: 4096, clampContext: true })
    try {
      assert.equal(h.router.config.contextWindow, 1024)
      assert.match(h.logs.text(), /"level":40.*clamped to 1024/)
    } finally {
      await h.close()
    }
  })

  it("allows the incident's configuration with guards off, loudly", async () => {
    const h = await startHarness(
      { guardsEnabled: false },
      { contextWindow: 4096, guardsEnabled: false },
    )
    try {
      assert.equal(h.router.config.contextWindow, 4096)
      assert.match(h.logs.text(), /"level":40.*UNSAFE: context window 4096 exceeds/)
      // G2 admits against the advertised window: a prompt over the pool reaches the workers.
      await h
        .client()
        .completions.create({ model: 'echo-test', prompt: 'x'.repeat(2000), max_tokens: 1 })
      assert.equal(h.workers.generateRequests[0].promptTokenIds.length, 2001)
    } finally {
      await h.close()
    }
  })

  it("refuses workers whose guards are off while the router's are on", async () => {
    await assert.rejects(startHarness({ guardsEnabled: false }), /runs with guards disabled/)
  })

  it('refuses to start when a worker does not answer', async () => {
    await assert.rejects(
      startHarness({}, { prefillUrls: ['http://127.0.0.1:9'] }),
      (err: unknown) => err instanceof KvfenceError && err.code === 'worker_unavailable',
    )
  })

  it('takes the smallest limit over all workers', () => {
    const info = (
      role: 'prefill' | 'decode',
      numPages: number,
      maxPositionEmbeddings: number,
    ): ServerInfo => ({
      role,
      model: 'm',
      pageSize: 16,
      numPages,
      capacityTokens: numPages * 16,
      numPagesFree: numPages,
      numPagesUsed: 0,
      maxPositionEmbeddings,
      guardsEnabled: true,
      faults: [],
    })
    const decision = decideContextWindow(
      [
        { url: 'http://p', info: info('prefill', 42580, 1_048_576) }, // 681 280 tokens
        { url: 'http://d', info: info('decode', 100_000, 1_048_576) },
      ],
      { clampContext: false, guardsEnabled: true },
    )
    assert.deepEqual(decision, {
      contextWindow: 681_280,
      effectiveCapacityTokens: 681_280,
      warnings: [],
    })
    assert.throws(
      () =>
        decideContextWindow([{ url: 'http://p', info: info('prefill', 42580, 1_048_576) }], {
          contextWindow: 1_048_576,
          clampContext: false,
          guardsEnabled: true,
        }),
      /1048576 exceeds the effective KV capacity 681280 tokens \(limited by prefill worker http:\/\/p KV pool/,
    )
  })
})
