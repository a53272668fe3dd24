/** The limit store's contract, one suite for both stores: the in-process one and the Redis one
 *  (a real redis-server). Then the Redis store's policy when Redis cannot be reached at all. */
import assert from 'node:assert/strict'
import { after, before, describe, it } from 'node:test'
import { pino } from 'pino'
import {
  type LimitStore,
  createLocalLimitStore,
} from '../../../src/router/admission/limit-store.js'
import { LimitError } from '../../../src/router/admission/limit-error.js'
import { createLimiter } from '../../../src/router/admission/limits.js'
import { queueLimitDefaults } from '../../../src/router/admission/queue-limits.js'
import { createRedisLimitStore } from '../../../src/router/admission/redis-limits.js'
import { freePort } from '../../reliability/helpers.js'
import { type RedisServer, redisSkipReason, startRedis } from './redis-helpers.js'

const skip = redisSkipReason()
if (skip !== null) console.log(`# skipping the Redis store: ${skip}`)
const silent = pino({ level: 'silent' })

/** The stores under test, each with a fresh key space per test. */
const makers: { name: string; skip: string | null; make: (id: string) => Promise<LimitStore> }[] =
  []
let redis: RedisServer | null = null
const opened: LimitStore[] = []
makers.push({
  name: 'in-process',
  skip: null,
  make: () => Promise.resolve(createLocalLimitStore()),
})
makers.push({
  name: 'redis',
  skip,
  make: async (id) => createRedisLimitStore({ url: redis!.url, keyPrefix: `${id}:` }, silent),
})

before(async () => {
  if (skip === null) redis = await startRedis()
})
after(async () => {
  for (const store of opened) store.close()
  await redis?.kill()
})

for (const maker of makers) {
  describe(`${maker.name} limit store`, { skip: maker.skip ?? false }, () => {
    const open = async (id: string) => {
      const store = await maker.make(id)
      opened.push(store)
      return store
    }

    it('grants up to maxConcurrent units, refuses the next, and takes one back on release', async () => {
      const store = await open('concurrency')
      const a = await store.acquire('alpha', 2)
      const b = await store.acquire('alpha', 2)
      assert.ok(a.isGranted && b.isGranted)
      assert.deepEqual(await store.acquire('alpha', 2), { isGranted: false, numRunning: 2 })
      assert.equal((await store.acquire('beta', 2)).isGranted, true) // another tenant
      a.release()
      a.release() // idempotent
      await new Promise((r) => setTimeout(r, 20)) // a Redis release is sent, not awaited
      const c = await store.acquire('alpha', 2)
      assert.equal(c.isGranted, true)
      assert.deepEqual(await store.acquire('alpha', 2), { isGranted: false, numRunning: 2 })
      assert.equal((await store.acquire('alpha', undefined)).isGranted, true) // no limit
      store.check()
    })

    it('charges a full bucket, refuses past what is left, and refunds', async () => {
      const store = await open('tokens')
      const tpm = 600 // 0.01 token per ms: a test's few ms refill less than one token
      assert.deepEqual(await store.charge('alpha', tpm, 500), { isCharged: true })
      const refused = await store.charge('alpha', tpm, 200)
      assert.ok(!refused.isCharged)
      assert.equal(Math.floor(refused.numTokensLeft), 100)
      store.refund('alpha', tpm, 300)
      await new Promise((r) => setTimeout(r, 20))
      assert.deepEqual(await store.charge('alpha', tpm, 350), { isCharged: true })
      const left = await store.charge('alpha', tpm, 100)
      assert.ok(!left.isCharged)
      assert.equal(Math.floor(left.numTokensLeft), 50)
      store.refund('alpha', tpm, 10_000) // never past full
      await new Promise((r) => setTimeout(r, 20))
      const full = await store.charge('alpha', tpm, 601)
      assert.ok(!full.isCharged)
      assert.equal(Math.floor(full.numTokensLeft), 600)
    })

    it("behind the limiter, refuses with the limiter's own 429s", async () => {
      const store = await open('limiter')
      const limiter = createLimiter(queueLimitDefaults, () => performance.now(), store)
      const limits = { maxConcurrentRequests: 1, tokensPerMinute: 600 }
      const ticket = await limiter.admitTenant('alpha', limits, 500)
      await assert.rejects(
        async () => limiter.admitTenant('alpha', limits, 10),
        (err: unknown) =>
          err instanceof LimitError &&
          err.status === 429 &&
          /1 requests in flight, the limit of your key is 1 at once/.test(err.message),
      )
      ticket.release(0)
      await new Promise((r) => setTimeout(r, 20))
      await assert.rejects(
        async () => limiter.admitTenant('alpha', limits, 200),
        (err: unknown) =>
          err instanceof LimitError &&
          err.retryAfterSec === 10 &&
          /100 of your key's 600/.test(err.message),
      )
      await new Promise((r) => setTimeout(r, 20)) // the refused request's unit is given back
      ;(await limiter.admitTenant('alpha', limits, 100)).release(0)
      limiter.check()
    })
  })
}

describe('redis limit store without Redis', () => {
  it('fail-closed refuses with 503 and Retry-After; local counts in this process', async () => {
    const url = `redis://127.0.0.1:${await freePort()}` // nothing listens there
    const closed = await createRedisLimitStore({ url }, silent)
    const local = await createRedisLimitStore({ url, onUnavailable: 'local' }, silent)
    try {
      assert.equal(closed.isAvailable, false)
      await assert.rejects(
        async () => closed.acquire('alpha', 1),
        (err: unknown) =>
          err instanceof LimitError &&
          err.code === 'capacity_exhausted' &&
          err.status === 503 &&
          err.retryAfterSec === 1,
      )
      assert.equal((await closed.acquire('alpha', undefined)).isGranted, true) // no limit: served
      assert.equal((await local.acquire('alpha', 1)).isGranted, true)
      assert.deepEqual(await local.acquire('alpha', 1), { isGranted: false, numRunning: 1 })
      assert.deepEqual(await local.charge('alpha', 600, 500), { isCharged: true })
    } finally {
      closed.close()
      local.close()
    }
  })
})
