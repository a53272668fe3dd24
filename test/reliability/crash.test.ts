/** Crash recovery with real processes: `kill -9` of the decode worker, the prefill worker or the
 *  router while requests stream. In-flight requests end with an error (never a hang, never a normal
 *  finish with someone else's text), new requests get 503 while a worker is down, the pools drain,
 *  and a part restarted on the same port restores service with exactly the single-process
 *  engine's tokens. */
import assert from 'node:assert/strict'
import type { ChildProcess } from 'node:child_process'
import { after, before, describe, it } from 'node:test'
import OpenAI from 'openai'
import { findCanaries } from '../../src/audit/canaries.js'
import { Oracle } from '../../src/soak/oracle.js'
import { echoModelDir } from '../helpers/paths.js'
import {
  allocatePorts,
  client,
  eventually,
  kill9,
  makeTenants,
  pagesUsed,
  shape,
  startDecode,
  startPrefill,
  startRouterPart,
  stopAll,
  type Ports,
  type Tenant,
} from './helpers.js'

const tenants = makeTenants()
const canaryA = 'Hq3ZtW8xLm2Rv7Kp'
const canaryB = 'Ny5cJd9QsT4gBw6F'
const promptOf = (canary: string) =>
  `the river walks near ${canary} the stone garden and the light opens over the green field, ${canary} holds the market`
const oracle = new Oracle(echoModelDir, shape.decodePages, shape.pageSize)

interface Ended {
  tenant: Tenant
  text: string
  error: unknown
}

/** Start a long stream for `tenant`; `firstChunk` resolves when its first text arrives. */
function longStream(url: string, tenant: Tenant, canary: string) {
  let onFirst: () => void = () => {}
  const firstChunk = new Promise<void>((resolve) => (onFirst = resolve))
  const ended = (async (): Promise<Ended> => {
    let text = ''
    try {
      const stream = await client(url, tenant.key, 20_000).completions.create({
        model: 'echo-tiny',
        prompt: promptOf(canary),
        max_tokens: 380,
        temperature: 0,
        stream: true,
      })
      for await (const chunk of stream) {
        text += chunk.choices[0]?.text ?? ''
        onFirst()
      }
      return { tenant, text, error: null }
    } catch (error) {
      onFirst()
      return { tenant, text, error }
    }
  })()
  return { firstChunk, ended }
}

/** Six streams (three per tenant); resolves when the first text arrived, with their endings. */
async function startStreams(url: string) {
  const streams = [0, 1, 2].flatMap(() => [
    longStream(url, tenants.a, canaryA),
    longStream(url, tenants.b, canaryB),
  ])
  await Promise.race(streams.map((s) => s.firstChunk))
  return Promise.all(streams.map((s) => s.ended))
}

/** Every stream ended: normally with the oracle's exact text, or with a server error (in-stream
 *  error event or a closed connection) — never a client timeout — and no stream carried the other
 *  tenant's canary. Returns how many ended in an error. */
function checkEndings(endings: Ended[]): number {
  let numErrors = 0
  for (const e of endings) {
    const other = e.tenant === tenants.a ? canaryB : canaryA
    assert.deepEqual(findCanaries(e.text, [other]), [], `${e.tenant.name} saw the other's canary`)
    if (e.error === null) {
      const want = oracle.expected({
        endpoint: 'completion',
        prompt: promptOf(e.tenant === tenants.a ? canaryA : canaryB),
        maxTokens: 380,
      })
      assert.equal(e.text, want.text, 'a stream that finished normally must be the oracle’s text')
      continue
    }
    numErrors++
    assert.ok(e.error instanceof OpenAI.APIError, `not an API error: ${String(e.error)}`)
    assert.ok(
      !(e.error instanceof OpenAI.APIConnectionTimeoutError),
      'a request hung until the client timeout',
    )
  }
  return numErrors
}

/** A request while a part is down: a 503 (worker_unavailable) or, for the router, a refused connection. */
async function expect503(url: string, key: string): Promise<void> {
  const err = await client(url, key, 10_000)
    .completions.create({ model: 'echo-tiny', prompt: 'the river', max_tokens: 4, temperature: 0 })
    .then(
      () => null,
      (e: unknown) => e,
    )
  assert.ok(err instanceof OpenAI.APIError, `expected an error, got ${String(err)}`)
  assert.equal(err.status, 503)
  assert.equal(err.code, 'worker_unavailable')
}

/** A request after recovery is served, with exactly the single-process engine's text. */
async function expectServed(url: string, tenant: Tenant, canary: string): Promise<void> {
  const prompt = promptOf(canary)
  const res = await client(url, tenant.key).completions.create({
    model: 'echo-tiny',
    prompt,
    max_tokens: 40,
    temperature: 0,
  })
  assert.equal(
    res.choices[0].text,
    oracle.expected({ endpoint: 'completion', prompt, maxTokens: 40 }).text,
  )
}

describe('crash recovery (kill -9, restart in place)', () => {
  let ports: Ports
  let prefill: ChildProcess | undefined
  let decode: ChildProcess | undefined
  let router: ChildProcess | undefined
  const routerUrl = () => `http://127.0.0.1:${ports.router}`
  const prefillUrl = () => `http://127.0.0.1:${ports.prefill}`
  const decodeUrl = () => `http://127.0.0.1:${ports.decode}`
  const drained = () =>
    eventually(async () => (await pagesUsed(prefillUrl())) + (await pagesUsed(decodeUrl())) === 0)

  before(async () => {
    ports = await allocatePorts()
    ;[prefill, decode] = await Promise.all([startPrefill(ports), startDecode(ports)])
    router = await startRouterPart(ports, tenants.file)
  })
  after(async () => stopAll([router, prefill, decode]))

  it('decode worker killed mid-stream: streams end in an error, 503 while down, service back after restart', async () => {
    const endingsPromise = startStreams(routerUrl())
    await kill9(decode!)
    const endings = await endingsPromise
    assert.ok(checkEndings(endings) > 0, 'the kill came after every stream had finished')
    await expect503(routerUrl(), tenants.a.key)
    decode = await startDecode(ports)
    await expectServed(routerUrl(), tenants.a, canaryA)
    assert.ok(await drained(), 'pools did not return to 0 pages')
  })

  it('prefill worker killed with requests in flight: each ends cleanly, 503 while down, service back after restart', async () => {
    const streams = [0, 1, 2].flatMap(() => [
      longStream(routerUrl(), tenants.a, canaryA),
      longStream(routerUrl(), tenants.b, canaryB),
    ])
    await kill9(prefill!)
    checkEndings(await Promise.all(streams.map((s) => s.ended)))
    assert.ok(
      await eventually(async () => (await pagesUsed(decodeUrl())) === 0),
      'the decode pool kept pages of requests whose prefill worker died',
    )
    await expect503(routerUrl(), tenants.b.key)
    prefill = await startPrefill(ports)
    await expectServed(routerUrl(), tenants.b, canaryB)
    assert.ok(await drained(), 'pools did not return to 0 pages')
  })

  it('router killed mid-stream: the workers abort its requests and drain; a new router on the same port serves', async () => {
    const endingsPromise = startStreams(routerUrl())
    await kill9(router!)
    const endings = await endingsPromise
    for (const e of endings) {
      const other = e.tenant === tenants.a ? canaryB : canaryA
      assert.deepEqual(findCanaries(e.text, [other]), [])
    }
    assert.ok(
      endings.some((e) => e.error instanceof OpenAI.APIConnectionError),
      'no stream saw the router go away',
    )
    assert.ok(await drained(), 'the workers kept pages of a dead router’s requests (G8)')
    router = await startRouterPart(ports, tenants.file)
    await expectServed(routerUrl(), tenants.a, canaryA)
  })

  it('decode worker restarted on another transfer port: the first request after it is served', async () => {
    await kill9(decode!)
    const ports2 = { ...ports, transfer: (await allocatePorts()).transfer }
    decode = await startDecode(ports2)
    await expectServed(routerUrl(), tenants.b, canaryB)
    assert.ok(await drained(), 'pools did not return to 0 pages')
  })
})
