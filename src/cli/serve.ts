/** `kvfence serve`: router + one prefill worker + one decode worker as child processes on this
 *  host, serving a model (the bundled one by default) until interrupted. */
import type { Command } from 'commander'
import { startCluster } from '../engine/cluster.js'
import { bundledModelDir } from '../paths.js'
import { collect, intOption } from './options.js'

interface ServeFlags {
  model: string
  tenants: string
  host: string
  port: number
  pageSize: number
  prefillPages: number
  decodePages: number
  contextWindow?: number
  clampContext: boolean
  injectFault: string[]
  unsafeDisableGuards: boolean
  logLevel: string
}

/** Register `kvfence serve`. */
export function registerServe(program: Command): void {
  program
    .command('serve')
    .description('run router + prefill worker + decode worker on this host')
    .requiredOption(
      '--tenants <file>',
      'tenants YAML file (create one with `kvfence keys add NAME`)',
    )
    .option('--model <dir>', 'Hugging Face model directory', bundledModelDir)
    .option('--host <host>', 'address to bind', '127.0.0.1')
    .option('--port <port>', 'router port', intOption, 8000)
    .option('--page-size <n>', 'tokens per KV page', intOption, 16)
    .option('--prefill-pages <n>', 'pages in the prefill worker’s KV pool', intOption, 64)
    .option('--decode-pages <n>', 'pages in the decode worker’s KV pool', intOption, 64)
    .option(
      '--context-window <n>',
      'advertised context window (default: the effective KV capacity)',
      intOption,
    )
    .option(
      '--clamp-context',
      'clamp an advertised context larger than the KV pools instead of refusing to start',
      false,
    )
    .option(
      '--inject-fault <name>',
      'inject a fault into the prefill worker (needs KVFENCE_ALLOW_FAULTS=1)',
      collect,
      [],
    )
    .option('--unsafe-disable-guards', 'turn every guard off (needs KVFENCE_ALLOW_FAULTS=1)', false)
    .option('--log-level <level>', 'log level of the parts', 'info')
    .action(async (flags: ServeFlags) => {
      const cluster = await startCluster({
        modelDir: flags.model,
        tenantsFile: flags.tenants,
        host: flags.host,
        routerPort: flags.port,
        pageSize: flags.pageSize,
        prefillPages: flags.prefillPages,
        decodePages: flags.decodePages,
        contextWindow: flags.contextWindow,
        clampContext: flags.clampContext,
        prefillFaults: flags.injectFault,
        disableGuards: flags.unsafeDisableGuards,
        logLevel: flags.logLevel,
      })
      process.stderr.write(`kvfence serving on ${cluster.routerUrl}/v1 (Ctrl-C stops)\n`)
      let isStopping = false
      const stop = async () => {
        isStopping = true
        await cluster.stop()
        process.exit(0)
      }
      process.on('SIGINT', () => void stop())
      process.on('SIGTERM', () => void stop())
      for (const child of Object.values(cluster.processes)) {
        child.once('exit', (code) => {
          if (isStopping) return
          isStopping = true
          process.stderr.write(`kvfence: a part of the cluster exited (code ${code}); stopping\n`)
          void cluster.stop().then(() => process.exit(1))
        })
      }
    })
}
