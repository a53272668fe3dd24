/** Real `kvfence prefill` and `kvfence decode` processes started with `--tls-*` (certificates from
 *  the real `kvfence certs init`), driven by the router's worker client over TLS: the control
 *  channel, the probes and the KV transfer all run over mutual TLS 1.3, and a request generates exactly the
 *  single-process engine's tokens. A client without a certificate of the cluster CA, or in
 *  plaintext, is refused before any HTTP request is read. */
import assert from 'node:assert/strict'
import { type ChildProcess, execFile } from 'node:child_process'
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import https from 'node:https'
import net from 'node:net'
import tls from 'node:tls'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { after, before, describe, it } from 'node:test'
import { promisify } from 'node:util'
import { stringify } from 'yaml'
import { newClusterToken } from '../../src/control/cluster-token.js'
import { forkPart, stopAll } from '../../src/engine/processes.js'
import { cliEntry } from '../../src/common/paths.js'
import { apiKeyDigest } from '../../src/router/tenants/tenants.js'
import { createWorkerClient } from '../../src/control/worker-client.js'
import { loadTlsMaterial } from '../../src/link/tls.js'
import OpenAI from 'openai'
import type { Agent } from 'undici'
import { Oracle } from '../../src/soak/oracle.js'
import { greedyOracle, makeRequest, tokensOf } from '../engine/pair.js'
import { echoModelDir } from '../helpers/paths.js'
import { makeTenants } from '../reliability/helpers.js'
import {
  completesAsOracle,
  openaiTrusting,
  tlsFlags as clusterTlsFlags,
} from '../helpers/cluster.js'

const dir = mkdtempSync(join(tmpdir(), 'kvfence-tls-workers-'))
const certs = join(dir, 'certs')
const clusterToken = newClusterToken()
const tlsFlags = (part: string) => clusterTlsFlags(certs, part)

describe('workers over mutual TLS', () => {
  const started: ChildProcess[] = []
  let prefillUrl = ''
  let decodeUrl = ''
  let decodeTransferPort = 0

  before(async () => {
    await promisify(execFile)(process.execPath, [cliEntry, 'certs', 'init', certs])
    const start = async (role: 'prefill' | 'decode') => {
      const args = [role, '--model', echoModelDir, '--pages', '32', '--port', '0']
      if (role === 'decode') args.push('--transfer-port', '0')
      const { ready } = await forkPart(
        [...args, ...tlsFlags(role), '--log-level', 'warn'],
        {
          env: { ...process.env, KVFENCE_CLUSTER_TOKEN: clusterToken },
          logFile: join(dir, `${role}.log`),
          timeoutMs: 60_000,
          failure: (why, last) => new Error(`${role} did not start (${why.kind}): ${last}`),
        },
        started,
      )
      if (role === 'decode')
        decodeTransferPort = (ready as typeof ready & { transferPort: number }).transferPort
      return `https://127.0.0.1:${ready.port}`
    }
    ;[prefillUrl, decodeUrl] = await Promise.all([start('prefill'), start('decode')])
  })
  after(async () => {
    await stopAll(started)
    rmSync(dir, { recursive: true, force: true })
  })

  it('generates exactly the single-process tokens, control and transfer over TLS', async () => {
    const workers = createWorkerClient({
      prefillUrls: [prefillUrl],
      decodeUrls: [decodeUrl],
      clusterToken,
      tls: loadTlsMaterial({
        ca: join(certs, 'ca.crt'),
        cert: join(certs, 'router.crt'),
        key: join(certs, 'router.key'),
      }),
    })
    try {
      const prompt = tokensOf('the code is Qx7vR2mK9pLt4Wz8. again: the code is ')
      const tokenIds: number[] = []
      const request = makeRequest('tenant-a', prompt, 12)
      for await (const e of workers.generate(request, AbortSignal.timeout(60_000)))
        if (e.type === 'token') tokenIds.push(e.tokenId)
      assert.deepEqual(tokenIds, greedyOracle(prompt, 12))
      const info = await workers.serverInfo(decodeUrl)
      assert.equal(info.role, 'decode')
    } finally {
      workers.close()
    }
  })

  it('refuses a client without a certificate of the cluster CA in the handshake', async () => {
    const status = (options: https.RequestOptions) =>
      new Promise<string>((resolve) => {
        const req = https.get(`${decodeUrl}/health`, { ...options, agent: false }, (res) =>
          resolve(`HTTP ${res.statusCode}`),
        )
        req.on('error', (err: NodeJS.ErrnoException) => resolve(String(err.code)))
      })
    const ca = loadTlsMaterial({
      ca: join(certs, 'ca.crt'),
      cert: join(certs, 'router.crt'),
      key: join(certs, 'router.key'),
    }).ca
    // It trusts the CA but shows no certificate: refused, no HTTP reply at all.
    assert.equal(await status({ ca }), 'ERR_SSL_TLSV13_ALERT_CERTIFICATE_REQUIRED')
    // Plaintext HTTP to the TLS port: no HTTP reply either.
    const plain = await fetch(decodeUrl.replace('https:', 'http:') + '/health').then(
      (res) => `HTTP ${res.status}`,
      () => 'refused',
    )
    assert.equal(plain, 'refused')
  })

  it('the decode worker logs each connection its ports refuse in the handshake', async () => {
    const ca = readFileSync(join(certs, 'ca.crt'))
    const controlPort = Number(new URL(decodeUrl).port)
    const other = join(dir, 'other-certs')
    await promisify(execFile)(process.execPath, [cliEntry, 'certs', 'init', other])
    const otherCluster = {
      cert: readFileSync(join(other, 'router.crt')),
      key: readFileSync(join(other, 'router.key')),
    }
    const logged = (what: string) =>
      readFileSync(join(dir, 'decode.log'), 'utf8')
        .split('\n')
        .filter((line) => line.includes(`"msg":"${what} from 127.0.0.1:`))
        .map((line) =>
          (JSON.parse(line) as { msg: string }).msg.replace(/127\.0\.0\.1:\d+/, '127.0.0.1:PORT'),
        )
    for (const [what, port] of [
      ['transfer connection', decodeTransferPort],
      ['control connection', controlPort],
    ] as const) {
      const before = logged(what).length
      // A TLS client that trusts the CA but shows no certificate: refused in the handshake.
      await new Promise<void>((resolve) => {
        const socket = tls.connect({ host: '127.0.0.1', port, ca })
        socket.on('error', () => {})
        socket.on('close', () => resolve())
      })
      // A client with a certificate of another cluster's CA.
      await new Promise<void>((resolve) => {
        const socket = tls.connect({ host: '127.0.0.1', port, ca, ...otherCluster }, () =>
          socket.write('GET / HTTP/1.1\r\n\r\n'),
        )
        socket.on('error', () => {})
        socket.on('close', () => resolve())
      })
      // A plaintext peer writing bytes that are no TLS record.
      await new Promise<void>((resolve) => {
        const socket = net.connect(port, '127.0.0.1', () => socket.write('GET / HTTP/1.1\r\n\r\n'))
        socket.on('error', () => {})
        socket.on('close', () => resolve())
      })
      // The line is written when the server's side of the handshake fails, which may come after
      // the client saw the connection close.
      let lines = logged(what).slice(before)
      for (let i = 0; i < 100 && lines.length < 3; i++) {
        await new Promise((r) => setTimeout(r, 50))
        lines = logged(what).slice(before)
      }
      assert.deepEqual(lines, [
        `${what} from 127.0.0.1:PORT refused: TLS handshake failed: peer did not return a certificate`,
        `${what} from 127.0.0.1:PORT refused: TLS handshake failed: client certificate refused (UNABLE_TO_VERIFY_LEAF_SIGNATURE: not from the cluster CA)`,
        `${what} from 127.0.0.1:PORT refused: TLS handshake failed: http request (the peer does not speak TLS: is it started without TLS?)`,
      ])
    }
  })

  it('kvfence router --cluster-tls-* reaches them over mutual TLS and serves HTTPS to the openai client', async () => {
    const tenants = makeTenants()
    const { ready } = await forkPart(
      [
        'router',
        '--model',
        echoModelDir,
        '--prefill',
        prefillUrl,
        '--decode',
        decodeUrl,
        '--tenants',
        tenants.file,
        '--port',
        '0',
        '--cluster-tls-ca',
        join(certs, 'ca.crt'),
        '--cluster-tls-cert',
        join(certs, 'router.crt'),
        '--cluster-tls-key',
        join(certs, 'router.key'),
        // Clients over HTTPS with the router's certificate of `certs init` (SAN 127.0.0.1).
        '--tls-cert',
        join(certs, 'router.crt'),
        '--tls-key',
        join(certs, 'router.key'),
        '--log-level',
        'warn',
      ],
      {
        env: { ...process.env, KVFENCE_CLUSTER_TOKEN: clusterToken },
        logFile: join(dir, 'router.log'),
        timeoutMs: 60_000,
        failure: (why, last) => new Error(`router did not start (${why.kind}): ${last}`),
      },
      started,
    )
    const baseURL = `https://127.0.0.1:${ready.port}/v1`
    const { client, agent } = trustingClusterCa(baseURL, tenants.a.key)
    const oracle = new Oracle(echoModelDir, 32, 16)
    try {
      const prompt = 'the river walks near the stone garden'
      await completesAsOracle(client, oracle, prompt)
      const chat = await client.chat.completions.create({
        model: 'echo-tiny',
        messages: [{ role: 'user', content: prompt }],
        max_tokens: 10,
        temperature: 0,
      })
      const chatText = oracle.expected({ endpoint: 'chat', prompt, maxTokens: 10 }).text
      assert.equal(chat.choices[0].message.content, chatText)
      const stream = await client.chat.completions.create({
        model: 'echo-tiny',
        messages: [{ role: 'user', content: prompt }],
        max_tokens: 10,
        temperature: 0,
        stream: true,
      })
      let streamed = ''
      let finish: string | null = null
      for await (const chunk of stream) {
        streamed += chunk.choices[0]?.delta.content ?? ''
        finish = chunk.choices[0]?.finish_reason ?? finish
      }
      assert.equal(streamed, chatText)
      assert.ok(finish === 'stop' || finish === 'length', `finish_reason ${finish}`)
      // A client that does not trust the cluster CA (the system's roots only) fails the handshake.
      const untrusting = new OpenAI({ baseURL, apiKey: tenants.a.key, maxRetries: 0 })
      await assert.rejects(
        untrusting.completions.create({ model: 'echo-tiny', prompt, max_tokens: 4 }),
        (err: Error) => {
          assert.ok(err instanceof OpenAI.APIConnectionError, String(err))
          // fetch's TypeError, caused by the certificate check's error (the router shows its leaf only).
          const codes: unknown[] = []
          for (let e: unknown = err; e instanceof Error; e = e.cause)
            codes.push((e as NodeJS.ErrnoException).code)
          assert.ok(codes.includes('UNABLE_TO_VERIFY_LEAF_SIGNATURE'), `codes ${codes.join(', ')}`)
          return true
        },
      )
    } finally {
      await agent.close()
    }
  })

  it('kvfence router --config serves HTTPS with the file’s router.tls, and refuses --tls-cert beside it', async () => {
    const tenants = makeTenants()
    const file = join(dir, 'https.yaml')
    // Paths relative to the file, as an operator writes them next to `certs init`'s folder.
    writeFileSync(
      file,
      stringify({
        model: echoModelDir,
        router: { port: 0, tls: { cert: 'certs/router.crt', key: 'certs/router.key' } },
        workers: { prefill: [{ url: prefillUrl }], decode: [{ url: decodeUrl }] },
        tls: { dir: 'certs' },
        tenants: [{ name: 'alice', keySha256: apiKeyDigest(tenants.a.key) }],
      }),
    )
    const { ready } = await forkPart(['router', '--config', file, '--log-level', 'warn'], {
      env: { ...process.env, KVFENCE_CLUSTER_TOKEN: clusterToken },
      logFile: join(dir, 'router-config.log'),
      timeoutMs: 60_000,
      failure: (why, last) => new Error(`router did not start (${why.kind}): ${last}`),
    }, started) // prettier-ignore
    const { client, agent } = trustingClusterCa(`https://127.0.0.1:${ready.port}/v1`, tenants.a.key)
    try {
      const oracle = new Oracle(echoModelDir, 32, 16)
      await completesAsOracle(client, oracle, 'the river walks near the stone garden')
    } finally {
      await agent.close()
    }
    const both = await promisify(execFile)(process.execPath, [
      cliEntry, 'router', '--config', file,
      '--tls-cert', join(certs, 'router.crt'), '--tls-key', join(certs, 'router.key'),
    ]).then(
      () => ({ code: 0, stderr: '' }),
      (err: { code: number; stderr: string }) => err,
    ) // prettier-ignore
    assert.equal(both.code, 2)
    assert.equal(
      both.stderr,
      `kvfence: ${file} has router.tls: give it or --tls-cert/--tls-key, not both\n`,
    )
  })

  it('kvfence router: --cluster-tls-* go together (one line, exit 2)', async () => {
    const run = await promisify(execFile)(process.execPath, [
      cliEntry,
      'router',
      '--prefill',
      prefillUrl,
      '--decode',
      decodeUrl,
      '--tenants',
      makeTenants().file,
      '--port',
      '0',
      '--cluster-tls-ca',
      join(certs, 'ca.crt'),
    ]).then(
      () => ({ code: 0, stderr: '' }),
      (err: { code: number; stderr: string }) => err,
    )
    assert.equal(run.code, 2)
    assert.equal(
      run.stderr,
      'kvfence: cluster TLS needs all three of --cluster-tls-ca, --cluster-tls-cert and --cluster-tls-key (see kvfence certs init)\n',
    )
  })
  it('kvfence router checks its HTTPS pair and its Redis URL before it dials a worker (one line, exit 2)', async () => {
    const refused = async (...flags: string[]) =>
      promisify(execFile)(
        process.execPath,
        // Workers nobody listens on: the router would wait for them before anything else.
        [
          cliEntry,
          'router',
          '--prefill',
          'http://127.0.0.1:1',
          '--decode',
          'http://127.0.0.1:2',
        ].concat(['--tenants', makeTenants().file, '--port', '0', ...flags]),
        { timeout: 30_000 },
      ).then(
        () => ({ code: 0, stderr: '' }),
        (err: { code: number; stderr: string }) => ({ code: err.code, stderr: err.stderr }),
      )
    const missing = join(dir, 'missing.crt')
    assert.deepEqual(await refused('--tls-cert', missing, '--tls-key', join(certs, 'router.key')), {
      code: 2,
      stderr: `kvfence: TLS certificate ${missing}: cannot read it (ENOENT)\n`,
    })
    assert.deepEqual(await refused('--limits-redis', 'http://:hunter2@10.0.0.5:6379'), {
      code: 2,
      stderr:
        'kvfence: --limits-redis: must be a redis:// or rediss:// URL, got http://:***@10.0.0.5:6379/\n',
    })
    assert.deepEqual(await refused('--limits-redis', 'redis://:hunter2@[bad'), {
      code: 2,
      stderr:
        'kvfence: --limits-redis: must be a redis:// or rediss:// URL, got (unparsable URL)\n',
    })
  })
})

/** An `openai` client trusting this cluster's CA (which signed the router's certificate). */
function trustingClusterCa(baseURL: string, apiKey: string): { client: OpenAI; agent: Agent } {
  return openaiTrusting(baseURL, apiKey, readFileSync(join(certs, 'ca.crt')))
}
