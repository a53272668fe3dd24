/** The audit's YAML config file (`kvfence audit --config FILE`), parsed once into a typed value or
 *  one clear error. Tenants' keys are never written in the file: each tenant names the environment
 *  variable that holds its key (`keyEnv`), read here. Flags given on the command line override the
 *  file field by field (the CLI merges them).
 *
 *  ```yaml
 *  target: http://127.0.0.1:8000        # required (here or --target)
 *  model: tiny-echo                     # optional
 *  tenants:                             # at least two; the first plants, the second observes
 *    - { name: alice, keyEnv: TENANT_A_KEY }
 *    - { name: bob, keyEnv: TENANT_B_KEY }
 *  probes: [capacity, boundary, canary] # optional, default all
 *  budget: { maxRequests: 800, maxSeconds: 300, concurrency: 4 }
 *  seed: 42
 *  failOn: [content-leak, availability] # classes, severities, tags or verdicts (gate.ts)
 *  reports: { json: audit.json, junit: audit.xml, html: audit.html }
 *  authorized_targets: [llm.staging.internal]  # hosts other than loopback the audit may reach
 *  ```
 *  Knows YAML and environment variables; knows nothing of HTTP. */
import { readFile } from 'node:fs/promises'
import { parse as parseYaml } from 'yaml'
import { z } from 'zod'
import { maxAuditSeconds, minAuditSeconds } from './budget.js'
import { failOnFault, type FailOnTerm } from './gate.js'
import { AuditError, probeNames, type ProbeName, type Tenant } from './types.js'

/** The range of the budget's integers, inclusive: the same as `runAudit` checks, here so that a
 *  value out of range is refused naming where it came from (`--concurrency`, `budget.concurrency`)
 *  rather than as "concurrency must be …" without either. */
export const auditBounds = Object.freeze({
  maxRequests: { min: 1, max: 1_000_000 },
  concurrency: { min: 1, max: 256 },
  maxConcurrency: { min: 1, max: 256 },
})

/** A budget integer within `bound` (the message names the range; the path names the key). */
function budgetInt(bound: { readonly min: number; readonly max: number }) {
  const message = `must be an integer from ${bound.min} to ${bound.max}`
  return z.number().int(message).min(bound.min, message).max(bound.max, message).optional()
}

const ConfigFile = z.strictObject({
  target: z.string().min(1).optional(),
  model: z.string().min(1).optional(),
  tenants: z
    .array(
      z.strictObject({
        name: z.string().regex(/^[\w.@-]+$/, 'must be a plain word'),
        keyEnv: z
          .string()
          .regex(/^[A-Za-z_][A-Za-z0-9_]*$/, 'must be an environment variable name'),
      }),
    )
    .optional(),
  probes: z.array(z.enum(probeNames)).min(1).optional(),
  budget: z
    .strictObject({
      maxRequests: budgetInt(auditBounds.maxRequests),
      maxSeconds: z.number().min(minAuditSeconds).max(maxAuditSeconds).optional(),
      concurrency: budgetInt(auditBounds.concurrency),
      maxConcurrency: budgetInt(auditBounds.maxConcurrency),
    })
    .optional(),
  seed: z
    .number()
    .int()
    .min(0)
    .max(2 ** 32 - 1)
    .optional(),
  // One term or a list of them (`failOn: high`, `failOn: [content-leak, availability]`).
  // Terms are checked after (failOnFault), so that an unknown one is named with the known ones
  // rather than as zod's "Invalid input" of the union.
  failOn: z
    .union([z.string(), z.array(z.string()).min(1)], {
      error: 'must be a term or a list of terms (classes, severities, tags or verdicts)',
    })
    .optional(),
  authorized_targets: z.array(z.string().min(1)).optional(),
  // `kvfence watch`'s section (its own parser checks it): one file serves the audit and the watch.
  watch: z.unknown().optional(),
  reports: z
    .strictObject({
      json: z.string().min(1).optional(),
      junit: z.string().min(1).optional(),
      html: z.string().min(1).optional(),
    })
    .optional(),
})

/** The fault of the first two tenants whose names are equal ignoring case (`tenant a is given
 *  twice`, `tenants a and A differ only in case …`), or null. Names are compared so, as the
 *  router compares them: a report or a log that tells two tenants apart by case only would be
 *  read as one tenant. */
export function sameTenantNameFault(names: readonly string[]): string | null {
  const seen = new Map<string, string>()
  for (const name of names) {
    const earlier = seen.get(name.toLowerCase())
    if (earlier === name) return `tenant ${name} is given twice`
    if (earlier !== undefined)
      return `tenants ${earlier} and ${name} differ only in case (tenant names are compared ignoring case)`
    seen.set(name.toLowerCase(), name)
  }
  return null
}

/** The config file's content, keys resolved from the environment. */
export interface AuditConfigFile {
  readonly target?: string
  readonly model?: string
  readonly tenants?: readonly Tenant[]
  readonly probes?: readonly ProbeName[]
  readonly maxRequests?: number
  readonly maxSeconds?: number
  readonly concurrency?: number
  readonly maxConcurrency?: number
  readonly seed?: number
  readonly failOn?: readonly FailOnTerm[]
  readonly reports?: { readonly json?: string; readonly junit?: string; readonly html?: string }
  /** Hosts (`host`, `host:port` or a URL) other than loopback the audit may be pointed at. */
  readonly authorizedTargets?: readonly string[]
}

/** Reads and validates `file`. Throws `AuditError('invalid_config')` with one line naming the file
 *  and the first problem (never a key). */
export async function loadAuditConfig(
  file: string,
  env: Readonly<Record<string, string | undefined>>,
): Promise<AuditConfigFile> {
  let text: string
  try {
    text = await readFile(file, 'utf8')
  } catch (err) {
    const code = (err as { code?: string }).code ?? 'unreadable'
    throw new AuditError('invalid_config', `cannot read config ${file}: ${code}`)
  }
  return parseAuditConfig(text, file, env)
}

/** Parses the text of a config file (see {@link loadAuditConfig}). */
export function parseAuditConfig(
  text: string,
  file: string,
  env: Readonly<Record<string, string | undefined>>,
): AuditConfigFile {
  let raw: unknown
  try {
    raw = parseYaml(text)
  } catch (err) {
    const first = (err instanceof Error ? err.message : String(err)).split('\n')[0]
    throw new AuditError('invalid_config', `config ${file} is not valid YAML: ${first}`)
  }
  // A key written into the file would end up in repositories and CI logs: refuse it by name.
  const rawTenants = (raw as { tenants?: unknown } | null)?.tenants
  if (Array.isArray(rawTenants)) {
    rawTenants.forEach((t: unknown, i) => {
      if (typeof t === 'object' && t !== null && 'key' in t) {
        throw new AuditError(
          'invalid_config',
          `config ${file}: tenants.${i}: a key is never read from a file; put it in an environment variable named by keyEnv`,
        )
      }
    })
  }
  const parsed = ConfigFile.safeParse(raw ?? {})
  if (!parsed.success) {
    const issue = parsed.error.issues[0]
    const where = issue.path.length > 0 ? issue.path.join('.') : '(top level)'
    throw new AuditError('invalid_config', `config ${file}: ${where}: ${issue.message}`)
  }
  const c = parsed.data
  const failOn =
    c.failOn === undefined ? undefined : typeof c.failOn === 'string' ? [c.failOn] : c.failOn
  const failOnFaultText = failOn === undefined ? null : failOnFault(failOn)
  if (failOnFaultText !== null)
    throw new AuditError('invalid_config', `config ${file}: failOn: ${failOnFaultText}`)
  const tenants = c.tenants?.map(({ name, keyEnv }) => {
    const key = env[keyEnv]
    if (key === undefined || key === '') {
      throw new AuditError(
        'invalid_config',
        `config ${file}: tenant ${name}: environment variable ${keyEnv} is not set`,
      )
    }
    return { name, key }
  })
  const fault = tenants === undefined ? null : sameTenantNameFault(tenants.map((t) => t.name))
  if (fault !== null) throw new AuditError('invalid_config', `config ${file}: tenants: ${fault}`)
  return {
    target: c.target,
    model: c.model,
    tenants,
    probes: c.probes,
    maxRequests: c.budget?.maxRequests,
    maxSeconds: c.budget?.maxSeconds,
    concurrency: c.budget?.concurrency,
    // Present only when given, so a file without them reads as before.
    ...(c.budget?.maxConcurrency === undefined ? {} : { maxConcurrency: c.budget.maxConcurrency }),
    seed: c.seed,
    failOn: failOn as FailOnTerm[] | undefined,
    reports: c.reports,
    ...(c.authorized_targets === undefined ? {} : { authorizedTargets: c.authorized_targets }),
  }
}
