/** Which targets an audit (and `kvfence watch`) may be pointed at. An audit sends hundreds of
 *  requests, some of them deliberately malformed or over capacity: pointed at the wrong host by a
 *  typo, it is an attack on someone else's service. Loopback is always allowed (a local engine or a tunnel); any other
 *  host only when the operator names it, in the config (`authorized_targets`) or with
 *  `--authorized`. The check reads the URL only: it runs before any request, and before any
 *  DNS lookup.
 *  Knows URLs; knows nothing of HTTP requests. */
import { isIP } from 'node:net'
import { AuditError } from './types.js'

/** Whether `hostname` (as `URL.hostname` gives it: IPv6 in brackets) is loopback: `localhost`
 *  (and `*.localhost`, RFC 6761), 127.0.0.0/8, `::1`, or `::ffff:127.x.y.z`. */
export function isLoopbackHost(hostname: string): boolean {
  const host = hostname
    .toLowerCase()
    .replace(/^\[|\]$/g, '')
    .replace(/\.$/, '')
  if (host === 'localhost' || host.endsWith('.localhost')) return true
  if (isIP(host) === 4) return host.split('.')[0] === '127'
  if (isIP(host) === 6) {
    if (host === '::1' || /^(0{1,4}:){7}0{0,3}1$/.test(host)) return true
    // IPv4-mapped 127.x.y.z, written dotted or (as URL normalizes it) in hex.
    const mapped = /^::ffff:(\d+)\.\d+\.\d+\.\d+$/.exec(host)
    return (
      (mapped !== null && mapped[1] === '127') || /^::ffff:7f[0-9a-f]{2}:[0-9a-f]{1,4}$/.test(host)
    )
  }
  return false
}

/** What an authorization entry names: a bare host (any port), `host:port`, or a URL (its host,
 *  and its port when one is written, `:80` and `:443` included). The host as `URL.hostname`
 *  gives it (lower case, IPv6 in brackets); null when the entry names none. Parsed by hand for
 *  the port: `URL` drops a port that is its scheme's default, so `host:80` would read as "any
 *  port" and `host:443` never match `https://host`. */
function authorizedEntry(entry: string): { hostname: string; port: number | null } | null {
  const authority = entry
    .trim()
    .replace(/^[a-z][a-z0-9+.-]*:\/\//i, '')
    .split(/[/?#]/)[0]
    .replace(/^.*@/, '')
  const m = /^(\[[^\]]+\]|[^:[\]]+)(?::(\d{1,5}))?$/.exec(authority)
  if (m === null) return null
  try {
    const { hostname } = new URL(`http://${m[1]}`)
    return { hostname, port: m[2] === undefined ? null : Number(m[2]) }
  } catch {
    return null
  }
}

/** The port a target URL reaches: the one it writes, or its scheme's default. */
function portOf(url: URL): number {
  if (url.port !== '') return Number(url.port)
  return url.protocol === 'https:' ? 443 : 80
}

/** Throws `AuditError('unauthorized_target')` (one line saying how to authorize) unless `target`
 *  is loopback, or `authorized` names its host (with any port when the entry gives none, else
 *  that port; a target without a port reaches its scheme's default, 80 or 443). `isAuthorizedFlag` (`--authorized`) authorizes the target given. */
export function checkAuthorizedTarget(
  target: string,
  authorized: readonly string[],
  isAuthorizedFlag: boolean,
): void {
  let url: URL
  try {
    url = new URL(target)
  } catch {
    return // not a URL: runAudit's own validation says so
  }
  // Not http(s) (`localhost:8000` parses with the scheme `localhost:`): that is what is wrong with
  // it, and runAudit's validation says so; asked to authorize it, the user was told the wrong fault.
  if (url.protocol !== 'http:' && url.protocol !== 'https:') return
  if (isAuthorizedFlag || isLoopbackHost(url.hostname)) return
  const hostname = url.hostname.toLowerCase()
  const port = portOf(url)
  for (const entry of authorized) {
    const named = authorizedEntry(entry)
    if (named === null || named.hostname !== hostname) continue
    if (named.port === null || named.port === port) return
  }
  throw new AuditError(
    'unauthorized_target',
    `${url.host} is not loopback and not an authorized target: audit only endpoints you are allowed to test, ` +
      `then list it under authorized_targets in --config or pass --authorized`,
  )
}
