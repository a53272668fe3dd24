/** Making tenant API keys and the tenants file that registers them: a fresh key, and the YAML
 *  text of a tenants file holding the keys' digests. Used by `kvfence keys`, the soak and tests.
 *  Knows the key format and the tenants-file layout (see tenants.ts); knows nothing of files on
 *  disk or of requests. */
import { randomBytes } from 'node:crypto'
import { stringify as toYaml } from 'yaml'
import { apiKeyDigest } from './tenants.js'

/** A fresh API key: `sk-kvf-` and 256 random bits in hex. */
export function newApiKey(): string {
  return `sk-kvf-${randomBytes(32).toString('hex')}`
}

/** The tenants-file YAML for tenants whose keys are given (only digests are written). */
export function tenantsYaml(tenants: readonly { name: string; key: string }[]): string {
  return toYaml({ tenants: tenants.map((t) => ({ name: t.name, keySha256: apiKeyDigest(t.key) })) })
}
