/** `kvfence certs init DIR`: a cluster CA and one certificate per part (router, prefill, decode),
 *  each good for both ends of a TLS connection (serverAuth and clientAuth), with SANs for the given
 *  hosts plus 127.0.0.1 and localhost. The parts then authenticate each other against that CA
 *  alone (src/tls.ts). Certificates are built by @peculiar/x509 over WebCrypto (ECDSA P-256,
 *  SHA-256), loaded on first use so that other commands never pay for it.
 *  Knows file names, modes and X.509 profiles; knows nothing of sockets. */
import { webcrypto } from 'node:crypto'
import { existsSync, lstatSync, writeFileSync, chmodSync } from 'node:fs'
import { isIP } from 'node:net'
import { join } from 'node:path'
import { InvalidArgumentError, type Command } from 'commander'
import { KvfenceError } from '../errors.js'
import { makeDir } from '../make-dir.js'

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
  for (const [name, { certPem, keyPem: key }] of Object.entries(issued)) {
    // Keys first, created with their mode (never briefly world-readable), then forced to it when
    // an existing file is replaced.
    writeFileSync(join(dir, `${name}.key`), key, { mode: 0o600 })
    chmodSync(join(dir, `${name}.key`), 0o600)
    writeFileSync(join(dir, `${name}.crt`), certPem, { mode: 0o644 })
    chmodSync(join(dir, `${name}.crt`), 0o644)
  }
  return paths
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

/** Register `kvfence certs init`. */
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
}
