/** A cluster over mutual TLS keeps serving across `kvfence certs renew`: real `kvfence prefill`,
 *  `decode` and `router` processes started with certificates of `kvfence certs init --days 20`
 *  warn at start that they expire (naming the file and the date written in it) and expose the
 *  dates on `/metrics`; the parts' certificates are renewed under the same CA while the cluster
 *  serves; the decode worker restarted with its new certificate (and its date on its `/metrics`) is
 *  trusted by the router and the prefill worker still holding the old ones (same CA); and the router's public HTTPS pair,
 *  replaced by a renewed one, is reloaded without a restart, with its warning and gauge updated. */
import assert from 'node:assert/strict'
import { type ChildProcess, execFile } from 'node:child_process'
import { X509Certificate } from 'node:crypto'
import { copyFileSync, mkdirSync, mkdtempSync, readFileSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import https from 'node:https'
import tls from 'node:tls'
import { after, before, describe, it } from 'node:test'
import { promisify } from 'node:util'
import { fetch as undiciFetch } from 'undici'
import { certExpiryMetric } from '../../src/link/cert-expiry.js'
import { newClusterToken } from '../../src/control/cluster-token.js'
import { forkPart, stopAll } from '../../src/engine/processes.js'
import { cliEntry } from '../../src/common/paths.js'
import { Oracle } from '../../src/soak/oracle.js'
import { certPollMs } from '../../src/link/tls.js'
import { echoModelDir } from '../helpers/paths.js'
import { pollUntil } from '../helpers/poll.js'
import {
  completesAsOracle,
  openaiTrusting,
  tlsFlags as clusterTlsFlags,
} from '../helpers/cluster.js'
import { freePort, makeTenants } from '../reliability/helpers.js'

const run = promisify(execFile)
const dir = mkdtempSync(join(tmpdir(), 'kvfence-certs-renew-'))
const certs = join(dir, 'certs')
const publicDir = join(dir, 'public') // the router's certificate for its clients
const clusterToken = newClusterToken()
const tlsFlags = (part: string) => clusterTlsFlags(certs, part)
const expiry = (file: string) => new Date(new X509Certificate(readFileSync(file)).validTo)
const serial = (file: string) => new X509Certificate(readFileSync(file)).serialNumber
const logLines = (name: string) =>
  readFileSync(join(dir, name), 'utf8')
    .split('\n')
    .filter((line) => line.startsWith('{'))
    .map((line) => JSON.parse(line) as { level: number; msg: string })
/** pino's number for warn. */
const warnLevel = 40

/** The warning a part logs for `<part>.crt` in `certs`, expiring on `date` in `numDays` days. */
function partWarning(part: string, date: Date, numDays: number): string {
  return `TLS certificate ${join(certs, `${part}.crt`)} expires on ${date.toISOString()} (in ${numDays} days): renew it under the same CA (kvfence certs renew DIR --parts ${part}, DIR the folder of certs init with ca.key), copy the new .crt and .key to ${certs} and restart this part`
}

describe('certs renew while the cluster serves', () => {
  const started: ChildProcess[] = []
  const ports = { prefill: 0, decode: 0, transfer: 0 }
  let decode: ChildProcess | undefined

  const startWorker = async (role: 'prefill' | 'decode', log: string) => {
    const args = [role, '--model', echoModelDir, '--pages', '32', '--host', '127.0.0.1']
    args.push('--port', String(ports[role]))
    if (role === 'decode')
      args.push('--transfer-host', '127.0.0.1', '--transfer-port', String(ports.transfer))
    const { child } = await forkPart(
      [...args, ...tlsFlags(role), '--log-level', 'warn'],
      {
        env: { ...process.env, KVFENCE_CLUSTER_TOKEN: clusterToken },
        logFile: join(dir, log),
        timeoutMs: 60_000,
        failure: (why, last) => new Error(`${role} did not start (${why.kind}): ${last}`),
      },
      started,
    )
    return child
  }

  before(async () => {
    await run(process.execPath, [cliEntry, 'certs', 'init', certs, '--days', '20'])
    mkdirSync(publicDir)
    for (const ext of ['crt', 'key'])
      copyFileSync(join(certs, `router.${ext}`), join(publicDir, `router.${ext}`))
    ports.prefill = await freePort()
    ports.decode = await freePort()
    ports.transfer = await freePort()
    ;[, decode] = await Promise.all([
      startWorker('prefill', 'prefill.log'),
      startWorker('decode', 'decode-1.log'),
    ])
  })
  after(async () => {
    await stopAll(started)
    rmSync(dir, { recursive: true, force: true })
  })

  it('warns at start, serves through a renewal and a restart with the new certificate, and reloads the public one', async () => {
    const tenants = makeTenants()
    const { ready } = await forkPart(
      [
        'router', '--model', echoModelDir, '--tenants', tenants.file, '--port', '0',
        '--prefill', `https://127.0.0.1:${ports.prefill}`,
        '--decode', `https://127.0.0.1:${ports.decode}`,
        '--cluster-tls-ca', join(certs, 'ca.crt'),
        '--cluster-tls-cert', join(certs, 'router.crt'),
        '--cluster-tls-key', join(certs, 'router.key'),
        '--tls-cert', join(publicDir, 'router.crt'),
        '--tls-key', join(publicDir, 'router.key'),
        '--log-level', 'warn',
      ],
      {
        env: { ...process.env, KVFENCE_CLUSTER_TOKEN: clusterToken },
        logFile: join(dir, 'router.log'),
        timeoutMs: 60_000,
        failure: (why, last) => new Error(`router did not start (${why.kind}): ${last}`),
      },
      started,
    ) // prettier-ignore
    const base = `https://127.0.0.1:${ready.port}`
    const ca = readFileSync(join(certs, 'ca.crt'))
    const { client: trusting, agent } = openaiTrusting(`${base}/v1`, tenants.a.key, ca)
    const oracle = new Oracle(echoModelDir, 32, 16)
    const prompt = 'the river walks near the stone garden'
    const completes = () => completesAsOracle(trusting, oracle, prompt, 8)
    const gauges = async () => {
      const text = await (await undiciFetch(`${base}/metrics`, { dispatcher: agent })).text()
      return text.split('\n').filter((line) => line.startsWith(`${certExpiryMetric}{`))
    }
    const gauge = (file: string, kind: string) =>
      `${certExpiryMetric}{file="${file}",kind="${kind}"} ${expiry(file).getTime() / 1000}`
    try {
      // At start: each part names its certificate and the CA, with the dates in the files.
      const caFile = join(certs, 'ca.crt')
      const caWarning = `TLS CA ${caFile} expires on ${expiry(caFile).toISOString()} (in 19 days): every certificate it signed stops being trusted then: make a new CA (kvfence certs init DIR --force), give every part its ca.crt and certificate, and restart them`
      for (const [log, part] of [
        ['decode-1.log', 'decode'],
        ['prefill.log', 'prefill'],
        ['router.log', 'router'],
      ]) {
        const tlsWarnings = () =>
          logLines(log)
            .filter((l) => l.level === warnLevel && l.msg.startsWith('TLS '))
            .map((l) => l.msg)
        // The log file is the part's stderr: its lines may land after it reports ready.
        await pollUntil(() => tlsWarnings().length >= 2, { timeoutMs: 10_000, intervalMs: 50 })
        const warnings = tlsWarnings()
        const own = partWarning(part, expiry(join(certs, `${part}.crt`)), 19)
        assert.deepEqual(warnings.slice(0, 2), [caWarning, own], log)
      }
      // The public certificate's warning is the router's third TLS line: wait for it as for the
      // first two (under load it landed after them, and the test read the log too early).
      const publicWarning = `TLS certificate ${join(publicDir, 'router.crt')} expires on ${expiry(join(publicDir, 'router.crt')).toISOString()} (in 19 days): replace it (and its key) with a new certificate of your public CA; the router reloads the pair without a restart`
      await pollUntil(() => logLines('router.log').some((l) => l.msg === publicWarning), {
        timeoutMs: 10_000,
        intervalMs: 50,
      })
      assert.ok(logLines('router.log').some((l) => l.msg === publicWarning))
      assert.deepEqual(await gauges(), [
        gauge(caFile, 'ca'),
        gauge(join(certs, 'router.crt'), 'part'),
        gauge(join(publicDir, 'router.crt'), 'https'),
      ])
      await completes()

      // Renew every part under the same CA while it serves.
      const caBefore = readFileSync(caFile, 'utf8')
      const oldDecodeSerial = serial(join(certs, 'decode.crt'))
      await run(process.execPath, [cliEntry, 'certs', 'renew', certs, '--days', '15'])
      assert.equal(readFileSync(caFile, 'utf8'), caBefore, 'the CA is untouched')
      assert.notEqual(serial(join(certs, 'decode.crt')), oldDecodeSerial)
      await completes()

      // The decode worker restarted with its renewed certificate: the router and the prefill
      // worker, still on the certificates they started with, trust it (same CA).
      await stopAll([decode!])
      decode = await startWorker('decode', 'decode-2.log')
      const renewedWarnings = () =>
        logLines('decode-2.log')
          .filter((l) => l.level === warnLevel && l.msg.startsWith('TLS certificate'))
          .map((l) => l.msg)
      // The log file is the part's stderr: its lines may land after it reports ready.
      await pollUntil(async () => renewedWarnings().length > 0, {
        timeoutMs: 10_000,
        intervalMs: 50,
      })
      assert.deepEqual(renewedWarnings(), [
        partWarning('decode', expiry(join(certs, 'decode.crt')), 14),
      ])
      // Its /metrics (mutual TLS, as the router's scrape) gives the new date.
      const workerMetrics = await new Promise<string>((resolve, reject) => {
        const req = https.get(
          {
            host: '127.0.0.1',
            port: ports.decode,
            path: '/metrics',
            ca,
            cert: readFileSync(join(certs, 'router.crt')),
            key: readFileSync(join(certs, 'router.key')),
            agent: false,
          },
          (res) => {
            let body = ''
            res.on('data', (chunk: Buffer) => (body += chunk.toString('utf8')))
            res.on('end', () => resolve(body))
          },
        )
        req.on('error', reject)
      })
      const decodeCert = join(certs, 'decode.crt')
      assert.ok(
        workerMetrics.includes(
          `${certExpiryMetric}{file="${decodeCert}",kind="part",role="decode"} ${expiry(decodeCert).getTime() / 1000}\n`,
        ),
        workerMetrics
          .split('\n')
          .filter((l) => l.startsWith(certExpiryMetric))
          .join('\n'),
      )
      const shown = await new Promise<string>((resolve, reject) => {
        const socket = tls.connect(
          {
            host: '127.0.0.1',
            port: ports.transfer,
            ca,
            cert: readFileSync(join(certs, 'prefill.crt')),
            key: readFileSync(join(certs, 'prefill.key')),
          },
          () => {
            resolve(socket.getPeerCertificate().serialNumber)
            socket.destroy()
          },
        )
        socket.on('error', reject)
      })
      assert.equal(shown, serial(join(certs, 'decode.crt')), 'the restarted worker shows it')
      await pollUntil(async () => (await completes(), true), { timeoutMs: 20_000, intervalMs: 200 })
      await completes()

      // The router's public pair replaced by the renewed one: reloaded, warned, gauged.
      for (const ext of ['key', 'crt'])
        copyFileSync(join(certs, `router.${ext}`), join(publicDir, `router.${ext}`))
      const publicCert = join(publicDir, 'router.crt')
      const reloadWarning = `TLS certificate ${publicCert} expires on ${expiry(publicCert).toISOString()} (in 14 days): replace it (and its key) with a new certificate of your public CA; the router reloads the pair without a restart`
      assert.ok(
        await pollUntil(async () => logLines('router.log').some((l) => l.msg === reloadWarning), {
          timeoutMs: certPollMs * 5,
          intervalMs: 200,
        }),
        'the reload is followed by the warning with the new date',
      )
      assert.ok((await gauges()).includes(gauge(publicCert, 'https')))
      await completes()
    } finally {
      await agent.close()
    }
  })
})
