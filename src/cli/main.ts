#!/usr/bin/env node
/** The `kvfence` command: one sub-command per file in this folder, registered and run by run.ts.
 *  The process ends here only when the command was refused or printed help or the version; a
 *  server keeps running, and a command that failed otherwise has set `process.exitCode`. */
import { runCli } from './run.js'

const code = await runCli(process.argv.slice(2))
if (code !== undefined) process.exit(code)
