/** The paths of `bench -- router` and their plumbing: a streamed or whole completion through a
 *  router (or anything relaying to one), the same generation straight to the stand-in workers over
 *  control channels of the bench's own, closed-loop rates, the child's counts, and small helpers.
 *  Shared by the router bench's parts (router.ts, router-floors.ts, router-responses.ts,
 *  router-baseline.ts). */
import type { ChildProcess } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import http from 'node:http'
import https from 'node:https'
import { performance } from 'node:perf_hooks'
import { openChannel, type ControlChannel } from '../src/control/channel-client.js'
import type { GenerateRequest } from '../src/control/messages.js'
import { KvfenceError } from '../src/common/errors.js'
import { bosId, charIds, keys } from '../test/router/helpers.js'

/** What the child reports once listening. */
export interface Endpoints {
  routerUrl: string
  /** The second router, serving HTTPS. */
  httpsRouterUrl: string
  prefillUrl: string
  decodeUrl: string
  transferPort: number
}

export const prompt = 'Hello, workers!' // 15 characters: 16 prompt tokens with BOS
/** How long the clients keep an idle pooled connection, ms: below the servers' keep-alive. */
export const idleSocketMs = 2_000
export const maxTokens = 15

// ---------------------------------------------------------------------------------------------
// The two paths

/** One completion through the router; the body is read to its end. */
export async function routerRequest(
  agent: http.Agent | https.Agent,
  e: Endpoints,
  isStream: boolean,
): Promise<void> {
  const body = JSON.stringify({
    model: 'echo-test',
    prompt,
    max_tokens: maxTokens,
    temperature: 0,
    stream: isStream,
  })
  const res = await post(agent, `${e.routerUrl}/v1/completions`, body, {
    authorization: `Bearer ${keys.alpha}`,
  })
  const text = await readAll(res)
  if (res.statusCode !== 200) throw new Error(`router: HTTP ${res.statusCode}: ${text}`)
}

/** The direct path's own control channels, one to each stand-in (as the router holds one). */
export interface DirectChannels {
  decode: ControlChannel
  prefill: ControlChannel
}

export async function openDirectChannels(e: Endpoints): Promise<DirectChannels> {
  const open = (url: string, role: 'prefill' | 'decode') =>
    openChannel({
      url,
      role,
      tls: null,
      clusterToken: null,
      connectTimeoutMs: 5_000,
      refusal: (status) => new KvfenceError('worker_unavailable', `${role}: HTTP ${status}`),
    })
  const [decode, prefill] = await Promise.all([
    open(e.decodeUrl, 'decode'),
    open(e.prefillUrl, 'prefill'),
  ])
  return { decode, prefill }
}

/** The router's control-plane steps for the same request, by hand. */
export async function directRequest(c: DirectChannels, e: Endpoints): Promise<void> {
  const request: GenerateRequest = {
    requestId: randomBytes(16).toString('hex'),
    tenant: 'alpha',
    promptTokenIds: [bosId, ...charIds(prompt)],
    maxTokens,
    sampling: { temperature: 0, topP: 1, seed: null },
    stopTokenIds: [],
    transferSecret: randomBytes(32).toString('hex'),
  }
  const signal = new AbortController().signal
  let prefill: Promise<unknown> | null = null
  let isDone = false
  for await (const event of c.decode.generate(request, signal)) {
    if (event.type === 'reserved') {
      const { maxTokens: _, stopTokenIds: __, ...rest } = request
      const decode = { host: '127.0.0.1', port: e.transferPort }
      prefill = c.prefill.prefill({ ...rest, decode }, signal)
      prefill.catch(() => {}) // awaited below: not an unhandled rejection meanwhile
    } else if (event.type === 'done') isDone = true
  }
  await prefill
  if (!isDone) throw new Error('direct: the decode stand-in ended without done')
}

/** Completed requests per second of `numClients` clients sending back to back for `seconds`, and
 *  how many completed. */
export async function closedLoopRate(
  request: () => Promise<void>,
  numClients: number,
  seconds: number,
): Promise<{ rate: number; numDone: number }> {
  const startMs = performance.now()
  const endMs = startMs + seconds * 1000
  let numDone = 0
  await Promise.all(
    Array.from({ length: numClients }, async () => {
      while (performance.now() < endMs) {
        await request()
        numDone++
      }
    }),
  )
  return { rate: numDone / ((performance.now() - startMs) / 1000), numDone }
}

/** The child's count of socket writes to the router's clients so far, and the CPU time it has
 *  used (user + system, ms). */
export function childCounts(child: ChildProcess): Promise<{ numWrites: number; cpuMs: number }> {
  return new Promise((resolve) => {
    const onMessage = (m: { type?: string; numWrites?: number; cpuMs?: number }) => {
      if (m.type !== 'writes') return
      child.off('message', onMessage)
      resolve({ numWrites: m.numWrites!, cpuMs: m.cpuMs! })
    }
    child.on('message', onMessage)
    child.send({ type: 'writes' })
  })
}

// ---------------------------------------------------------------------------------------------
// Plumbing

export function post(
  agent: http.Agent | https.Agent,
  url: string,
  body: string,
  headers: Record<string, string> = {},
): Promise<http.IncomingMessage> {
  return new Promise((resolve, reject) => {
    const request = url.startsWith('https:') ? https.request : http.request
    const req = request(
      url,
      {
        method: 'POST',
        agent,
        headers: {
          'content-type': 'application/json',
          'content-length': Buffer.byteLength(body),
          ...headers,
        },
      },
      resolve,
    )
    req.on('error', reject)
    req.end(body)
  })
}

export async function readAll(res: http.IncomingMessage): Promise<string> {
  let text = ''
  res.setEncoding('utf8')
  for await (const chunk of res as AsyncIterable<string>) text += chunk
  return text
}

export async function timed(f: () => Promise<void>): Promise<number> {
  const start = performance.now()
  await f()
  return performance.now() - start
}

export function round(value: number, digits: number): number {
  return Number(value.toFixed(digits))
}

export function intFlag(args: readonly string[], name: string, fallback: number): number {
  const at = args.indexOf(name)
  if (at === -1) return fallback
  const value = Number(args[at + 1])
  if (!Number.isSafeInteger(value) || value < 1) {
    throw new Error(`${name} needs a positive integer, got ${String(args[at + 1])}`)
  }
  return value
}

/** The value after `name` in `args`; null when `name` is absent. Throws when it has no value. */
export function stringFlag(args: readonly string[], name: string): string | null {
  const at = args.indexOf(name)
  if (at === -1) return null
  const value = args[at + 1]
  if (value === undefined || value.startsWith('--')) throw new Error(`${name} needs a value`)
  return value
}

export async function stop(child: ChildProcess): Promise<void> {
  if (child.exitCode !== null) return
  const exited = new Promise<void>((resolve) => child.once('exit', () => resolve()))
  child.disconnect()
  const timer = setTimeout(() => child.kill('SIGKILL'), 5_000)
  await exited
  clearTimeout(timer)
}
