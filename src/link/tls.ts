/** Mutual TLS between kvfence's parts, shared by the control plane (router → workers, HTTPS) and
 *  the data plane (P → D transfer): TLS 1.3 only, every peer shows a certificate from the cluster
 *  CA (made by `kvfence certs init`), and that CA is the only trust anchor. A client also checks
 *  that the server's certificate names the host it dialled (SAN: DNS name or IP address).
 *  Knows files, node:tls options and handshake errors; knows nothing of frames or HTTP routes. */
import { X509Certificate } from 'node:crypto'
import { readFileSync, statSync, unwatchFile, watchFile } from 'node:fs'
import net, { isIP } from 'node:net'
import tls from 'node:tls'
import { KvfenceError } from '../common/errors.js'

/** Paths of one part's TLS files (PEM). */
export interface TlsFiles {
  /** The cluster CA's certificate: the only certificate a peer is checked against. */
  readonly ca: string
  /** This part's certificate, signed by the CA. */
  readonly cert: string
  /** This part's private key. */
  readonly key: string
}

/** One part's TLS files, read (PEM bytes) and checked to form a usable context. */
export interface TlsMaterial {
  readonly ca: Buffer
  readonly cert: Buffer
  readonly key: Buffer
  /** Where they were read from (for the lines and the gauge of src/link/cert-expiry.ts); absent for
   *  material made in memory. */
  readonly files?: TlsFiles
}

/** How long a TLS handshake may take before the connection is dropped, ms. */
export const tlsHandshakeTimeoutMs = 10_000

/** The {@link TlsFiles} of `--tls-ca/--tls-cert/--tls-key`: all three or none (null).
 *  @throws KvfenceError `config_invalid` when only some are given. */
export function tlsFilesFrom(flags: {
  tlsCa?: string
  tlsCert?: string
  tlsKey?: string
}): TlsFiles | null {
  const { tlsCa, tlsCert, tlsKey } = flags
  if (tlsCa === undefined && tlsCert === undefined && tlsKey === undefined) return null
  if (tlsCa === undefined || tlsCert === undefined || tlsKey === undefined)
    throw new KvfenceError(
      'config_invalid',
      'TLS needs all three of --tls-ca, --tls-cert and --tls-key (see kvfence certs init)',
    )
  return { ca: tlsCa, cert: tlsCert, key: tlsKey }
}

/** What to do about an expired cluster certificate (of `certs init`). */
const renewClusterCert = 'renew it (kvfence certs renew)'

/** What to do about the router's expired public certificate: `certs renew` would issue one of
 *  the cluster CA, which the router's clients do not trust. */
const replacePublicCert = 'replace it (and its key) with a new certificate of your public CA'

/** Refuse a certificate outside its validity window at `now`: every peer would refuse it in the
 *  handshake, so a part started with it would run and serve nothing. `fix` is what the line tells
 *  the operator to do about an expired one. @throws KvfenceError `config_invalid`, one line naming
 *  the file and the date. */
export function checkCertValidity(
  pem: Buffer,
  path: string,
  now = new Date(),
  fix = renewClusterCert,
): void {
  let cert: X509Certificate
  try {
    cert = new X509Certificate(pem)
  } catch (err) {
    throw new KvfenceError('config_invalid', `TLS certificate ${path}: ${openSslReason(err)}`)
  }
  const notBefore = new Date(cert.validFrom)
  const notAfter = new Date(cert.validTo)
  if (now.getTime() > notAfter.getTime())
    throw new KvfenceError(
      'config_invalid',
      `TLS certificate ${path} expired on ${notAfter.toISOString()}: ${fix}`,
    )
  if (now.getTime() < notBefore.getTime())
    throw new KvfenceError(
      'config_invalid',
      `TLS certificate ${path} is not valid before ${notBefore.toISOString()}: check this host's clock`,
    )
}

/** Read `files`, check that the key matches the certificate and that the certificate is valid
 *  now ({@link checkCertValidity}). @throws KvfenceError `config_invalid` naming the file that
 *  cannot be read, the pair that does not fit, or the certificate out of its validity. */
export function loadTlsMaterial(files: TlsFiles): TlsMaterial {
  const material = {
    ca: readTls('CA', files.ca),
    cert: readTls('certificate', files.cert),
    key: readTls('key', files.key),
  }
  try {
    tls.createSecureContext({ ...material, minVersion: 'TLSv1.3' })
  } catch (err) {
    throw new KvfenceError(
      'config_invalid',
      `TLS files ${files.cert} and ${files.key}: ${openSslReason(err)}`,
    )
  }
  checkCertValidity(material.cert, files.cert)
  checkCaValidity(material.ca, files.ca)
  checkSignedByCa(material, files)
  return Object.freeze({ ...material, files })
}

/** Refuse a CA file whose certificates have all expired: every peer's check of this part's
 *  certificate chain, and this part's of theirs, fails on it (`certificate has expired`).
 *  @throws KvfenceError `config_invalid`, one line naming the file and the date. */
function checkCaValidity(pem: Buffer, path: string, now = new Date()): void {
  const ends = pemCertificates(pem, path).map((cert) => Date.parse(cert.validTo))
  if (ends.length === 0 || ends.some((end) => end >= now.getTime())) return
  throw new KvfenceError(
    'config_invalid',
    `TLS CA ${path} expired on ${new Date(Math.max(...ends)).toISOString()}: make a new CA (kvfence certs init DIR --force) and give every part its ca.crt and certificate`,
  )
}

/** The certificates of a PEM file, in order; none when it holds none (a key, say).
 *  @throws KvfenceError `config_invalid` on a certificate block that does not parse. */
export function pemCertificates(pem: Buffer, path: string): X509Certificate[] {
  const blocks =
    pem.toString('latin1').match(/-----BEGIN CERTIFICATE-----[^-]+-----END CERTIFICATE-----/g) ?? []
  return blocks.map((block) => {
    try {
      return new X509Certificate(block)
    } catch (err) {
      throw new KvfenceError('config_invalid', `TLS certificate ${path}: ${openSslReason(err)}`)
    }
  })
}

/** Refuse a CA file without a certificate, and a part's certificate that no certificate of that
 *  file signed (directly, or through intermediates after it in the certificate file): every peer
 *  sharing this part's CA would refuse it, or this part every peer, so it would run and serve
 *  nothing (the usual cause: ca.crt copied from another `certs init` than the certificate).
 *  @throws KvfenceError `config_invalid`, one line naming both files. */
function checkSignedByCa(material: TlsMaterial, files: TlsFiles): void {
  const cas = pemCertificates(material.ca, files.ca)
  if (cas.length === 0)
    throw new KvfenceError(
      'config_invalid',
      `TLS CA ${files.ca} holds no certificate: give the cluster's ca.crt (kvfence certs init)`,
    )
  const [leaf, ...intermediates] = pemCertificates(material.cert, files.cert)
  const signs = (issuer: X509Certificate, cert: X509Certificate) =>
    cert.checkIssued(issuer) && cert.verify(issuer.publicKey)
  let cert = leaf
  for (let depth = 0; depth <= intermediates.length; depth++) {
    if (cas.some((ca) => signs(ca, cert))) return
    const next = intermediates.find((c) => c !== cert && signs(c, cert))
    if (next === undefined) break
    cert = next
  }
  throw new KvfenceError(
    'config_invalid',
    `TLS certificate ${files.cert} is not signed by the CA in ${files.ca}: give every part the ca.crt of the kvfence certs init that made its certificate`,
  )
}

/** A public server's certificate and key (no client certificates asked for), read and checked to
 *  fit and to be valid now. @throws KvfenceError `config_invalid` naming the file or the pair. */
export function loadCertPair(files: { cert: string; key: string }): { cert: Buffer; key: Buffer } {
  const pair = { cert: readTls('certificate', files.cert), key: readTls('key', files.key) }
  try {
    tls.createSecureContext(pair)
  } catch (err) {
    throw new KvfenceError(
      'config_invalid',
      `TLS files ${files.cert} and ${files.key}: ${openSslReason(err)}`,
    )
  }
  checkCertValidity(pair.cert, files.cert, new Date(), replacePublicCert)
  return pair
}

function readTls(what: string, path: string): Buffer {
  let bytes: Buffer
  try {
    bytes = readFileSync(path)
  } catch (err) {
    const code = (err as NodeJS.ErrnoException).code ?? String(err)
    throw new KvfenceError('config_invalid', `TLS ${what} ${path}: cannot read it (${code})`)
  }
  if (what === 'key') checkKeyMode(path)
  return bytes
}

/** Mode bits a private key may not have: any access by other users, or write by the group (the
 *  owner's read and write, and the group's read, as PostgreSQL allows, are fine). */
const keyModeForbidden = 0o037

/** Refuse a private key file other users can read: whoever reads it can act as this part (or, for
 *  the router's public key, as the API) until the certificate is replaced. `certs init` writes
 *  keys 0600; a copy made without keeping the mode is the usual cause. @throws KvfenceError
 *  `config_invalid`, one line with the mode and the fix. */
function checkKeyMode(path: string): void {
  const mode = statSync(path).mode & 0o777
  if ((mode & keyModeForbidden) !== 0)
    throw new KvfenceError(
      'config_invalid',
      `TLS key ${path} has mode 0${mode.toString(8)}, open to other users: chmod 600 ${path}`,
    )
}

/** Options for a TLS server of a part: TLS 1.3, a client certificate from the CA required (a
 *  client without one is refused in the handshake, before the server reads any of its bytes). */
export function serverTlsOptions(material: TlsMaterial): tls.TlsOptions {
  return {
    ca: material.ca,
    cert: material.cert,
    key: material.key,
    minVersion: 'TLSv1.3',
    requestCert: true,
    rejectUnauthorized: true,
    handshakeTimeout: tlsHandshakeTimeoutMs,
  }
}

/** Log one warn line for each connection a part's TLS server refuses in the handshake (a client
 *  without a certificate of the cluster CA, a plaintext client, a timeout): `<what> from
 *  10.0.0.6:51234 refused: TLS handshake failed: …`, so that the operator of the refusing part
 *  sees why as well as the peer. `what` names the port, e.g. `transfer connection`. */
export function logRefusedHandshakes(
  server: tls.Server,
  what: string,
  log: { warn(fields: Record<string, unknown>, message: string): void },
): void {
  // The TLS socket has lost its address by the time the handshake fails (its TCP socket is gone):
  // the address is taken from the TCP socket when it connects, and found again through the TLS
  // socket's `_parent` (Node's own link to it; without it the line says "a peer").
  const peers = new WeakMap<net.Socket, string>()
  server.prependListener('connection', (raw: net.Socket) => {
    if (raw.remoteAddress !== undefined) peers.set(raw, `${raw.remoteAddress}:${raw.remotePort}`)
  })
  server.on('tlsClientError', (err: Error, socket: tls.TLSSocket) => {
    const code = socket.authorizationError == null ? '' : String(socket.authorizationError)
    const why =
      code === ''
        ? describeTlsError(err)
        : `TLS handshake failed: client certificate refused (${code}${unknownIssuerCodes.has(code) ? ': not from the cluster CA' : ''})`
    const raw = (socket as unknown as { _parent?: net.Socket })._parent
    const peer =
      (raw === undefined ? undefined : peers.get(raw)) ??
      (socket.remoteAddress === undefined
        ? 'a peer'
        : `${socket.remoteAddress}:${socket.remotePort}`)
    log.warn({ peer }, `${what} from ${peer} refused: ${why}`)
  })
}

/** Options for a TLS client of a part dialling `host`: TLS 1.3, the CA as the only trust anchor,
 *  this part's certificate shown, and the server's certificate checked for the host dialled (an
 *  IP against IP SANs, a name against DNS SANs and sent as SNI). Without `host` (an agent's
 *  options), Node takes each request's host. */
export function clientTlsOptions(material: TlsMaterial, host?: string): tls.ConnectionOptions {
  return {
    ca: material.ca,
    cert: material.cert,
    key: material.key,
    minVersion: 'TLSv1.3',
    rejectUnauthorized: true,
    ...(host !== undefined && isIP(host) === 0 ? { servername: host } : {}),
  }
}

/** Error codes of a failed certificate check (Node's X509_V_ERR names, and a SAN mismatch). */
const certificateCodes = new Set([
  'CERT_HAS_EXPIRED',
  'CERT_NOT_YET_VALID',
  'UNABLE_TO_VERIFY_LEAF_SIGNATURE',
  'UNABLE_TO_GET_ISSUER_CERT',
  'UNABLE_TO_GET_ISSUER_CERT_LOCALLY',
  'SELF_SIGNED_CERT_IN_CHAIN',
  'DEPTH_ZERO_SELF_SIGNED_CERT',
  'CERT_SIGNATURE_FAILURE',
  'CERT_UNTRUSTED',
  'CERT_REJECTED',
  'INVALID_PURPOSE',
  'ERR_TLS_CERT_ALTNAME_INVALID',
])

/** Whether `err` is a TLS failure (handshake, alert, certificate check) rather than TCP's. */
export function isTlsError(err: unknown): boolean {
  const code = (err as NodeJS.ErrnoException | null)?.code
  return (
    typeof code === 'string' &&
    (code.startsWith('ERR_SSL_') ||
      code.startsWith('ERR_TLS_') ||
      code === 'EPROTO' ||
      certificateCodes.has(code))
  )
}

/** Certificate checks that fail when the peer's certificate is not from the trusted CA. */
const unknownIssuerCodes = new Set([
  'UNABLE_TO_VERIFY_LEAF_SIGNATURE',
  'UNABLE_TO_GET_ISSUER_CERT',
  'UNABLE_TO_GET_ISSUER_CERT_LOCALLY',
  'SELF_SIGNED_CERT_IN_CHAIN',
  'DEPTH_ZERO_SELF_SIGNED_CERT',
])

/** One line for a TLS failure: "TLS handshake failed: certificate has expired"; a peer that
 *  answers in plaintext, or shows a certificate of another CA, is named as such. Other errors:
 *  their message. */
export function describeTlsError(err: unknown): string {
  if (!isTlsError(err)) return err instanceof Error ? err.message : String(err)
  const reason = openSslReason(err)
  const code = (err as NodeJS.ErrnoException).code ?? ''
  const hint =
    reason === 'wrong version number' ||
    reason === 'packet length too long' ||
    reason === 'http request'
      ? ' (the peer does not speak TLS: is it started without TLS?)'
      : unknownIssuerCodes.has(code)
        ? ' (the peer’s certificate is not from the cluster CA)'
        : ''
  return `TLS handshake failed: ${reason}${hint}`
}

/** OpenSSL's short reason ("wrong version number") instead of its long message, which names
 *  source files; Node's own messages ("certificate has expired") as they are. */
function openSslReason(err: unknown): string {
  if (!(err instanceof Error)) return String(err)
  const reason = (err as Error & { reason?: unknown }).reason
  if (typeof reason === 'string' && reason.length > 0) return reason
  // "write EPROTO 80…:error:0A00010B:SSL routines:ssl3_get_record:wrong version number:file:line:"
  const fromMessage = /error:[0-9A-F]+:[^:]*:[^:]*:([^:]+):/.exec(err.message)?.[1]
  return fromMessage ?? err.message.split('\n')[0]
}

/** How often the router's public certificate files are polled for a change, ms. */
export const certPollMs = 2_000

/** Keep `server`'s certificate current: whenever `cert` or `key` changes on disk (its content or
 *  its mode: mtime or ctime; polled every
 *  {@link certPollMs}), both are read again, checked as at start ({@link loadCertPair}: the pair
 *  fits, the key's mode, the dates) and installed for new connections (`setSecureContext`), then
 *  `onInstalled` is called with it; a pair that fails is logged and the previous one kept.
 *  Returns the function that stops watching. */
export function reloadCertOnChange(
  server: tls.Server,
  files: { cert: string; key: string },
  options: tls.SecureContextOptions,
  log: { info: (msg: string) => void; warn: (msg: string) => void },
  onInstalled: (pair: { cert: Buffer; key: Buffer }) => void = () => {},
): () => void {
  let installed: { cert: Buffer; key: Buffer } | null = null
  const reload = (): void => {
    try {
      const pair = loadCertPair(files)
      // Both files change on a renewal and each change is seen: install a pair once.
      if (installed !== null && pair.cert.equals(installed.cert) && pair.key.equals(installed.key))
        return
      server.setSecureContext({ ...options, ...pair })
      installed = pair
      log.info(`reloaded the TLS certificate ${files.cert}`)
      onInstalled(pair)
    } catch (err) {
      const reason = err instanceof KvfenceError ? err.message : openSslReason(err)
      log.warn(`kept the previous TLS certificate: ${reason}`)
    }
  }
  // ctime too: `chmod 600` on a key refused for its mode changes ctime, not mtime, and is the fix
  // the refusal's line asks for.
  type Times = { mtimeMs: number; ctimeMs: number }
  const onChange = (now: Times, before: Times): void => {
    if (now.mtimeMs !== before.mtimeMs || now.ctimeMs !== before.ctimeMs) reload()
  }
  for (const path of [files.cert, files.key])
    watchFile(path, { interval: certPollMs, persistent: false }, onChange)
  return () => {
    for (const path of [files.cert, files.key]) unwatchFile(path, onChange)
  }
}
