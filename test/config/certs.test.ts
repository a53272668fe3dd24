/** `kvfence certs init` and `kvfence certs renew`: a cluster CA and one certificate per part, read
 *  back with Node's own X.509 parser (an implementation independent of the library that wrote
 *  them). */
import assert from 'node:assert/strict'
import { X509Certificate, createPrivateKey } from 'node:crypto'
import {
  copyFileSync,
  existsSync,
  mkdirSync,
  mkdtempSync,
  readFileSync,
  readdirSync,
  rmSync,
  statSync,
  writeFileSync,
} from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { after, describe, it } from 'node:test'
import { createAuthority } from '../../src/cli/certs.js'
import { kvfenceOrThrow } from '../helpers/cli.js'

/** `kvfence certs …` in this process (test/helpers/cli.ts), settling as the process would. */
const kvfence = (...args: string[]) => kvfenceOrThrow('certs', ...args)
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

/** The one line and exit code 2 of a refused `kvfence certs …`. */
function refusedWith(line: string) {
  return (err: { code: number; stderr: string }) => {
    assert.equal(err.code, 2)
    assert.equal(err.stderr, `${line}\n`)
    return true
  }
}

describe('kvfence certs renew', () => {
  const read = (dir: string, name: string) => readFileSync(join(dir, name), 'utf8')

  it('issues the named parts again with new keys under the same CA, keeping their hosts; ca.crt, ca.key and the other parts untouched', async () => {
    const dir = join(root, 'renew-a')
    await kvfence('init', dir, '--hosts', '10.0.0.7,fd00::7,p1.example', '--days', '100')
    const before = Object.fromEntries(readdirSync(dir).map((name) => [name, read(dir, name)]))
    const { stdout } = await kvfence('renew', dir, '--parts', 'decode,router', '--days', '20')
    assert.equal(
      stdout,
      ['decode.crt', 'decode.key', 'router.crt', 'router.key'].map((n) => join(dir, n)).join('\n') +
        '\n',
    )
    assert.deepEqual(readdirSync(dir).sort(), Object.keys(before).sort(), 'no file left behind')
    for (const name of ['ca.crt', 'ca.key', 'prefill.crt', 'prefill.key'])
      assert.equal(read(dir, name), before[name], `${name} unchanged`)
    const ca = new X509Certificate(read(dir, 'ca.crt'))
    for (const part of ['decode', 'router']) {
      const cert = new X509Certificate(read(dir, `${part}.crt`))
      const old = new X509Certificate(before[`${part}.crt`])
      assert.notEqual(read(dir, `${part}.key`), before[`${part}.key`], `${part}: a new key`)
      assert.notEqual(
        cert.publicKey.export({ type: 'spki', format: 'pem' }),
        old.publicKey.export({ type: 'spki', format: 'pem' }),
        `${part}: a new public key`,
      )
      assert.ok(cert.checkPrivateKey(createPrivateKey(read(dir, `${part}.key`))))
      assert.ok(
        cert.verify(ca.publicKey) && cert.checkIssued(ca),
        `${part}.crt is signed by the CA`,
      )
      assert.equal(cert.subjectAltName, old.subjectAltName, `${part}: the same hosts`)
      assert.equal(cert.subject, old.subject)
      assert.equal(statSync(join(dir, `${part}.key`)).mode & 0o777, 0o600)
      assert.equal(statSync(join(dir, `${part}.crt`)).mode & 0o777, 0o644)
      const days = (Date.parse(cert.validTo) - Date.now()) / 86_400_000
      assert.ok(days > 19.9 && days <= 20, `valid for 20 days, got ${days}`)
    }
  })

  it('renews every part by default, with --hosts replacing the hosts, ending with the CA when it expires first', async () => {
    const dir = join(root, 'renew-b')
    await kvfence('init', dir, '--hosts', '10.0.0.7', '--days', '40')
    const caBefore = read(dir, 'ca.crt')
    const caNotAfter = new X509Certificate(caBefore).validTo
    const { stderr } = await kvfence('renew', dir, '--hosts', '10.0.0.8,p2.example')
    assert.equal(
      stderr,
      `kvfence: the renewed certificates expire with the CA in ${join(dir, 'ca.crt')}, on ${new Date(caNotAfter).toISOString()}: make a new CA before then (kvfence certs init ${dir} --force)\n`,
    )
    assert.equal(read(dir, 'ca.crt'), caBefore)
    for (const part of ['router', 'prefill', 'decode']) {
      const cert = new X509Certificate(read(dir, `${part}.crt`))
      assert.equal(
        cert.subjectAltName,
        'IP Address:127.0.0.1, DNS:localhost, IP Address:10.0.0.8, DNS:p2.example',
      )
      assert.equal(cert.validTo, caNotAfter)
    }
  })

  it('refuses, with one line and exit 2 and nothing written: no CA, a CA key of another CA, an unknown part, a bad host, a CA expiring first or expired, a part with no hosts to keep', async () => {
    const dir = join(root, 'renew-c')
    await kvfence('init', dir, '--days', '10')
    const before = Object.fromEntries(readdirSync(dir).map((name) => [name, read(dir, name)]))
    const caNotAfter = new Date(new X509Certificate(before['ca.crt']).validTo).toISOString()
    await assert.rejects(
      kvfence('renew', dir, '--days', '11'),
      (err: { code: number; stderr: string }) => {
        assert.equal(err.code, 2)
        assert.match(
          err.stderr,
          new RegExp(
            `^kvfence: the CA ${join(dir, 'ca.crt')} expires on ${caNotAfter}, before certificates of 11 days would \\(\\S+\\): give --days 9 or fewer, or make a new CA \\(kvfence certs init ${dir} --force\\)\\n$`,
          ),
        )
        return true
      },
    )
    await assert.rejects(
      kvfence('renew', dir, '--parts', 'decode,gateway'),
      refusedWith(
        `error: option '--parts <list>' argument 'decode,gateway' is invalid. "gateway" is not a part; the parts are router, prefill, decode`,
      ),
    )
    await assert.rejects(
      kvfence('renew', dir, '--hosts', '10.0.0.6:8101'),
      refusedWith(
        `error: option '--hosts <list>' argument '10.0.0.6:8101' is invalid. "10.0.0.6:8101" is neither an IP address nor a host name (letters, digits, hyphens and dots; no scheme, port or path)`,
      ),
    )
    const other = join(root, 'renew-other')
    await kvfence('init', other)
    const mixed = join(root, 'renew-mixed')
    mkdirSync(mixed)
    for (const name of Object.keys(before)) copyFileSync(join(dir, name), join(mixed, name))
    copyFileSync(join(other, 'ca.key'), join(mixed, 'ca.key'))
    await assert.rejects(
      kvfence('renew', mixed),
      refusedWith(
        `kvfence: ${join(mixed, 'ca.key')} is not the key of ${join(mixed, 'ca.crt')}: give the pair written by one kvfence certs init`,
      ),
    )
    const empty = join(root, 'renew-empty')
    mkdirSync(empty)
    await assert.rejects(
      kvfence('renew', empty),
      refusedWith(
        `kvfence: ${join(empty, 'ca.crt')} is missing: renew needs the CA of kvfence certs init in ${empty} (ca.crt and ca.key)`,
      ),
    )
    await assert.rejects(
      kvfence('renew', join(root, 'renew-none')),
      refusedWith(`kvfence: ${join(root, 'renew-none')} is not a folder of kvfence certs init`),
    )
    const expired = join(root, 'renew-expired')
    mkdirSync(expired)
    const caEnded = new Date(Math.floor(Date.now() / 1000) * 1000 - 86_400_000)
    const oldCa = await createAuthority({
      notBefore: new Date(caEnded.getTime() - 86_400_000),
      notAfter: caEnded,
    })
    writeFileSync(join(expired, 'ca.crt'), oldCa.certPem)
    writeFileSync(join(expired, 'ca.key'), oldCa.keyPem, { mode: 0o600 })
    await assert.rejects(
      kvfence('renew', expired, '--hosts', '10.0.0.7'),
      refusedWith(
        `kvfence: the CA ${join(expired, 'ca.crt')} expired on ${caEnded.toISOString()}: make a new one (kvfence certs init ${expired} --force) and give every part its ca.crt`,
      ),
    )
    rmSync(join(dir, 'decode.crt'))
    await assert.rejects(
      kvfence('renew', dir, '--parts', 'prefill,decode'),
      refusedWith(
        `kvfence: ${join(dir, 'decode.crt')} is missing, so its hosts are unknown: give --hosts`,
      ),
    )
    assert.deepEqual(
      readdirSync(dir).sort(),
      Object.keys(before)
        .filter((n) => n !== 'decode.crt')
        .sort(),
    )
    for (const [name, text] of Object.entries(before))
      if (name !== 'decode.crt')
        assert.equal(read(dir, name), text, `${name} unchanged by the refusals`)
  })
})
