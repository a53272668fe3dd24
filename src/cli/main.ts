#!/usr/bin/env node
/** The `kvfence` command: one sub-command per file in this folder, registered here. Only the
 *  file of the sub-command named on the command line is loaded (all of them for `--help`, `help`,
 *  an unknown name or none): every worker and router a cluster forks is this command, and loading
 *  every sub-command's modules (the `openai` client, Redis, x509…) cost each of them about as
 *  long again as its own start. */
import { readFileSync } from 'node:fs'
import { join } from 'node:path'
import { Command, CommanderError } from 'commander'
import { packageRoot } from '../common/paths.js'

type Register = (program: Command) => void

/** Each sub-command's file, in the order `--help` lists them; `prefill` and `decode` share one. */
const registrars: readonly [names: readonly string[], load: () => Promise<Register>][] = [
  [['demo'], async () => (await import('./demo.js')).registerDemo],
  [['serve'], async () => (await import('./serve.js')).registerServe],
  [['generate'], async () => (await import('./generate.js')).registerGenerate],
  [['prefill', 'decode'], async () => (await import('./worker.js')).registerWorkers],
  [['router'], async () => (await import('./router.js')).registerRouter],
  [['keys'], async () => (await import('./keys.js')).registerKeys],
  [['certs'], async () => (await import('./certs.js')).registerCerts],
  [['soak'], async () => (await import('./soak.js')).registerSoak],
  [['audit'], async () => (await import('./audit.js')).registerAudit],
  [['watch'], async () => (await import('./watch.js')).registerWatch],
]

const program = new Command()
program
  .name('kvfence')
  .description(
    'Disaggregated LLM serving that is safe from cross-tenant KV-cache leaks, and an auditor that proves it.',
  )
  .version(
    (JSON.parse(readFileSync(join(packageRoot, 'package.json'), 'utf8')) as { version: string })
      .version,
    '-V, --version',
    'print the version of kvfence',
  )
  .exitOverride()

try {
  const named = process.argv[2]
  const only = registrars.find(([names]) => names.includes(named))
  for (const [, load] of only === undefined ? registrars : [only]) (await load())(program)
  await program.parseAsync(process.argv)
} catch (err) {
  if (err instanceof CommanderError) process.exit(err.exitCode === 0 ? 0 : 2)
  process.stderr.write(`kvfence: ${err instanceof Error ? err.message : String(err)}\n`)
  process.exit(2)
}
