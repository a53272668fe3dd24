/** Tenants, their API keys and limits: the YAML file
 *  `tenants: [{ name, keySha256, limits?: { maxConcurrentRequests?, tokensPerMinute? } }]` and the
 *  lookup of a presented key. Keys are held only as SHA-256 digests and compared in constant time.
 *  Knows tenant names and key digests; never holds, returns or logs a plain key. */
import { createHash, timingSafeEqual } from 'node:crypto'
import { readFileSync } from 'node:fs'
import { parse as parseYaml } from 'yaml'
import { z } from 'zod'
import { KvfenceError } from '../errors.js'

/** A tenant's limits; an absent field is no limit. */
export const TenantLimits = z.strictObject({
  /** Requests of this tenant in flight at once (queued ones included); more → 429. */
  maxConcurrentRequests: z.number().int().min(1).optional(),
  /** Tokens (prompt + max_tokens, unused completion tokens refunded) per rolling minute;
   *  more → 429 with the seconds until enough are free in `Retry-After`. */
  tokensPerMinute: z.number().int().min(1).optional(),
})
export type TenantLimits = z.infer<typeof TenantLimits>

/** One tenant as configured: its name (logged, sent to workers), its key's SHA-256 (hex) and its
 *  limits. */
export const TenantRecord = z.strictObject({
  // Names go to logs, metric labels and worker page metadata: plain words only.
  name: z
    .string()
    .min(1)
    .max(128)
    .regex(/^[A-Za-z0-9._@-]+$/, 'a tenant name is letters, digits and . _ @ - only'),
  keySha256: z
    .string()
    .regex(/^[0-9a-fA-F]{64}$/, "keySha256 must be the 64 hex digits of the key's SHA-256")
    .transform((s) => s.toLowerCase()),
  limits: TenantLimits.optional(),
})
export type TenantRecord = z.infer<typeof TenantRecord>

/** An authenticated tenant. */
export interface Tenant {
  readonly name: string
  readonly limits: TenantLimits
}

/** The tenants file. */
export const TenantsFile = z.strictObject({ tenants: z.array(TenantRecord).min(1) })

/** Tenants by key digest. */
export interface TenantRegistry {
  /** The tenant whose key is `apiKey`, or null. Costs the same whichever tenant (if any) matches. */
  authenticate(apiKey: string): Tenant | null
  /** Tenant names, in file order. */
  readonly names: readonly string[]
}

/** SHA-256 hex digest of an API key: what the tenants file stores as `keySha256`. */
export function apiKeyDigest(apiKey: string): string {
  return createHash('sha256').update(apiKey, 'utf8').digest('hex')
}

/** A registry over `records`; throws `internal_error` on duplicate names or digests. */
export function createTenantRegistry(records: readonly TenantRecord[]): TenantRegistry {
  const parsed = z.array(TenantRecord).min(1).safeParse(records)
  if (!parsed.success) {
    throw new KvfenceError('internal_error', `tenants: ${describeIssue(parsed.error.issues[0])}`)
  }
  const names = new Set<string>()
  const digests = new Set<string>()
  for (const t of parsed.data) {
    if (names.has(t.name))
      throw new KvfenceError('internal_error', `tenants: duplicate name ${t.name}`)
    if (digests.has(t.keySha256)) {
      throw new KvfenceError(
        'internal_error',
        `tenants: tenant ${t.name} shares its key with another`,
      )
    }
    names.add(t.name)
    digests.add(t.keySha256)
  }
  const entries = parsed.data.map((t) => ({
    tenant: Object.freeze({ name: t.name, limits: Object.freeze({ ...t.limits }) }),
    digest: Buffer.from(t.keySha256, 'hex'), // 32 bytes
  }))

  return Object.freeze({
    names: Object.freeze(entries.map((e) => e.tenant.name)),
    authenticate(apiKey: string): Tenant | null {
      const presented = createHash('sha256').update(apiKey, 'utf8').digest()
      let found: Tenant | null = null
      // Compare with every tenant, without an early exit.
      for (const e of entries) {
        if (timingSafeEqual(presented, e.digest) && found === null) found = e.tenant
      }
      return found
    },
  })
}

/** Reads and validates a tenants YAML file; throws `internal_error` naming the file and fault. */
export function loadTenants(path: string): TenantRegistry {
  let text: string
  try {
    text = readFileSync(path, 'utf8')
  } catch (err) {
    throw new KvfenceError('internal_error', `cannot read tenants file ${path}: ${message(err)}`)
  }
  let value: unknown
  try {
    value = parseYaml(text)
  } catch (err) {
    throw new KvfenceError(
      'internal_error',
      `tenants file ${path} is not valid YAML: ${message(err)}`,
    )
  }
  const parsed = TenantsFile.safeParse(value)
  if (!parsed.success) {
    throw new KvfenceError(
      'internal_error',
      `tenants file ${path}: ${describeIssue(parsed.error.issues[0])}`,
    )
  }
  try {
    return createTenantRegistry(parsed.data.tenants)
  } catch (err) {
    throw new KvfenceError('internal_error', `tenants file ${path}: ${message(err)}`)
  }
}

/** The API key of an `Authorization: Bearer KEY` header, or null. */
export function bearerKey(header: string | undefined): string | null {
  if (header === undefined) return null
  const match = /^Bearer\s+(\S+)\s*$/i.exec(header)
  return match === null ? null : match[1]
}

function describeIssue(issue: z.core.$ZodIssue | undefined): string {
  if (issue === undefined) return 'invalid'
  const path = issue.path.map(String).join('.')
  return path === '' ? issue.message : `${path}: ${issue.message}`
}

function message(err: unknown): string {
  return err instanceof Error ? err.message : String(err)
}
