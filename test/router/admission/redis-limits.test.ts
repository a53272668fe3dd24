/** Router replicas sharing tenants' limits through a real redis-server: a tenant limited to 4
 *  requests at once gets its 5th refused (429) whichever of two router processes it reaches, a
 *  tokens-per-minute budget holds across both, and when Redis dies the policy applies
 *  (`fail-closed`: 503 with Retry-After; `local`: each replica counts alone) until Redis is back.
 *  Real router processes in gateway mode in front of a stand-in vLLM. */
import assert from 'node:assert/strict'
import type { ChildProcess } from 'node:child_process'
import { mkdtempSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { after, before, describe, it } from 'node:test'
import { newApiKey } from '../../../src/router/tenants/tenant-keys.js'
import { apiKeyDigest } from '../../../src/router/tenants/tenants.js'
import type { Engine } from '../../helpers/engines.js'
import { waitUntil } from '../../helpers/poll.js'
import { freePort, kill9, startPart, stopAll } from '../../reliability/helpers.js'
import {
  type RedisServer,
  redisSkipReason,
  replicaChat,
  startHoldingEngine,
  startRedis,
} from './redis-helpers.js'

const skip = redisSkipReason()
if (skip !== null) console.log(`# skipping the Redis limit tests: ${skip}`)

const dir = mkdtempSync(join(tmpdir(), 'kvfence-redis-limits-'))
const tenants = {
  four: { name: 'four-at-once', key: newApiKey(), limits: { maxConcurrentRequests: 4 } },
  budget: { name: 'budget', key: newApiKey() },
}
let engine: Engine
let redis: RedisServer
const children: ChildProcess[] = []

before(async () => {
  if (skip !== null) return
  engine = await startHoldingEngine() // its streams hold a request for 3 s
  redis = await startRedis()
})
after(async () => {
  if (skip !== null) return
  await stopAll(children)
  await redis.kill()
  await engine.close()
})

/** Starts two router replicas sharing limits in Redis under `onUnavailable`; returns their URLs.
 *  `budget` gets `tokensPerMinute`. */
async function startReplicas(
  name: string,
  onUnavailable: 'fail-closed' | 'local',
  tokensPerMinute = 1_000_000,
  leaseSeconds = 15,
): Promise<string[]> {
  const urls: string[] = []
  for (const replica of ['a', 'b']) {
    const port = await freePort()
    const file = join(dir, `${name}-${replica}.yaml`)
    const record = (t: { name: string; key: string }, limits?: object) => ({
      name: t.name,
      keySha256: apiKeyDigest(t.key),
      ...(limits === undefined ? {} : { limits }),
    })
    const config = {
      router: {
        port,
        limits: {
          store: 'redis',
          url: redis.url,
          keyPrefix: `${name}:`,
          onUnavailable,
          leaseSeconds,
        },
      },
      backend: { kind: 'vllm', url: engine.url, discoveryIntervalMs: 0 },
      tenants: [
        record(tenants.four, tenants.four.limits),
        record(tenants.budget, { tokensPerMinute }),
      ],
    }
    writeFileSync(file, JSON.stringify(config)) // YAML holds JSON
    children.push(await startPart(['router', '--config', file]))
    urls.push(`http://127.0.0.1:${port}`)
  }
  return urls
}

const chat = replicaChat

/** Opens a streamed request that holds its concurrency unit until its stream ends (3 s). */
async function holdOne(url: string, key: string): Promise<Response> {
  const res = await chat(url, key, true)
  assert.equal(res.status, 200, 'a held stream was refused')
  return res
}

/** Reads `res`'s body to its end. */
async function drain(res: Response): Promise<void> {
  await res.text()
}

async function unavailableGauge(url: string): Promise<number> {
  const text = await (await fetch(`${url}/metrics`)).text()
  const line = text.split('\n').find((l) => l.startsWith('kvfence_limit_store_unavailable '))
  assert.ok(line !== undefined, 'no kvfence_limit_store_unavailable in /metrics')
  return Number(line.split(' ')[1])
}

/** `kvfence_router_admission_rejections_total{reason}` of the router at `url` (0 when absent). */
async function rejections(url: string, reason: string): Promise<number> {
  const text = await (await fetch(`${url}/metrics`)).text()
  const prefix = `kvfence_router_admission_rejections_total{reason="${reason}"} `
  const line = text.split('\n').find((l) => l.startsWith(prefix))
  return line === undefined ? 0 : Number(line.slice(prefix.length))
}

/** The fail-closed pair, shared: its `budget` tenant has a budget of 1 token, which the tokens
 *  test reads a request's cost from (the pair's other tests send as `four` only). */
let urls: string[]

describe('limits shared by router replicas through Redis', { skip: skip ?? false }, () => {
  before(async () => {
    urls = await startReplicas('closed', 'fail-closed', 1)
  })

  it('refuses a tenant limited to 4 at once its 5th request on either replica', async () => {
    const [a, b] = urls as [string, string]
    const { key } = tenants.four
    const held = [
      await holdOne(a, key),
      await holdOne(b, key),
      await holdOne(a, key),
      await holdOne(b, key),
    ]
    for (const url of [a, b]) {
      const res = await chat(url, key, false)
      assert.equal(res.status, 429)
      assert.equal(res.headers.get('retry-after'), '1')
      assert.match(await res.text(), /4 requests in flight, the limit of your key is 4 at once/)
    }
    await Promise.all(held.map(drain))
    const res = await chat(b, key, false) // units come back when requests end
    assert.equal(res.status, 200)
    await res.text()
  })

  it('fail-closed: without Redis, 503 with Retry-After, and served again once it is back', async () => {
    const [a, b] = urls as [string, string]
    const tenantLimitBefore = await Promise.all(urls.map((u) => rejections(u, 'tenant_limit')))
    await redis.kill()
    for (const url of [a, b]) {
      const res = await chat(url, tenants.four.key, false)
      assert.equal(res.status, 503)
      assert.equal(res.headers.get('retry-after'), '1')
      assert.match(await res.text(), /limit store is unavailable/)
      assert.equal(await unavailableGauge(url), 1)
      // Counted as the store's absence, not as the tenant's limit.
      assert.equal(await rejections(url, 'limit_store_unavailable'), 1)
    }
    assert.deepEqual(
      await Promise.all(urls.map((u) => rejections(u, 'tenant_limit'))),
      tenantLimitBefore,
    )
    await redis.restart()
    for (const url of [a, b]) {
      await waitUntil(async () => (await unavailableGauge(url)) === 0, {
        timeoutMs: 10_000,
        intervalMs: 100,
        what: 'Redis back',
      })
      const res = await chat(url, tenants.four.key, false)
      assert.equal(res.status, 200)
      await res.text()
    }
  })
})

describe('a tokens-per-minute budget shared by router replicas', { skip: skip ?? false }, () => {
  it('holds across both replicas', async () => {
    // What one request costs as the router counts it (prompt tokens as the engine's /tokenize
    // counts the templated chat, + max_tokens), from its refusal under a budget of 1 token (the
    // fail-closed pair's).
    const maxTokens = 3 // the stand-in's non-streamed reply uses all of them: nothing is refunded
    const refused = await chat(urls[0], tenants.budget.key, false, maxTokens)
    assert.equal(refused.status, 429)
    const cost = Number(/may use (\d+) tokens/.exec(await refused.text())?.[1])
    assert.ok(cost > maxTokens, `a request costs ${cost} tokens`)
    // Room for 3 requests and half of a 4th; alone, each replica would serve 3.
    const [a, b] = (await startReplicas('budget', 'fail-closed', Math.floor(3.5 * cost))) as [
      string,
      string,
    ]
    const statuses: number[] = []
    for (const url of [a, b, a, b]) {
      const res = await chat(url, tenants.budget.key, false, maxTokens)
      statuses.push(res.status)
      await res.text()
    }
    assert.deepEqual(statuses, [200, 200, 200, 429])
  })
})

describe('local: without Redis each replica counts alone', { skip: skip ?? false }, () => {
  it('serves within the per-replica limit, and shares limits again once Redis is back', async () => {
    const [a, b] = (await startReplicas('local', 'local')) as [string, string]
    const { key } = tenants.four
    await redis.kill()
    const held: Response[] = []
    for (let i = 0; i < 4; i++) held.push(await holdOne(a, key)) // 4 on a alone
    const fifth = await chat(a, key, false)
    assert.equal(fifth.status, 429)
    await fifth.text()
    held.push(await holdOne(b, key)) // b counts its own
    assert.equal(await unavailableGauge(a), 1)
    await Promise.all(held.map(drain))
    await redis.restart()
    for (const url of [a, b])
      await waitUntil(async () => (await unavailableGauge(url)) === 0, {
        timeoutMs: 10_000,
        intervalMs: 100,
        what: 'Redis back',
      })
    const shared = [
      await holdOne(a, key),
      await holdOne(b, key),
      await holdOne(a, key),
      await holdOne(b, key),
    ]
    const res = await chat(b, key, false)
    assert.equal(res.status, 429)
    await res.text()
    await Promise.all(shared.map(drain))
  })
})

describe('a replica that dies', { skip: skip ?? false }, () => {
  it('gives its concurrency units back within a lease', async () => {
    const [a, b] = (await startReplicas('dies', 'fail-closed', undefined, 2)) as [string, string]
    const processA = children.at(-2)!
    const { key } = tenants.four
    const held: Response[] = []
    for (let i = 0; i < 4; i++) held.push(await holdOne(a, key))
    await kill9(processA) // its 4 leases stay in Redis, refreshed by no one
    for (const res of held) res.body?.cancel().catch(() => undefined)
    const refused = await chat(b, key, false)
    assert.equal(refused.status, 429, "a dead replica's units are counted until they expire")
    await refused.text()
    await waitUntil(
      async () => {
        const res = await chat(b, key, false)
        await res.text()
        return res.status === 200
      },
      { timeoutMs: 10_000, intervalMs: 200, what: 'the dead replica’s units back' },
    )
  })
})
