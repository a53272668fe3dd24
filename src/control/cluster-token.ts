/** The control-plane credential shared by the router and its workers. Workers open the control
 *  channel (whose requests name tenants and carry transfer secrets) and answer `POST /internal/*`
 *  only for a caller that presents it, so a process that merely reaches a worker's port cannot act as any tenant.
 *  Read once from `KVFENCE_CLUSTER_TOKEN` (an environment variable, never a flag: argv is visible
 *  to every local user); `kvfence serve` and `kvfence demo` make a random one for their children.
 *  Knows the header and the comparison; knows nothing of requests. */
import { createHash, randomBytes, timingSafeEqual } from 'node:crypto'

/** The header that carries the token on the channel's upgrade and `POST /internal/*`. */
export const clusterTokenHeader = 'x-kvfence-cluster-token'

/** The environment variable the token is read from. */
export const clusterTokenEnv = 'KVFENCE_CLUSTER_TOKEN'

/** A fresh random token (256 bits, hex). */
export function newClusterToken(): string {
  return randomBytes(32).toString('hex')
}

/** The configured token, or null when the variable is unset or empty. */
export function clusterTokenFrom(env: NodeJS.ProcessEnv): string | null {
  const token = env[clusterTokenEnv]
  return token === undefined || token === '' ? null : token
}

/** Whether `presented` (a header value) equals `token`, in constant time (compared as SHA-256
 *  digests so that lengths leak nothing either). */
export function isClusterTokenValid(
  token: string,
  presented: string | string[] | undefined,
): boolean {
  if (typeof presented !== 'string') return false
  const digest = (s: string) => createHash('sha256').update(s, 'utf8').digest()
  return timingSafeEqual(digest(token), digest(presented))
}

/** Whether a bind address only accepts connections from this host (see src/link/plaintext.ts). */
export { isLoopbackHost } from '../link/plaintext.js'
