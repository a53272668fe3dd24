/** TLS by default across hosts: a part that binds or dials beyond loopback without TLS is refused
 *  at start with one line (exit 2), unless `--allow-plaintext` (cluster file: `allowPlaintext:
 *  true`), which starts it with a warning; loopback stays plaintext. Addresses beyond loopback are
 *  only parsed here: every refusal comes before a socket is bound or dialled, and the one part
 *  allowed to start binds 0.0.0.0 with nothing sent to it. */
import assert from 'node:assert/strict'
import { execFile, type ChildProcess } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import { rmSync } from 'node:fs'
import { join } from 'node:path'
import { after, describe, it } from 'node:test'
import { pino } from 'pino'
import { parseClusterConfig } from '../../src/config/cluster.js'
import { clusterConfigPlan, workerArgs } from '../../src/config/launch.js'
import { newClusterToken } from '../../src/control/cluster-token.js'
import { buildFaultConfig } from '../../src/engine/faults.js'
import { PrefillWorker } from '../../src/engine/prefill-worker.js'
import { forkPart, stopAll } from '../../src/engine/processes.js'
import { createWorkerCore } from '../../src/engine/worker-core.js'
import {
  checkPlaintextLinks,
  clientPlaintextWarning,
  isLoopbackHost,
} from '../../src/link/plaintext.js'
import { apiKeyDigest } from '../../src/router/tenants/tenants.js'
import { echoModel } from '../engine/pair.js'
import { twoTenants } from '../helpers/cluster.js'
import { stoppedPartLog } from '../helpers/processes.js'
import { cliPath, echoModelDir } from '../helpers/paths.js'

const token = newClusterToken()

function run(args: string[]): Promise<{ code: number | null; stdout: string; stderr: string }> {
  return new Promise((resolve) =>
    execFile(
      process.execPath,
      [cliPath, ...args],
      { timeout: 60_000, env: { ...process.env, KVFENCE_CLUSTER_TOKEN: token } },
      (err, stdout, stderr) =>
        resolve({ code: err ? ((err as { code?: number }).code ?? null) : 0, stdout, stderr }),
    ),
  )
}

/** The refusal's wording after "<part> <where> without TLS: refused, " (src/link/plaintext.ts). */
const why = 'tenants’ prompts and KV pages would cross the network in plaintext'

describe('plaintext links beyond loopback', () => {
  const { dir, tenantsFile } = twoTenants('kvfence-plaintext-')
  const children: ChildProcess[] = []
  after(async () => {
    await stopAll(children)
    rmSync(dir, { recursive: true, force: true })
  })

  it('loopback is 127.0.0.0/8, ::1 and localhost only', () => {
    for (const host of ['127.0.0.1', '127.1.2.3', '::1', '[::1]', 'localhost'])
      assert.equal(isLoopbackHost(host), true, host)
    for (const host of ['0.0.0.0', '::', '[::]', '10.0.0.7', '128.0.0.1', 'db.example', '::ffff:1'])
      assert.equal(isLoopbackHost(host), false, host)
  })

  it('a router serving clients over plain HTTP beyond loopback is warned about; HTTPS or loopback is not', () => {
    assert.equal(
      clientPlaintextWarning('0.0.0.0', false),
      "router serves clients in plaintext on 0.0.0.0: tenants' API keys and prompts cross the network unencrypted unless TLS ends in front of it (--tls-cert/--tls-key to serve HTTPS)",
    )
    assert.equal(clientPlaintextWarning('0.0.0.0', true), null)
    assert.equal(clientPlaintextWarning('127.0.0.1', false), null)
    assert.equal(clientPlaintextWarning('::1', false), null)
  })

  it('checkPlaintextLinks: loopback passes silently, beyond it refused, or warned when allowed', () => {
    const warnings: string[] = []
    const check = (hosts: string[], allowPlaintext: boolean) =>
      checkPlaintextLinks({
        part: 'decode worker',
        links: hosts.map((host) => ({ what: 'binds to', host })),
        allowPlaintext,
        tlsHint: '--tls-*',
        log: { warn: (m) => warnings.push(m) },
      })
    check(['127.0.0.1', 'localhost'], false)
    assert.deepEqual(warnings, [])
    assert.throws(() => check(['127.0.0.1', '10.0.0.7', '0.0.0.0'], false), {
      code: 'config_invalid',
      message: `decode worker binds to 10.0.0.7, binds to 0.0.0.0 without TLS: refused, ${why}; use --tls-* (kvfence certs init), or --allow-plaintext to accept that`,
    })
    check(['10.0.0.7'], true)
    assert.deepEqual(warnings, [
      'decode worker binds to 10.0.0.7 without TLS (--allow-plaintext): tenants’ prompts and KV pages cross the network in plaintext',
    ])
  })

  it('a decode worker bound beyond loopback without TLS: one line, exit 2', async () => {
    const res = await run([
      'decode',
      '--model',
      echoModelDir,
      '--host',
      '10.213.9.2',
      '--port',
      '0',
      '--transfer-port',
      '0',
    ])
    assert.equal(res.code, 2)
    assert.equal(
      res.stderr
        .split('\n')
        .filter((l) => l.startsWith('kvfence:'))
        .join('\n'),
      `kvfence: decode worker binds its control plane to 10.213.9.2 without TLS: refused, ${why}; use --tls-ca/--tls-cert/--tls-key (kvfence certs init), or --allow-plaintext to accept that`,
    )
  })

  it('its transfer receiver beyond loopback too', async () => {
    const res = await run([
      'decode',
      '--model',
      echoModelDir,
      '--port',
      '0',
      '--transfer-host',
      '0.0.0.0',
    ])
    assert.equal(res.code, 2)
    assert.match(
      res.stderr,
      /^kvfence: decode worker binds its KV transfer receiver to 0\.0\.0\.0 without TLS: refused,/m,
    )
  })

  it('with --allow-plaintext it starts, and warns', async () => {
    const logFile = join(dir, 'decode.log')
    const started: ChildProcess[] = []
    const { ready } = await forkPart(
      [
        'decode',
        '--model',
        echoModelDir,
        '--host',
        '0.0.0.0',
        '--port',
        '0',
        '--transfer-port',
        '0',
        '--allow-plaintext',
      ],
      {
        env: { ...process.env, KVFENCE_CLUSTER_TOKEN: token },
        logFile,
        timeoutMs: 60_000,
        failure: (w, last) => new Error(`decode did not start (${w.kind}): ${last}`),
      },
      started,
    )
    assert.ok(ready.port > 0)
    const warnings = (await stoppedPartLog(started, logFile))
      .split('\n')
      .filter((l) => l.includes('"level":40'))
      .map((l) => (JSON.parse(l) as { msg: string }).msg)
    assert.deepEqual(warnings, [
      'decode worker binds its control plane to 0.0.0.0 without TLS (--allow-plaintext): tenants’ prompts and KV pages cross the network in plaintext',
    ])
  })

  it('a router dialling workers beyond loopback without cluster TLS: one line, before dialling', async () => {
    const res = await run([
      'router',
      '--model',
      echoModelDir,
      '--prefill',
      'http://127.0.0.1:1',
      '--decode',
      'http://10.213.9.2:8102',
      '--tenants',
      tenantsFile,
      '--port',
      '0',
    ])
    assert.equal(res.code, 2)
    assert.equal(
      res.stderr,
      `kvfence: router dials worker 10.213.9.2 without TLS: refused, ${why}; use --cluster-tls-ca/--cluster-tls-cert/--cluster-tls-key (or tls: in the cluster file) (kvfence certs init), or --allow-plaintext to accept that\n`,
    )
  })

  it('kvfence serve --host beyond loopback: one line, before any part starts', async () => {
    const res = await run([
      'serve',
      '--model',
      echoModelDir,
      '--tenants',
      tenantsFile,
      '--host',
      '10.213.9.1',
    ])
    assert.equal(res.code, 2)
    assert.equal(
      res.stderr,
      `kvfence: kvfence serve binds its router and workers to 10.213.9.1 without TLS: refused, ${why}; use kvfence serve --config with tls: { dir } (kvfence certs init), or --allow-plaintext to accept that\n`,
    )
  })

  it('a cluster file: refused beyond loopback; allowPlaintext: true warns and passes the flag on', () => {
    const tenants = [{ name: 'a', keySha256: apiKeyDigest(randomBytes(16).toString('hex')) }]
    const file = (extra: object) =>
      parseClusterConfig(
        {
          router: { host: '10.213.9.1' },
          workers: { prefill: [{ pages: 8 }], decode: [{ url: 'http://10.213.9.2:8102' }] },
          tenants,
          ...extra,
        },
        'cluster.yaml',
        dir,
      )
    const log = pino({ level: 'silent' })
    assert.throws(() => clusterConfigPlan(file({}), log), {
      code: 'config_invalid',
      message: `the cluster binds its workers to 10.213.9.1, dials worker 10.213.9.2 without TLS: refused, ${why}; use tls: { dir } in the cluster file (kvfence certs init), or --allow-plaintext to accept that`,
    })
    const warnings: string[] = []
    const recording = pino({ level: 'warn' }, { write: (l: string) => void warnings.push(l) })
    const plan = clusterConfigPlan(file({ allowPlaintext: true }), recording)
    assert.deepEqual(plan.prefill, [{ pages: 8, tls: null, allowPlaintext: true }])
    const worker = plan.prefill[0]
    assert.ok(!('url' in worker))
    assert.ok(workerArgs(plan, 'prefill', worker).includes('--allow-plaintext'))
    assert.deepEqual(plan.decode, [{ url: 'http://10.213.9.2:8102' }])
    assert.equal(plan.router.runs === 'here' && plan.router.options.allowPlaintext, true)
    assert.equal(warnings.length, 1)
    assert.match(warnings[0], /the cluster binds its workers to 10\.213\.9\.1, dials worker/)
  })

  it('a cluster file on loopback stays plaintext, and says so', () => {
    const lines: string[] = []
    const log = pino({ level: 'info' }, { write: (l: string) => void lines.push(l) })
    const config = parseClusterConfig(
      {
        workers: { prefill: [{ pages: 8 }], decode: [{ pages: 8 }] },
        tenants: [{ name: 'a', keySha256: apiKeyDigest('k'.repeat(32)) }],
      },
      'cluster.yaml',
      dir,
    )
    const plan = clusterConfigPlan(config, log)
    assert.deepEqual(plan.prefill, [{ pages: 8, tls: null }])
    assert.deepEqual(
      lines.map((l) => (JSON.parse(l) as { msg: string }).msg),
      ['control and data planes are plaintext on loopback; use tls: for other hosts'],
    )
  })

  it('a prefill worker without TLS refuses to send KV pages beyond loopback, before any work', async () => {
    const core = createWorkerCore({
      model: echoModel(),
      numPages: 8,
      pageSize: 16,
      faults: buildFaultConfig([], false, {}),
    })
    const prefill = new PrefillWorker(core)
    const request = {
      requestId: randomBytes(16).toString('hex'),
      tenant: 'a',
      promptTokenIds: [1, 2, 3],
      sampling: { temperature: 0, topP: 1, seed: null },
      transferSecret: randomBytes(32).toString('hex'),
      decode: { host: '10.213.9.2', port: 8103 },
    }
    await assert.rejects(prefill.prefill(request, AbortSignal.timeout(10_000)), {
      code: 'transfer_failed',
      message:
        'refused to send KV pages in plaintext to 10.213.9.2 (beyond loopback): start the prefill worker with --tls-ca/--tls-cert/--tls-key, or --allow-plaintext',
    })
    assert.equal(core.pool.numUsed, 0)
    prefill.close()
  })

  it('allowPlaintext is a field of the whole file, not of the router section', () => {
    assert.throws(
      () => parseClusterConfig({ router: { allowPlaintext: true }, tenants: [] }, 'c.yaml', dir),
      { code: 'config_invalid' },
    )
  })
})
