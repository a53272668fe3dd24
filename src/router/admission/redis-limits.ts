/** The Redis {@link LimitStore}: router replicas behind one load balancer share each tenant's
 *  limits. Every check-and-change is one Lua script (run by `EVALSHA` through ioredis's
 *  `defineCommand`), so replicas never interleave inside one; scripts read Redis's clock
 *  (`TIME`), so replicas' clocks need not agree.
 *
 *  | key                          | type       | holds                                        |
 *  | ---------------------------- | ---------- | -------------------------------------------- |
 *  | `<prefix>{tenant}:leases`    | sorted set | one member per unit held, scored by expiry ms |
 *  | `<prefix>{tenant}:tokens`    | hash       | `tokens` (fractional), `updatedMs`            |
 *  | `<prefix>{service}:counters` | hash       | tenant → virtual token counter (fair queue)   |
 *  | `<prefix>{service}:batch:<router id>` | string | the last batch of counter changes applied |
 *
 *  A unit is a lease that expires unless its router refreshes it (every third of
 *  `leaseMs`): the units of a replica that dies come back within a lease. When Redis cannot
 *  be reached, `fail-closed` refuses requests (503 `capacity_exhausted` with `Retry-After`) and
 *  `local` counts in this process alone; either way the gauge `kvfence_limit_store_unavailable`
 *  is 1 and one warn line says so, and one info line when Redis is back.
 *
 *  The fair queue's virtual token counters (VTC, fair-queue.ts) are shared too, but the queue
 *  decides on the hot path and never waits for Redis: it reads a local view, the counters last
 *  fetched plus this router's changes not yet confirmed, and every {@link serviceSyncMs} one
 *  script sends the changes as one batch and returns every tenant's counter. So a replica orders
 *  its backlogs by the others' service as it was at most one sync period (plus a round trip)
 *  ago. A change is `c ↦ max(c, floor) + delta`: a charge adds (`HINCRBYFLOAT`), VTC's lift raises
 *  the shared counter to the floor this replica saw (the least counter of its backlogged tenants),
 *  so idling banks no credit on any replica, and two replicas lifting one tenant to one floor
 *  raise it once, not twice. A tenant's changes between syncs compose into one such pair.
 *  Each batch carries a number; Redis keeps the last one applied per router (for
 *  `batchMarkerMs`), so a batch whose reply was lost is sent again under its number and applied
 *  once. The counters vanish `leaseMs` after the last replica's sync. While Redis cannot be reached the
 *  counters are this router's alone, under either policy (fairness is advisory; the limits are
 *  what fail closed); once it answers, the changes made meanwhile are sent, with the counters last
 *  fetched as floors, so a Redis that lost its data gets them back. The sync is also what notices
 *  that Redis answers again after a command timed out on a live connection.
 *  Knows Redis and the store's contract; knows nothing of HTTP or tenants' keys. */
import assert from 'node:assert/strict'
import { randomUUID } from 'node:crypto'
import type { Redis } from 'ioredis'
import type { Logger } from 'pino'
import { Gauge, type Registry } from 'prom-client'
import {
  type ConcurrencyGrant,
  type LimitStore,
  type ServiceCounters,
  type TokenCharge,
  checkCounters,
  createLocalLimitStore,
} from './limit-store.js'
import { LimitError, LimitStoreUnavailableError } from './limit-error.js'

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
/** How often a router sends its changes to the fair queue's counters and fetches everyone's, ms:
 *  the most by which one replica's view of another's service lags. */
export const serviceSyncMs = 200
/** How long Redis remembers a router's last applied batch of counter changes, ms: a batch whose
 *  reply was lost and is sent again within this is not counted twice. */
const batchMarkerMs = 3_600_000

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

// KEYS[1] counters, KEYS[2] this router's batch marker; ARGV: batch number (0: no changes),
// markerMs, idleMs, then per tenant: tenant, floor ('' for none), delta → HGETALL of the counters.
// Floors and deltas arrive as JS number strings and are stored as sent (Lua's tostring keeps 14
// digits only).
const serviceScript = `
local seq = tonumber(ARGV[1])
local done = tonumber(redis.call('GET', KEYS[2]) or '0')
if seq > done then
  for i = 4, #ARGV, 3 do
    local tenant, floor, delta = ARGV[i], ARGV[i + 1], ARGV[i + 2]
    if floor ~= '' and tonumber(redis.call('HGET', KEYS[1], tenant) or '0') < tonumber(floor) then
      redis.call('HSET', KEYS[1], tenant, floor)
    end
    if tonumber(delta) > 0 then redis.call('HINCRBYFLOAT', KEYS[1], tenant, delta) end
  end
  redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return redis.call('HGETALL', KEYS[1])`

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
  kvfenceService(counters: string, marker: string, ...args: (string | number)[]): Promise<string[]>
}

/** A {@link LimitStore} in Redis, with its availability. */
export interface RedisLimitStore extends LimitStore {
  /** False while Redis cannot be reached (the policy applies). */
  readonly isAvailable: boolean
  /** Registers `kvfence_limit_store_unavailable` (1 while Redis cannot be reached) in `registry`. */
  registerMetrics(registry: Registry): void
  /** Sends this router's changes to the service counters and fetches all (what the timer does
   *  every {@link serviceSyncMs}); resolves once a sync begun after the call has ended, whether
   *  or not Redis answered. */
  syncService(): Promise<void>
}

/** An ioredis client of `url` (not connected yet: `lazyConnect`) with the store's Lua scripts
 *  defined on it, as `commands`. Commands fail at once while Redis is unreachable (no offline
 *  queue, no retry) and after {@link commandTimeoutMs}. */
async function newRedisClient(url: string): Promise<{ redis: Redis; commands: LimitCommands }> {
  // Loaded here, not with the module: a router without a Redis store (the default) would pay
  // ~0.1 s of CPU at every start for a client it never makes.
  const { Redis } = await import('ioredis')
  const redis = new Redis(url, {
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
  redis.defineCommand('kvfenceService', { numberOfKeys: 2, lua: serviceScript })
  return { redis, commands: redis as unknown as LimitCommands }
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
  const { redis, commands } = await newRedisClient(settings.url)

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

  const sync = startServiceSync(redis, commands, availability, {
    countersKey: `${prefix}{service}:counters`,
    markerKey: `${prefix}{service}:batch:${routerId}`,
    leaseMs,
  })
  const service = sync.service

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
    service: service.counters,
    check() {
      local.check()
      service.counters.check()
      for (const [tenant, ids] of held) {
        if (ids.size === 0) throw new Error(`tenant ${tenant} holds an empty set of leases`)
      }
    },
    close() {
      clearInterval(refreshTimer)
      sync.stop()
      // The last changes go out first (a batch whose reply is lost here is counted once still).
      void sync.syncAfterCurrent().finally(() => redis.disconnect())
    },
    registerMetrics(registry) {
      registerUnavailableGauge(registry, () => availability.isAvailable)
    },
    syncService: sync.syncAfterCurrent,
  }
}

/** Syncs this router's service counters with Redis every {@link serviceSyncMs} (see the section
 *  below): `countersKey` holds every tenant's counter, `markerKey` this router's last applied
 *  batch; both expire `leaseMs` after the last sync. `stop` ends the timer. */
function startServiceSync(
  redis: Redis,
  commands: LimitCommands,
  availability: ReturnType<typeof watchAvailability>,
  keys: { countersKey: string; markerKey: string; leaseMs: number },
) {
  const service = createSyncedServiceCounters()
  const { countersKey, markerKey, leaseMs } = keys
  /** One sync: the batch out, every counter back. Runs whenever the connection is up, even while
   *  a timed-out command marks Redis unavailable: its answer is what marks it available again. */
  async function syncOnce(): Promise<void> {
    if (redis.status !== 'ready') return service.fail()
    const batch = service.takeBatch()
    try {
      const reply = await commands.kvfenceService(
        countersKey,
        markerKey,
        batch.seq,
        batchMarkerMs,
        leaseMs,
        ...batchArgs(batch),
      )
      service.confirm(batch, countersOf(reply))
      availability.set(true, 'the service counters synced')
    } catch (err) {
      service.fail()
      availability.set(false, (err as Error).message)
    }
  }
  let syncing: Promise<void> | null = null
  function startSync(): Promise<void> {
    syncing ??= syncOnce().finally(() => {
      syncing = null
    })
    return syncing
  }
  /** A sync begun after the one running now, if any, has ended. */
  async function syncAfterCurrent(): Promise<void> {
    while (syncing !== null) await syncing
    await startSync()
  }
  const syncTimer = setInterval(() => void startSync(), serviceSyncMs)
  syncTimer.unref()
  return {
    service,
    syncAfterCurrent,
    stop: () => clearInterval(syncTimer),
  }
}

// ---------------------------------------------------------------------------------------------
// The fair queue's counters, shared

/** A change to one tenant's counter not yet confirmed by Redis: `c ↦ max(c, floor) + delta`
 *  (`floor` -Infinity: none). A change then another compose into one of the same form. */
interface CounterChange {
  floor: number
  delta: number
}

/** Changes to the counters sent as one: `seq` (> 0) names it to Redis, which applies each
 *  number once; 0 when it holds no change (a fetch only). */
export interface ServiceBatch {
  readonly seq: number
  readonly changes: ReadonlyMap<string, Readonly<CounterChange>>
}

/** `change` applied to counter `c`. */
function applied(change: Readonly<CounterChange>, c: number): number {
  return Math.max(c, change.floor) + change.delta
}

/** The counters of one router as a local view of the shared ones, and the batches that carry its
 *  changes to Redis (the module's header says how). Socket-free: the store calls
 *  {@link takeBatch}, sends it, and reports {@link confirm} with every counter Redis holds, or
 *  {@link fail}; at most one batch is out at a time, and a failed one goes out again unchanged
 *  (with floors added). */
export function createSyncedServiceCounters() {
  let shared = new Map<string, number>() // tenant → counter as Redis last returned it
  const view = new Map<string, number>() // tenant → shared counter with this router's changes since
  let pending = new Map<string, CounterChange>() // tenant → its changes not yet in a batch
  let unconfirmed: { seq: number; changes: Map<string, CounterChange> } | null = null
  let lastSeq = 0
  let needsFloors = false // Redis may have lost the counters: send the ones last fetched as floors

  function changeOf(tenant: string): CounterChange {
    let change = pending.get(tenant)
    if (change === undefined) pending.set(tenant, (change = { floor: -Infinity, delta: 0 }))
    return change
  }

  const counters: ServiceCounters = {
    counterOf: (tenant) => view.get(tenant) ?? 0,
    add(tenant, amount) {
      if (amount === 0) return
      changeOf(tenant).delta += amount
      view.set(tenant, (view.get(tenant) ?? 0) + amount)
    },
    raiseTo(tenant, floor) {
      if (floor <= (view.get(tenant) ?? 0)) return
      const change = changeOf(tenant)
      // max(max(c, f₁) + d, f) = max(c, f₁, f − d) + d
      change.floor = Math.max(change.floor, floor - change.delta)
      view.set(tenant, floor)
    },
    check() {
      checkCounters(view)
      checkCounters(shared)
      for (const batch of [pending, unconfirmed?.changes ?? new Map<string, CounterChange>()]) {
        for (const [tenant, { delta }] of batch) {
          assert.ok(delta >= 0 && Number.isFinite(delta), `tenant ${tenant}'s delta is ${delta}`)
        }
      }
    },
  }

  return {
    counters,
    /** The batch to send now: the unconfirmed one again, else the changes pending. */
    takeBatch(): ServiceBatch {
      if (unconfirmed === null) {
        unconfirmed = { seq: 0, changes: pending }
        pending = new Map()
      }
      if (needsFloors) {
        // max(c, s) first: a no-op on counters that only grow, a restore on lost ones.
        for (const [tenant, c] of shared) {
          const change = unconfirmed.changes.get(tenant)
          if (change === undefined) unconfirmed.changes.set(tenant, { floor: c, delta: 0 })
          else change.floor = Math.max(change.floor, c)
        }
        needsFloors = false
      }
      if (unconfirmed.seq === 0 && unconfirmed.changes.size > 0) unconfirmed.seq = ++lastSeq
      return unconfirmed
    },
    /** Redis applied `batch` (now or before) and returned `counters` (tenant → counter). */
    confirm(batch: ServiceBatch, fetched: Map<string, number>): void {
      assert.equal(batch, unconfirmed, 'a batch confirmed that is not the one out')
      unconfirmed = null
      shared = fetched
      view.clear()
      for (const [tenant, c] of shared) view.set(tenant, c)
      for (const [tenant, change] of pending)
        view.set(tenant, applied(change, view.get(tenant) ?? 0))
    },
    /** The batch out, if any, may or may not have been applied; the view keeps every change. */
    fail(): void {
      if (unconfirmed?.seq === 0) unconfirmed = null // a fetch only: nothing to send again
      needsFloors = true
    },
  }
}

/** `batch`'s changes as the service script's arguments: tenant, floor ('' for none), delta. */
function batchArgs(batch: ServiceBatch): string[] {
  const args: string[] = []
  for (const [tenant, { floor, delta }] of batch.changes) {
    args.push(tenant, floor === -Infinity ? '' : String(floor), String(delta))
  }
  return args
}

/** The service script's reply (HGETALL: tenant, counter, …) as tenant → counter. */
function countersOf(reply: string[]): Map<string, number> {
  const counters = new Map<string, number>()
  for (let i = 0; i < reply.length; i += 2) counters.set(reply[i], Number(reply[i + 1]))
  return counters
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
/** `url` with its password, if any, shown as `***`; `(unparsable URL)` when it is no URL. */
export function redactedUrl(url: string): string {
  try {
    const u = new URL(url)
    if (u.password !== '') u.password = '***'
    return u.toString()
  } catch {
    return '(unparsable URL)'
  }
}
