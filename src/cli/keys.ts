/** `kvfence keys add|list|remove`: manage tenant API keys in a YAML file with a `tenants:` list —
 *  a tenants file or the cluster config file. Only SHA-256 digests are stored; `add` prints the
 *  new key once (it cannot be recovered later). Edits keep the rest of the file (limits, other
 *  sections, comments) as it was. */
import { accessSync, constants, existsSync } from 'node:fs'
import { dirname } from 'node:path'
import { type Command, InvalidArgumentError } from 'commander'
import lockfile from 'proper-lockfile'
import writeFileAtomic from 'write-file-atomic'
import { isMap, isSeq, type Document } from 'yaml'
import { z } from 'zod'
import { describeIssue } from '../files/issues.js'
import { parseYamlDocument, readYamlFileText } from '../files/yaml-file.js'
import { KvfenceError } from '../common/errors.js'
import { newApiKey } from '../router/tenants/tenant-keys.js'
import { intOption, positiveIntOption } from './options.js'
import {
  apiKeyDigest,
  maxTenantWeight,
  minTenantWeight,
  sameTenantNames,
  sameTenantNamesFault,
  TenantRecord,
} from '../router/tenants/tenants.js'
import { ClusterConfig } from '../config/cluster.js'

/** The file's YAML document and its validated tenants; a missing file is an empty document when
 *  `mayCreate`. Throws `config_invalid` naming the file and the fault. */
function readTenantsDocument(
  path: string,
  mayCreate: boolean,
): { doc: Document; tenants: TenantRecord[] } {
  const isNew = !existsSync(path)
  if (isNew && !mayCreate) throw new KvfenceError('config_invalid', `${path} does not exist`)
  // Errors name the position and kind of fault only: the file holds key digests (see
  // src/files/yaml-file.ts). A directory, a device or a file over 16 MiB is refused unread.
  const label = `tenants file ${path}`
  const doc = parseYamlDocument(
    isNew ? '{}' : readYamlFileText(path, label, 'config_invalid'),
    label,
    'config_invalid',
  )
  if (doc.contents !== null && !isMap(doc.contents)) {
    throw new KvfenceError('config_invalid', `${path}: the file must be a YAML mapping`)
  }
  const list = doc.get('tenants')
  // Listing or removing in a file with no tenants list is a wrong path, not an empty list.
  if (list === undefined && !mayCreate)
    throw new KvfenceError('config_invalid', `${path} has no tenants list (is it a tenants file?)`)
  if (list !== undefined && !isSeq(list)) {
    throw new KvfenceError('config_invalid', `${path}: tenants must be a list`)
  }
  let value: { tenants?: unknown } | null
  try {
    value = doc.toJS() as { tenants?: unknown } | null
  } catch {
    // The library's message names the alias: file content.
    throw new KvfenceError('config_invalid', `${label} is not valid YAML: a bad alias`)
  }
  // The file is a tenants file or a cluster file (`serve --config`): a key neither has would
  // make `serve` refuse the file that `keys add` had just written a key into.
  const unknown = Object.keys(value ?? {}).find((key) => !Object.hasOwn(ClusterConfig.shape, key))
  if (unknown !== undefined)
    throw new KvfenceError(
      'config_invalid',
      `${path}: unknown key "${unknown}" (a tenants file holds tenants:, a cluster file ${Object.keys(ClusterConfig.shape).join(', ')})`,
    )
  const parsed = z.array(TenantRecord).safeParse(value?.tenants ?? [])
  if (!parsed.success) {
    const issue = parsed.error.issues[0]
    throw new KvfenceError(
      'config_invalid',
      `${path}: ${describeIssue({ ...issue, path: ['tenants', ...issue.path] })}`,
    )
  }
  if (list === undefined) doc.set('tenants', doc.createNode([]))
  const seq = doc.get('tenants')
  // Block style, one tenant a line.
  if (isSeq(seq) && seq.items.length === 0) seq.flow = false
  if (isNew) doc.contents!.flow = false
  return { doc, tenants: parsed.data }
}

/** Parses `keys add --weight`: a number (`2`, `0.5` or `1e3`, as YAML reads the file's) from
 *  {@link minTenantWeight} to {@link maxTenantWeight}, else commander's one-line error (see
 *  options.ts). */
function weightOption(value: string): number {
  const w = /^\d+(\.\d+)?(e[+-]?\d+)?$/i.test(value) ? Number(value) : NaN
  if (!(w >= minTenantWeight && w <= maxTenantWeight))
    throw new InvalidArgumentError(
      `expected a number from ${minTenantWeight} to ${maxTenantWeight}, got "${value}"`,
    )
  return w
}

/** Register `kvfence keys`. */
export function registerKeys(program: Command): void {
  const keys = program.command('keys').description('manage tenant API keys')
  const fileOption = ['--tenants <file>', 'YAML file with a tenants list', 'tenants.yaml'] as const
  keys
    .command('add <name>')
    .description(
      'create a key for tenant NAME, store its SHA-256 in the tenants file, print the key once',
    )
    .option(...fileOption)
    .option('--max-concurrent <n>', 'limit: requests in flight at once', positiveIntOption)
    .option(
      '--tokens-per-minute <n>',
      'limit: tokens (prompt + max_tokens) per minute',
      positiveIntOption,
    )
    .option(
      '--prefix-cache-pages <n>',
      "pages of each prefill worker's prefix cache kept for this tenant alone (0: none; default: an equal share of the rest)",
      intOption,
    )
    .option(
      '--weight <w>',
      "the tenant's share against other waiting tenants in the router's fair queue (0.001 to 1000; default 1)",
      weightOption,
    )
    .option(
      '--canary',
      "a watch tenant (canary: true): the router's response sentinel learns canaries from its prompts and confirms a leak when another tenant's answer carries one (for kvfence watch's tenants only; see docs/monitoring.md)",
    )
    .action(
      async (
        name: string,
        flags: {
          tenants: string
          maxConcurrent?: number
          tokensPerMinute?: number
          prefixCachePages?: number
          weight?: number
          canary?: boolean
        },
      ) => {
        const unlock = await lockTenantsFile(flags.tenants)
        try {
          addTenant(name, flags)
        } finally {
          await unlock()
        }
      },
    )
  keys
    .command('list')
    .description(
      'list tenants, their limits, weights, prefix-cache pages and which are canary tenants (never keys)',
    )
    .option(...fileOption)
    .action((flags: { tenants: string }) => {
      const { tenants } = readTenantsDocument(flags.tenants, false)
      checkTenantNames(flags.tenants, tenants)
      for (const t of tenants) {
        const limits = Object.entries(t.limits ?? {}).map(([k, v]) => `${k}=${v}`)
        const more = [
          ...(t.weight === undefined ? [] : [`weight=${t.weight}`]),
          ...(t.prefixCachePages === undefined ? [] : [`prefixCachePages=${t.prefixCachePages}`]),
          ...(t.canary === true ? ['canary'] : []),
        ]
        const columns = [t.name, limits.length > 0 ? limits.join(' ') : 'no limits', ...more]
        process.stdout.write(`${columns.join('\t')}\n`)
      }
    })
  keys
    .command('remove <name>')
    .description('remove tenant NAME and its key from the tenants file')
    .option(...fileOption)
    .action(async (name: string, flags: { tenants: string }) => {
      const unlock = await lockTenantsFile(flags.tenants)
      try {
        const { doc, tenants } = readTenantsDocument(flags.tenants, false)
        // The name as written: removal cuts a tenant off, so a name that matches one only
        // ignoring case is refused naming it (it may be the one meant, or a typo).
        const index = tenants.findIndex((t) => t.name === name)
        if (index === -1) {
          const other = tenants.find((t) => t.name.toLowerCase() === name.toLowerCase())?.name
          throw new KvfenceError(
            'config_invalid',
            other === undefined
              ? `tenant ${name} is not in ${flags.tenants}`
              : `tenant ${name} is not in ${flags.tenants}, but ${other} is: tenant names are compared ignoring case, yet remove takes the name as written (kvfence keys remove ${other})`,
          )
        }
        doc.deleteIn(['tenants', index])
        writeTenantsFile(flags.tenants, doc)
      } finally {
        await unlock()
      }
      process.stderr.write(`tenant ${name} removed from ${flags.tenants}\n`)
    })
}

/** Throws `config_invalid` with the router's own line (`tenants file PATH: tenants: names bob and
 *  BOB differ only in case …`) when two names are equal ignoring case: `serve` refuses such a
 *  file, so `list` and `add` must not pass it as good. (`remove` reads it, to fix it.) */
function checkTenantNames(path: string, tenants: readonly TenantRecord[]): void {
  const same = sameTenantNames(tenants.map((t) => t.name))
  if (same !== null)
    throw new KvfenceError(
      'config_invalid',
      `tenants file ${path}: tenants: ${sameTenantNamesFault(same)}`,
    )
}

/** `keys add`: a new tenant with a fresh key in the tenants file (the caller holds its lock).
 *  Throws `config_invalid` when the name exists or the record is invalid. */
function addTenant(
  name: string,
  flags: {
    tenants: string
    maxConcurrent?: number
    tokensPerMinute?: number
    prefixCachePages?: number
    weight?: number
    canary?: boolean
  },
): void {
  const { doc, tenants } = readTenantsDocument(flags.tenants, true)
  checkTenantNames(flags.tenants, tenants)
  // Names are compared ignoring case, as the router compares them (sameTenantNames).
  const existing = tenants.find((t) => t.name.toLowerCase() === name.toLowerCase())?.name
  if (existing !== undefined) {
    throw new KvfenceError(
      'config_invalid',
      existing === name
        ? `tenant ${name} already exists in ${flags.tenants}`
        : `tenant ${existing} already exists in ${flags.tenants}: tenant names are compared ignoring case, so ${name} would be taken for it`,
    )
  }
  const key = newApiKey()
  const limits = {
    ...(flags.maxConcurrent === undefined ? {} : { maxConcurrentRequests: flags.maxConcurrent }),
    ...(flags.tokensPerMinute === undefined ? {} : { tokensPerMinute: flags.tokensPerMinute }),
  }
  const parsed = TenantRecord.safeParse({
    name,
    keySha256: apiKeyDigest(key),
    ...(Object.keys(limits).length > 0 ? { limits } : {}),
    ...(flags.prefixCachePages === undefined ? {} : { prefixCachePages: flags.prefixCachePages }),
    ...(flags.weight === undefined ? {} : { weight: flags.weight }),
    ...(flags.canary === true ? { canary: true } : {}),
  })
  if (!parsed.success) {
    const issue = parsed.error.issues[0]
    throw new KvfenceError('config_invalid', `tenant ${JSON.stringify(name)}: ${issue?.message}`)
  }
  const record = parsed.data
  doc.addIn(['tenants'], doc.createNode(record))
  writeTenantsFile(flags.tenants, doc)
  const what = flags.canary === true ? 'canary tenant' : 'tenant'
  process.stderr.write(`${what} ${name} added to ${flags.tenants}; its key (shown once):\n`)
  process.stdout.write(`${key}\n`)
}
/** Takes the tenants file's lock (a `PATH.lock` directory, proper-lockfile) for one read, change
 *  and write of the file: without it two `keys` commands at once each wrote back what they had
 *  read, and one's change was lost (an added key that never works, or a removal reported done
 *  while the key stayed valid). Waits up to ~10 s for another command; a lock left by a killed
 *  command is taken over once stale (10 s without its holder touching it). Resolves with the
 *  release; throws `config_invalid` when the lock cannot be had. */
async function lockTenantsFile(path: string): Promise<() => Promise<void>> {
  try {
    // The lock retries any failure for 20 s: a missing folder is told at once.
    accessSync(dirname(path), constants.W_OK)
    return await lockfile.lock(path, {
      realpath: false,
      stale: 10_000,
      retries: { retries: 100, minTimeout: 20, maxTimeout: 200 },
    })
  } catch (err) {
    // A missing folder or no write access to it: the same line as a write that fails for it.
    const code = (err as NodeJS.ErrnoException).code
    if (code !== undefined && code !== 'ELOCKED') {
      const reason = /^E[A-Z]+: [^,]*/.exec((err as Error).message)?.[0] ?? code
      throw new KvfenceError('config_invalid', `cannot write tenants file ${path}: ${reason}`)
    }
    throw new KvfenceError(
      'config_invalid',
      `cannot lock tenants file ${path} (another kvfence keys command holds ${path}.lock): ${(err as Error).message}`,
    )
  }
}

/** Replace the file in one step (a temporary file, fsynced, renamed over it): a router reloading
 *  the file (`watchTenants`) never reads it half-written, and a crash leaves the old file whole.
 *  An existing file keeps its mode and owner; a new one is readable by its owner only. */
function writeTenantsFile(path: string, doc: Document): void {
  try {
    writeFileAtomic.sync(path, doc.toString(), existsSync(path) ? {} : { mode: 0o600 })
  } catch (err) {
    // The library's message names its temporary file (`t.yaml.2727288112`): name the real one,
    // keeping the system's reason ("ENOENT: no such file or directory").
    const reason = /^E[A-Z]+: [^,]*/.exec((err as Error).message)?.[0] ?? (err as Error).message
    throw new KvfenceError('config_invalid', `cannot write tenants file ${path}: ${reason}`)
  }
}
