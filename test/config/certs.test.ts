/** `kvfence certs init`: a cluster CA and one certificate per part, read back with Node's own
 *  X.509 parser (an implementation independent of the library that wrote them). */
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { X509Certificate, createPrivateKey } from 'node:crypto'
import { existsSync, mkdtempSync, readFileSync, rmSync, statSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { after, describe, it } from 'node:test'
import { promisify } from 'node:util'
import { cliEntry } from '../../src/paths.js'

const run = promisify(execFile)
const kvfence = (...args: string[]) => run(process.execPath, [cliEntry, 'certs', ...args])
const root = mkdtempSync(join(tmpdir(), 'kvfence-certs-'))

describe('kvfence certs init', () => {
  after(() => rmSync(root, { recursive: true, force: true }))

  it('makes a CA and a server-and-client certificate per part, keys 0600 in a 0700 folder', async () => {
    const dir = join(root, 'a')
    await kvfence('init', dir, '--hosts', '10.0.0.7,p1.example', '--days', '30')
    assert.equal(statSync(dir).mode & 0o777, 0o700)
    const ca = new X509Certificate(readFileSync(join(dir, 'ca.crt')))
    assert.equal(ca.ca, true)
    assert.equal(statSync(join(dir, 'ca.key')).mode & 0o777, 0o600)
    for (const part of ['router', 'prefill', 'decode']) {
      const cert = new X509Certificate(readFileSync(join(dir, `${part}.crt`)))
      assert.equal(statSync(join(dir, `${part}.crt`)).mode & 0o777, 0o644)
      assert.equal(statSync(join(dir, `${part}.key`)).mode & 0o777, 0o600)
      assert.equal(cert.ca, false)
      assert.ok(cert.verify(ca.publicKey), `${part}.crt is signed by the CA`)
      assert.ok(cert.checkIssued(ca), `${part}.crt names the CA as issuer`)
      assert.equal(
        cert.subjectAltName,
        'IP Address:127.0.0.1, DNS:localhost, IP Address:10.0.0.7, DNS:p1.example',
      )
      assert.deepEqual(cert.keyUsage, ['1.3.6.1.5.5.7.3.1', '1.3.6.1.5.5.7.3.2'])
      const key = createPrivateKey(readFileSync(join(dir, `${part}.key`)))
      assert.ok(cert.checkPrivateKey(key), `${part}.key belongs to ${part}.crt`)
      const days = (Date.parse(cert.validTo) - Date.now()) / 86_400_000
      assert.ok(days > 29.9 && days <= 30, `valid for 30 days, got ${days}`)
    }
  })

  it('refuses to overwrite existing files (one line, exit 2) unless --force', async () => {
    const dir = join(root, 'b')
    await kvfence('init', dir)
    const before = readFileSync(join(dir, 'ca.crt'), 'utf8')
    await assert.rejects(kvfence('init', dir), (err: { code: number; stderr: string }) => {
      assert.equal(err.code, 2)
      assert.equal(
        err.stderr,
        `kvfence: ${join(dir, 'ca.crt')} exists; refusing to overwrite it (use --force to replace the cluster's certificates)\n`,
      )
      return true
    })
    assert.equal(readFileSync(join(dir, 'ca.crt'), 'utf8'), before)
    await kvfence('init', dir, '--force')
    assert.notEqual(readFileSync(join(dir, 'ca.crt'), 'utf8'), before)
  })

  it('refuses a --hosts entry that is neither an IP nor a host name, before writing anything', async () => {
    for (const [hosts, bad] of [
      ['10.0.0.6,http://10.0.0.7', 'http://10.0.0.7'],
      ['10.0.0.6:8101', '10.0.0.6:8101'],
      ['p1.example,p 2.example', 'p 2.example'],
      ['999.1.1.1', '999.1.1.1'],
      ['-p1.example', '-p1.example'],
    ]) {
      const dir = join(root, 'c')
      await assert.rejects(
        kvfence('init', dir, '--hosts', hosts),
        (err: { code: number; stderr: string }) => {
          assert.equal(err.code, 2)
          assert.equal(
            err.stderr,
            `error: option '--hosts <list>' argument '${hosts}' is invalid. "${bad}" is neither an IP address nor a host name (letters, digits, hyphens and dots; no scheme, port or path)\n`,
          )
          return true
        },
      )
      assert.equal(existsSync(dir), false, `nothing written for --hosts ${hosts}`)
    }
    // Names and addresses of every kind still pass.
    await kvfence('init', join(root, 'd'), '--hosts', 'p1,p-2.example.org,10.0.0.7,fd00::7')
  })
})
