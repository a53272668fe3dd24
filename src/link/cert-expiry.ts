/** When a part's TLS certificates expire, said before it happens: a warning line from
 *  {@link certExpiryWarnDays} days before a certificate (the part's own, the cluster CA, the
 *  router's public one) expires and an error line once it has, at start, at each reload and once a
 *  day while the part runs; and `kvfence_tls_certificate_expiry_timestamp_seconds` on `/metrics`,
 *  for an alert (deploy/kvfence-tls-rules.yml).
 *  Knows certificate files, dates, log lines and a gauge; knows nothing of handshakes. */
import { basename, dirname } from 'node:path'
import { Gauge, type Registry } from 'prom-client'
import { pemCertificates, type TlsMaterial } from './tls.js'

/** How long before a certificate expires the part starts warning, days. */
export const certExpiryWarnDays = 30

/** How often a running part says again what is about to expire, ms (a day). */
export const certExpiryRecheckMs = 86_400_000

/** Name of the gauge of each certificate's expiry, Unix seconds. */
export const certExpiryMetric = 'kvfence_tls_certificate_expiry_timestamp_seconds'

/** What a certificate file is to the part: the cluster CA it trusts (`ca`, `--tls-ca`), its own
 *  certificate of that CA (`part`, `--tls-cert`, `--cluster-tls-cert`), or the router's
 *  certificate for its clients (`https`, the router's `--tls-cert`). */
export type CertKind = 'ca' | 'part' | 'https'

/** When one certificate file stops being valid. */
export interface CertExpiry {
  /** The file, as the part was given it. */
  readonly file: string
  readonly kind: CertKind
  /** The earliest `notAfter` of the certificates in the file (a CA file or a chain may hold
   *  several: the first to expire ends the file's use). */
  readonly notAfter: Date
}

/** The {@link CertExpiry} of PEM `pem` read from `file`, or null when it holds no certificate.
 *  @throws KvfenceError `config_invalid` on a certificate that does not parse (src/link/tls.ts refuses
 *  such a file before a part asks this). */
export function certExpiryOf(pem: Buffer, file: string, kind: CertKind): CertExpiry | null {
  const ends = pemCertificates(pem, file).map((cert) => Date.parse(cert.validTo))
  return ends.length === 0 ? null : { file, kind, notAfter: new Date(Math.min(...ends)) }
}

/** A line to log about `expiry` at `now`: `error` once expired, `warn` within
 *  {@link certExpiryWarnDays} days, null before that. Each line names the file, the date (ISO
 *  8601, UTC) and what to do. */
export function expiryNotice(
  expiry: CertExpiry,
  now: Date,
): { level: 'warn' | 'error'; message: string } | null {
  const msLeft = expiry.notAfter.getTime() - now.getTime()
  if (msLeft > certExpiryWarnDays * 86_400_000) return null
  const { file, kind } = expiry
  const date = expiry.notAfter.toISOString()
  const what = kind === 'ca' ? 'TLS CA' : 'TLS certificate'
  const numDaysLeft = Math.floor(msLeft / 86_400_000)
  const left =
    numDaysLeft === 0
      ? 'in less than a day'
      : numDaysLeft === 1
        ? 'in 1 day'
        : `in ${numDaysLeft} days`
  const when = msLeft <= 0 ? `expired on ${date}` : `expires on ${date} (${left})`
  return {
    level: msLeft <= 0 ? 'error' : 'warn',
    message: `${what} ${file} ${when}: ${fix(expiry)}`,
  }
}

/** What an operator does about `expiry`. A part's certificate from `certs init` is named
 *  `<part>.crt`, which says which part to renew. */
function fix({ file, kind }: CertExpiry): string {
  if (kind === 'https')
    return 'replace it (and its key) with a new certificate of your public CA; the router reloads the pair without a restart'
  if (kind === 'ca')
    return `every certificate it signed stops being trusted then: make a new CA (kvfence certs init DIR --force), give every part its ca.crt and certificate, and restart them`
  const part = /^(router|prefill|decode)\.crt$/.exec(basename(file))?.[1]
  const parts = part === undefined ? '' : ` --parts ${part}`
  return `renew it under the same CA (kvfence certs renew DIR${parts}, DIR the folder of certs init with ca.key), copy the new .crt and .key to ${dirname(file)} and restart this part`
}

/** The certificates a part holds, their expiry logged and exposed; see the module's comment. */
export interface CertExpiryWatch {
  /** Record the certificates now in use (at start, or after a reload), replacing those of the
   *  same file and kind (one file may be both the router's cluster certificate and its public
   *  one: each keeps its series), and log a line for each about to expire or expired. */
  set(expiries: readonly CertExpiry[]): void
  /** Every certificate recorded, in the order first set. */
  list(): CertExpiry[]
  /** Stop the daily re-check. */
  stop(): void
}

/** Options of {@link watchCertExpiry}. */
export interface CertExpiryWatchOptions {
  /** Where the lines go. */
  log: { warn(message: string): void; error(message: string): void }
  /** Registry to add {@link certExpiryMetric} to (labels `file`, `kind`); none: no gauge. */
  registry?: Registry
  /** Interval of the re-check while running, ms. Default {@link certExpiryRecheckMs}. */
  recheckMs?: number
  /** The clock. Default: `new Date()`. */
  now?: () => Date
}

/** A {@link CertExpiryWatch} that logs at each `set` and every `recheckMs` (an unref'd timer: it
 *  never keeps a process alive), and serves the gauge from what was last set. */
export function watchCertExpiry(options: CertExpiryWatchOptions): CertExpiryWatch {
  const { log } = options
  const now = options.now ?? (() => new Date())
  // Keyed by kind and file: a file given as two kinds is two certificates to the operator.
  const byFile = new Map<string, CertExpiry>()
  const say = (expiries: Iterable<CertExpiry>): void => {
    const at = now()
    for (const expiry of expiries) {
      const notice = expiryNotice(expiry, at)
      if (notice !== null) log[notice.level](notice.message)
    }
  }
  if (options.registry !== undefined) {
    new Gauge({
      name: certExpiryMetric,
      help: 'When each TLS certificate the part holds expires, Unix seconds (kind: ca, part or https)',
      labelNames: ['file', 'kind'] as const,
      registers: [options.registry],
      collect() {
        this.reset()
        for (const { file, kind, notAfter } of byFile.values())
          this.set({ file, kind }, notAfter.getTime() / 1000)
      },
    })
  }
  const timer = setInterval(() => say(byFile.values()), options.recheckMs ?? certExpiryRecheckMs)
  timer.unref()
  return {
    set(expiries) {
      for (const expiry of expiries) byFile.set(`${expiry.kind} ${expiry.file}`, expiry)
      say(expiries)
    },
    list: () => [...byFile.values()],
    stop: () => clearInterval(timer),
  }
}

/** The expiries of a part's cluster TLS files: its CA and its own certificate (none for material
 *  made in memory, without files). */
export function tlsExpiries(material: TlsMaterial): CertExpiry[] {
  const { files } = material
  if (files === undefined) return []
  return [
    certExpiryOf(material.ca, files.ca, 'ca'),
    certExpiryOf(material.cert, files.cert, 'part'),
  ].filter((e): e is CertExpiry => e !== null)
}
