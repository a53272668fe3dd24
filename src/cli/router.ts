/** `kvfence router`: start the OpenAI-compatible router in front of prefill and decode workers
 *  that run elsewhere (or on this host). Tells a parent process that forked it, once listening. */
import type { Command } from 'commander'
import { pino } from 'pino'
import { buildFaultConfig, faultBanner } from '../engine/faults.js'
import { bundledModelDir } from '../paths.js'
import { startRouter } from '../router/index.js'
import { collect, intOption } from './options.js'

interface RouterFlags {
  model: string
  prefill: string[]
  decode: string[]
  tenants: string
  host: string
  port: number
  contextWindow?: number
  clampContext: boolean
  unsafeDisableGuards: boolean
  logLevel: string
}

/** Register `kvfence router`. */
export function registerRouter(program: Command): void {
  program
    .command('router')
    .description('start the OpenAI-compatible router in front of prefill and decode workers')
    .requiredOption('--prefill <url>', 'a prefill worker’s control URL; repeatable', collect, [])
    .requiredOption('--decode <url>', 'a decode worker’s control URL; repeatable', collect, [])
    .requiredOption(
      '--tenants <file>',
      'tenants YAML file (create one with `kvfence keys add NAME`)',
    )
    .option(
      '--model <dir>',
      'model directory (for its tokenizer and chat template)',
      bundledModelDir,
    )
    .option('--host <host>', 'address to bind', '127.0.0.1')
    .option('--port <port>', 'port (0 picks one)', intOption, 8000)
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
      '--unsafe-disable-guards',
      'turn the router’s guards off (needs KVFENCE_ALLOW_FAULTS=1)',
      false,
    )
    .option('--log-level <level>', 'pino log level', 'info')
    .action(async (flags: RouterFlags) => {
      const faults = buildFaultConfig([], flags.unsafeDisableGuards, process.env)
      const banner = faultBanner('kvfence router', faults)
      if (banner) process.stderr.write(`${banner}\n`)
      const log = pino({ name: 'kvfence-router', level: flags.logLevel }, pino.destination(2))
      const router = await startRouter({
        modelDir: flags.model,
        prefillUrls: flags.prefill,
        decodeUrls: flags.decode,
        tenants: flags.tenants,
        host: flags.host,
        port: flags.port,
        contextWindow: flags.contextWindow,
        clampContext: flags.clampContext,
        guardsEnabled: faults.guardsEnabled,
        log,
      })
      process.send?.({
        type: 'ready',
        role: 'router',
        port: router.port,
        contextWindow: router.config.contextWindow,
      })
      const shutdown = () => void router.close().then(() => process.exit(0))
      process.on('SIGTERM', shutdown)
      process.on('SIGINT', shutdown)
    })
}
