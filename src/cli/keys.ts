/** `kvfence keys add NAME`: create a tenant API key, store only its SHA-256 digest in the tenants
 *  file, and print the key once (it cannot be recovered later). */
import { randomBytes } from 'node:crypto'
import { existsSync, readFileSync, writeFileSync } from 'node:fs'
import type { Command } from 'commander'
import { parse as parseYaml, stringify as toYaml } from 'yaml'
import { apiKeyDigest, TenantsFile } from '../router/tenants.js'

/** A fresh API key: `sk-kvf-` and 256 random bits in hex. */
export function newApiKey(): string {
  return `sk-kvf-${randomBytes(32).toString('hex')}`
}

/** The tenants-file YAML for tenants whose keys are given (only digests are written). */
export function tenantsYaml(tenants: readonly { name: string; key: string }[]): string {
  return toYaml({ tenants: tenants.map((t) => ({ name: t.name, keySha256: apiKeyDigest(t.key) })) })
}

/** Register `kvfence keys`. */
export function registerKeys(program: Command): void {
  const keys = program.command('keys').description('manage tenant API keys')
  keys
    .command('add <name>')
    .description(
      'create a key for tenant NAME, store its SHA-256 in the tenants file, print the key once',
    )
    .option('--tenants <file>', 'tenants YAML file (created if missing)', 'tenants.yaml')
    .action((name: string, flags: { tenants: string }) => {
      let tenants: { name: string; keySha256: string }[] = []
      if (existsSync(flags.tenants)) {
        const parsed = TenantsFile.safeParse(parseYaml(readFileSync(flags.tenants, 'utf8')))
        if (!parsed.success)
          throw new Error(
            `${flags.tenants} is not a valid tenants file: ${parsed.error.issues[0]?.message}`,
          )
        tenants = parsed.data.tenants
      }
      if (tenants.some((t) => t.name === name))
        throw new Error(`tenant ${name} already exists in ${flags.tenants}`)
      const key = newApiKey()
      tenants.push({ name, keySha256: apiKeyDigest(key) })
      writeFileSync(flags.tenants, toYaml({ tenants }), { mode: 0o600 })
      process.stderr.write(`tenant ${name} added to ${flags.tenants}; its key (shown once):\n`)
      process.stdout.write(`${key}\n`)
    })
}
