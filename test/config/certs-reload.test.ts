/** The router's public HTTPS certificate is reloaded when its files change (reloadCertOnChange in
 *  src/link/tls.ts): after `kvfence certs init --force` rewrites them, a new connection is served with
 *  the new certificate, without a restart; a broken or expired pair is refused and the previous
 *  one kept; a pair refused for its key's mode is installed once `chmod 600` fixes the mode. */
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { X509Certificate } from 'node:crypto'
import { chmodSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import https from 'node:https'
import type { AddressInfo } from 'node:net'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { after, describe, it } from 'node:test'
import { promisify } from 'node:util'
import { issuePartCert, loadAuthority } from '../../src/cli/certs.js'
import { cliEntry } from '../../src/common/paths.js'
import { certPollMs, loadCertPair, reloadCertOnChange } from '../../src/link/tls.js'

const run = promisify(execFile)
const dir = mkdtempSync(join(tmpdir(), 'kvfence-certs-reload-'))
const files = { cert: join(dir, 'router.crt'), key: join(dir, 'router.key') }

/** The serial number of the certificate a new connection to `port` is shown. */
function servedSerial(port: number): Promise<string> {
  return new Promise((resolve, reject) => {
    const req = https.get(
      { host: '127.0.0.1', port, path: '/', rejectUnauthorized: false, agent: false },
      (res) => {
        resolve(
          res.socket &&
            (res.socket as import('node:tls').TLSSocket).getPeerCertificate().serialNumber,
        )
        res.resume()
      },
    )
    req.on('error', reject)
  })
}

const fileSerial = () => new X509Certificate(readFileSync(files.cert)).serialNumber
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms))

describe('HTTPS certificate reload', () => {
  after(() => rmSync(dir, { recursive: true, force: true }))

  it('serves the rewritten certificate to new connections, and keeps the old one over a bad pair', async () => {
    await run(process.execPath, [cliEntry, 'certs', 'init', dir])
    const server = https.createServer(loadCertPair(files), (_req, res) => res.end('ok'))
    const lines: string[] = []
    const log = { info: (m: string) => lines.push(m), warn: (m: string) => lines.push(m) }
    const installed: string[] = []
    const stop = reloadCertOnChange(server, files, {}, log, (pair) =>
      installed.push(new X509Certificate(pair.cert).serialNumber),
    )
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
    const { port } = server.address() as AddressInfo
    try {
      const first = fileSerial()
      assert.equal(await servedSerial(port), first)
      // mtime has a 1 ms or coarser grain: make sure the rewrite is seen as a change.
      await sleep(20)
      await run(process.execPath, [cliEntry, 'certs', 'init', dir, '--force'])
      const second = fileSerial()
      assert.notEqual(second, first)
      await sleep(certPollMs * 2 + 500)
      assert.equal(await servedSerial(port), second)
      assert.equal(lines.at(-1), `reloaded the TLS certificate ${files.cert}`)
      assert.equal(lines.filter((l) => l.startsWith('reloaded')).length, 1, 'installed once')

      writeFileSync(files.key, 'not a key\n')
      await sleep(certPollMs * 2 + 500)
      assert.equal(await servedSerial(port), second, 'the previous pair is kept')
      assert.match(lines.at(-1) ?? '', /^kept the previous TLS certificate: /)

      // An expired pair is checked as at start, and refused; the line says to replace it from
      // the public CA (certs renew would issue one of the cluster CA, which clients distrust).
      const ca = await loadAuthority(
        readFileSync(join(dir, 'ca.crt'), 'utf8'),
        readFileSync(join(dir, 'ca.key'), 'utf8'),
      )
      const expiredOn = new Date(Math.floor(Date.now() / 1000) * 1000 - 86_400_000)
      const expired = await issuePartCert(ca, 'router', ['127.0.0.1'], {
        notBefore: new Date(expiredOn.getTime() - 86_400_000),
        notAfter: expiredOn,
      })
      writeFileSync(files.key, expired.keyPem)
      writeFileSync(files.cert, expired.certPem)
      await sleep(certPollMs * 2 + 500)
      assert.equal(await servedSerial(port), second, 'the previous pair is kept')
      assert.equal(
        lines.at(-1),
        `kept the previous TLS certificate: TLS certificate ${files.cert} expired on ${expiredOn.toISOString()}: replace it (and its key) with a new certificate of your public CA`,
      )
      assert.deepEqual(installed, [second], 'onInstalled: each pair installed, once')

      // A key open to other users is refused; `chmod 600`, as the line says, changes only the
      // key's mode (its ctime, not its mtime), and the pair is then installed.
      const renewed = await issuePartCert(ca, 'router', ['127.0.0.1'], {
        notBefore: new Date(Date.now() - 86_400_000),
        notAfter: new Date(Date.now() + 30 * 86_400_000),
      })
      writeFileSync(files.cert, renewed.certPem)
      writeFileSync(files.key, renewed.keyPem)
      chmodSync(files.key, 0o644)
      await sleep(certPollMs * 2 + 500)
      assert.equal(await servedSerial(port), second, 'the previous pair is kept')
      assert.equal(
        lines.at(-1),
        `kept the previous TLS certificate: TLS key ${files.key} has mode 0644, open to other users: chmod 600 ${files.key}`,
      )
      chmodSync(files.key, 0o600)
      await sleep(certPollMs * 2 + 500)
      const third = new X509Certificate(renewed.certPem).serialNumber
      assert.equal(await servedSerial(port), third, 'installed after chmod 600')
      assert.equal(lines.at(-1), `reloaded the TLS certificate ${files.cert}`)
      assert.deepEqual(installed, [second, third])
    } finally {
      stop()
      server.close()
    }
  })
})
