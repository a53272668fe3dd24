/** Warnings before a TLS certificate expires (src/link/cert-expiry.ts), with certificates issued here
 *  for known dates: a warning from 30 days before, naming the file, the date and the command; an
 *  error once past; the gauge of each file's expiry; the daily re-check; and a part refused at
 *  start when its CA has expired (every handshake would fail on it). */
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { X509Certificate } from 'node:crypto'
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { after, before, describe, it } from 'node:test'
import { promisify } from 'node:util'
import { Registry } from 'prom-client'
import {
  certExpiryMetric,
  certExpiryOf,
  expiryNotice,
  tlsExpiries,
  watchCertExpiry,
} from '../../src/link/cert-expiry.js'
import { createAuthority, issuePartCert } from '../../src/cli/certs.js'
import { cliEntry } from '../../src/common/paths.js'
import { loadTlsMaterial } from '../../src/link/tls.js'
import { pollUntil } from '../helpers/poll.js'

const root = mkdtempSync(join(tmpdir(), 'kvfence-cert-expiry-'))
const day = 86_400_000
// Whole seconds: X.509 keeps validity to the second.
const start = new Date(Math.floor(Date.now() / 1000) * 1000)
const partEnds = new Date(start.getTime() + 10 * day)
const caEnds = new Date(start.getTime() + 40 * day)
const files = {
  ca: join(root, 'ca.crt'),
  cert: join(root, 'decode.crt'),
  key: join(root, 'decode.key'),
}

/** A log that keeps its lines, each prefixed by its level. */
function recordingLog() {
  const lines: string[] = []
  return {
    lines,
    warn: (m: string) => lines.push(`warn ${m}`),
    error: (m: string) => lines.push(`error ${m}`),
  }
}

const partWarning = (numDays: number) =>
  `TLS certificate ${files.cert} expires on ${partEnds.toISOString()} (in ${numDays} days): renew it under the same CA (kvfence certs renew DIR --parts decode, DIR the folder of certs init with ca.key), copy the new .crt and .key to ${root} and restart this part`

describe('certificate expiry', () => {
  before(async () => {
    const ca = await createAuthority({ notBefore: start, notAfter: caEnds })
    const decode = await issuePartCert(ca, 'decode', ['127.0.0.1'], {
      notBefore: start,
      notAfter: partEnds,
    })
    writeFileSync(files.ca, ca.certPem)
    writeFileSync(files.cert, decode.certPem)
    writeFileSync(files.key, decode.keyPem, { mode: 0o600 })
  })
  after(() => rmSync(root, { recursive: true, force: true }))

  it('a part loading its files knows both dates, as Node reads them from the files', () => {
    const expiries = tlsExpiries(loadTlsMaterial(files))
    assert.deepEqual(expiries, [
      { file: files.ca, kind: 'ca', notAfter: caEnds },
      { file: files.cert, kind: 'part', notAfter: partEnds },
    ])
    // The dates are the ones issued (an independent parser agrees).
    assert.equal(Date.parse(new X509Certificate(decodePem()).validTo), partEnds.getTime())
  })

  it('warns within 30 days, naming file, date and command; an error once past; nothing before', () => {
    const [ca, part] = tlsExpiries(loadTlsMaterial(files))
    const at = (msBeforeEnd: number, end = partEnds) => new Date(end.getTime() - msBeforeEnd)
    assert.deepEqual(expiryNotice(part, at(10 * day - 60_000)), {
      level: 'warn',
      message: partWarning(9),
    })
    assert.deepEqual(expiryNotice(part, at(30 * day)), {
      level: 'warn',
      message: partWarning(30),
    })
    assert.equal(expiryNotice(part, at(30 * day + 1_000)), null)
    assert.deepEqual(expiryNotice(part, at(-1_000)), {
      level: 'error',
      message: `TLS certificate ${files.cert} expired on ${partEnds.toISOString()}: renew it under the same CA (kvfence certs renew DIR --parts decode, DIR the folder of certs init with ca.key), copy the new .crt and .key to ${root} and restart this part`,
    })
    assert.equal(expiryNotice(ca, start), null, 'the CA has 40 days left')
    assert.deepEqual(expiryNotice(ca, at(day / 2, caEnds)), {
      level: 'warn',
      message: `TLS CA ${files.ca} expires on ${caEnds.toISOString()} (in less than a day): every certificate it signed stops being trusted then: make a new CA (kvfence certs init DIR --force), give every part its ca.crt and certificate, and restart them`,
    })
    const https = certExpiryOf(decodePem(), '/etc/ssl/api.crt', 'https')!
    assert.equal(
      expiryNotice(https, start)?.message,
      `TLS certificate /etc/ssl/api.crt expires on ${partEnds.toISOString()} (in 10 days): replace it (and its key) with a new certificate of your public CA; the router reloads the pair without a restart`,
    )
  })

  it('the watch logs when set and at each re-check, and the gauge gives each expiry in Unix seconds', async () => {
    const log = recordingLog()
    const registry = new Registry()
    let now = start
    const watch = watchCertExpiry({ log, registry, recheckMs: 20, now: () => now })
    try {
      watch.set(tlsExpiries(loadTlsMaterial(files)))
      assert.deepEqual(log.lines, [`warn ${partWarning(10)}`], 'at start: the part, not the CA')
      const text = await registry.metrics()
      assert.deepEqual(
        text.split('\n').filter((l) => l.startsWith(`${certExpiryMetric}{`)),
        [
          `${certExpiryMetric}{file="${files.ca}",kind="ca"} ${caEnds.getTime() / 1000}`,
          `${certExpiryMetric}{file="${files.cert}",kind="part"} ${partEnds.getTime() / 1000}`,
        ],
      )
      // Time passes without a reload: the re-check says it again, then says it has expired.
      now = new Date(partEnds.getTime() + 1_000)
      assert.ok(
        await pollUntil(() => log.lines.some((l) => l.startsWith('error ')), {
          timeoutMs: 5_000,
          intervalMs: 10,
        }),
      )
      assert.equal(
        log.lines.find((l) => l.startsWith('error ')),
        `error TLS certificate ${files.cert} expired on ${partEnds.toISOString()}: renew it under the same CA (kvfence certs renew DIR --parts decode, DIR the folder of certs init with ca.key), copy the new .crt and .key to ${root} and restart this part`,
      )
    } finally {
      watch.stop()
    }
  })

  it('a file that is both the router’s cluster certificate and its public one keeps both series', async () => {
    // An operator may serve clients with router.crt of certs init too: the https expiry set at
    // start must not replace the part's (the gauge lost kind="part" when keyed by file alone).
    const log = recordingLog()
    const registry = new Registry()
    const watch = watchCertExpiry({ log, registry, now: () => start })
    try {
      watch.set(tlsExpiries(loadTlsMaterial(files)))
      watch.set([certExpiryOf(decodePem(), files.cert, 'https')!])
      const text = await registry.metrics()
      assert.deepEqual(
        text.split('\n').filter((l) => l.startsWith(`${certExpiryMetric}{`)),
        [
          `${certExpiryMetric}{file="${files.ca}",kind="ca"} ${caEnds.getTime() / 1000}`,
          `${certExpiryMetric}{file="${files.cert}",kind="part"} ${partEnds.getTime() / 1000}`,
          `${certExpiryMetric}{file="${files.cert}",kind="https"} ${partEnds.getTime() / 1000}`,
        ],
      )
      assert.deepEqual(
        watch.list().map((e) => e.kind),
        ['ca', 'part', 'https'],
      )
    } finally {
      watch.stop()
    }
  })

  it('a part whose CA has expired is refused at start, one line naming the file and the date', async () => {
    const dir = join(root, 'expired-ca')
    const caEnded = new Date(start.getTime() - day)
    const ca = await createAuthority({
      notBefore: new Date(start.getTime() - 9 * day),
      notAfter: caEnded,
    })
    const decode = await issuePartCert(ca, 'decode', ['127.0.0.1'], {
      notBefore: start,
      notAfter: partEnds,
    })
    const expired = { ca: `${dir}-ca.crt`, cert: `${dir}-decode.crt`, key: `${dir}-decode.key` }
    writeFileSync(expired.ca, ca.certPem)
    writeFileSync(expired.cert, decode.certPem)
    writeFileSync(expired.key, decode.keyPem, { mode: 0o600 })
    const line = `TLS CA ${expired.ca} expired on ${caEnded.toISOString()}: make a new CA (kvfence certs init DIR --force) and give every part its ca.crt and certificate`
    assert.throws(() => loadTlsMaterial(expired), { message: line })
    const args = ['decode', '--port', '0', '--transfer-port', '0']
    args.push('--tls-ca', expired.ca, '--tls-cert', expired.cert, '--tls-key', expired.key)
    const started = await promisify(execFile)(process.execPath, [cliEntry, ...args], {
      timeout: 20_000,
    }).then(
      () => ({ code: 0, stderr: '' }),
      (err: { code: number; stderr: string }) => err,
    )
    assert.equal(started.code, 2)
    assert.equal(started.stderr, `kvfence: ${line}\n`)
  })
})

function decodePem(): Buffer {
  return loadTlsMaterial(files).cert
}
