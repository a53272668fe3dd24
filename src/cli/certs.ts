/** `kvfence certs init DIR`: a cluster CA and one certificate per part (router, prefill, decode),
 *  each good for both ends of a TLS connection (serverAuth and clientAuth), with SANs for the given
 *  hosts plus 127.0.0.1 and localhost. The parts then authenticate each other against that CA
 *  alone (src/link/tls.ts). `kvfence certs renew DIR` issues the parts' certificates again (new keys)
 *  under the CA already in DIR, which it leaves as it is, so that no part needs new trust.
 *  Certificates are built by @peculiar/x509 over WebCrypto (ECDSA P-256, SHA-256), loaded on
 *  first use so that other commands never pay for it.
 *  Knows file names, modes and X.509 profiles; knows nothing of sockets. */
import { X509Certificate, createPrivateKey, createPublicKey, webcrypto } from 'node:crypto'
import { chmodSync, existsSync, lstatSync, readFileSync, renameSync, writeFileSync } from 'node:fs'
import { isIP } from 'node:net'
import { join } from 'node:path'
import { InvalidArgumentError, type Command } from 'commander'
import { KvfenceError } from '../common/errors.js'
import { makeDir } from '../common/make-dir.js'
import { randomHex } from '../common/random-hex.js'

type X509 = typeof import('@peculiar/x509')

/** The library, with the Reflect metadata API its dependency injection needs (a global polyfill,
 *  installed once per process by its own module). */
async function loadX509(): Promise<X509> {
  await import('reflect-metadata')
  return import('@peculiar/x509')
}

/** The parts that get a certificate, each one file pair `<part>.crt` / `<part>.key`. */
export const certParts = ['router', 'prefill', 'decode'] as const
/** One of {@link certParts}. */
export type CertPart = (typeof certParts)[number]

/** Hosts every certificate names, so that one machine's parts can talk over TLS too. */
export const defaultCertHosts = ['127.0.0.1', 'localhost'] as const

/** Why `host` cannot be a SAN a peer would match, or null when it can: an IP address, or a DNS
 *  name (RFC 1123: dot-separated labels of letters, digits and inner hyphens, at most 63
 *  characters each and 253 in all). A URL, a port or a space in `--hosts` would otherwise become
 *  a DNS SAN no dialled host ever matches, and every handshake would fail. */
export function hostProblem(host: string): string | null {
  if (host.length === 0) return 'a host name may not be empty'
  if (isIP(host) !== 0) return null
  const label = /^[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?$/
  const labels = host.split('.')
  if (host.length <= 253 && labels.every((l) => label.test(l)) && !/^[\d.]+$/.test(host))
    return null
  return `"${host}" is neither an IP address nor a host name (letters, digits, hyphens and dots; no scheme, port or path)`
}

/** Validity of certificates made by `certs init` unless `--days` says otherwise, days. */
export const defaultCertDays = 365

const algorithm = { name: 'ECDSA', namedCurve: 'P-256', hash: 'SHA-256' } as const

/** A CA able to sign: its certificate (PEM) and its key (a WebCrypto private key). */
export interface CertAuthority {
  readonly certPem: string
  readonly key: webcrypto.CryptoKey
  readonly subject: string
}

/** A certificate and its private key, both PEM. */
export interface IssuedCert {
  readonly certPem: string
  readonly keyPem: string
}

/** Validity window of a certificate. */
export interface Validity {
  readonly notBefore: Date
  readonly notAfter: Date
}

/** `days` from now (back-dated one minute, so a peer whose clock lags slightly still accepts it). */
export function validityDays(days: number, now = new Date()): Validity {
  const notBefore = new Date(now.getTime() - 60_000)
  return { notBefore, notAfter: new Date(now.getTime() + days * 86_400_000) }
}

/** A random positive 128-bit serial number in hex (RFC 5280 §4.1.2.2: at most 20 octets). */
function serialNumber(): string {
  const bytes = webcrypto.getRandomValues(new Uint8Array(16))
  bytes[0] &= 0x7f
  bytes[0] |= 0x01 // never a leading zero octet
  return Buffer.from(bytes).toString('hex')
}

async function keyPem(x509: X509, key: webcrypto.CryptoKey): Promise<string> {
  const der = await webcrypto.subtle.exportKey('pkcs8', key)
  return `${x509.PemConverter.encode(der, 'PRIVATE KEY')}\n`
}

/** A new self-signed cluster CA (basicConstraints CA, path length 0: it signs only parts). */
export async function createAuthority(validity: Validity): Promise<IssuedCert & CertAuthority> {
  const x509 = await loadX509()
  const keys = await webcrypto.subtle.generateKey(algorithm, true, ['sign', 'verify'])
  const subject = 'CN=kvfence cluster CA, O=kvfence'
  const cert = await x509.X509CertificateGenerator.createSelfSigned({
    serialNumber: serialNumber(),
    name: subject,
    ...validity,
    signingAlgorithm: algorithm,
    keys,
    extensions: [
      new x509.BasicConstraintsExtension(true, 0, true),
      new x509.KeyUsagesExtension(
        x509.KeyUsageFlags.keyCertSign | x509.KeyUsageFlags.cRLSign,
        true,
      ),
      await x509.SubjectKeyIdentifierExtension.create(keys.publicKey),
    ],
  })
  const certPem = `${cert.toString('pem')}\n`
  return { certPem, keyPem: await keyPem(x509, keys.privateKey), key: keys.privateKey, subject }
}

/** The CA written by `certs init` (`ca.crt`, `ca.key` as PEM), able to sign again.
 *  @throws Error when the key is not a PKCS #8 P-256 key. */
export async function loadAuthority(certPem: string, keyPem: string): Promise<CertAuthority> {
  const x509 = await loadX509()
  const der = x509.PemConverter.decodeFirst(keyPem)
  const key = await webcrypto.subtle.importKey('pkcs8', der, algorithm, false, ['sign'])
  return { certPem, key, subject: new x509.X509Certificate(certPem).subject }
}

/** A certificate for `part` signed by `ca`, naming `hosts` (IPs as IP SANs, the rest as DNS
 *  SANs), usable as a TLS server and as a TLS client. @throws RangeError on a host that is neither
 *  an IP nor a host name ({@link hostProblem}). */
export async function issuePartCert(
  ca: CertAuthority,
  part: string,
  hosts: readonly string[],
  validity: Validity,
): Promise<IssuedCert> {
  const x509 = await loadX509()
  const keys = await webcrypto.subtle.generateKey(algorithm, true, ['sign', 'verify'])
  const names = hosts.map((host) => {
    const problem = hostProblem(host)
    if (problem !== null) throw new RangeError(problem)
    return { type: isIP(host) === 0 ? ('dns' as const) : ('ip' as const), value: host }
  })
  const cert = await x509.X509CertificateGenerator.create({
    serialNumber: serialNumber(),
    subject: `CN=kvfence ${part}, O=kvfence`,
    issuer: ca.subject,
    ...validity,
    signingAlgorithm: algorithm,
    publicKey: keys.publicKey,
    signingKey: ca.key,
    extensions: [
      new x509.BasicConstraintsExtension(false, undefined, true),
      new x509.KeyUsagesExtension(x509.KeyUsageFlags.digitalSignature, true),
      new x509.ExtendedKeyUsageExtension([
        x509.ExtendedKeyUsage.serverAuth,
        x509.ExtendedKeyUsage.clientAuth,
      ]),
      new x509.SubjectAlternativeNameExtension(names),
      await x509.SubjectKeyIdentifierExtension.create(keys.publicKey),
      await x509.AuthorityKeyIdentifierExtension.create(
        new x509.X509Certificate(ca.certPem).publicKey,
      ),
    ],
  })
  return { certPem: `${cert.toString('pem')}\n`, keyPem: await keyPem(x509, keys.privateKey) }
}

/** Options of {@link initCerts}. */
export interface InitCertsOptions {
  /** Extra SANs beside {@link defaultCertHosts}. */
  hosts?: readonly string[]
  /** Validity, days. Default {@link defaultCertDays}. */
  days?: number
  /** Replace existing files. Default false. */
  force?: boolean
}

/** The files `certs init` writes into its folder. */
export function certFileNames(): string[] {
  return ['ca.crt', 'ca.key', ...certParts.flatMap((p) => [`${p}.crt`, `${p}.key`])]
}

/** Write a cluster CA and a certificate per part into `dir` (made 0700 if missing): keys 0600,
 *  certificates 0644. Returns the paths written. @throws KvfenceError `config_invalid` when a file
 *  exists (and not `force`), `dir` is not a folder, or a host is neither an IP nor a host name. */
export async function initCerts(dir: string, options: InitCertsOptions = {}): Promise<string[]> {
  const hosts = [...new Set([...defaultCertHosts, ...(options.hosts ?? [])])]
  const problem = hosts.map(hostProblem).find((p) => p !== null)
  if (problem !== undefined) throw new KvfenceError('config_invalid', `--hosts: ${problem}`)
  const days = options.days ?? defaultCertDays
  if (existsSync(dir) && !lstatSync(dir).isDirectory())
    throw new KvfenceError('config_invalid', `${dir} exists and is not a folder`)
  const paths = certFileNames().map((name) => join(dir, name))
  const existing = paths.filter((p) => existsSync(p))
  if (existing.length > 0 && options.force !== true)
    throw new KvfenceError(
      'config_invalid',
      `${existing[0]} exists; refusing to overwrite it (use --force to replace the cluster's certificates)`,
    )
  const validity = validityDays(days)
  const ca = await createAuthority(validity)
  const issued: Record<string, IssuedCert> = { ca }
  for (const part of certParts) issued[part] = await issuePartCert(ca, part, hosts, validity)
  if (!existsSync(dir)) {
    makeDir(dir)
    chmodSync(dir, 0o700)
  }
  for (const [name, pair] of Object.entries(issued)) writeIssued(dir, name, pair)
  return paths
}

/** Write `<name>.key` (0600) then `<name>.crt` (0644) into `dir`, each to a fresh file with its
 *  mode (a key is never briefly readable by others) renamed over the old one: a part reading the
 *  files meanwhile sees the old file or the new, never a part of one. */
function writeIssued(dir: string, name: string, { certPem, keyPem: key }: IssuedCert): void {
  for (const [path, text, mode] of [
    [join(dir, `${name}.key`), key, 0o600],
    [join(dir, `${name}.crt`), certPem, 0o644],
  ] as const) {
    const fresh = `${path}.${randomHex(6)}.tmp`
    writeFileSync(fresh, text, { mode, flag: 'wx' })
    chmodSync(fresh, mode) // the umask may have taken bits off
    renameSync(fresh, path)
  }
}

/** Options of {@link renewCerts}. */
export interface RenewCertsOptions {
  /** The parts to renew. Default: every one of {@link certParts}. */
  parts?: readonly CertPart[]
  /** SANs beside {@link defaultCertHosts}. Default: the hosts each part's current certificate
   *  names (so a renewal keeps them). */
  hosts?: readonly string[]
  /** Validity, days. Default {@link defaultCertDays}. */
  days?: number
  /** The time the new certificates start from. Default: now. */
  now?: Date
}

/** What {@link renewCerts} wrote. */
export interface RenewedCerts {
  /** `<part>.crt`, `<part>.key` of each part renewed, in order. */
  readonly paths: string[]
  /** When the new certificates expire. */
  readonly notAfter: Date
  /** Whether that is the CA's expiry, sooner than the default days (no `days` given). */
  readonly isCappedByCa: boolean
}

/** The CA of `dir` (`ca.crt`, `ca.key`), checked able to sign: both files there, the key the
 *  certificate's, the certificate a CA. @throws KvfenceError `config_invalid`, one line naming
 *  the file and what is wrong. */
async function authorityIn(dir: string): Promise<CertAuthority & { notAfter: Date }> {
  const [crtPath, keyPath] = [join(dir, 'ca.crt'), join(dir, 'ca.key')]
  const missing = [crtPath, keyPath].find((p) => !existsSync(p))
  if (missing !== undefined)
    throw new KvfenceError(
      'config_invalid',
      `${missing} is missing: renew needs the CA of kvfence certs init in ${dir} (ca.crt and ca.key)`,
    )
  const [certPem, keyPemText] = [readFileSync(crtPath, 'utf8'), readFileSync(keyPath, 'utf8')]
  let cert: X509Certificate
  let publicOfKey: Buffer
  try {
    cert = new X509Certificate(certPem)
  } catch (err) {
    throw new KvfenceError('config_invalid', `${crtPath} is not a PEM certificate (${String(err)})`)
  }
  try {
    publicOfKey = createPublicKey(createPrivateKey(keyPemText)).export({
      type: 'spki',
      format: 'der',
    })
  } catch (err) {
    throw new KvfenceError('config_invalid', `${keyPath} is not a PEM private key (${String(err)})`)
  }
  if (!cert.ca) throw new KvfenceError('config_invalid', `${crtPath} is not a CA certificate`)
  if (!publicOfKey.equals(cert.publicKey.export({ type: 'spki', format: 'der' })))
    throw new KvfenceError(
      'config_invalid',
      `${keyPath} is not the key of ${crtPath}: give the pair written by one kvfence certs init`,
    )
  const authority = await loadAuthority(certPem, keyPemText)
  return { ...authority, notAfter: new Date(cert.validTo) }
}

/** The hosts `certPath`'s SANs name (IP addresses and DNS names, in order). */
function sanHosts(certPath: string): string[] {
  const names = new X509Certificate(readFileSync(certPath)).subjectAltName ?? ''
  // "IP Address:127.0.0.1, DNS:localhost": no SAN kvfence writes holds a comma or a colon prefix.
  return names
    .split(', ')
    .map((name) => /^(?:DNS|IP Address):(.+)$/.exec(name)?.[1])
    .filter((host): host is string => host !== undefined)
}

/** Issue the certificates of `parts` again, each with a new key pair, signed by the CA already in
 *  `dir` (ca.crt and ca.key left untouched): keys 0600, certificates 0644, as {@link initCerts}.
 *  Every check is made before any file is written. Returns the paths written.
 *  @throws KvfenceError `config_invalid` when `dir` holds no CA, its key is not the
 *  certificate's, a host is neither an IP nor a host name, a part has no certificate to take its
 *  hosts from (and no `hosts`), the CA has expired, or it expires before `days` would (without
 *  `days`, the certificates end with the CA instead). */
export async function renewCerts(
  dir: string,
  options: RenewCertsOptions = {},
): Promise<RenewedCerts> {
  if (!existsSync(dir) || !lstatSync(dir).isDirectory())
    throw new KvfenceError('config_invalid', `${dir} is not a folder of kvfence certs init`)
  const extraHosts = options.hosts
  const problem = (extraHosts ?? []).map(hostProblem).find((p) => p !== null)
  if (problem !== undefined) throw new KvfenceError('config_invalid', `--hosts: ${problem}`)
  const ca = await authorityIn(dir)
  const now = options.now ?? new Date()
  const caPath = join(dir, 'ca.crt')
  if (ca.notAfter.getTime() <= now.getTime())
    throw new KvfenceError(
      'config_invalid',
      `the CA ${caPath} expired on ${ca.notAfter.toISOString()}: make a new one (kvfence certs init ${dir} --force) and give every part its ca.crt`,
    )
  const days = options.days ?? defaultCertDays
  const wanted = validityDays(days, now)
  const isCappedByCa = ca.notAfter.getTime() < wanted.notAfter.getTime()
  if (isCappedByCa && options.days !== undefined) {
    const numDaysLeft = Math.floor((ca.notAfter.getTime() - now.getTime()) / 86_400_000)
    throw new KvfenceError(
      'config_invalid',
      `the CA ${caPath} expires on ${ca.notAfter.toISOString()}, before certificates of ${days} days would (${wanted.notAfter.toISOString()}): ` +
        (numDaysLeft >= 1
          ? `give --days ${numDaysLeft} or fewer, or make a new CA (kvfence certs init ${dir} --force)`
          : `make a new CA (kvfence certs init ${dir} --force)`),
    )
  }
  // Without --days a certificate ends with its CA at the latest: init gives both the same days.
  const validity = isCappedByCa ? { ...wanted, notAfter: ca.notAfter } : wanted
  const parts = options.parts ?? certParts
  const hostsOf = (part: CertPart): string[] => {
    if (extraHosts !== undefined) return [...new Set([...defaultCertHosts, ...extraHosts])]
    const certPath = join(dir, `${part}.crt`)
    if (!existsSync(certPath))
      throw new KvfenceError(
        'config_invalid',
        `${certPath} is missing, so its hosts are unknown: give --hosts`,
      )
    return sanHosts(certPath)
  }
  const issued = new Map<CertPart, IssuedCert>()
  for (const part of parts) issued.set(part, await issuePartCert(ca, part, hostsOf(part), validity))
  for (const [part, pair] of issued) writeIssued(dir, part, pair)
  return {
    paths: parts.flatMap((part) => [join(dir, `${part}.crt`), join(dir, `${part}.key`)]),
    notAfter: validity.notAfter,
    isCappedByCa,
  }
}

function daysOption(value: string): number {
  const n = Number(value)
  if (!/^\d+$/.test(value) || n < 1 || n > 36_500)
    throw new InvalidArgumentError(`expected a whole number of days in [1, 36500], got "${value}"`)
  return n
}

function hostsOption(value: string): string[] {
  const hosts = value.split(',').map((h) => h.trim())
  if (hosts.some((h) => h.length === 0))
    throw new InvalidArgumentError(`expected host names or IPs separated by commas, got "${value}"`)
  const problem = hosts.map(hostProblem).find((p) => p !== null)
  if (problem !== undefined) throw new InvalidArgumentError(problem)
  return hosts
}

function partsOption(value: string): CertPart[] {
  const parts = value.split(',').map((p) => p.trim())
  const unknown = parts.find((p) => !(certParts as readonly string[]).includes(p))
  if (unknown !== undefined)
    throw new InvalidArgumentError(
      `"${unknown}" is not a part; the parts are ${certParts.join(', ')}`,
    )
  return [...new Set(parts as CertPart[])]
}

/** Register `kvfence certs init` and `kvfence certs renew`. */
export function registerCerts(program: Command): void {
  const certs = program
    .command('certs')
    .description('make the TLS certificates of a cluster (mutual TLS between its parts)')
  certs
    .command('init <dir>')
    .description(
      'make a cluster CA and a certificate per part (router, prefill, decode) in <dir>; copy ca.crt and a part’s .crt/.key to its host',
    )
    .option(
      '--hosts <list>',
      'host names and IPs the parts run on, comma-separated (127.0.0.1 and localhost are always included)',
      hostsOption,
    )
    .option('--days <n>', `validity in days (default ${defaultCertDays})`, daysOption)
    .option('--force', 'replace existing files in <dir>', false)
    .action(async (dir: string, flags: { hosts?: string[]; days?: number; force: boolean }) => {
      const paths = await initCerts(dir, flags)
      process.stdout.write(`${paths.join('\n')}\n`)
    })
  certs
    .command('renew <dir>')
    .description(
      'issue the parts’ certificates again (new keys) under the CA already in <dir>, which stays as it is; copy each renewed .crt/.key to its host',
    )
    .option(
      '--parts <list>',
      `parts to renew, comma-separated (default: all of ${certParts.join(', ')})`,
      partsOption,
    )
    .option(
      '--hosts <list>',
      'host names and IPs the parts run on, comma-separated (127.0.0.1 and localhost are always included; default: those each current certificate names)',
      hostsOption,
    )
    .option(
      '--days <n>',
      `validity in days (default ${defaultCertDays}, or until the CA expires if sooner)`,
      daysOption,
    )
    .action(async (dir: string, flags: { parts?: CertPart[]; hosts?: string[]; days?: number }) => {
      const renewed = await renewCerts(dir, flags)
      process.stdout.write(`${renewed.paths.join('\n')}\n`)
      if (renewed.isCappedByCa)
        process.stderr.write(
          `kvfence: the renewed certificates expire with the CA in ${join(dir, 'ca.crt')}, on ${renewed.notAfter.toISOString()}: make a new CA before then (kvfence certs init ${dir} --force)\n`,
        )
    })
}
