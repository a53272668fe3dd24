/** Tenants, their API keys and limits: the YAML file
 *  `tenants: [{ name, keySha256, limits?: { maxConcurrentRequests?, tokensPerMinute? },
 *  prefixCachePages? }]` and the
 *  lookup of a presented key. Keys are held only as SHA-256 digests and compared in constant time.
 *  Knows tenant names and key digests; never holds, returns or logs a plain key. */
import * as crypto from 'node:crypto'
import { createHash, timingSafeEqual } from 'node:crypto'
import { type Stats, unwatchFile, watchFile } from 'node:fs'
import type { Logger } from 'pino'
import { z } from 'zod'
import { describeIssue } from '../../files/issues.js'
import { loadYamlFile } from '../../files/yaml-file.js'
import type { PrefixCachePartition } from '../../control/messages.js'
import { KvfenceError } from '../../common/errors.js'

/** A tenant's limits; an absent field is no limit. */
export const TenantLimits = z.strictObject({
  /** Requests of this tenant in flight at once (queued ones included); more → 429. */
  maxConcurrentRequests: z.number().int().min(1).optional(),
  /** Tokens (prompt + max_tokens, unused completion tokens refunded) per rolling minute;
   *  more → 429 with the seconds until enough are free in `Retry-After`. */
  tokensPerMinute: z.number().int().min(1).optional(),
})
export type TenantLimits = z.infer<typeof TenantLimits>

/** The smallest weight a tenant may have: with {@link maxTenantWeight}, a million to one is more
 *  spread than any operator needs, and a weight far smaller (1e-300 was accepted) drives the
 *  tenant's virtual token counter past what a double holds, where it stops ordering anything
 *  (../admission/fair-queue.ts). */
export const minTenantWeight = 0.001

/** The largest weight a tenant may have (see {@link minTenantWeight}). */
export const maxTenantWeight = 1000

/** One tenant as configured: its name (logged, sent to workers), its key's SHA-256 (hex) and its
 *  limits. */
export const TenantRecord = z.strictObject({
  // Names go to logs, metric labels and worker page metadata: plain words only.
  name: z
    .string()
    .min(1, 'a tenant name may not be empty')
    .max(128, 'a tenant name is at most 128 characters')
    .regex(/^[A-Za-z0-9._@-]+$/, 'a tenant name is letters, digits and . _ @ - only'),
  keySha256: z
    .string()
    .regex(/^[0-9a-fA-F]{64}$/, "keySha256 must be the 64 hex digits of the key's SHA-256")
    .transform((s) => s.toLowerCase()),
  limits: TenantLimits.optional(),
  /** The tenant's share of the router's service against other tenants with requests queued
   *  (../admission/fair-queue.ts): a tenant of weight 2 is served twice the tokens of one of weight 1 while both
   *  wait. Default 1. */
  weight: z
    .number()
    .min(minTenantWeight, `weight must be from ${minTenantWeight} to ${maxTenantWeight}`)
    .max(maxTenantWeight, `weight must be from ${minTenantWeight} to ${maxTenantWeight}`)
    .optional(),
  /** A watch tenant: the response sentinel learns canaries from its prompts. */
  canary: z.boolean().optional(),
  /** Pages of each prefill worker's prefix cache kept for this tenant alone (0: none); default:
   *  an equal share of the pages no tenant is given by name (src/kv/prefix-cache.ts). */
  prefixCachePages: z.number().int().min(0, 'prefixCachePages must be an integer ≥ 0').optional(),
})
export type TenantRecord = z.infer<typeof TenantRecord>

/** An authenticated tenant. */
export interface Tenant {
  readonly name: string
  readonly limits: TenantLimits
  /** Share of the service in the fair queue (> 0); absent when the file sets none, which counts
   *  as {@link defaultTenantWeight}. */
  readonly weight?: number
  /** Present (true) when marked `canary: true`: its prompts' canaries are watched for in other
   *  tenants' answers. Absent otherwise, so that an ordinary tenant is just its name and limits. */
  readonly isCanary?: true
  /** Its prefix-cache partition under the whole file, sent to prefill workers with each of its
   *  requests: its own size if the file gives one, the pages given by name, the tenants without. */
  readonly prefixCachePartition: PrefixCachePartition
}

/** A tenant's weight when the tenants file gives none. */
export const defaultTenantWeight = 1

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

/** The first two of `names` that are equal ignoring case (`Alice`, `alice`), or null. Tenant
 *  names are compared so: people read them in logs, metric labels and audit reports, where two
 *  tenants told apart by case only would be taken for one. */
export function sameTenantNames(names: readonly string[]): readonly [string, string] | null {
  const seen = new Map<string, string>()
  for (const name of names) {
    const earlier = seen.get(name.toLowerCase())
    if (earlier !== undefined) return [earlier, name]
    seen.set(name.toLowerCase(), name)
  }
  return null
}

/** The fault of two names {@link sameTenantNames} found, in a few words. */
export function sameTenantNamesFault([first, second]: readonly [string, string]): string {
  return first === second
    ? `duplicate name ${first}`
    : `names ${first} and ${second} differ only in case (tenant names are compared ignoring case)`
}

/** SHA-256 of a presented key (UTF-8), 32 bytes: once per request, so in one call where Node has
 *  one (`crypto.hash`, Node ≥ 20.12: no Hash object per request), else through `createHash`. */
const sha256: (text: string) => Buffer =
  typeof crypto.hash === 'function'
    ? (text) => crypto.hash('sha256', text, 'buffer')
    : (text) => createHash('sha256').update(text, 'utf8').digest()

/** A registry over `records`; throws `internal_error` on names equal ignoring case or on
 *  duplicate digests. */
export function createTenantRegistry(records: readonly TenantRecord[]): TenantRegistry {
  const parsed = z.array(TenantRecord).min(1).safeParse(records)
  if (!parsed.success) {
    throw new KvfenceError('internal_error', `tenants: ${describeIssue(parsed.error.issues[0])}`)
  }
  const same = sameTenantNames(parsed.data.map((t) => t.name))
  if (same !== null)
    throw new KvfenceError('internal_error', `tenants: ${sameTenantNamesFault(same)}`)
  const digests = new Set<string>()
  for (const t of parsed.data) {
    if (digests.has(t.keySha256)) {
      throw new KvfenceError(
        'internal_error',
        `tenants: tenant ${t.name} shares its key with another`,
      )
    }
    digests.add(t.keySha256)
  }
  // The prefix-cache split depends on the whole file only, never on traffic.
  const sized = parsed.data.filter((t) => t.prefixCachePages !== undefined)
  const split = {
    reservedPages: sized.reduce((sum, t) => sum + t.prefixCachePages!, 0),
    numDefaultTenants: parsed.data.length - sized.length,
  }
  const entries = parsed.data.map((t) => ({
    tenant: Object.freeze({
      name: t.name,
      limits: Object.freeze({ ...t.limits }),
      ...(t.weight !== undefined && { weight: t.weight }),
      ...(t.canary === true ? { isCanary: true as const } : {}),
      prefixCachePartition: Object.freeze({
        ...(t.prefixCachePages !== undefined && { pages: t.prefixCachePages }),
        ...split,
      }),
    }),
    digest: Buffer.from(t.keySha256, 'hex'), // 32 bytes
  }))

  return Object.freeze({
    names: Object.freeze(entries.map((e) => e.tenant.name)),
    authenticate(apiKey: string): Tenant | null {
      const presented = sha256(apiKey)
      let found: Tenant | null = null
      // Compare with every tenant, without an early exit.
      for (const e of entries) {
        if (timingSafeEqual(presented, e.digest) && found === null) found = e.tenant
      }
      return found
    },
  })
}

/** Reads and validates a tenants YAML file; throws `internal_error` naming the file and fault in
 *  one line that quotes nothing of the file but field names and tenant names (it may be logged:
 *  see src/config/yaml-file.ts). Refuses a directory, a device or a file over 16 MiB. */
export function loadTenants(path: string): TenantRegistry {
  const value = loadYamlFile(path, `tenants file ${path}`, 'internal_error')
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

/** A tenants file kept in force while the router runs (see {@link watchTenants}). */
export interface TenantsWatcher {
  /** The tenants as last read successfully; every call sees one whole file, never a mix. */
  readonly registry: TenantRegistry
  /** Re-reads the file now: true if the new tenants took effect, false (logged at error) if the
   *  file was unreadable or invalid and the previous tenants stay. */
  reload(): boolean
  /** Stops watching the file. */
  close(): void
}

/** Default interval at which {@link watchTenants} polls the file's metadata, ms. */
export const defaultTenantsPollMs = 1_000

/** Loads the tenants file at `path` (throws as {@link loadTenants} does) and keeps it in force:
 *  `keys add` / `keys remove` take effect within about `intervalMs` (default
 *  {@link defaultTenantsPollMs}) without a restart. Polls the file's metadata (`fs.watchFile`:
 *  a stat per interval, so it also follows a file replaced by rename and works on any file
 *  system) and, when it changed, reads the whole file and swaps the registry in one assignment.
 *  A file that no longer parses or validates (including one with no tenants) leaves the previous
 *  tenants in force and is logged at error: an operator's typo must neither lock every tenant out
 *  nor bring the router down. The poll does not keep the process alive. */
export function watchTenants(
  path: string,
  options: {
    log: Logger
    intervalMs?: number
    /** Reads the tenant records out of `path` (default: `path` is a tenants file); throws on a
     *  file that is unreadable or invalid. `kvfence router --config` passes the cluster config's. */
    read?: (path: string) => readonly TenantRecord[]
  },
): TenantsWatcher {
  const { log, read } = options
  const load = (): TenantRegistry => {
    if (read === undefined) return loadTenants(path)
    const records = read(path)
    try {
      return createTenantRegistry(records)
    } catch (err) {
      throw new KvfenceError('internal_error', `tenants file ${path}: ${message(err)}`)
    }
  }
  let current = load()

  function reload(): boolean {
    let next: TenantRegistry
    try {
      next = load()
    } catch (err) {
      log.error(
        { tenantsFile: path, detail: message(err) },
        'tenants file reload failed; the previous tenants stay in force',
      )
      return false
    }
    const before = new Set(current.names)
    const after = new Set(next.names)
    current = next // one assignment: a request authenticates against the old file or the new
    log.info(
      {
        tenantsFile: path,
        numTenants: next.names.length,
        added: next.names.filter((n) => !before.has(n)),
        removed: [...before].filter((n) => !after.has(n)),
      },
      'tenants file reloaded',
    )
    return true
  }

  const onChange = (now: Stats, previous: Stats) => {
    const isChanged =
      now.mtimeMs !== previous.mtimeMs || now.size !== previous.size || now.ino !== previous.ino
    if (isChanged) reload()
  }
  watchFile(
    path,
    { interval: options.intervalMs ?? defaultTenantsPollMs, persistent: false },
    onChange,
  )

  return Object.freeze({
    registry: Object.freeze({
      get names() {
        return current.names
      },
      authenticate: (apiKey: string) => current.authenticate(apiKey),
    }),
    reload,
    close: () => unwatchFile(path, onChange),
  })
}

/** The API key of an `Authorization: Bearer KEY` header, or null. */
export function bearerKey(header: string | undefined): string | null {
  if (header === undefined) return null
  const match = /^Bearer\s+(\S+)\s*$/i.exec(header)
  return match === null ? null : match[1]
}

function message(err: unknown): string {
  return err instanceof Error ? err.message : String(err)
}
