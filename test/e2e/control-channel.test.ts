/** The control channel (src/control/channel-client.ts ↔ src/control/channel-server.ts) between the
 *  router's worker client and real `kvfence prefill`/`kvfence decode` processes: requests share
 *  one connection per worker and generate exactly the single-process tokens; a client's abort
 *  reaches the decode worker as `cancel`, which aborts the request and frees its pages (G8); a
 *  wrong cluster token is refused at the upgrade; a worker killed mid-stream fails every open
 *  stream with `worker_unavailable`, and the next request opens a new connection; over mutual
 *  TLS, the same. */
import assert from 'node:assert/strict'
import { type ChildProcess, execFile } from 'node:child_process'
import { mkdtempSync, rmSync } from 'node:fs'
import http from 'node:http'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { after, before, describe, it } from 'node:test'
import { promisify } from 'node:util'
import { clusterTokenHeader, newClusterToken } from '../../src/control/cluster-token.js'
import type { GenerateRequest } from '../../src/control/messages.js'
import { forkPart, stopAll } from '../../src/engine/processes.js'
import { KvfenceError } from '../../src/common/errors.js'
import { cliEntry } from '../../src/common/paths.js'
import {
  ClusterTokenRefusedError,
  createWorkerClient,
  type WorkerClient,
} from '../../src/control/worker-client.js'
import { loadTlsMaterial, type TlsMaterial } from '../../src/link/tls.js'
import { greedyOracle, makeRequest, tokensOf } from '../engine/pair.js'
import { echoModelDir } from '../helpers/paths.js'
import { waitUntil } from '../helpers/poll.js'
import { tlsFlags as clusterTlsFlags } from '../helpers/cluster.js'

const dir = mkdtempSync(join(tmpdir(), 'kvfence-control-channel-'))
const certs = join(dir, 'certs')
const clusterToken = newClusterToken()
const prompt = tokensOf('the code is Qx7vR2mK9pLt4Wz8. again: the code is ')

/** Forks a worker of `role` on `port` (0: any), with `extra` flags; its URL. */
async function startWorker(
  started: ChildProcess[],
  role: 'prefill' | 'decode',
  options: { port?: number; scheme?: 'http' | 'https'; extra?: string[] } = {},
): Promise<{ url: string; child: ChildProcess }> {
  // 256 pages of 16 tokens: room for 4 requests of 900 tokens at once.
  const args = [
    role,
    '--model',
    echoModelDir,
    '--pages',
    '256',
    '--port',
    String(options.port ?? 0),
  ]
  if (role === 'decode') args.push('--transfer-port', '0')
  const { child, ready } = await forkPart(
    [...args, ...(options.extra ?? []), '--log-level', 'warn'],
    {
      env: { ...process.env, KVFENCE_CLUSTER_TOKEN: clusterToken },
      logFile: join(dir, `${role}-${Date.now()}.log`),
      timeoutMs: 60_000,
      failure: (why, last) => new Error(`${role} did not start (${why.kind}): ${last}`),
    },
    started,
  )
  return { url: `${options.scheme ?? 'http'}://127.0.0.1:${ready.port}`, child }
}

/** The tokens of `request` through `workers`. */
async function tokensThrough(workers: WorkerClient, request: GenerateRequest): Promise<number[]> {
  const tokenIds: number[] = []
  for await (const e of workers.generate(request, AbortSignal.timeout(60_000)))
    if (e.type === 'token') tokenIds.push(e.tokenId)
  return tokenIds
}

/** A worker's Prometheus sample `name{…labels}` (0 when absent). */
async function sample(url: string, name: string, labels = ''): Promise<number> {
  const text = await (await fetch(`${url}/metrics`)).text()
  const line = text.split('\n').find((l) => l.startsWith(`${name}{`) && l.includes(labels))
  return line === undefined ? 0 : Number(line.slice(line.lastIndexOf(' ') + 1))
}

/** The worker's `numPagesUsed` (plain HTTP `/server_info`). */
async function numPagesUsed(workers: WorkerClient, url: string): Promise<number> {
  return (await workers.serverInfo(url)).numPagesUsed
}

describe('control channel to plaintext workers', () => {
  const started: ChildProcess[] = []
  let prefillUrl = ''
  let decode = { url: '', child: null as unknown as ChildProcess }
  let workers: WorkerClient

  before(async () => {
    const [p, d] = await Promise.all([
      startWorker(started, 'prefill'),
      startWorker(started, 'decode'),
    ])
    prefillUrl = p.url
    decode = d
    workers = createWorkerClient({
      prefillUrls: [prefillUrl],
      decodeUrls: [decode.url],
      clusterToken,
    })
  })
  after(async () => {
    workers?.close()
    await stopAll(started)
  })

  /** Waits until the decode worker counted one more aborted request than `abortedBefore` and
   *  holds no pages. */
  async function abortedAndFreed(abortedBefore: number): Promise<void> {
    await waitUntil(
      async () =>
        (await sample(decode.url, 'kvfence_worker_requests_total', 'outcome="request_aborted"')) ===
        abortedBefore + 1,
      { timeoutMs: 10_000, intervalMs: 20, what: 'the decode worker counted the abort' },
    )
    await waitUntil(async () => (await numPagesUsed(workers, decode.url)) === 0, {
      timeoutMs: 10_000,
      intervalMs: 20,
      what: "the decode worker freed the request's pages",
    })
  }

  it('generates exactly the single-process tokens, 4 requests at once on one connection per worker', async () => {
    const want = greedyOracle(prompt, 12)
    const got = await Promise.all(
      Array.from({ length: 4 }, () => tokensThrough(workers, makeRequest('tenant-a', prompt, 12))),
    )
    for (const tokenIds of got) assert.deepEqual(tokenIds, want)
    assert.equal(await sample(decode.url, 'kvfence_control_channels'), 1)
    assert.equal(await sample(prefillUrl, 'kvfence_control_channels'), 1)
    assert.equal(await numPagesUsed(workers, decode.url), 0)
  })

  it("a client's abort reaches the decode worker as cancel: the request is aborted there and its pages freed", async () => {
    const abortedBefore = await sample(
      decode.url,
      'kvfence_worker_requests_total',
      'outcome="request_aborted"',
    )
    const client = new AbortController()
    const request = makeRequest('tenant-a', prompt, 900)
    let numTokens = 0
    await assert.rejects(
      async () => {
        for await (const e of workers.generate(request, client.signal)) {
          if (e.type === 'token' && ++numTokens === 2) client.abort()
        }
      },
      (err: unknown) => err instanceof KvfenceError && err.code === 'request_aborted',
    )
    assert.equal(numTokens, 2)
    await abortedAndFreed(abortedBefore)
    assert.equal(await numPagesUsed(workers, prefillUrl), 0)
    // The connection stays: the next request runs on it.
    assert.deepEqual(
      await tokensThrough(workers, makeRequest('tenant-a', prompt, 5)),
      greedyOracle(prompt, 5),
    )
    assert.equal(await sample(decode.url, 'kvfence_control_channels'), 1)
  })

  it('a router that closes its channel mid-stream (it stopped) aborts the request on the worker and frees its pages', async () => {
    const abortedBefore = await sample(
      decode.url,
      'kvfence_worker_requests_total',
      'outcome="request_aborted"',
    )
    const leaving = createWorkerClient({
      prefillUrls: [prefillUrl],
      decodeUrls: [decode.url],
      clusterToken,
    })
    let numTokens = 0
    await assert.rejects(async () => {
      for await (const e of leaving.generate(
        makeRequest('tenant-a', prompt, 900),
        AbortSignal.timeout(60_000),
      )) {
        if (e.type === 'token' && ++numTokens === 2) leaving.close()
      }
    }, /control channel closed/)
    await abortedAndFreed(abortedBefore)
    assert.equal(await sample(decode.url, 'kvfence_control_channels'), 1, "only the suite's own")
  })

  it('refuses the upgrade without the cluster token (401) and a wrong token is ClusterTokenRefusedError', async () => {
    const status = await new Promise<number>((resolve, reject) => {
      const req = http.request(`${decode.url}/internal/channel`, {
        headers: {
          connection: 'Upgrade',
          upgrade: 'kvfence-control/1',
          [clusterTokenHeader]: 'nope',
        },
        agent: false,
      })
      req.on('response', (res) => resolve(res.statusCode!))
      req.on('upgrade', () => reject(new Error('upgraded without the token')))
      req.on('error', reject)
      req.end()
    })
    assert.equal(status, 401)
    const wrong = createWorkerClient({
      prefillUrls: [prefillUrl],
      decodeUrls: [decode.url],
      clusterToken: newClusterToken(),
    })
    try {
      await assert.rejects(
        () => tokensThrough(wrong, makeRequest('tenant-a', prompt, 3)),
        (err: unknown) =>
          err instanceof ClusterTokenRefusedError &&
          err.code === 'worker_unavailable' &&
          err.message.startsWith(
            `decode worker ${decode.url} refused the router's cluster token (HTTP 401)`,
          ),
      )
    } finally {
      wrong.close()
    }
    assert.equal(await numPagesUsed(workers, decode.url), 0)
  })

  it('a decode worker killed mid-stream fails each open stream with worker_unavailable; the next request reconnects', async () => {
    const clients = Array.from({ length: 3 }, () => ({ numTokens: 0, error: null as unknown }))
    let numStarted = 0
    let onAllStarted: () => void = () => {}
    const allStarted = new Promise<void>((resolve) => (onAllStarted = resolve))
    const runs = clients.map(async (c) => {
      try {
        for await (const e of workers.generate(
          makeRequest('tenant-a', prompt, 900),
          AbortSignal.timeout(60_000),
        )) {
          if (e.type === 'token' && ++c.numTokens === 1 && ++numStarted === clients.length)
            onAllStarted()
        }
      } catch (err) {
        c.error = err
      }
    })
    await allStarted
    const port = Number(new URL(decode.url).port)
    decode.child.kill('SIGKILL')
    await Promise.all(runs)
    for (const c of clients) {
      assert.ok(c.numTokens >= 1 && c.numTokens < 900, `tokens before the kill: ${c.numTokens}`)
      assert.ok(c.error instanceof KvfenceError, String(c.error))
      assert.equal(c.error.code, 'worker_unavailable')
      assert.match(c.error.message, new RegExp(`decode worker ${decode.url}: control channel`))
    }
    // The same worker back on its port: the next request opens a new connection.
    decode = await startWorker(started, 'decode', { port })
    assert.deepEqual(
      await tokensThrough(workers, makeRequest('tenant-a', prompt, 5)),
      greedyOracle(prompt, 5),
    )
    assert.equal(await sample(decode.url, 'kvfence_control_channels'), 1)
  })
})

describe('control channel to workers over mutual TLS', () => {
  const started: ChildProcess[] = []
  let prefillUrl = ''
  let decodeUrl = ''
  let tls: TlsMaterial
  const tlsFlags = (part: string) => clusterTlsFlags(certs, part)

  before(async () => {
    await promisify(execFile)(process.execPath, [cliEntry, 'certs', 'init', certs])
    tls = loadTlsMaterial({
      ca: join(certs, 'ca.crt'),
      cert: join(certs, 'router.crt'),
      key: join(certs, 'router.key'),
    })
    const [p, d] = await Promise.all(
      (['prefill', 'decode'] as const).map((role) =>
        startWorker(started, role, { scheme: 'https', extra: tlsFlags(role) }),
      ),
    )
    prefillUrl = p.url
    decodeUrl = d.url
  })
  after(async () => {
    await stopAll(started)
    rmSync(dir, { recursive: true, force: true })
  })

  it('generates exactly the single-process tokens over one TLS connection per worker', async () => {
    const workers = createWorkerClient({
      prefillUrls: [prefillUrl],
      decodeUrls: [decodeUrl],
      clusterToken,
      tls,
    })
    try {
      const got = await Promise.all(
        Array.from({ length: 3 }, () =>
          tokensThrough(workers, makeRequest('tenant-a', prompt, 12)),
        ),
      )
      for (const tokenIds of got) assert.deepEqual(tokenIds, greedyOracle(prompt, 12))
      const info = await workers.serverInfo(decodeUrl)
      assert.equal(info.numPagesUsed, 0)
    } finally {
      workers.close()
    }
  })

  it('a router without a certificate of the cluster CA cannot open the channel: worker_unavailable naming TLS', async () => {
    const stranger = createWorkerClient({
      prefillUrls: [prefillUrl],
      decodeUrls: [decodeUrl],
      clusterToken,
      tls: { ...tls, cert: undefined as unknown as Buffer, key: undefined as unknown as Buffer },
    })
    try {
      await assert.rejects(
        () => tokensThrough(stranger, makeRequest('tenant-a', prompt, 3)),
        (err: unknown) =>
          err instanceof KvfenceError &&
          err.code === 'worker_unavailable' &&
          err.message.startsWith(`decode worker ${decodeUrl}: `),
      )
    } finally {
      stranger.close()
    }
  })
})
