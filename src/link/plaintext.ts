/** The rule for links between kvfence's parts without TLS: the control plane (router → workers)
 *  and the KV data plane (P → D) carry tenants' prompts (as text, and as KV pages), so a part that
 *  binds or dials beyond loopback without TLS is refused at start, unless the operator says
 *  `--allow-plaintext` (cluster file: `allowPlaintext: true`), which is logged as a warning.
 *  Loopback stays plaintext. Knows addresses and the wording; knows nothing of sockets or TLS. */
import { KvfenceError } from '../common/errors.js'

/** Whether a host (a bind address, or a URL's hostname, IPv6 in brackets or not) only reaches this
 *  host: `localhost`, 127.0.0.0/8 or ::1. `0.0.0.0` and `::` (every interface) are not. */
export function isLoopbackHost(host: string): boolean {
  const h = host.startsWith('[') && host.endsWith(']') ? host.slice(1, -1) : host
  return h === 'localhost' || h === '::1' || /^127\.\d+\.\d+\.\d+$/.test(h)
}

/** One address a part binds or dials, with what it is for ("binds its control plane to"). */
export interface LinkAddress {
  /** What the part does with it, e.g. `binds its KV transfer receiver to`. */
  readonly what: string
  /** The host (bind address, or a URL's hostname). */
  readonly host: string
}

/** What {@link checkPlaintextLinks} needs. */
export interface PlaintextCheck {
  /** The part, as the line names it: `decode worker`, `router`, `kvfence serve`. */
  readonly part: string
  /** The addresses it binds or dials without TLS (loopback ones are fine and skipped). */
  readonly links: readonly LinkAddress[]
  /** The operator's `--allow-plaintext` (or `allowPlaintext: true`). */
  readonly allowPlaintext: boolean
  /** How to turn TLS on for this part, e.g. `--tls-ca/--tls-cert/--tls-key`. */
  readonly tlsHint: string
  /** Where the warning goes when plaintext is allowed. */
  readonly log: { warn: (msg: string) => void }
}

/** The name of the switch, in the refusal and the docs. */
export const allowPlaintextFlag = '--allow-plaintext'

/** Refuse (or, when allowed, warn about) a part's plaintext links beyond loopback. Call only for a
 *  part without TLS. @throws KvfenceError `config_invalid`, one line naming the first such
 *  address, how to turn TLS on and the switch that allows plaintext. */
export function checkPlaintextLinks(check: PlaintextCheck): void {
  const exposed = check.links.filter((l) => !isLoopbackHost(l.host))
  if (exposed.length === 0) return
  const where = exposed.map((l) => `${l.what} ${l.host}`).join(', ')
  if (check.allowPlaintext) {
    check.log.warn(
      `${check.part} ${where} without TLS (${allowPlaintextFlag}): tenants’ prompts and KV pages cross the network in plaintext`,
    )
    return
  }
  throw new KvfenceError(
    'config_invalid',
    `${check.part} ${where} without TLS: refused, tenants’ prompts and KV pages would cross the network in plaintext; use ${check.tlsHint} (kvfence certs init), or ${allowPlaintextFlag} to accept that`,
  )
}

/** The hostname of a worker URL (`http://10.0.0.7:8102` → `10.0.0.7`), or the URL itself when it
 *  does not parse (the part that dials it reports the bad URL). */
export function hostOfUrl(url: string): string {
  try {
    return new URL(url).hostname
  } catch {
    return url
  }
}

/** The warning for a router that serves its clients over plain HTTP on `host` beyond loopback
 *  (tenants' API keys and prompts then cross the network in clear), or null when it serves
 *  HTTPS or only this host. A warning, not a refusal: TLS is often ended in a load balancer in
 *  front of the router, which the router cannot see. */
export function clientPlaintextWarning(host: string, isHttps: boolean): string | null {
  if (isHttps || isLoopbackHost(host)) return null
  return `router serves clients in plaintext on ${host}: tenants' API keys and prompts cross the network unencrypted unless TLS ends in front of it (--tls-cert/--tls-key to serve HTTPS)`
}
