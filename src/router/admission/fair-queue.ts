/** The router-wide queue in front of the workers, and the wait for room in a full KV pool.
 *  - Running slots: at most `maxConcurrentRequests` requests run; more wait, one queue per tenant.
 *    A freed slot goes to the backlogged tenant that has received the least service, the virtual
 *    token counter (VTC) of Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024:
 *    each tenant's counter grows by (1 × prompt tokens + 2 × generated tokens) ÷ its weight, the
 *    prompt's when the request gets its slot, the generated tokens' when it ends. A tenant that
 *    becomes backlogged has its counter lifted to the least counter among the backlogged (or,
 *    with none, to that of the last tenant to leave the backlog), so that idling banks no credit;
 *    on a tie the tenant with fewer requests running goes first. Within a tenant, first come
 *    first served.
 *  - Reserved slots: the last `reservedSlots` of the slots (at most all but one) are taken only by
 *    a request whose tenant has none running, so that a tenant holding the other slots cannot
 *    make another tenant's first request wait for one of its requests to end. A slot is open to
 *    a tenant while fewer than `maxConcurrentRequests − reserved` run, or fewer than
 *    `maxConcurrentRequests` run and the tenant has none running; a freed slot goes to the
 *    least-served backlogged tenant it is open to. The cost: a tenant alone runs on `reserved`
 *    slots fewer.
 *  - The queue's bound: with `maxQueuedRequests` waiting, a newcomer takes the place of the newest
 *    request of the tenant with the most queued, if that tenant has more queued than the newcomer's;
 *    else the newcomer is refused. A tenant with nothing queued is never refused for a queue that
 *    others filled.
 *  - Room in a full KV pool: requests refused for a full pool wait, one queue per tenant; each
 *    request that ends wakes one waiter only, and one that then gets room wakes the next (the room
 *    freed may hold more than one). The waiter woken is the first of the waiting tenant with the
 *    least service, by the same counters, lift and ties as the slots: a tenant that fills the pool
 *    cannot put another's request behind its backlog of waits. A request stays in its tenant's
 *    backlog from its first refusal until it gets room (its tries in between do not lift it
 *    again). While any wait, a newcomer queues behind them.
 *  - One wait bound: a request waits at most `maxQueueWaitMs` in all, the queue and the pool waits
 *    together, from the moment it asks for a slot; then 503 with `Retry-After`. The request's
 *    abort signal is what names it across the two waits.
 *  - Where the counters live: a {@link ServiceCounters} (limit-store.ts), this process's memory by
 *    default; with `router.limits.store: redis`, shared by the router replicas (redis-limits.ts),
 *    read here from a local view at most one sync period behind the other replicas' service.
 *  Knows tenant names, weights, token counts and time; knows nothing of HTTP, workers or keys. */
import assert from 'node:assert/strict'
import { KvfenceError } from '../../common/errors.js'
import { type ServiceCounters, createLocalServiceCounters } from './limit-store.js'
import { LimitError } from './limit-error.js'
import {
  type QueueLimits,
  type RoomTurn,
  type Slot,
  type SlotClaim,
  queueLimitDefaults,
} from './queue-limits.js'

/** Weights of the service a request is counted for, per token: VTC's evaluation weighs a
 *  generated token twice a prompt token (w_p = 1, w_q = 2), as output tokens cost more to
 *  produce (one forward pass each) than prompt tokens (one batched prefill). */
export const serviceWeights = Object.freeze({ prompt: 1, generated: 2 })

/** How often the first request waiting for KV room tries again when no request ends (the pool
 *  may free pages the router does not see: a decode worker releases a request's pages shortly
 *  after its end), ms. Only the first waiter polls, so this never makes a herd. */
export const roomPollMs = 250

/** A request's place across its waits: arrival order, the end of its wait budget, its tenant. */
interface RequestWait {
  readonly seq: number
  /** `nowMs()` past which the request may wait no more. */
  readonly deadlineMs: number
  readonly claim: SlotClaim
  /** Whether the request is in its tenant's backlog of waits for room (refused, not yet in). */
  isWaitingForRoom: boolean
}

/** A request in a tenant's queue. */
interface QueuedRequest {
  readonly seq: number
  grant(): void
  refuse(err: KvfenceError): void
}

/** A request waiting for KV room. */
interface RoomWaiter {
  readonly seq: number
  readonly tenant: string
  wake(): void
}

/** The reserved slots that take effect: `reservedSlots` (default {@link queueLimitDefaults}'),
 *  at most `maxConcurrentRequests − 1`, so that one slot is always open to every tenant. Throws
 *  an AssertionError for a negative or fractional `reservedSlots` (config and flags refuse them
 *  first, in a user's words). */
export function effectiveReservedSlots(queue: QueueLimits): number {
  const reservedSlots = queue.reservedSlots ?? queueLimitDefaults.reservedSlots
  assert.ok(Number.isInteger(reservedSlots) && reservedSlots >= 0, `reservedSlots ${reservedSlots}`)
  return Math.min(reservedSlots, queue.maxConcurrentRequests - 1)
}

/** The claim of a request whose caller named no tenant (one anonymous tenant, weight 1). */
const anonymousClaim: SlotClaim = Object.freeze({ tenant: '', weight: 1, numPromptTokens: 0 })

/** The queue of running slots and KV room (see the module's header). `nowMs` in ms; `counters`
 *  the tenants' virtual token counters (default: in this process). */
export function createFairQueue(
  queue: QueueLimits,
  nowMs: () => number,
  counters: ServiceCounters = createLocalServiceCounters(),
) {
  const tenants = createTenantBacklogs(counters)
  const waits = new WeakMap<AbortSignal, RequestWait>()
  let numRunning = 0
  // The slots open to every tenant; the rest only to a tenant with none running. One always is.
  const numOpenSlots = queue.maxConcurrentRequests - effectiveReservedSlots(queue)
  const room = createRoomQueue(queue, nowMs, waitOf, tenants)
  let nextSeq = 0

  /** The wait of the request `signal` names, begun now for `claim`'s tenant if it is new. */
  function waitOf(signal: AbortSignal, claim: SlotClaim = anonymousClaim): RequestWait {
    let wait = waits.get(signal)
    if (wait === undefined) {
      wait = {
        seq: nextSeq++,
        deadlineMs: nowMs() + queue.maxQueueWaitMs,
        claim,
        isWaitingForRoom: false,
      }
      waits.set(signal, wait)
    }
    return wait
  }

  /** A running slot of `claim`'s tenant, its prompt charged now. */
  function makeSlot(claim: SlotClaim): Slot {
    tenants.charge(claim.tenant, claim.weight, serviceWeights.prompt * claim.numPromptTokens)
    tenants.startRunning(claim.tenant)
    let isReleased = false
    return {
      release(numGeneratedTokens = 0): void {
        if (isReleased) return
        isReleased = true
        tenants.charge(claim.tenant, claim.weight, serviceWeights.generated * numGeneratedTokens)
        tenants.stopRunning(claim.tenant)
        numRunning--
        grantOpenSlots()
        room.onRequestEnded()
      },
    }
  }

  /** Whether a request of `tenant` may take a slot now (see the module's header). */
  function isSlotOpenTo(tenant: string): boolean {
    return (
      numRunning < numOpenSlots ||
      (numRunning < queue.maxConcurrentRequests && !tenants.isRunning(tenant))
    )
  }

  /** Hands free slots to queued requests while one is open to a backlogged tenant: the first of
   *  the least served among those it is open to. An end can open two: its own slot, and the
   *  reserved one to its tenant's next request if that tenant now has none running. */
  function grantOpenSlots(): void {
    for (;;) {
      const next =
        numRunning < numOpenSlots
          ? tenants.takeNext()
          : numRunning < queue.maxConcurrentRequests
            ? tenants.takeNext((tenant) => !tenants.isRunning(tenant))
            : undefined
      if (next === undefined) return
      numRunning++
      next.grant() // counts its tenant as running before the next turn of the loop
    }
  }

  function acquireSlot(signal: AbortSignal, claim: SlotClaim = anonymousClaim): Promise<Slot> {
    if (signal.aborted) return Promise.reject(aborted())
    const wait = waitOf(signal, claim)
    // None queued can take an open slot (check()), so a request it is open to passes no one.
    if (isSlotOpenTo(claim.tenant)) {
      numRunning++
      return Promise.resolve(makeSlot(claim))
    }
    if (tenants.numQueued() >= queue.maxQueuedRequests && !tenants.evictForNewcomer(claim.tenant)) {
      return Promise.reject(
        new LimitError(
          'capacity_exhausted',
          `The server is busy: ${numRunning} requests running and ${tenants.numQueued()} queued; retry later.`,
          1,
        ),
      )
    }
    return queueForSlot(tenants, claim.tenant, signal, wait, () => makeSlot(claim), queue, nowMs)
  }

  return {
    acquireSlot,
    waitForRoom: room.waitForRoom,
    numQueued: tenants.numQueued,
    numRunning: () => numRunning,
    numWaitingForRoom: room.numWaiting,
    /** Queued requests by tenant (only tenants with some). */
    numQueuedByTenant: tenants.numQueuedByTenant,
    /** Each tenant's virtual token counter (weighted tokens ÷ weight). */
    serviceOf: tenants.serviceOf,
    check(): void {
      checkSlots(queue, numOpenSlots, numRunning, tenants.numQueued())
      tenants.check(numRunning)
      for (const tenant of tenants.numQueuedByTenant().keys()) {
        assert.ok(
          !isSlotOpenTo(tenant),
          `tenant ${tenant} has requests queued while a slot is open to it: ${numRunning} of ${queue.maxConcurrentRequests} run, ${numOpenSlots} open to all, ${tenant} runs ${tenants.isRunning(tenant) ? 'some' : 'none'}`,
        )
      }
      room.check()
    },
  }
}

/** Queues a request (its `wait`) in `tenant`'s backlog until it is granted a slot (`makeSlot`
 *  makes it), its wait reaches `maxQueueWaitMs` (503 `capacity_exhausted`) or `signal` aborts. */
function queueForSlot(
  tenants: ReturnType<typeof createTenantBacklogs>,
  tenant: string,
  signal: AbortSignal,
  wait: RequestWait,
  makeSlot: () => Slot,
  queue: QueueLimits,
  nowMs: () => number,
): Promise<Slot> {
  return new Promise<Slot>((resolve, reject) => {
    const leave = () => {
      clearTimeout(timer)
      signal.removeEventListener('abort', onAbort)
      tenants.dequeue(tenant, request)
    }
    const request: QueuedRequest = {
      seq: wait.seq,
      grant() {
        leave()
        resolve(makeSlot())
      },
      refuse(err) {
        leave()
        reject(err)
      },
    }
    const onAbort = () => request.refuse(aborted())
    const timer = setTimeout(
      () =>
        request.refuse(
          new LimitError(
            'capacity_exhausted',
            `The server is busy: the request waited ${queue.maxQueueWaitMs} ms in the queue; retry later.`,
            1,
          ),
        ),
      Math.max(0, wait.deadlineMs - nowMs()),
    )
    signal.addEventListener('abort', onAbort, { once: true })
    tenants.enqueue(tenant, request)
  })
}

/** Asserts the slots' invariants: `numRunning` within its bound, `numQueued` within its, and
 *  none queued while a slot open to every tenant (the first `numOpenSlots`) is free. */
function checkSlots(
  queue: QueueLimits,
  numOpenSlots: number,
  numRunning: number,
  numQueued: number,
): void {
  assert.ok(
    numRunning >= 0 && numRunning <= queue.maxConcurrentRequests,
    `running ${numRunning} outside [0, ${queue.maxConcurrentRequests}]`,
  )
  assert.ok(
    numQueued <= queue.maxQueuedRequests,
    `queued ${numQueued} > ${queue.maxQueuedRequests}`,
  )
  assert.ok(
    numOpenSlots >= 1 && numOpenSlots <= queue.maxConcurrentRequests,
    `${numOpenSlots} slots open to all, outside [1, ${queue.maxConcurrentRequests}]`,
  )
  assert.ok(
    numQueued === 0 || numRunning >= numOpenSlots,
    `${numQueued} requests queued while only ${numRunning} of ${queue.maxConcurrentRequests} slots run (${numOpenSlots} open to all)`,
  )
}

/** The tenant of `queues` (tenant → its waiting items, oldest first, never empty) with the least
 *  service (`counterOf`: tenant → counter) among those `isEligible` admits (default all), or
 *  undefined when none. Ties (a tenant just lifted to another's counter) go to the tenant with
 *  fewer requests running (`runningOf`), then to the earlier arrival at the head. */
function leastServedOf(
  queues: ReadonlyMap<string, readonly { seq: number }[]>,
  counterOf: (tenant: string) => number,
  runningOf: ReadonlyMap<string, number>,
  isEligible: (tenant: string) => boolean = () => true,
): string | undefined {
  let best: { tenant: string; counter: number; numRunning: number; seq: number } | undefined
  for (const [tenant, items] of queues) {
    if (!isEligible(tenant)) continue
    const counter = counterOf(tenant)
    const numRunningOfTenant = runningOf.get(tenant) ?? 0
    const { seq } = items[0]
    const isBetter =
      best === undefined ||
      counter < best.counter ||
      (counter === best.counter &&
        (numRunningOfTenant < best.numRunning ||
          (numRunningOfTenant === best.numRunning && seq < best.seq)))
    if (isBetter) best = { tenant, counter, numRunning: numRunningOfTenant, seq }
  }
  return best?.tenant
}

/** The tenants' queues, and their virtual token counters kept in `service` (see the module's
 *  header). */
function createTenantBacklogs(service: ServiceCounters) {
  const backlogs = new Map<string, QueuedRequest[]>() // tenant → its queued requests, oldest first; never empty
  const runningOf = new Map<string, number>() // tenant → its requests holding a slot (> 0)
  let lastLeftService = 0 // counter of the last tenant whose backlog emptied (VTC's lift with none backlogged)
  let numQueued = 0

  function charge(tenant: string, weight: number, numWeightedTokens: number): void {
    service.add(tenant, numWeightedTokens / weight)
  }

  /** Counts a slot of `tenant` as running (ties in {@link takeNext} favour fewer). */
  function startRunning(tenant: string): void {
    runningOf.set(tenant, (runningOf.get(tenant) ?? 0) + 1)
  }

  function stopRunning(tenant: string): void {
    const n = runningOf.get(tenant)! - 1
    if (n === 0) runningOf.delete(tenant)
    else runningOf.set(tenant, n)
  }

  function leastServed(
    queues: ReadonlyMap<string, readonly { seq: number }[]>,
    isEligible?: (tenant: string) => boolean,
  ) {
    return leastServedOf(queues, service.counterOf, runningOf, isEligible)
  }

  /** Removes and returns the first request of the backlogged tenant with the least service
   *  among those `isEligible` admits (default all; {@link leastServedOf}), or undefined when none
   *  waits. */
  function takeNext(isEligible?: (tenant: string) => boolean): QueuedRequest | undefined {
    const tenant = leastServed(backlogs, isEligible)
    if (tenant === undefined) return undefined
    const head = backlogs.get(tenant)![0]
    dequeue(tenant, head)
    return head
  }

  /** VTC's lift of a tenant joining a backlog: its counter rises to the least counter of
   *  `others` (the tenants already backlogged), or with none to that of the last tenant to leave
   *  a backlog, so that idling banks no credit. */
  function lift(tenant: string, others: Iterable<string>): void {
    let floor = Infinity
    for (const other of others) floor = Math.min(floor, service.counterOf(other))
    if (floor === Infinity) floor = lastLeftService
    service.raiseTo(tenant, floor)
  }

  /** Notes that `tenant` left a backlog (the floor of the next lift with none backlogged). */
  function noteLeft(tenant: string): void {
    lastLeftService = service.counterOf(tenant)
  }

  /** Takes `request` out of `tenant`'s backlog (no-op if it is not there). */
  function dequeue(tenant: string, request: QueuedRequest): void {
    const requests = backlogs.get(tenant)
    const i = requests?.indexOf(request) ?? -1
    if (requests === undefined || i === -1) return
    requests.splice(i, 1)
    numQueued--
    if (requests.length === 0) {
      backlogs.delete(tenant)
      noteLeft(tenant)
    }
  }

  /** Adds `request` to `tenant`'s backlog, lifting the counter of a newly backlogged tenant. */
  function enqueue(tenant: string, request: QueuedRequest): void {
    let requests = backlogs.get(tenant)
    if (requests === undefined) {
      lift(tenant, backlogs.keys())
      requests = []
      backlogs.set(tenant, requests)
    }
    requests.push(request)
    numQueued++
  }

  /** Makes room in a full queue for a request of `tenant` by refusing the newest request of the
   *  tenant with the most queued, when it has more than `tenant`; false when none has. */
  function evictForNewcomer(tenant: string): boolean {
    const numOwn = backlogs.get(tenant)?.length ?? 0
    let longest: [string, QueuedRequest[]] | undefined
    for (const entry of backlogs) {
      if (longest === undefined || entry[1].length > longest[1].length) longest = entry
    }
    if (longest === undefined || longest[1].length <= numOwn) return false
    const [victimTenant, requests] = longest
    const victim = requests[requests.length - 1]
    const numVictimQueued = requests.length
    dequeue(victimTenant, victim)
    victim.refuse(longestBacklogRefusal(numVictimQueued))
    return true
  }

  return {
    charge,
    startRunning,
    stopRunning,
    /** Whether `tenant` has a request holding a slot. */
    isRunning: (tenant: string): boolean => runningOf.has(tenant),
    takeNext,
    leastServed,
    lift,
    noteLeft,
    dequeue,
    enqueue,
    evictForNewcomer,
    numQueued: () => numQueued,
    numQueuedByTenant: (): Map<string, number> =>
      new Map([...backlogs].map(([tenant, requests]) => [tenant, requests.length])),
    serviceOf: service.counterOf,
    /** Asserts the backlogs' invariants; `numRunning` is the slots running. */
    check(numRunning: number): void {
      checkBacklogs(backlogs, runningOf, numQueued, numRunning)
    },
  }
}

/** Asserts that `backlogs` hold `numQueued` requests, none empty, and `runningOf` `numRunning`. */
function checkBacklogs(
  backlogs: ReadonlyMap<string, readonly QueuedRequest[]>,
  runningOf: ReadonlyMap<string, number>,
  numQueued: number,
  numRunning: number,
): void {
  let numInBacklogs = 0
  for (const [tenant, requests] of backlogs) {
    assert.ok(requests.length > 0, `tenant ${tenant} has an empty backlog`)
    numInBacklogs += requests.length
  }
  assert.equal(numInBacklogs, numQueued, `backlogs hold ${numInBacklogs}, counted ${numQueued}`)
  let numRunningOfTenants = 0
  for (const n of runningOf.values()) numRunningOfTenants += n
  assert.equal(
    numRunningOfTenants,
    numRunning,
    `tenants hold ${numRunningOfTenants} slots, ${numRunning} run`,
  )
}

/** The waiters for KV room, one list per tenant by arrival, and each tenant's backlog of waits
 *  for room (its waiters and its woken requests still trying); `tenants` holds the counters that
 *  pick the next waiter and lifts a tenant new to the backlog. */
function createRoomWaiters(tenants: ReturnType<typeof createTenantBacklogs>) {
  const waiters = new Map<string, RoomWaiter[]>() // tenant → its waiters by seq; never empty
  const backlogOf = new Map<string, number>() // tenant → its requests waiting for room or trying (> 0)
  let numWaiters = 0

  return {
    numWaiters: () => numWaiters,
    /** Puts `wait` in its tenant's backlog of waits for room (lifting a tenant new to it). */
    joinBacklog(wait: RequestWait): void {
      if (wait.isWaitingForRoom) return
      wait.isWaitingForRoom = true
      const { tenant } = wait.claim
      const n = backlogOf.get(tenant) ?? 0
      if (n === 0) tenants.lift(tenant, backlogOf.keys())
      backlogOf.set(tenant, n + 1)
    },
    /** Takes `wait` out of its tenant's backlog (no-op if it is not in it). */
    leaveBacklog(wait: RequestWait): void {
      if (!wait.isWaitingForRoom) return
      wait.isWaitingForRoom = false
      const { tenant } = wait.claim
      const n = backlogOf.get(tenant)! - 1
      if (n > 0) return void backlogOf.set(tenant, n)
      backlogOf.delete(tenant)
      tenants.noteLeft(tenant)
    },
    /** The first waiter of the waiting tenant with the least service, left in place. */
    next(): RoomWaiter | undefined {
      const tenant = tenants.leastServed(waiters)
      return tenant === undefined ? undefined : waiters.get(tenant)![0]
    },
    add(waiter: RoomWaiter): void {
      let list = waiters.get(waiter.tenant)
      if (list === undefined) waiters.set(waiter.tenant, (list = []))
      let at = list.length // a retry keeps its place: by seq, not by the time it came back
      while (at > 0 && list[at - 1].seq > waiter.seq) at--
      list.splice(at, 0, waiter)
      numWaiters++
    },
    remove(waiter: RoomWaiter): void {
      const list = waiters.get(waiter.tenant)
      const i = list?.indexOf(waiter) ?? -1
      if (i === -1) return
      list!.splice(i, 1)
      numWaiters--
      if (list!.length === 0) waiters.delete(waiter.tenant)
    },
    check(): void {
      let n = 0
      for (const [tenant, list] of waiters) {
        assert.ok(list.length > 0, `tenant ${tenant} has an empty queue of room waiters`)
        assert.ok((backlogOf.get(tenant) ?? 0) >= list.length, `${tenant}'s room backlog short`)
        for (let i = 1; i < list.length; i++) {
          assert.ok(list[i - 1].seq < list[i].seq, 'room waiters of a tenant out of order')
        }
        n += list.length
      }
      assert.equal(n, numWaiters, `room queues hold ${n}, counted ${numWaiters}`)
    },
  }
}

/** Requests waiting for KV room (see the module's header); `waitOf` gives a request's place,
 *  wait bound and tenant, `tenants` the counters that pick the next waiter. */
function createRoomQueue(
  queue: QueueLimits,
  nowMs: () => number,
  waitOf: (signal: AbortSignal) => RequestWait,
  tenants: ReturnType<typeof createTenantBacklogs>,
) {
  const waiters = createRoomWaiters(tenants)
  let numWokenTrying = 0 // woken room waiters whose attempt has not ended
  let roomPoll: NodeJS.Timeout | null = null
  const pollMs = queue.roomPollMs ?? roomPollMs

  function wakeNextRoomWaiter(): void {
    waiters.next()?.wake()
  }

  /** Keeps one poll timer while requests wait for room; it wakes one of them only when no
   *  woken request is trying (that one's end wakes the next). */
  function armRoomPoll(): void {
    if (roomPoll !== null || waiters.numWaiters() === 0) return
    roomPoll = setTimeout(() => {
      roomPoll = null
      if (numWokenTrying === 0) wakeNextRoomWaiter()
      armRoomPoll()
    }, pollMs)
    roomPoll.unref()
  }

  /** A turn that, once its attempt ends with room found, takes `wait` out of the backlog and
   *  wakes the next room waiter; refused, the request stays backlogged for its next wait. */
  function wokenTurn(wait: RequestWait): RoomTurn {
    numWokenTrying++
    let isEnded = false
    return {
      end(isRefused: boolean): void {
        if (isEnded) return
        isEnded = true
        numWokenTrying--
        if (isRefused) return
        waiters.leaveBacklog(wait)
        if (waiters.numWaiters() > 0) wakeNextRoomWaiter()
      },
    }
  }

  function waitForRoom(signal: AbortSignal, hasFoundPoolFull: boolean): Promise<RoomTurn> {
    const wait = waitOf(signal)
    if (signal.aborted) {
      waiters.leaveBacklog(wait)
      return Promise.reject(aborted())
    }
    if (!hasFoundPoolFull && waiters.numWaiters() === 0 && numWokenTrying === 0) {
      return Promise.resolve({ end() {} }) // no one is ahead: try at once
    }
    const remainingMs = wait.deadlineMs - nowMs()
    if (remainingMs <= 0) {
      waiters.leaveBacklog(wait)
      return Promise.reject(roomTimeout(queue))
    }
    waiters.joinBacklog(wait)
    return new Promise<RoomTurn>((resolve, reject) => {
      const leave = () => {
        clearTimeout(timer)
        signal.removeEventListener('abort', onAbort)
        waiters.remove(waiter)
      }
      const waiter: RoomWaiter = {
        seq: wait.seq,
        tenant: wait.claim.tenant,
        wake() {
          leave()
          resolve(wokenTurn(wait))
        },
      }
      const giveUp = (err: KvfenceError) => {
        leave()
        waiters.leaveBacklog(wait)
        reject(err)
      }
      const onAbort = () => giveUp(aborted())
      const timer = setTimeout(() => giveUp(roomTimeout(queue)), remainingMs)
      signal.addEventListener('abort', onAbort, { once: true })
      waiters.add(waiter)
      armRoomPoll()
    })
  }

  return {
    waitForRoom,
    numWaiting: waiters.numWaiters,
    /** A running request ended: one waiter (if any) may find room now. */
    onRequestEnded(): void {
      if (waiters.numWaiters() > 0) wakeNextRoomWaiter()
    },
    check(): void {
      waiters.check()
      assert.ok(numWokenTrying >= 0, `${numWokenTrying} woken room waiters trying`)
    },
  }
}

/** The refusal of a request whose wait for KV room ran out. */
function roomTimeout(queue: QueueLimits): LimitError {
  return new LimitError(
    'capacity_exhausted',
    `The KV pool has no room for this request right now (waited ${queue.maxQueueWaitMs} ms in all); retry later.`,
    1,
  )
}

/** The refusal of a queued request whose place went to a tenant with fewer queued. */
function longestBacklogRefusal(numQueuedOfTenant: number): LimitError {
  return new LimitError(
    'capacity_exhausted',
    `The server is busy: the queue is full and your key had the most requests queued (${numQueuedOfTenant}); retry later.`,
    1,
  )
}

function aborted(): KvfenceError {
  return new KvfenceError('request_aborted', 'the client went away while the request waited')
}
