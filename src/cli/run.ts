/** The `kvfence` command line parsed and run in the calling process: main.ts runs it with the
 *  process's arguments, and tests run it in-process where starting a process would prove nothing
 *  (a flag refused before any part starts). Only the file of the sub-command named in `args` is
 *  loaded (all of them for `--help`, `help`, an unknown name or none): every worker and router a
 *  cluster forks is this command, and loading every sub-command's modules (the `openai` client,
 *  Redis, x509…) cost each of them about as long again as its own start. */
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
  [['self-check'], async () => (await import('./self-check.js')).registerSelfCheck],
]

/** Where commander's own messages (help, version, refused flags) and the one-line refusal of a
 *  failed command go: the process's stdout and stderr unless given. */
export interface CliOutput {
  writeOut(text: string): void
  writeErr(text: string): void
}

const processOutput: CliOutput = {
  writeOut: (text) => void process.stdout.write(text),
  writeErr: (text) => void process.stderr.write(text),
}

/** Parses `args` (the words after `kvfence`) and runs the sub-command they name. Resolves to the
 *  exit code the process must end with now: 0 after `--help` or `--version`, 2 after a refusal
 *  (a flag commander refused, or an error the command threw, written as one line `kvfence:
 *  message`); undefined when the command's action returned (a server keeps running; a command
 *  that failed otherwise has set `process.exitCode`). */
export async function runCli(
  args: readonly string[],
  output: CliOutput = processOutput,
): Promise<number | undefined> {
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
    .configureOutput({ writeOut: output.writeOut, writeErr: output.writeErr })
    .exitOverride()
  try {
    const only = registrars.find(([names]) => names.includes(args[0]))
    for (const [, load] of only === undefined ? registrars : [only]) (await load())(program)
    await program.parseAsync([...args], { from: 'user' })
    return undefined
  } catch (err) {
    if (err instanceof CommanderError) return err.exitCode === 0 ? 0 : 2
    output.writeErr(`kvfence: ${err instanceof Error ? err.message : String(err)}\n`)
    return 2
  }
}
