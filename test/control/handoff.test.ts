/** The P/D hand-off (src/control/handoff.ts) without any network: the two workers are scripted
 *  sides, which is what the module's transport-free interfaces are for. Each test states the
 *  exact order of steps on both sides and what the client receives, as one log. The last test
 *  runs the real in-process pair (real workers, loopback TCP) through it and compares with the
 *  single-process engine. */
import assert from 'node:assert/strict'
import { after, describe, it } from 'node:test'
import type {
  DecodeEvent,
  GenerateRequest,
  PrefillRequest,
  PrefillResult,
} from '../../src/control/messages.js'
import {
  checkCachedTokens,
  checkDone,
  checkPrefill,
  handOff,
  WorkerReportedError,
  type DecodeSide,
  type GenerationEvent,
  type HandoffOptions,
  type PrefillSide,
} from '../../src/control/handoff.js'
import { KvfenceError } from '../../src/common/errors.js'
import {
  greedyOracle,
  makeRequest,
  runRequest,
  startPair,
  tokensOf,
  type Pair,
} from '../engine/pair.js'

const rid = '0123456789abcdef0123456789abcdef'
const otherRid = 'fedcba9876543210fedcba9876543210'
const secret = 'ab'.repeat(32)

const request: GenerateRequest = {
  requestId: rid,
  tenant: 'tenant-a',
  promptTokenIds: [1, 40, 41],
  maxTokens: 4,
  sampling: { temperature: 0, topP: 1, seed: null },
  stopTokenIds: [],
  transferSecret: secret,
}

/** P's result for {@link request} when all is well: first token 7, its log-probabilities. */
const goodResult: PrefillResult = {
  requestId: rid,
  numPages: 1,
  numTokens: 3,
  firstTokenId: 7,
  firstTokenLogprobs: { logprob: -0.25, top: [{ tokenId: 7, logprob: -0.25 }] },
  cachedTokens: 0,
}

const reserved: DecodeEvent = { type: 'reserved', numPages: 1 }
const token = (tokenId: number): DecodeEvent => ({ type: 'token', tokenId })
const done = (completionTokens: number): DecodeEvent => ({
  type: 'done',
  finishReason: 'length',
  promptTokens: 3,
  completionTokens,
})

function describeEvent(e: DecodeEvent | GenerationEvent): string {
  return e.type === 'token' ? `token ${e.tokenId}` : e.type
}

/** A scripted decode worker: yields `script` one event per pull, then ends (`'end'`), throws
 *  the given error, or waits until its signal aborts and throws as a real one does (`'hang'`). */
function fakeDecode(log: string[], script: DecodeEvent[], ending: 'end' | 'hang' | KvfenceError) {
  const seen: { signal: AbortSignal | null } = { signal: null }
  const side: DecodeSide = {
    name: 'D',
    async *generate(req, signal) {
      seen.signal = signal
      signal.addEventListener('abort', () => log.push('D aborted'), { once: true })
      log.push(`D generate ${req.requestId === rid ? 'rid' : req.requestId}`)
      for (const e of script) {
        log.push(`D yields ${describeEvent(e)}`)
        yield e
      }
      if (ending === 'hang') {
        await new Promise((resolve) => signal.addEventListener('abort', resolve, { once: true }))
        throw new KvfenceError('request_aborted', 'D dropped the request')
      }
      if (ending instanceof KvfenceError) {
        log.push(`D throws ${ending.code}`)
        throw ending
      }
      log.push('D ends')
    },
    transferAddress: (event) => {
      log.push(`D address (${event.numPages} pages)`)
      return Promise.resolve({ host: '10.0.0.2', port: 7001 })
    },
  }
  return { side, seen }
}

/** A prefill worker whose result the test settles by hand. */
function fakePrefill(log: string[]) {
  const seen: { signal: AbortSignal | null; requests: PrefillRequest[] } = {
    signal: null,
    requests: [],
  }
  let settlers!: { resolve: (r: PrefillResult) => void; reject: (e: KvfenceError) => void }
  const result = new Promise<PrefillResult>((resolve, reject) => (settlers = { resolve, reject }))
  const side: PrefillSide = {
    name: 'P',
    prefill(req, signal) {
      seen.signal = signal
      seen.requests.push(req)
      signal.addEventListener('abort', () => log.push('P aborted'), { once: true })
      log.push(`P prefill → ${req.decode.host}:${req.decode.port}`)
      return result
    },
  }
  return {
    side,
    seen,
    resolve(r: PrefillResult) {
      log.push('P result')
      settlers.resolve(r)
    },
    reject(e: KvfenceError) {
      log.push(`P fails ${e.code}`)
      settlers.reject(e)
    },
  }
}

/** Reads the hand-off to its end, logging what the client receives. */
async function drain(
  events: AsyncGenerator<GenerationEvent, void>,
  log: string[],
): Promise<{ released: GenerationEvent[]; error: unknown }> {
  const released: GenerationEvent[] = []
  try {
    for await (const e of events) {
      log.push(`out ${describeEvent(e)}`)
      released.push(e)
    }
    return { released, error: null }
  } catch (error) {
    log.push('out error')
    return { released, error }
  }
}

/** Lets every pending callback and I/O turn run (the hand-off is then waiting on a side). */
const settle = () => new Promise((resolve) => setImmediate(resolve))

function options(extra: Partial<HandoffOptions> = {}): HandoffOptions {
  return { signal: new AbortController().signal, ...extra }
}

describe('hand-off: order of steps and the first token', () => {
  it('reserves on D, prefills on P with D’s address and the secret, holds the first token until P confirms it', async () => {
    const log: string[] = []
    const decode = fakeDecode(log, [reserved, token(7), token(8), done(2)], 'end')
    const prefill = fakePrefill(log)
    const run = drain(handOff(request, decode.side, prefill.side, options()), log)
    await settle()
    // D's first token has arrived; nothing has left, because P has not answered yet.
    assert.deepEqual(log, [
      'D generate rid',
      'D yields reserved',
      'D address (1 pages)',
      'P prefill → 10.0.0.2:7001',
      'D yields token 7',
    ])
    assert.deepEqual(prefill.seen.requests, [
      {
        requestId: rid,
        tenant: 'tenant-a',
        promptTokenIds: [1, 40, 41],
        sampling: { temperature: 0, topP: 1, seed: null },
        transferSecret: secret,
        decode: { host: '10.0.0.2', port: 7001 },
      },
    ])
    prefill.resolve(goodResult)
    const { released, error } = await run
    assert.equal(error, null)
    assert.deepEqual(log.slice(5), [
      'P result',
      'out token 7',
      'D yields token 8',
      'out token 8',
      'D yields done',
      'D ends',
      'out done',
    ])
    assert.deepEqual(released, [
      { type: 'token', tokenId: 7, logprobs: goodResult.firstTokenLogprobs },
      { type: 'token', tokenId: 8 },
      {
        type: 'done',
        finishReason: 'length',
        promptTokens: 3,
        completionTokens: 2,
        cachedTokens: 0,
        numTransferredPages: 1,
      },
    ])
    assert.equal(decode.seen.signal, prefill.seen.signal, 'one signal for both sides')
    assert.equal(decode.seen.signal?.aborted, false, 'a finished request aborts nobody')
  })
})

describe('hand-off: P’s result must confirm D’s first token (checkPrefill)', () => {
  const cases: { what: string; result: PrefillResult; problem: string }[] = [
    {
      what: 'another request',
      result: { ...goodResult, requestId: otherRid },
      problem: `prefill answered for request ${otherRid}`,
    },
    {
      what: 'another first token',
      result: { ...goodResult, firstTokenId: 9 },
      problem: 'first token 7 from decode, 9 from prefill',
    },
    {
      what: 'another prompt length (a placeholder)',
      result: { ...goodResult, numTokens: 1 },
      problem: 'prefill sent 1 prompt tokens, want 3',
    },
  ]
  for (const { what, result, problem } of cases) {
    it(`P’s result naming ${what}: guard_violation, both sides aborted, no token released`, async () => {
      const log: string[] = []
      const decode = fakeDecode(log, [reserved, token(7), token(8), done(2)], 'end')
      const prefill = fakePrefill(log)
      const run = drain(handOff(request, decode.side, prefill.side, options()), log)
      await settle()
      prefill.resolve(result)
      const { released, error } = await run
      assert.deepEqual(released, [])
      assert.ok(error instanceof KvfenceError)
      assert.equal(error.code, 'guard_violation')
      assert.equal(error.message, `request ${rid} (prefill P, decode D): ${problem}`)
      assert.deepEqual(log.slice(4), [
        'D yields token 7',
        'P result',
        'D aborted',
        'P aborted',
        'out error',
      ])
    })
  }

  it('with guards off (the incident’s configuration), the mismatching token is released', async () => {
    const log: string[] = []
    const decode = fakeDecode(log, [reserved, token(7), done(1)], 'end')
    const prefill = fakePrefill(log)
    const run = drain(
      handOff(request, decode.side, prefill.side, options({ guardsEnabled: false })),
      log,
    )
    await settle()
    prefill.resolve({ ...goodResult, requestId: otherRid, firstTokenId: 9 })
    const { released, error } = await run
    assert.equal(error, null)
    assert.deepEqual(
      released.map((e) => describeEvent(e)),
      ['token 7', 'done'],
    )
  })
})

describe('hand-off: D failing after P succeeded ends the request on both sides', () => {
  it('D reporting an error after P succeeded: the error, after the tokens already released', async () => {
    const log: string[] = []
    const failure: DecodeEvent = {
      type: 'error',
      code: 'guard_violation',
      message: 'G5: read of page 3 by owner 12, but it belongs to owner 9',
    }
    const decode = fakeDecode(log, [reserved, token(7), token(8), failure], 'end')
    const prefill = fakePrefill(log)
    const run = drain(handOff(request, decode.side, prefill.side, options()), log)
    await settle()
    prefill.resolve(goodResult)
    const { released, error } = await run
    assert.deepEqual(
      released.map((e) => describeEvent(e)),
      ['token 7', 'token 8'],
    )
    assert.ok(error instanceof WorkerReportedError)
    assert.equal(error.code, 'guard_violation')
    assert.equal(
      error.message,
      'decode worker D: guard_violation: G5: read of page 3 by owner 12, but it belongs to owner 9',
    )
    assert.deepEqual(log.slice(5), [
      'P result',
      'out token 7',
      'D yields token 8',
      'out token 8',
      'D yields error',
      'D aborted',
      'P aborted',
      'out error',
    ])
  })

  it('D throwing after P succeeded: D’s own error, and both sides aborted', async () => {
    const log: string[] = []
    const dropped = new KvfenceError('transfer_failed', 'D lost the connection')
    const decode = fakeDecode(log, [reserved, token(7)], dropped)
    const prefill = fakePrefill(log)
    const run = drain(handOff(request, decode.side, prefill.side, options()), log)
    await settle()
    prefill.resolve(goodResult)
    const { released, error } = await run
    assert.deepEqual(
      released.map((e) => describeEvent(e)),
      ['token 7'],
    )
    assert.equal(error, dropped)
    assert.deepEqual(log.slice(5), [
      'P result',
      'out token 7',
      'D throws transfer_failed',
      'D aborted',
      'P aborted',
      'out error',
    ])
  })
})

describe('hand-off: P failing, the client’s abort, leaving early or D’s silence abort both sides', () => {
  it('P failing while D waits for the KV: P’s error, D aborted, nothing released', async () => {
    const log: string[] = []
    const decode = fakeDecode(log, [reserved], 'hang')
    const prefill = fakePrefill(log)
    const run = drain(handOff(request, decode.side, prefill.side, options()), log)
    await settle()
    const refused = new KvfenceError('context_length_exceeded', 'P: prompt over its pool')
    prefill.reject(refused)
    const { released, error } = await run
    assert.deepEqual(released, [])
    assert.equal(error, refused, 'P’s error wins over the abort D reports next')
    assert.deepEqual(log, [
      'D generate rid',
      'D yields reserved',
      'D address (1 pages)',
      'P prefill → 10.0.0.2:7001',
      'P fails context_length_exceeded',
      'D aborted',
      'P aborted',
      'out error',
    ])
  })

  it('the client’s abort: request_aborted, both sides aborted, nothing released', async () => {
    const log: string[] = []
    const decode = fakeDecode(log, [reserved], 'hang')
    const prefill = fakePrefill(log)
    const client = new AbortController()
    const run = drain(
      handOff(request, decode.side, prefill.side, options({ signal: client.signal })),
      log,
    )
    await settle()
    client.abort()
    const { released, error } = await run
    assert.deepEqual(released, [])
    assert.ok(error instanceof KvfenceError)
    assert.equal(error.code, 'request_aborted')
    assert.equal(error.message, `request ${rid} was aborted by the client`)
    assert.deepEqual(log, [
      'D generate rid',
      'D yields reserved',
      'D address (1 pages)',
      'P prefill → 10.0.0.2:7001',
      'D aborted',
      'P aborted',
      'out error',
    ])
  })

  it('leaving the iteration after the first token aborts both sides', async () => {
    const log: string[] = []
    const decode = fakeDecode(log, [reserved, token(7), token(8), done(2)], 'end')
    const prefill = fakePrefill(log)
    prefill.resolve(goodResult)
    for await (const e of handOff(request, decode.side, prefill.side, options())) {
      log.push(`out ${describeEvent(e)}`)
      break
    }
    assert.deepEqual(log, [
      'P result',
      'D generate rid',
      'D yields reserved',
      'D address (1 pages)',
      'P prefill → 10.0.0.2:7001',
      'D yields token 7',
      'out token 7',
      'D aborted',
      'P aborted',
    ])
  })

  it('D silent past idleTimeoutMs: worker_unavailable naming D, both sides aborted', async () => {
    const log: string[] = []
    const decode = fakeDecode(log, [reserved], 'hang')
    const prefill = fakePrefill(log)
    const { released, error } = await drain(
      handOff(request, decode.side, prefill.side, options({ idleTimeoutMs: 20 })),
      log,
    )
    assert.deepEqual(released, [])
    assert.ok(error instanceof KvfenceError)
    assert.equal(error.code, 'worker_unavailable')
    assert.equal(error.message, `decode worker D sent nothing for 20 ms (request ${rid})`)
    assert.deepEqual(log.slice(-3), ['D aborted', 'P aborted', 'out error'])
  })
})

describe('hand-off: the end must be consistent (checkDone)', () => {
  it('D counting more completion tokens than it streamed: guard_violation after the tokens', async () => {
    const log: string[] = []
    const decode = fakeDecode(log, [reserved, token(7), token(8), done(3)], 'end')
    const prefill = fakePrefill(log)
    prefill.resolve(goodResult)
    const { released, error } = await drain(
      handOff(request, decode.side, prefill.side, options()),
      log,
    )
    assert.deepEqual(
      released.map((e) => describeEvent(e)),
      ['token 7', 'token 8'],
    )
    assert.ok(error instanceof KvfenceError)
    assert.equal(error.code, 'guard_violation')
    assert.equal(
      error.message,
      `request ${rid} (decode D): decode counted 3 completion tokens, streamed 2`,
    )
    assert.deepEqual(log.slice(-4), ['D ends', 'D aborted', 'P aborted', 'out error'])
  })

  it('D ending without done: worker_unavailable, no done released', async () => {
    const log: string[] = []
    const decode = fakeDecode(log, [reserved, token(7)], 'end')
    const prefill = fakePrefill(log)
    prefill.resolve(goodResult)
    const { released, error } = await drain(
      handOff(request, decode.side, prefill.side, options()),
      log,
    )
    assert.deepEqual(
      released.map((e) => describeEvent(e)),
      ['token 7'],
    )
    assert.ok(error instanceof KvfenceError)
    assert.equal(error.code, 'worker_unavailable')
    assert.equal(error.message, `decode worker D ended request ${rid} without a done event`)
  })
})

describe('hand-off checks as pure functions', () => {
  it('checkPrefill names every mismatch at once', () => {
    assert.throws(
      () =>
        checkPrefill(
          { ...goodResult, requestId: otherRid, numTokens: 1, firstTokenId: 9 },
          7,
          request,
          'P',
          'D',
        ),
      {
        name: 'KvfenceError',
        code: 'guard_violation',
        message: `request ${rid} (prefill P, decode D): prefill answered for request ${otherRid}; prefill sent 1 prompt tokens, want 3; first token 7 from decode, 9 from prefill`,
      },
    )
    checkPrefill(goodResult, 7, request, 'P', 'D')
  })

  it('checkDone names both counts', () => {
    assert.throws(
      () =>
        checkDone(
          { type: 'done', finishReason: 'stop', promptTokens: 1, completionTokens: 4 },
          2,
          request,
          'D',
        ),
      {
        code: 'guard_violation',
        message: `request ${rid} (decode D): decode counted 1 prompt tokens, want 3; decode counted 4 completion tokens, streamed 2`,
      },
    )
    checkDone(
      { type: 'done', finishReason: 'stop', promptTokens: 3, completionTokens: 2 },
      2,
      request,
      'D',
    )
  })

  it('checkCachedTokens: a cache count covering the whole prompt is refused', () => {
    assert.throws(() => checkCachedTokens(3, 3, rid, 'P'), {
      code: 'internal_error',
      message: `decode worker P sent cachedTokens 3 outside [0, 3) for request ${rid}`,
    })
    checkCachedTokens(2, 3, rid, 'P')
    checkCachedTokens(undefined, 3, rid, 'P')
  })
})

describe('hand-off on the real in-process pair', { timeout: 20_000 }, () => {
  let pair: Pair | undefined
  after(async () => {
    await pair?.close()
  })

  it('releases exactly the single-process engine’s tokens, then done with P’s page count', async () => {
    pair = await startPair()
    // 70 tokens: 5 pages of 16.
    const prompt = tokensOf('the river walks near the stone garden and Qx7vR2mK9pLt4Wz8 holds it!!')
    const out = await runRequest(pair, makeRequest('tenant-a', prompt, 12))
    assert.equal(out.error, null)
    const want = greedyOracle(prompt, 12)
    assert.deepEqual(
      out.released.flatMap((e) => (e.type === 'token' ? [e.tokenId] : [])),
      want,
    )
    assert.deepEqual(out.released.at(-1), {
      type: 'done',
      finishReason: 'length',
      promptTokens: 70,
      completionTokens: 12,
      cachedTokens: 0,
      numTransferredPages: 5,
    })
  })
})
