#!/usr/bin/env node
/** The `kvfence` command: one sub-command per file in this folder, registered here. */
import { Command, CommanderError } from 'commander'
import { registerAudit } from './audit.js'
import { registerCerts } from './certs.js'
import { registerDemo } from './demo.js'
import { registerGenerate } from './generate.js'
import { registerKeys } from './keys.js'
import { registerRouter } from './router.js'
import { registerServe } from './serve.js'
import { registerSoak } from './soak.js'
import { registerWatch } from './watch.js'
import { registerWorkers } from './worker.js'

const program = new Command()
program
  .name('kvfence')
  .description(
    'Disaggregated LLM serving that is safe from cross-tenant KV-cache leaks, and an auditor that proves it.',
  )
  .exitOverride()

registerDemo(program)
registerServe(program)
registerGenerate(program)
registerWorkers(program)
registerRouter(program)
registerKeys(program)
registerCerts(program)
registerSoak(program)
registerAudit(program)
registerWatch(program)

try {
  await program.parseAsync(process.argv)
} catch (err) {
  if (err instanceof CommanderError) process.exit(err.exitCode === 0 ? 0 : 2)
  process.stderr.write(`kvfence: ${err instanceof Error ? err.message : String(err)}\n`)
  process.exit(2)
}
