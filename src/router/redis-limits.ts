/** The Redis {@link LimitStore}: router replicas behind one load balancer share each tenant's
 *  limits. Every check-and-change is one Lua script (run by `EVALSHA` through ioredis's
 *  `defineCommand`), so replicas never interleave inside one; scripts read Redis's clock
 *  (`TIME`), so replicas' clocks need not agree.
 *
 *  | key                          | type       | holds                                        |
 *  | ---------------------------- | ---------- | -------------------------------------------- |
 *  | `<prefix>{tenant}:leases`    | sorted set | one member per unit held, scored by expiry ms |
 *  | `<prefix>{tenant}:tokens`    | hash       | `tokens` (fractional), `updatedMs`            |
 *
 *  A unit is a lease that expires unless its router refreshes it (every third of
 *  `leaseMs`): the units of a replica that dies come back within a lease. When Redis cannot
 *  be reached, `fail-closed` refuses requests (503 `capacity_exhausted` with `Retry-After`) and
 *  `local` counts in this process alone; either way the gauge `kvfence_limit_store_unavailable`
 *  is 1 and one warn line says so, and one info line when Redis is back.
 *  Knows Redis and the store's contract; knows nothing of HTTP or tenants' keys. */
import { randomUUID } from 'node:crypto'
import { Redis } from 'ioredis'
import type { Logger } from 'pino'
import { Gauge, type Registry } from 'prom-client'
import {
  type ConcurrencyGrant,
  type LimitStore,
  type TokenCharge,
  createLocalLimitStore,
} from './limit-store.js'
import { LimitError, LimitStoreUnavailableError } from './limits.js'

/** What the router does while Redis cannot be reached. */
export type UnavailablePolicy = 'fail-closed' | 'local'

/** Settings of the Redis store (`router.limits` in the cluster config). */
export interface RedisLimitSettings {
  /** `redis://host:port[/db]` (or `rediss://`). */
  readonly url: string
  /** Prefix of every key (default {@link defaultKeyPrefix}): replicas sharing limits share it. */
  readonly keyPrefix?: string
  /** Default `fail-closed`. */
  readonly onUnavailable?: UnavailablePolicy
  /** How long a concurrency unit outlives the router holding it, ms, unless refreshed (every
   *  third of it); default {@link defaultLeaseMs}. */
  readonly leaseMs?: number
}

/** Default of {@link RedisLimitSettings.keyPrefix}. */
export const defaultKeyPrefix = 'kvfence:limits:'
/** Default of {@link RedisLimitSettings.leaseMs}. */
export const defaultLeaseMs = 15_000
/** Longest wait for one Redis reply, ms; then the store counts as unavailable. */
const commandTimeoutMs = 500
/** How long start-up waits for the first connection, ms; then the policy applies. */
const connectWaitMs = 2_000
/** Idle token buckets vanish after this, ms (a bucket is full again after 60 s anyway). */
const bucketIdleMs = 120_000

// KEYS[1] leases; ARGV: maxConcurrent, lease id, leaseMs → {isGranted 0|1, units held}
const acquireScript = `
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local n = redis.call('ZCARD', KEYS[1])
if n >= tonumber(ARGV[1]) then return {0, n} end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
return {1, n + 1}`

// KEYS[1] leases; ARGV: leaseMs, lease ids… → units refreshed. Re-adds a lease lost by a Redis
// restart: its request still runs.
const refreshScript = `
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ms = tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], now + ms, ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], ms)
return #ARGV - 1`

// KEYS[1] bucket; ARGV: tokensPerMinute, numTokens, 'charge'|'refund', idle ms
//   → {isCharged 0|1, tokens left as a string (Lua numbers become integers in replies)}
const tokensScript = `
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local tpm = tonumber(ARGV[1])
local n = tonumber(ARGV[2])
local b = redis.call('HMGET', KEYS[1], 'tokens', 'updatedMs')
local tokens = tonumber(b[1]) or tpm
local updated = tonumber(b[2]) or now
tokens = math.min(tpm, tokens + math.max(0, now - updated) * tpm / 60000)
local ok = 1
if ARGV[3] == 'refund' then tokens = math.min(tpm, tokens + n)
elseif tokens >= n then tokens = tokens - n
else ok = 0 end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'updatedMs', tostring(now))
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[4]))
return {ok, tostring(tokens)}`

interface LimitCommands {
  kvfenceAcquire(key: string, max: number, leaseId: string, ms: number): Promise<[number, number]>
  kvfenceRefresh(key: string, ms: number, ...leaseIds: string[]): Promise<number>
  kvfenceTokens(
    key: string,
    tpm: number,
    n: number,
    mode: 'charge' | 'refund',
    idleMs: number,
  ): Promise<[number, string]>
}

/** A {@link LimitStore} in Redis, with its availability. */
export interface RedisLimitStore extends LimitStore {
  /** False while Redis cannot be reached (the policy applies). */
  readonly isAvailable: boolean
  /** Registers `kvfence_limit_store_unavailable` (1 while Redis cannot be reached) in `registry`. */
  registerMetrics(registry: Registry): void
}

/** Connects to Redis (waiting up to {@link connectWaitMs}; an unreachable Redis at start is
 *  logged and handled by the policy, not fatal) and returns the store. */
export async function createRedisLimitStore(
  settings: RedisLimitSettings,
  log: Logger,
): Promise<RedisLimitStore> {
  const prefix = settings.keyPrefix ?? defaultKeyPrefix
  const policy = settings.onUnavailable ?? 'fail-closed'
  const leaseMs = settings.leaseMs ?? defaultLeaseMs
  const local = createLocalLimitStore()
  const routerId = randomUUID()
  let numLeases = 0
  const held = new Map<string, Set<string>>() // tenant → lease ids this router holds in Redis
  const redis = new Redis(settings.url, {
    enableOfflineQueue: false, // unreachable → fail at once, not queue behind a reconnect
    maxRetriesPerRequest: 0,
    commandTimeout: commandTimeoutMs,
    connectTimeout: connectWaitMs,
    retryStrategy: (times) => Math.min(100 * times, 1_000),
    lazyConnect: true,
  })
  redis.defineCommand('kvfenceAcquire', { numberOfKeys: 1, lua: acquireScript })
  redis.defineCommand('kvfenceRefresh', { numberOfKeys: 1, lua: refreshScript })
  redis.defineCommand('kvfenceTokens', { numberOfKeys: 1, lua: tokensScript })
  const commands = redis as unknown as LimitCommands

  const availability = watchAvailability(redis, settings.url, policy, log)
  redis.connect().catch((err: Error) => availability.set(false, err.message))
  await waitUntilSettled(redis, connectWaitMs)
  availability.settle(redis.status === 'ready', redis.status)

  const leasesKey = (tenant: string) => `${prefix}{${tenant}}:leases`
  const tokensKey = (tenant: string) => `${prefix}{${tenant}}:tokens`
  const usable = () => availability.isAvailable && redis.status === 'ready'
  /** The policy's answer once a call to Redis failed. */
  function unavailable<T>(err: unknown, fallback: () => T): T {
    availability.set(false, (err as Error).message)
    if (policy === 'local') return fallback()
    throw storeUnavailable()
  }

  async function acquireInRedis(tenant: string, max: number): Promise<ConcurrencyGrant> {
    const leaseId = `${routerId}:${++numLeases}`
    const key = leasesKey(tenant)
    const [isGranted, numRunning] = await commands.kvfenceAcquire(key, max, leaseId, leaseMs)
    if (isGranted !== 1) return { isGranted: false, numRunning }
    const ofTenant = held.get(tenant) ?? new Set<string>()
    held.set(tenant, ofTenant)
    ofTenant.add(leaseId)
    let isReleased = false
    return {
      isGranted: true,
      release() {
        if (isReleased) return
        isReleased = true
        ofTenant.delete(leaseId)
        if (ofTenant.size === 0) held.delete(tenant)
        // Best effort: a lease Redis does not hear of expires within leaseMs.
        if (usable()) redis.zrem(key, leaseId).catch(() => undefined)
      },
    }
  }

  const refreshTimer = setInterval(() => {
    if (!usable()) return
    for (const [tenant, ids] of held) {
      commands.kvfenceRefresh(leasesKey(tenant), leaseMs, ...ids).catch(() => undefined)
    }
  }, leaseMs / 3)
  refreshTimer.unref()

  return {
    get isAvailable() {
      return availability.isAvailable
    },
    acquire(tenant, maxConcurrent) {
      if (maxConcurrent === undefined) return local.acquire(tenant, undefined)
      if (!usable())
        return unavailable(new Error(redis.status), () => local.acquire(tenant, maxConcurrent))
      return acquireInRedis(tenant, maxConcurrent).catch((err: unknown) =>
        unavailable(err, () => local.acquire(tenant, maxConcurrent)),
      )
    },
    charge(tenant, tpm, numTokens): Promise<TokenCharge> | TokenCharge {
      const fallback = () => local.charge(tenant, tpm, numTokens)
      if (!usable()) return unavailable(new Error(redis.status), fallback)
      return commands
        .kvfenceTokens(tokensKey(tenant), tpm, numTokens, 'charge', bucketIdleMs)
        .then(([isCharged, left]): TokenCharge =>
          isCharged === 1 ? { isCharged: true } : { isCharged: false, numTokensLeft: Number(left) },
        )
        .catch((err: unknown) => unavailable(err, fallback))
    },
    refund(tenant, tpm, numTokens) {
      // To the store counting now: a refund lost to an outage only makes a tenant wait longer.
      if (!usable()) return local.refund(tenant, tpm, numTokens)
      commands
        .kvfenceTokens(tokensKey(tenant), tpm, numTokens, 'refund', bucketIdleMs)
        .catch(() => undefined)
    },
    check() {
      local.check()
      for (const [tenant, ids] of held) {
        if (ids.size === 0) throw new Error(`tenant ${tenant} holds an empty set of leases`)
      }
    },
    close() {
      clearInterval(refreshTimer)
      redis.disconnect()
    },
    registerMetrics(registry) {
      registerUnavailableGauge(registry, () => availability.isAvailable)
    },
  }
}

/** What a request with a limit meets while Redis is away, under `fail-closed`: 503. */
function storeUnavailable(): LimitError {
  return new LimitStoreUnavailableError(
    'The limit store is unavailable, so no request can be counted against its limits; retry later.',
    1,
  )
}

/** `kvfence_limit_store_unavailable` in `registry`: 1 while `isAvailable()` is false. */
function registerUnavailableGauge(registry: Registry, isAvailable: () => boolean): void {
  new Gauge({
    name: 'kvfence_limit_store_unavailable',
    help: '1 while the Redis limit store cannot be reached (router.limits.onUnavailable applies), else 0.',
    registers: [registry],
    collect() {
      this.set(isAvailable() ? 0 : 1)
    },
  })
}

/** Whether Redis can be reached, from its connection's events and failed calls; every change
 *  is one log line (warn when it goes away, info when it is back). The only place that assigns
 *  it. */
function watchAvailability(redis: Redis, url: string, policy: UnavailablePolicy, log: Logger) {
  let isAvailable = false
  let hasReported = false
  function set(next: boolean, reason: string): void {
    if (next === isAvailable && hasReported) return
    const wasReported = hasReported
    isAvailable = next
    hasReported = true
    if (next) {
      if (wasReported) log.info({ url: redactedUrl(url) }, 'limit store: Redis is back')
      return
    }
    log.warn(
      { url: redactedUrl(url), reason, onUnavailable: policy },
      policy === 'local'
        ? 'limit store: Redis unavailable; counting limits in this router alone'
        : 'limit store: Redis unavailable; refusing requests (503) until it is back',
    )
  }
  redis.on('ready', () => set(true, 'ready'))
  redis.on('error', (err: Error) => set(false, err.message))
  redis.on('close', () => set(false, 'connection closed'))
  return {
    get isAvailable() {
      return isAvailable
    },
    set,
    /** Reports the state found at start unless an event already did. */
    settle(next: boolean, reason: string): void {
      if (!hasReported) set(next, reason)
    },
  }
}

/** Resolves when `redis` is ready or has failed to connect, or after `maxMs`. */
function waitUntilSettled(redis: Redis, maxMs: number): Promise<void> {
  if (redis.status === 'ready') return Promise.resolve()
  return new Promise((resolve) => {
    const done = () => {
      clearTimeout(timer)
      redis.off('ready', done)
      redis.off('error', done)
      resolve()
    }
    const timer = setTimeout(done, maxMs)
    redis.once('ready', done)
    redis.once('error', done)
  })
}

/** `url` without a password, for logs. */
function redactedUrl(url: string): string {
  try {
    const u = new URL(url)
    if (u.password !== '') u.password = '***'
    return u.toString()
  } catch {
    return '(unparsable URL)'
  }
}
