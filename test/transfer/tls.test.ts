/** The transfer over mutual TLS 1.3, with certificates made by the real `kvfence certs init`:
 *  it delivers exactly the pages plaintext delivers, and every peer that cannot show (or check) a
 *  certificate of the cluster CA fails with one line naming the cause, while the receiver's
 *  session never sees a frame of it. */
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { chmodSync, copyFileSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import net from 'node:net'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { after, before, describe, it } from 'node:test'
import { promisify } from 'node:util'
import { issuePartCert, loadAuthority } from '../../src/cli/certs.js'
import { cliEntry } from '../../src/common/paths.js'
import { loadTlsMaterial, type TlsMaterial } from '../../src/link/tls.js'
import type { TransferLog, TransferServer } from '../../src/transfer/receiver.js'
import {
  RecordingHooks,
  clientFor,
  closeEverything,
  helloBytes,
  makeSpec,
  outgoing,
  sendAndSettle,
  startServer,
  until,
  type TransferSpec,
} from './fixtures.js'

const root = mkdtempSync(join(tmpdir(), 'kvfence-tls-'))
const run = promisify(execFile)

/** The TLS files of `part` in a `certs init` folder. */
function material(dir: string, part: string): TlsMaterial {
  return loadTlsMaterial({
    ca: join(root, dir, 'ca.crt'),
    cert: join(root, dir, `${part}.crt`),
    key: join(root, dir, `${part}.key`),
  })
}

/** A log that keeps its lines. */
function recordingLog(): TransferLog & { lines: string[] } {
  const lines: string[] = []
  return { lines, warn: (_fields, message) => lines.push(message) }
}

/** Send `spec` from a client with `options` to `server`; the error (or null) and the hooks. */
async function sendTo(
  server: TransferServer,
  hooks: RecordingHooks,
  spec: TransferSpec,
  tls?: TlsMaterial,
): Promise<string | null> {
  hooks.expect(spec)
  const client = clientFor(server, tls === undefined ? {} : { tls })
  const err = await sendAndSettle(client, outgoing(spec))
  await client.close()
  return err === null ? null : err.message
}

/** Start `kvfence decode` with these TLS files; its exit code and stderr. A part that started
 *  anyway runs until killed: after 20 s it is, and the test fails rather than waits. */
async function startDecode(files: {
  ca: string
  cert: string
  key: string
}): Promise<{ code: number; stderr: string }> {
  const args = ['decode', '--port', '0', '--transfer-port', '0']
  args.push('--tls-ca', files.ca, '--tls-cert', files.cert, '--tls-key', files.key)
  return run(process.execPath, [cliEntry, ...args], { timeout: 20_000 }).then(
    () => ({ code: 0, stderr: '' }),
    (err: { code: number; stderr: string }) => err,
  )
}

describe('transfer over mutual TLS', () => {
  let cluster: { decode: TlsMaterial; prefill: TlsMaterial }
  let otherPrefill: TlsMaterial
  let expiredDecode: TlsMaterial
  const day = 86_400_000
  // Whole seconds: X.509 keeps validity to the second.
  const expiredOn = new Date(Math.floor(Date.now() / 1000) * 1000 - day)
  const validFrom = new Date(Math.floor(Date.now() / 1000) * 1000 + day)

  before(async () => {
    // Two clusters, each from the real command: "other" stands for a CA this cluster never trusts.
    for (const dir of ['cluster', 'other'])
      await run(process.execPath, [cliEntry, 'certs', 'init', join(root, dir)])
    cluster = { decode: material('cluster', 'decode'), prefill: material('cluster', 'prefill') }
    otherPrefill = material('other', 'prefill')
    // A decode certificate of this cluster's CA whose notAfter has passed.
    const ca = await loadAuthority(
      readFileSync(join(root, 'cluster', 'ca.crt'), 'utf8'),
      readFileSync(join(root, 'cluster', 'ca.key'), 'utf8'),
    )
    const expired = await issuePartCert(ca, 'decode', ['127.0.0.1'], {
      notBefore: new Date(Date.now() - 10 * day),
      notAfter: expiredOn,
    })
    const future = await issuePartCert(ca, 'decode', ['127.0.0.1'], {
      notBefore: validFrom,
      notAfter: new Date(Date.now() + 10 * day),
    })
    for (const [name, issued] of [
      ['expired', expired],
      ['future', future],
    ] as const) {
      writeFileSync(join(root, 'cluster', `${name}.crt`), issued.certPem)
      writeFileSync(join(root, 'cluster', `${name}.key`), issued.keyPem, { mode: 0o600 })
    }
    // Read as they are: loadTlsMaterial refuses them (see the tests of a part's start below).
    expiredDecode = {
      ca: readFileSync(join(root, 'cluster', 'ca.crt')),
      cert: readFileSync(join(root, 'cluster', 'expired.crt')),
      key: readFileSync(join(root, 'cluster', 'expired.key')),
    }
  })
  after(async () => {
    await closeEverything()
    rmSync(root, { recursive: true, force: true })
  })

  it('delivers exactly the pages a plaintext transfer delivers', async () => {
    const spec = makeSpec(1000, 16, 4096)
    for (const tls of [undefined, cluster]) {
      const hooks = new RecordingHooks()
      const server = await startServer(hooks, tls === undefined ? {} : { tls: tls.decode })
      assert.equal(server.isTls, tls !== undefined)
      assert.equal(await sendTo(server, hooks, spec, tls?.prefill), null)
      const r = hooks.of(spec.transferId)
      assert.equal(r.completedWith, spec.firstTokenId)
      assert.equal(r.written.size, spec.numPages)
      for (let o = 0; o < spec.numPages; o++)
        assert.deepEqual(r.written.get(o)?.payload, spec.pages[o], `page ${o}`)
      assert.deepEqual(hooks.violations, [])
      server.check()
    }
  })

  it('a receiver whose certificate is not from the trusted CA is refused by the sender', async () => {
    const hooks = new RecordingHooks()
    const server = await startServer(hooks, { tls: material('other', 'decode') })
    const message = await sendTo(server, hooks, makeSpec(), cluster.prefill)
    assert.equal(
      message,
      `connection_closed: transfer to 127.0.0.1:${server.port}: TLS handshake failed: self-signed certificate in certificate chain (the peer’s certificate is not from the cluster CA)`,
    )
    assert.equal(hooks.reservations.length, 0)
  })

  it('a sender whose certificate is not from the CA is dropped before any frame is read', async () => {
    const hooks = new RecordingHooks()
    const log = recordingLog()
    const server = await startServer(hooks, { tls: cluster.decode, log })
    // The sender trusts this cluster's CA but shows the other cluster's certificate.
    const sender = { ...otherPrefill, ca: cluster.prefill.ca }
    const message = await sendTo(server, hooks, makeSpec(), sender)
    assert.equal(
      message,
      `connection_closed: transfer to 127.0.0.1:${server.port}: TLS handshake failed: the receiver closed the connection before its HELLO (does it trust this part's certificate?)`,
    )
    assert.equal(hooks.reservations.length, 0, 'no BEGIN reached the hooks')
    assert.equal(server.stats.numConnections, 0, 'no session was ever made')
    await until(() => log.lines.length > 0, 2_000, 'the refusal log line')
    assert.match(
      log.lines[0],
      /^transfer connection from 127\.0\.0\.1:\d+ refused: TLS handshake failed: client certificate refused \(UNABLE_TO_VERIFY_LEAF_SIGNATURE: not from the cluster CA\)$/,
    )
  })

  it('an expired receiver certificate is refused by the sender', async () => {
    const hooks = new RecordingHooks()
    const server = await startServer(hooks, { tls: expiredDecode })
    const message = await sendTo(server, hooks, makeSpec(), cluster.prefill)
    assert.equal(
      message,
      `connection_closed: transfer to 127.0.0.1:${server.port}: TLS handshake failed: certificate has expired`,
    )
    assert.equal(hooks.reservations.length, 0)
  })

  it('a plaintext sender against a TLS receiver is dropped in the handshake', async () => {
    const hooks = new RecordingHooks()
    const log = recordingLog()
    const server = await startServer(hooks, { tls: cluster.decode, log })
    // What a plaintext sender's first bytes are: its HELLO frame, sent raw.
    const socket = net.connect({ host: '127.0.0.1', port: server.port })
    socket.on('error', () => {})
    socket.end(helloBytes())
    await new Promise((resolve) => socket.once('close', resolve))
    await until(() => log.lines.length > 0, 2_000, 'the refusal log line')
    assert.match(
      log.lines[0],
      /^transfer connection from 127\.0\.0\.1:\d+ refused: TLS handshake failed: wrong version number \(the peer does not speak TLS: is it started without TLS\?\)$/,
    )
    assert.equal(hooks.reservations.length, 0)
    assert.equal(server.stats.numConnections, 0)
  })

  it('a TLS sender against a plaintext receiver fails with one line saying so', async () => {
    const hooks = new RecordingHooks()
    const server = await startServer(hooks)
    const message = await sendTo(server, hooks, makeSpec(), cluster.prefill)
    assert.equal(
      message,
      `connection_closed: transfer to 127.0.0.1:${server.port}: TLS handshake failed: wrong version number (the peer does not speak TLS: is it started without TLS?)`,
    )
    assert.equal(hooks.reservations.length, 0)
  })

  it('a part given an expired certificate is refused at start, one line naming the file and date', async () => {
    const cert = join(root, 'cluster', 'expired.crt')
    const expected = `TLS certificate ${cert} expired on ${expiredOn.toISOString()}: renew it (kvfence certs renew)`
    assert.throws(() => material('cluster', 'expired'), { message: expected })
    const started = await startDecode({
      ca: join(root, 'cluster', 'ca.crt'),
      cert,
      key: join(root, 'cluster', 'expired.key'),
    })
    assert.equal(started.code, 2)
    assert.equal(started.stderr, `kvfence: ${expected}\n`)
  })

  it('a part whose certificate its CA file did not sign is refused at start, one line naming both', async () => {
    const ca = join(root, 'other', 'ca.crt')
    const cert = join(root, 'cluster', 'decode.crt')
    const started = await startDecode({ ca, cert, key: join(root, 'cluster', 'decode.key') })
    assert.equal(started.code, 2)
    assert.equal(
      started.stderr,
      `kvfence: TLS certificate ${cert} is not signed by the CA in ${ca}: give every part the ca.crt of the kvfence certs init that made its certificate\n`,
    )
  })

  it('a part whose key other users can read is refused at start; the group may read it', async () => {
    const key = join(root, 'cluster', 'open.key')
    copyFileSync(join(root, 'cluster', 'decode.key'), key)
    chmodSync(key, 0o644)
    const files = { ca: join(root, 'cluster', 'ca.crt'), cert: join(root, 'cluster', 'decode.crt') }
    const started = await startDecode({ ...files, key })
    assert.equal(started.code, 2)
    assert.equal(
      started.stderr,
      `kvfence: TLS key ${key} has mode 0644, open to other users: chmod 600 ${key}\n`,
    )
    chmodSync(key, 0o640)
    assert.doesNotThrow(() => loadTlsMaterial({ ...files, key }))
  })

  it('a CA file holding no certificate (a key given as --tls-ca) is refused', () => {
    const key = join(root, 'cluster', 'decode.key')
    assert.throws(
      () => loadTlsMaterial({ ca: key, cert: join(root, 'cluster', 'decode.crt'), key }),
      {
        message: `TLS CA ${key} holds no certificate: give the cluster's ca.crt (kvfence certs init)`,
      },
    )
  })

  it('a certificate not valid yet is refused at start, naming the date', () => {
    const cert = join(root, 'cluster', 'future.crt')
    assert.throws(() => material('cluster', 'future'), {
      message: `TLS certificate ${cert} is not valid before ${validFrom.toISOString()}: check this host's clock`,
    })
  })
})
