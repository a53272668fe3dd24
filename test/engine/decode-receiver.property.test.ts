/** Model-based property test of the decode worker's side of a transfer: the hooks the transfer
 *  receiver calls (`begin` → a reservation with `writePage` / `complete` / `abort`, with the G4, G5
 *  and G7 checks inside them), driven directly in random interleavings with the router's abort
 *  (before, during and after the transfer), connection teardown, refused pages, a second transfer
 *  for the same request, and calls outside the receiver's contract (a duplicate `complete`, a write
 *  or an `abort` after the transfer ended). Each request's prompt KV is one marker value of its
 *  own, so whose data a read sees is known.
 *
 *  After every step: the pool's invariant (`check()`) holds; no page is in two live page tables;
 *  a page is pinned exactly while its request's transfer is open; every attention read (the
 *  model's `checkRead` call) touches only pages its request owns at the epochs they were allocated
 *  with, and their prompt positions hold that request's marker; every page ever freed reads back
 *  only the poison value (NaN). At the end every request has settled as its history allows (no
 *  token without a completed transfer, nothing but request_aborted-or-earlier-failure after a
 *  router abort that came before `complete`), the pool is idle, no secret is left, and every
 *  transfer `begin` saw was counted exactly once (`kvfence_transfers_total`). */
import assert from 'node:assert/strict'
import { randomBytes } from 'node:crypto'
import { describe, it } from 'node:test'
import fc from 'fast-check'
import { KvfenceError } from '../../src/common/errors.js'
import type { DecodeEvent, GenerateRequest } from '../../src/control/messages.js'
import { DecodeWorker } from '../../src/engine/decode-worker.js'
import { buildFaultConfig } from '../../src/engine/faults.js'
import { createWorkerCore, type WorkerCore } from '../../src/engine/worker-core.js'
import { PageState, type PageRef } from '../../src/kv/pool.js'
import type { Reservation } from '../../src/transfer/index.js'
import { refusal } from '../../src/transfer/refusals.js'
import { echoModel } from './pair.js'

/** 8 pages of 4 tokens: three requests of up to 9 + 3 tokens (3 pages each) do not always fit. */
const numPages = 8
const pageSize = 4
const numRequests = 3

type Action =
  | { kind: 'start'; r: number }
  | { kind: 'begin'; r: number; variant: 'ok' | 'tenant' | 'tokens' }
  | { kind: 'write'; r: number; variant: 'next' | 'repeat' | 'beyond' }
  | { kind: 'complete'; r: number }
  | { kind: 'teardown'; r: number }
  | { kind: 'routerAbort'; r: number }
  | { kind: 'tick'; turns: number }
  /** A call on the last transfer of `r` that already ended (outside the receiver's contract). */
  | { kind: 'afterEnd'; r: number; op: 'complete' | 'write' | 'abort' }

/** One request's plan: its size, how its transfer goes, and where the disturbances fall. */
interface Plan {
  numPrompt: number
  maxTokens: number
  begin: 'ok' | 'tenant' | 'tokens'
  /** Per prompt page: a page write in order, sometimes preceded by a repeated or
   *  out-of-reservation page. */
  noise: ('none' | 'repeat' | 'beyond')[]
  /** Where the router's abort falls in the script (past its end: never). */
  abortAt: number
  /** Where the connection is torn down (past its end: never). */
  teardownAt: number
  /** A second BEGIN for the same request, at this position (past the end: none). */
  secondBeginAt: number
  /** A call after the transfer ended, outside the receiver's contract. */
  afterEnd: 'none' | 'complete' | 'write' | 'abort'
}

const planArb: fc.Arbitrary<Plan> = fc.record({
  numPrompt: fc.integer({ min: 1, max: 9 }),
  maxTokens: fc.integer({ min: 1, max: 3 }),
  begin: fc.constantFrom(
    'ok' as const,
    'ok' as const,
    'ok' as const,
    'ok' as const,
    'tenant',
    'tokens',
  ),
  noise: fc.array(
    fc.constantFrom(
      'none' as const,
      'none' as const,
      'none' as const,
      'none' as const,
      'repeat',
      'beyond',
    ),
    { minLength: 3, maxLength: 3 },
  ),
  abortAt: fc.integer({ min: 0, max: 16 }),
  teardownAt: fc.integer({ min: 0, max: 40 }),
  secondBeginAt: fc.integer({ min: 0, max: 30 }),
  afterEnd: fc.constantFrom('none' as const, 'none' as const, 'complete', 'write', 'abort'),
})

/** The actions of request `r`'s plan, in its own order. */
function scriptOf(r: number, plan: Plan): Action[] {
  const script: Action[] = [
    { kind: 'start', r },
    { kind: 'begin', r, variant: plan.begin },
  ]
  for (let ordinal = 0; ordinal < Math.ceil(plan.numPrompt / pageSize); ordinal++) {
    const noise = plan.noise[ordinal]
    if (noise !== 'none') script.push({ kind: 'write', r, variant: noise })
    script.push({ kind: 'write', r, variant: 'next' })
  }
  script.push({ kind: 'complete', r })
  if (plan.afterEnd !== 'none') script.push({ kind: 'afterEnd', r, op: plan.afterEnd })
  const insert = (at: number, a: Action) => {
    if (at <= script.length) script.splice(at, 0, a)
  }
  insert(plan.secondBeginAt, { kind: 'begin', r, variant: 'ok' })
  insert(plan.teardownAt, { kind: 'teardown', r })
  insert(plan.abortAt, { kind: 'routerAbort', r })
  return script
}

/** Interleave the scripts: each choice either lets the event loop turn (1–3 times, so decodes
 *  progress between frames) or takes the next action of one of the scripts not yet done. */
function interleave(scripts: Action[][], choices: number[]): Action[] {
  const out: Action[] = []
  const at = scripts.map(() => 0)
  let i = 0
  for (;;) {
    const open = scripts.map((_, r) => r).filter((r) => at[r] < scripts[r].length)
    if (open.length === 0) return out
    const choice = choices[i++ % choices.length]
    if (choice % 4 === 0) out.push({ kind: 'tick', turns: 1 + (choice % 3) })
    const r = open[choice % open.length]
    out.push(scripts[r][at[r]++])
  }
}

/** One transfer as the receiver would run it for the hooks. */
interface Transfer {
  readonly reservation: Reservation
  readonly numPages: number
  /** The next ordinal in order; pages 0..nextOrdinal-1 were written. */
  nextOrdinal: number
  isOpen: boolean
  /** `complete` returned (the receiver would have ACKed). */
  isCompleted: boolean
}

/** One request as the router and the harness see it. */
interface Req {
  readonly req: GenerateRequest
  /** The float its prompt KV holds on every layer, K and V. */
  readonly marker: number
  readonly controller: AbortController
  readonly events: DecodeEvent[]
  owner: number | null
  /** Settles with generate()'s error, or null once it resolved. */
  outcome: Promise<KvfenceError | null> | null
  transfers: Transfer[]
  /** The router's abort came while no transfer of this request had completed. */
  isAbortedBeforeComplete: boolean
}

/** A fresh decode worker with the shipped guards and an instrumented pool. */
function harness(): {
  core: WorkerCore
  decode: DecodeWorker
  live: Map<number, readonly PageRef[]>
  everAllocated: Set<number>
  violations: string[]
  numPromptOf: Map<number, number>
  markerOf: Map<number, number>
  allocatingFor: { marker: number; numPrompt: number } | null
} {
  const core = createWorkerCore({
    model: echoModel(),
    numPages,
    pageSize,
    faults: buildFaultConfig([], false, {}),
  })
  const decode = new DecodeWorker(core)
  const { pool } = core
  const h = {
    core,
    decode,
    live: new Map<number, readonly PageRef[]>(),
    everAllocated: new Set<number>(),
    violations: [] as string[],
    numPromptOf: new Map<number, number>(),
    markerOf: new Map<number, number>(),
    allocatingFor: null as { marker: number; numPrompt: number } | null,
  }
  const allocate = pool.allocate.bind(pool)
  pool.allocate = (n, owner, tenant) => {
    const lease = allocate(n, owner, tenant)
    assert.ok(h.allocatingFor, 'an allocation outside generate()')
    h.live.set(owner, lease.pages)
    h.numPromptOf.set(owner, h.allocatingFor.numPrompt)
    h.markerOf.set(owner, h.allocatingFor.marker)
    for (const ref of lease.pages) h.everAllocated.add(ref.page)
    return lease
  }
  const release = pool.release.bind(pool)
  pool.release = (lease) => {
    release(lease)
    h.live.delete(lease.owner)
  }
  // Checked here independently of G5 (which the original call then applies as shipped).
  const checkRead = pool.checkRead.bind(pool)
  pool.checkRead = (lease, numTokens) => {
    const { owner, pages: table } = lease
    const mine = h.live.get(owner)
    const numPrompt = h.numPromptOf.get(owner) ?? 0
    const marker = h.markerOf.get(owner)
    for (let ordinal = 0; ordinal < Math.ceil(numTokens / pageSize); ordinal++) {
      const ref = table[ordinal]
      if (
        mine?.[ordinal]?.page !== ref.page ||
        mine[ordinal].epoch !== ref.epoch ||
        pool.owner[ref.page] !== owner ||
        pool.epoch[ref.page] !== ref.epoch ||
        pool.state[ref.page] === PageState.free
      )
        h.violations.push(`owner ${owner} read page ${ref.page} (ordinal ${ordinal}), not its own`)
    }
    for (let pos = 0; pos < Math.min(numTokens, numPrompt); pos++) {
      const at = pool.offsetOf(lease, pos)
      for (let layer = 0; layer < pool.shape.numLayers; layer++)
        for (const store of [pool.k[layer], pool.v[layer]])
          for (let i = at; i < at + pool.tokenStride; i++)
            if (store[i] !== marker) {
              h.violations.push(`owner ${owner} read ${store[i]} at prompt position ${pos}`)
              return checkRead(lease, numTokens)
            }
    }
    return checkRead(lease, numTokens)
  }
  return h
}

/** The invariants that hold after every step. */
function checkStep(h: ReturnType<typeof harness>, reqs: Req[]): void {
  const { pool } = h.core
  pool.check()
  assert.deepEqual(h.violations, [])
  const seen = new Map<number, number>()
  for (const [owner, table] of h.live) {
    for (const ref of table) {
      assert.equal(seen.get(ref.page), undefined, `page ${ref.page} is in two live page tables`)
      seen.set(ref.page, owner)
      assert.equal(pool.owner[ref.page], owner)
      assert.equal(pool.epoch[ref.page], ref.epoch)
    }
  }
  // Pinned ⇔ a prompt page of a request whose transfer is open (G7: pins end with the transfer).
  const shouldPin = new Set<number>()
  for (const r of reqs) {
    if (r.owner === null || !r.transfers.some((t) => t.isOpen)) continue
    const table = h.live.get(r.owner)
    assert.ok(table, 'a request with an open transfer has its pages')
    for (const ref of table.slice(0, Math.ceil(r.req.promptTokenIds.length / pageSize)))
      shouldPin.add(ref.page)
  }
  for (let page = 0; page < numPages; page++)
    assert.equal(
      pool.pins[page] > 0,
      shouldPin.has(page),
      `page ${page} pin count ${pool.pins[page]}`,
    )
  // G6: a freed page reads back only poison.
  for (const page of h.everAllocated) {
    if (pool.state[page] !== PageState.free) continue
    const start = page * pool.pageStride
    for (let layer = 0; layer < pool.shape.numLayers; layer++)
      for (const store of [pool.k[layer], pool.v[layer]])
        for (let i = start; i < start + pool.pageStride; i++)
          assert.ok(Number.isNaN(store[i]), `free page ${page} holds ${store[i]}`)
  }
}

/** A page's payload for request `r`: every float of every layer's K and V is `marker`. */
function payloadOf(core: WorkerCore, marker: number): Uint8Array {
  return new Uint8Array(new Float32Array(core.pool.pageBytes / 4).fill(marker).buffer)
}

/** The transfers D counted, completed + failed. */
async function numCounted(core: WorkerCore): Promise<number> {
  const { values } = await core.metrics.transfers.get()
  return values.reduce((n, v) => n + v.value, 0)
}

const turn = () => new Promise<void>((r) => setImmediate(r))

describe('decode worker receiver hooks under abort races (property)', () => {
  it('refuses a write and a second complete() once the transfer completed, and counts it once', async () => {
    const h = harness()
    const { core, decode } = h
    const req: GenerateRequest = {
      requestId: randomBytes(16).toString('hex'),
      tenant: 'tenant-a',
      promptTokenIds: [5, 6, 7], // one prompt page, partly filled: it stays writable while decoding
      maxTokens: 3,
      sampling: { temperature: 0, topP: 1, seed: null },
      stopTokenIds: [],
      transferSecret: randomBytes(32).toString('hex'),
    }
    const events: DecodeEvent[] = []
    h.allocatingFor = { marker: 0.5, numPrompt: 3 }
    const generating = decode.generate(req, new AbortController().signal, (e) => events.push(e))
    h.allocatingFor = null
    const transferId = randomBytes(16).toString('hex')
    const reservation = decode.receiverHooks.begin({
      transferId,
      requestId: req.requestId,
      tenant: 'tenant-a',
      numTokens: 3,
      numPages: 1,
      pageBytes: core.pool.pageBytes,
    })
    reservation.writePage(0, 3, payloadOf(core, 0.5))
    reservation.complete(5)
    const ended = { code: 'transfer_failed', message: `transfer ${transferId} has already ended` }
    assert.throws(() => reservation.writePage(0, 3, payloadOf(core, -0.5)), ended)
    assert.throws(() => reservation.complete(5), ended)
    reservation.abort(refusal('connection_closed', 'late')) // a no-op after complete()
    await generating
    assert.deepEqual(h.violations, [], 'the decode read only the KV that arrived before complete()')
    assert.equal(events.filter((e) => e.type === 'token').length, 3)
    assert.equal(await numCounted(core), 1)
    assert.equal(core.pool.numUsed, 0)
  })

  it('keep every page its owner’s, pinned exactly while transferring, poisoned once free; count each transfer once', async () => {
    await fc.assert(
      fc.asyncProperty(
        fc.array(planArb, { minLength: numRequests, maxLength: numRequests }),
        fc.array(fc.nat({ max: 1000 }), { minLength: 1, maxLength: 60 }),
        async (plans, choices) => {
          const actions = interleave(
            plans.map((plan, r) => scriptOf(r, plan)),
            choices,
          )
          const h = harness()
          const { core, decode } = h
          let numBegins = 0
          const reqs: Req[] = plans.map((s, i) => ({
            req: {
              requestId: randomBytes(16).toString('hex'),
              tenant: i === 1 ? 'tenant-b' : 'tenant-a',
              // Token ids 5.. are printable characters of the echo model.
              promptTokenIds: Array.from({ length: s.numPrompt }, (_, j) => 5 + ((i * 7 + j) % 90)),
              maxTokens: s.maxTokens,
              sampling: { temperature: 0, topP: 1, seed: null },
              stopTokenIds: [],
              transferSecret: randomBytes(32).toString('hex'),
            },
            marker: (i + 1) * 0.0625,
            controller: new AbortController(),
            events: [],
            owner: null,
            outcome: null,
            transfers: [],
            isAbortedBeforeComplete: false,
          }))
          const openOf = (r: Req) => r.transfers.find((t) => t.isOpen)
          /** As the receiver does when a hook throws or the connection goes: abort, once. */
          const endWithAbort = (t: Transfer, err: KvfenceError) => {
            t.isOpen = false
            t.reservation.abort(err)
          }

          const apply = async (a: Action): Promise<void> => {
            if (a.kind === 'tick') {
              for (let i = 0; i < a.turns; i++) await turn()
              return
            }
            const r = reqs[a.r]
            switch (a.kind) {
              case 'start': {
                if (r.outcome !== null) return
                h.allocatingFor = { marker: r.marker, numPrompt: r.req.promptTokenIds.length }
                const ownerBefore = new Set(h.live.keys())
                r.outcome = decode
                  .generate(r.req, r.controller.signal, (e) => r.events.push(e))
                  .then(
                    () => null,
                    (err: unknown) => {
                      assert.ok(err instanceof KvfenceError, String(err))
                      return err
                    },
                  )
                h.allocatingFor = null
                r.owner = [...h.live.keys()].find((o) => !ownerBefore.has(o)) ?? null
                return
              }
              case 'begin': {
                // The receiver refuses (G10) a request D does not know, without calling begin().
                if (decode.receiverHooks.secretFor(r.req.requestId) === undefined) return
                const numPrompt = r.req.promptTokenIds.length
                const n = Math.ceil(numPrompt / pageSize)
                numBegins++
                try {
                  const reservation = decode.receiverHooks.begin({
                    transferId: randomBytes(16).toString('hex'),
                    requestId: r.req.requestId,
                    tenant: a.variant === 'tenant' ? 'tenant-c' : r.req.tenant,
                    numTokens: a.variant === 'tokens' ? numPrompt + pageSize : numPrompt,
                    numPages: a.variant === 'tokens' ? n + 1 : n,
                    pageBytes: core.pool.pageBytes,
                  })
                  assert.equal(a.variant, 'ok', 'begin() accepted a transfer that does not match')
                  r.transfers.push({
                    reservation,
                    numPages: n,
                    nextOrdinal: 0,
                    isOpen: true,
                    isCompleted: false,
                  })
                } catch (err) {
                  assert.ok(err instanceof KvfenceError, String(err))
                }
                return
              }
              case 'write': {
                const t = openOf(r)
                if (t === undefined) return
                const ordinal =
                  a.variant === 'next'
                    ? t.nextOrdinal
                    : a.variant === 'repeat'
                      ? Math.max(0, t.nextOrdinal - 1)
                      : t.numPages
                if (a.variant === 'next' && ordinal >= t.numPages) return
                if (a.variant === 'repeat' && t.nextOrdinal === 0) return
                const numPrompt = r.req.promptTokenIds.length
                const tokens = Math.max(1, Math.min(pageSize, numPrompt - ordinal * pageSize))
                try {
                  t.reservation.writePage(ordinal, tokens, payloadOf(core, r.marker))
                  assert.notEqual(a.variant, 'beyond', 'a page outside the reservation was written')
                  assert.ok(
                    !r.controller.signal.aborted,
                    'a page written after the router’s abort (G8)',
                  )
                  if (a.variant === 'next') t.nextOrdinal++
                } catch (err) {
                  assert.ok(err instanceof KvfenceError, String(err))
                  endWithAbort(t, err)
                }
                return
              }
              case 'complete': {
                const t = openOf(r)
                if (t === undefined) return
                t.isOpen = false
                try {
                  t.reservation.complete(5)
                  t.isCompleted = true
                  assert.ok(
                    !r.controller.signal.aborted,
                    'a transfer completed after the router’s abort (G8)',
                  )
                  assert.equal(t.nextOrdinal, t.numPages, 'complete() accepted missing pages (G4)')
                } catch (err) {
                  assert.ok(err instanceof KvfenceError, String(err))
                  t.reservation.abort(err)
                }
                return
              }
              case 'teardown': {
                const t = openOf(r)
                if (t !== undefined)
                  endWithAbort(t, refusal('connection_closed', 'torn down by the test'))
                return
              }
              case 'routerAbort': {
                if (!r.transfers.some((t) => t.isCompleted)) r.isAbortedBeforeComplete = true
                r.controller.abort()
                return
              }
              case 'afterEnd': {
                const t = r.transfers.findLast((x) => !x.isOpen)
                if (t === undefined) return
                try {
                  if (a.op === 'complete') t.reservation.complete(5)
                  else if (a.op === 'write')
                    t.reservation.writePage(0, 1, payloadOf(core, -r.marker))
                  else t.reservation.abort(refusal('connection_closed', 'late'))
                } catch (err) {
                  assert.ok(err instanceof KvfenceError, String(err))
                }
                return
              }
            }
          }

          for (const a of actions) {
            await apply(a)
            checkStep(h, reqs)
          }
          // The connection closes and the router lets every request go.
          for (const r of reqs) {
            const t = openOf(r)
            if (t !== undefined) endWithAbort(t, refusal('connection_closed', 'end of test'))
            await apply({ kind: 'routerAbort', r: reqs.indexOf(r) })
            checkStep(h, reqs)
          }
          for (const r of reqs) {
            if (r.outcome === null) continue
            const err = await r.outcome
            const tokens = r.events.filter((e) => e.type === 'token').length
            const wasCompleted = r.transfers.some((t) => t.isCompleted)
            if (!wasCompleted || r.isAbortedBeforeComplete)
              assert.equal(tokens, 0, 'a token without a completed transfer before the abort')
            if (err === null) {
              assert.ok(wasCompleted && !r.isAbortedBeforeComplete)
              assert.equal(tokens, r.req.maxTokens)
              assert.equal(r.events.at(-1)?.type, 'done')
            }
            assert.equal(decode.receiverHooks.secretFor(r.req.requestId), undefined)
          }
          checkStep(h, reqs)
          assert.equal(core.pool.numUsed, 0, 'pages left in use')
          assert.equal(h.live.size, 0)
          assert.equal(await numCounted(core), numBegins, 'each transfer counted exactly once')
        },
      ),
      { numRuns: 200 },
    )
  })
})
