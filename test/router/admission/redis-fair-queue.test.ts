/** The fair queue's virtual token counters (VTC) shared by router replicas through a real
 *  redis-server: service a tenant got through one replica counts on the other, a lift raises the
 *  shared counter once, a replica cut off from Redis keeps ordering by its own counters and sends
 *  what it counted meanwhile when Redis is back (once, even when a reply was lost), and, end to end,
 *  two router processes: a tenant that flooded replica 1 waits behind another tenant on replica 2.
 *  Expected counters are worked out by hand from VTC's rule (1 × prompt + 2 × generated tokens,
 *  ÷ the tenant's weight), not read from the implementation. */
import assert from 'node:assert/strict'
import type { ChildProcess } from 'node:child_process'
import { writeFileSync } from 'node:fs'
import { join } from 'node:path'
import { setTimeout as sleep } from 'node:timers/promises'
import { after, before, describe, it } from 'node:test'
import { Redis } from 'ioredis'
import { pino } from 'pino'
import { type Limiter, createLimiter } from '../../../src/router/admission/limits.js'
import { type Slot } from '../../../src/router/admission/queue-limits.js'
import {
  type RedisLimitStore,
  createRedisLimitStore,
  serviceSyncMs,
} from '../../../src/router/admission/redis-limits.js'
import { newApiKey } from '../../../src/router/tenants/tenant-keys.js'
import { apiKeyDigest } from '../../../src/router/tenants/tenants.js'
import type { Engine } from '../../helpers/engines.js'
import { waitUntil } from '../../helpers/poll.js'
import { freePort, startPart, stopAll } from '../../reliability/helpers.js'
import {
  type RedisServer,
  redisSkipReason,
  replicaChat,
  startHoldingEngine,
  startRedis,
} from './redis-helpers.js'
import { tempDir } from '../../helpers/temp-dir.js'

const skip = redisSkipReason()
if (skip !== null) console.log(`# skipping the shared fair-queue counters: ${skip}`)
const silent = pino({ level: 'silent' })
const never = new AbortController().signal
/** One slot at a time, so that every later request queues. */
const oneSlot = { maxConcurrentRequests: 1, maxQueuedRequests: 16, maxQueueWaitMs: 10_000 }

let redis: RedisServer
let probe: Redis // the test's own look at Redis
const stores: RedisLimitStore[] = []

before(async () => {
  if (skip !== null) return
  redis = await startRedis()
  probe = new Redis(redis.url, { lazyConnect: true })
  probe.on('error', () => undefined) // while the outage test has Redis down
  await probe.connect()
})
after(async () => {
  if (skip !== null) return
  for (const store of stores) store.close()
  probe.disconnect()
  await redis.kill()
})

/** A store and a one-slot limiter counting in it, under `keyPrefix`. */
async function replica(keyPrefix: string): Promise<{ store: RedisLimitStore; limiter: Limiter }> {
  const store = await createRedisLimitStore({ url: redis.url, keyPrefix }, silent)
  stores.push(store)
  return { store, limiter: createLimiter(oneSlot, () => performance.now(), store) }
}

/** The counters Redis holds under `keyPrefix`, tenant → counter as stored (a string). */
async function sharedCounters(keyPrefix: string): Promise<Record<string, string>> {
  return probe.hgetall(`${keyPrefix}{service}:counters`)
}

/** Runs one request of `tenant` to its end: `numPromptTokens` charged at its slot,
 *  `numGeneratedTokens` at its release. */
async function serve(
  limiter: Limiter,
  tenant: string,
  weight: number,
  numPromptTokens: number,
  numGeneratedTokens: number,
): Promise<void> {
  const slot = await limiter.acquireSlot(never, { tenant, weight, numPromptTokens })
  slot.release(numGeneratedTokens)
  limiter.check()
}

/** Queues a request of `tenant` (10 prompt tokens, weight 1), pushing `name` to `order` when it
 *  gets its slot. */
function queued(limiter: Limiter, order: string[], name: string, tenant: string): Promise<Slot> {
  return limiter.acquireSlot(never, { tenant, weight: 1, numPromptTokens: 10 }).then((slot) => {
    order.push(name)
    return slot
  })
}

describe('fair-queue counters shared through Redis', { skip: skip ?? false }, () => {
  it('a tenant served through one replica is not the least served on the other', async () => {
    const r1 = await replica('served:')
    const r2 = await replica('served:')
    // alpha (weight 2) runs 3 requests on replica 1: each (40 + 2 × 10) ÷ 2 = 30 → 90.
    for (let i = 0; i < 3; i++) await serve(r1.limiter, 'alpha', 2, 40, 10)
    assert.equal(r1.store.service.counterOf('alpha'), 90)
    await r1.store.syncService()
    assert.deepEqual(await sharedCounters('served:'), { alpha: '90' })
    await r2.store.syncService()
    assert.equal(r2.store.service.counterOf('alpha'), 90)

    // Replica 2: beta's request runs (beta 10); beta queues b1 (no lift: beta 10), then alpha
    // queues a1, a2 (lifted to beta's 10: alpha stays 90). The running request ends with nothing
    // generated: beta 10 < alpha 90 → b1. Counting alpha on replica 2 alone (0, lifted to 10, a
    // tie that fewer running breaks) would give a1 first.
    const order: string[] = []
    const running = await queued(r2.limiter, order, 'b0', 'beta')
    const slots = new Map<string, Promise<Slot>>([['b0', Promise.resolve(running)]])
    slots.set('b1', queued(r2.limiter, order, 'b1', 'beta'))
    slots.set('a1', queued(r2.limiter, order, 'a1', 'alpha'))
    slots.set('a2', queued(r2.limiter, order, 'a2', 'alpha'))
    r2.limiter.check()
    ;(await slots.get('b0')!).release(0) // beta 10
    ;(await slots.get('b1')!).release(5) // beta 10 + 10 + 2 × 5 = 30
    ;(await slots.get('a1')!).release(5) // alpha 90 + 10 + 10 = 110
    ;(await slots.get('a2')!).release(5) // alpha 130
    r2.limiter.check()
    assert.deepEqual(order, ['b0', 'b1', 'a1', 'a2'])

    await r2.store.syncService()
    assert.deepEqual(await sharedCounters('served:'), { alpha: '130', beta: '30' })
    await r1.store.syncService()
    assert.equal(r1.store.service.counterOf('alpha'), 130)
    assert.equal(r1.store.service.counterOf('beta'), 30)
    r1.store.check()
    r2.store.check()
  })

  it('a lift raises the shared counter to its floor, once for two replicas', async () => {
    const r1 = await replica('lift:')
    const r2 = await replica('lift:')
    // Replica 1: +5, lift to 20, +3 → 23 here; replica 2 lifts the same tenant to 20 too.
    r1.store.service.add('gamma', 5)
    r1.store.service.raiseTo('gamma', 20)
    r1.store.service.add('gamma', 3)
    r2.store.service.raiseTo('gamma', 20)
    assert.equal(r1.store.service.counterOf('gamma'), 23)
    assert.equal(r2.store.service.counterOf('gamma'), 20)
    await r1.store.syncService() // 0 → max(0, 20 − 5) + 8 = 23
    await r2.store.syncService() // max(23, 20) = 23: the second lift adds nothing
    assert.deepEqual(await sharedCounters('lift:'), { gamma: '23' })
    assert.equal(r2.store.service.counterOf('gamma'), 23)
  })

  it('without Redis the queue orders by local counters; the changes reach Redis once it is back', async () => {
    const r1 = await replica('outage:')
    await serve(r1.limiter, 'alpha', 1, 50, 20) // alpha 90
    await r1.store.syncService()
    assert.deepEqual(await sharedCounters('outage:'), { alpha: '90' })

    await redis.kill()
    await waitUntil(() => !r1.store.isAvailable, { timeoutMs: 5_000, intervalMs: 20 })
    // alpha 90 + 30 = 120 counted here alone. beta runs (10) and queues b1; alpha queues a1
    // (lifted to 10: stays 120). beta 10 < alpha 120 → b1 first.
    await serve(r1.limiter, 'alpha', 1, 10, 10)
    const order: string[] = []
    const running = await queued(r1.limiter, order, 'b0', 'beta')
    const b1 = queued(r1.limiter, order, 'b1', 'beta')
    const a1 = queued(r1.limiter, order, 'a1', 'alpha')
    running.release(0)
    ;(await b1).release(0) // beta 20
    ;(await a1).release(0) // alpha 130
    assert.deepEqual(order, ['b0', 'b1', 'a1'])
    await r1.store.syncService() // fails: nothing lost
    assert.equal(r1.store.service.counterOf('alpha'), 130)
    assert.equal(r1.store.service.counterOf('beta'), 20)
    r1.store.check()

    // Back empty (nothing persisted): the counters last fetched go as floors, then the changes.
    await redis.restart()
    await waitUntil(() => r1.store.isAvailable && probe.status === 'ready', {
      timeoutMs: 10_000,
      intervalMs: 50,
    })
    await r1.store.syncService()
    assert.deepEqual(await sharedCounters('outage:'), { alpha: '130', beta: '20' })
    await r1.store.syncService() // sent once, not twice
    assert.deepEqual(await sharedCounters('outage:'), { alpha: '130', beta: '20' })
    assert.equal(r1.store.service.counterOf('alpha'), 130)
  })

  it('a batch whose reply was lost is sent again and counted once', async () => {
    const r1 = await replica('lost:')
    r1.store.service.add('alpha', 7)
    // Redis holds every command for 1.5 s: the sync's reply misses the 500 ms command timeout,
    // yet the script runs once the pause ends.
    await probe.client('PAUSE', 1_500, 'ALL')
    await r1.store.syncService()
    assert.equal(r1.store.isAvailable, false)
    r1.store.service.add('alpha', 4) // pending behind the batch out
    await waitUntil(
      async () => {
        await r1.store.syncService()
        return r1.store.isAvailable // a sync answered: Redis counts as available again
      },
      { timeoutMs: 10_000, intervalMs: 100 },
    )
    await r1.store.syncService() // the change made meanwhile
    assert.deepEqual(await sharedCounters('lost:'), { alpha: '11' })
    assert.equal(r1.store.service.counterOf('alpha'), 11)
  })
})

// ---------------------------------------------------------------------------------------------
// End to end: two router processes

describe('two router replicas share the fair queue', { skip: skip ?? false }, () => {
  const children: ChildProcess[] = []
  const dir = tempDir('kvfence-redis-fair-')
  const alpha = { name: 'alpha', key: newApiKey() }
  const beta = { name: 'beta', key: newApiKey() }
  let engine: Engine
  before(async () => {
    if (skip !== null) return
    // A stream holds replica 2's one slot for 3 s; a reply not streamed comes at once.
    engine = await startHoldingEngine()
  })
  after(async () => {
    if (skip !== null) return
    await stopAll(children)
    await engine.close()
  })

  /** Starts a router replica with one running slot, sharing limits and counters under `e2e:`. */
  async function startReplica(name: string): Promise<string> {
    const port = await freePort()
    const file = join(dir, `${name}.yaml`)
    const config = {
      router: {
        port,
        maxConcurrentRequests: 1,
        limits: { store: 'redis', url: redis.url, keyPrefix: 'e2e:' },
      },
      backend: { kind: 'vllm', url: engine.url, discoveryIntervalMs: 0 },
      tenants: [alpha, beta].map((t) => ({ name: t.name, keySha256: apiKeyDigest(t.key) })),
    }
    writeFileSync(file, JSON.stringify(config)) // YAML holds JSON
    children.push(await startPart(['router', '--config', file]))
    return `http://127.0.0.1:${port}`
  }

  async function numQueued(url: string): Promise<number> {
    const text = await (await fetch(`${url}/metrics`)).text()
    const line = text.split('\n').find((l) => l.startsWith('kvfence_router_requests_queued '))
    return Number(line?.split(' ')[1])
  }

  it("a tenant that flooded replica 1 waits behind another tenant's request on replica 2", async () => {
    const one = await startReplica('one')
    const two = await startReplica('two')
    // alpha: 4 requests through replica 1, each its prompt + 2 × 30 generated tokens.
    for (let i = 0; i < 4; i++) {
      const res = await replicaChat(one, alpha.key, false)
      assert.equal(res.status, 200)
      await res.text()
    }
    await waitUntil(async () => Number((await sharedCounters('e2e:')).alpha ?? 0) > 240, {
      timeoutMs: 5_000,
      intervalMs: 50,
      what: "alpha's service in Redis",
    })
    await sleep(5 * serviceSyncMs) // replica 2 fetches the counters every sync period
    // Replica 2: beta holds the slot (beta: its prompt), then beta and alpha queue, in this order.
    const holder = await replicaChat(two, beta.key, true)
    assert.equal(holder.status, 200)
    const order: string[] = []
    const request = (name: string, key: string) =>
      replicaChat(two, key, false).then(async (res) => {
        assert.equal(res.status, 200)
        await res.text()
        order.push(name)
      })
    const done = [request('b1', beta.key)]
    await waitUntil(async () => (await numQueued(two)) === 1, { timeoutMs: 5_000, intervalMs: 20 })
    done.push(request('a1', alpha.key))
    await waitUntil(async () => (await numQueued(two)) === 2, { timeoutMs: 5_000, intervalMs: 20 })
    done.push(request('a2', alpha.key))
    await waitUntil(async () => (await numQueued(two)) === 3, { timeoutMs: 5_000, intervalMs: 20 })
    await holder.text()
    await Promise.all(done)
    assert.deepEqual(order, ['b1', 'a1', 'a2'])
  })
})
