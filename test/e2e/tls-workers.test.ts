/** Real `kvfence prefill` and `kvfence decode` processes started with `--tls-*` (certificates from
 *  the real `kvfence certs init`), driven by the router's worker client over HTTPS: the control
 *  plane and the KV transfer both run over mutual TLS 1.3, and a request generates exactly the
 *  single-process engine's tokens. A client without a certificate of the cluster CA, or in
 *  plaintext, is refused before any HTTP request is read. */
import assert from 'node:assert/strict'
import { type ChildProcess, execFile } from 'node:child_process'
import { mkdtempSync, rmSync } from 'node:fs'
import https from 'node:https'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { after, before, describe, it } from 'node:test'
import { promisify } from 'node:util'
import { newClusterToken } from '../../src/engine/cluster-token.js'
import { forkPart, stopAll } from '../../src/engine/processes.js'
import { cliEntry } from '../../src/paths.js'
import { createWorkerClient } from '../../src/router/worker-client.js'
import { loadTlsMaterial } from '../../src/tls.js'
import { greedyOracle, makeRequest, tokensOf } from '../engine/pair.js'
import { echoModelDir } from '../helpers/paths.js'

const dir = mkdtempSync(join(tmpdir(), 'kvfence-tls-workers-'))
const certs = join(dir, 'certs')
const clusterToken = newClusterToken()
const tlsFlags = (part: string) => [
  '--tls-ca',
  join(certs, 'ca.crt'),
  '--tls-cert',
  join(certs, `${part}.crt`),
  '--tls-key',
  join(certs, `${part}.key`),
]

describe('workers over mutual TLS', () => {
  const started: ChildProcess[] = []
  let prefillUrl = ''
  let decodeUrl = ''

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
})
