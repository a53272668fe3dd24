/** A man-in-the-middle on the data plane, as a real process between a real prefill worker and a
 *  real decode worker (in process here, over loopback TCP, guards on): it records tenant A's
 *  transfer, then tampers with tenant B's (duplicate, replay, splice, race: see
 *  middlebox-process.ts). For each attack D never completes the tampered transfer, D refuses it
 *  for the expected reason, and tenant B's answer holds nothing of tenant A's — in particular not
 *  A's canary, which A's own answer (the positive control) echoes. */
import assert from 'node:assert/strict'
import { fork, type ChildProcess } from 'node:child_process'
import { once } from 'node:events'
import { fileURLToPath } from 'node:url'
import { after, before, describe, it } from 'node:test'
import { KvfenceError } from '../../src/common/errors.js'
import type { GenerateRequest } from '../../src/control/messages.js'
import { greedyOracle, makeRequest, startPair, tokensOf, until, type Pair } from '../engine/pair.js'
import type { MiddleboxBegin, MiddleboxReply } from './middlebox-process.js'

// The echo model answers "the code is …. again: the code is " with the code it was shown.
const canaryA = 'Qx7vR2mK9pLt4Wz8'
const promptOf = (code: string): number[] => tokensOf(`the code is ${code}. again: the code is `)
const maxTokens = 24

/** The echo model's token ids as text (the inverse of tokensOf, without BOS). */
function textOf(tokenIds: number[]): string {
  return String.fromCharCode(...tokenIds.map((t) => t - 5 + 32))
}

/** Whether `text` holds 8 or more consecutive characters of `canary` (the auditor's rule). */
function holdsFragmentOf(text: string, canary: string): boolean {
  for (let i = 0; i + 8 <= canary.length; i++)
    if (text.includes(canary.slice(i, i + 8))) return true
  return false
}

interface Run {
  tokenIds: number[]
  decodeError: KvfenceError | null
  prefillError: KvfenceError | null | undefined
}

/** Run `req` as the router does (D reserves, then P prefills), P sending to `port`. A failed
 *  prefill aborts the decode request, as the router does, unless `isAbortOnPrefillFailure` is
 *  false (a router slow to abort: then D's own checks alone end the request). */
async function run(
  pair: Pair,
  req: GenerateRequest,
  port: number,
  isAbortOnPrefillFailure = true,
): Promise<Run> {
  const tokenIds: number[] = []
  const routerAbort = new AbortController()
  let prefilled: Promise<KvfenceError | null> | undefined
  const asError = (err: unknown): KvfenceError => {
    if (err instanceof KvfenceError) return err
    throw err
  }
  const decodeError = await pair.decode
    .generate(req, routerAbort.signal, (e) => {
      if (e.type === 'token') tokenIds.push(e.tokenId)
      if (e.type !== 'reserved') return
      prefilled = pair.prefill
        .prefill(
          {
            requestId: req.requestId,
            tenant: req.tenant,
            promptTokenIds: req.promptTokenIds,
            sampling: req.sampling,
            transferSecret: req.transferSecret,
            decode: { host: '127.0.0.1', port },
          },
          new AbortController().signal,
        )
        .then(
          () => null,
          (err: unknown) => {
            if (isAbortOnPrefillFailure) routerAbort.abort()
            return asError(err)
          },
        )
    })
    .then(() => null, asError)
  return { tokenIds, decodeError, prefillError: prefilled && (await prefilled) }
}

describe(
  'a middlebox between P and D cannot splice one tenant’s pages into another’s answer',
  {
    timeout: 60_000,
  },
  () => {
    let pair: Pair
    let middlebox: ChildProcess
    let port = 0
    const replies: MiddleboxReply[] = []
    /** Transfer id of each request's BEGIN, as the middlebox saw it on the wire. */
    const transferOf = new Map<string, string>()
    /** D's own log of refusals: transfer id and reason. */
    const refusals: { transferId: string; reason: unknown }[] = []

    before(async () => {
      pair = await startPair({
        receiver: {
          log: { warn: (f) => void refusals.push(f as { transferId: string; reason: unknown }) },
        },
      })
      const script = fileURLToPath(new URL('./middlebox-process.js', import.meta.url))
      middlebox = fork(script, ['--kvfence-middlebox', String(pair.port)], { stdio: 'inherit' })
      middlebox.on(
        'message',
        (m: MiddleboxReply | MiddleboxBegin | { type: 'listening'; port: number }) => {
          if (m.type === 'listening') port = m.port
          else if (m.type === 'begin') transferOf.set(m.requestId, m.transferId)
          else replies.push(m)
        },
      )
      await until(() => port !== 0)
      // The earlier request, relayed untouched and recorded: tenant A's, with its canary.
      const a = await run(pair, makeRequest('tenant-a', promptOf(canaryA), maxTokens), port)
      assert.equal(a.decodeError, null)
      assert.equal(a.prefillError, null)
      assert.deepEqual(a.tokenIds, greedyOracle(promptOf(canaryA), maxTokens))
      assert.ok(holdsFragmentOf(textOf(a.tokenIds), canaryA), 'positive control: A sees its canary')
    })

    after(async () => {
      middlebox?.disconnect()
      if (middlebox && middlebox.exitCode === null) await once(middlebox, 'exit')
      await pair?.close()
    })

    async function attack(
      mode: string,
      isAbortOnPrefillFailure = true,
    ): Promise<{ req: GenerateRequest; out: Run; tid: string }> {
      middlebox.send({ type: 'mode', mode })
      const numCompletedBefore = pair.receiver.stats.numCompleted
      // Tenant B's prompt has A's shape (same token count), so that A's pages fit B's reservation.
      const req = makeRequest('tenant-b', promptOf('Ba9cD3eF6gH1jK4m'), maxTokens)
      const out = await run(pair, req, port, isAbortOnPrefillFailure)
      await until(() => pair.d.pool.numUsed === 0 && pair.p.pool.numUsed === 0)
      pair.d.pool.check()
      // Nothing of A reached B, whatever else happened.
      assert.equal(holdsFragmentOf(textOf(out.tokenIds), canaryA), false, textOf(out.tokenIds))
      await until(() => transferOf.has(req.requestId))
      const tid = transferOf.get(req.requestId)!
      if (mode !== 'duplicate') {
        assert.ok(out.decodeError, 'B decoded a tampered transfer')
        assert.equal(out.decodeError.code, 'transfer_failed')
        assert.deepEqual(out.tokenIds, [])
        assert.equal(pair.receiver.stats.numCompleted, numCompletedBefore, 'D completed it')
      } else {
        assert.equal(pair.receiver.stats.numCompleted, numCompletedBefore + 1)
      }
      middlebox.send({ type: 'mode', mode: 'pass' })
      return { req, out, tid }
    }

    const reasonsOf = (link: 'relay' | 'own', tid: string): string[] =>
      replies
        .filter((r) => r.link === link && r.transferId === tid)
        .map((r) => (r.kind === 'ack' ? 'ack' : r.message.split(':')[0]))

    it('duplicate: the transfer completes once; its frames sent again are refused on either connection', async () => {
      const { out, tid } = await attack('duplicate')
      assert.equal(out.decodeError, null)
      assert.equal(out.prefillError, null)
      assert.deepEqual(out.tokenIds, greedyOracle(promptOf('Ba9cD3eF6gH1jK4m'), maxTokens))
      await until(() => reasonsOf('own', tid).length === 1 && reasonsOf('relay', tid).length === 2)
      // Same connection: the transfer id was seen; another connection: the request is no longer
      // waiting for a transfer (D forgot its secret once the transfer completed).
      assert.deepEqual(reasonsOf('relay', tid), ['ack', 'duplicate_transfer'])
      assert.deepEqual(reasonsOf('own', tid), ['unknown_request'])
    })

    it('replay: an earlier request’s recorded PAGES and END under the new BEGIN are refused (bad_end_mac)', async () => {
      const { out, tid } = await attack('replay')
      await until(() => reasonsOf('relay', tid).length === 1)
      assert.deepEqual(reasonsOf('relay', tid), ['bad_end_mac'])
      assert.ok(out.prefillError, 'P saw the NACK')
      assert.match(out.prefillError.message, /^bad_end_mac: /)
      assert.ok(refusals.some((r) => r.transferId === tid && r.reason === 'bad_end_mac'))
    })

    it('splice: a genuine BEGIN with an earlier request’s pages and END, P answered by the middlebox, is refused (bad_end_mac)', async () => {
      const { out, tid } = await attack('splice')
      // P was told its transfer succeeded (the middlebox ACKed it); D never saw P's frames, and
      // refused what the middlebox sent it.
      assert.equal(out.prefillError, null)
      assert.deepEqual(reasonsOf('relay', tid), [])
      await until(() => reasonsOf('own', tid).length === 1)
      assert.deepEqual(reasonsOf('own', tid), ['bad_end_mac'])
      assert.ok(refusals.some((r) => r.transferId === tid && r.reason === 'bad_end_mac'))
    })

    it('race: the BEGIN seen on the wire sent first on a second connection with altered pages is refused, and so is the genuine one', async () => {
      // The router's abort after P's failure would also end the copy; hold it back so that the
      // copy reaches its END and D's own check is what refuses it.
      const { out, tid } = await attack('race', false)
      await until(() => reasonsOf('own', tid).length === 1)
      // The genuine BEGIN lost the race: the request already had a transfer open (on the other
      // connection), so the decode worker's begin hook refused it.
      const genuine = replies.filter((r) => r.link === 'relay' && r.transferId === tid)
      assert.equal(genuine.length, 1)
      assert.equal(genuine[0].kind, 'nack')
      assert.match(genuine[0].message, /no reservation waiting for request/)
      // The copy, with A's pages and manifest under the MAC of P's genuine END: refused at END.
      assert.deepEqual(reasonsOf('own', tid), ['bad_end_mac'])
      assert.ok(out.prefillError)
    })
  },
)
