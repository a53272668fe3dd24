/** `kvfence watch`: runs the audit's cheapest triggers continuously against a live endpoint with
 *  dedicated monitoring tenants, within an hourly budget, and exposes Prometheus metrics; a
 *  finding is one JSON log line (stdout) and an optional webhook. Flags are merged over the
 *  audit's YAML `--config` file and its `watch:` section, flags winning. SIGTERM or SIGINT end it
 *  at once, mid-cycle, with exit 0 (requests in flight are cut as the process ends). Bad input,
 *  and a target that is not loopback nor authorized (as the audit's), is one line on stderr and
 *  exit 2. Never prints a tenant's key or the webhook URL. */
import { randomInt } from 'node:crypto'
import { Option, type Command } from 'commander'
import pino from 'pino'
import { AuditError, checkAuthorizedTarget, checkTenantKeys } from '../audit/index.js'
import {
  createWatchMetrics,
  cycleCostBound,
  formatWatchPlan,
  loadWatchConfig,
  runWatch,
  serveMetrics,
  validateWatchOptions,
  watchDefaults,
  webhookFormats,
  type WatchConfigFile,
  type WebhookFormat,
} from '../audit/watch/index.js'
import { describeWatchBound, watchBounds } from '../audit/watch/options.js'
import { parseTenants } from './audit.js'
import { logLevels } from './options.js'

interface WatchFlags {
  target?: string
  config?: string
  tenant?: string[]
  model?: string
  contextWindow?: string
  kvPoolTokens?: string
  seed?: string
  cycleSeconds?: string
  maxTokensPerHour?: string
  maxRequestsPerHour?: string
  metricsPort?: string
  metricsHost?: string
  resolveAfterCycles?: string
  requestTimeoutSeconds?: string
  webhook?: string
  webhookFormat?: WebhookFormat
  authorized?: boolean
  plan?: boolean
  logLevel: string
}

export function registerWatch(program: Command): void {
  program
    .command('watch')
    .description(
      'Watch a live OpenAI-compatible endpoint for cross-tenant leaks, continuously, within a budget (docs/monitoring.md).',
    )
    .option('--target <url>', 'base URL of the endpoint, e.g. http://127.0.0.1:8000')
    .option('--config <file>', "the audit's YAML config, plus a watch: section; flags override it")
    .option(
      '--tenant <name=key>',
      'a monitoring tenant and its key, or NAME=env:VARNAME (at least twice)',
      (value: string, previous: string[] | undefined) => [...(previous ?? []), value],
    )
    .option('--model <id>', 'model id (default: the first one /v1/models lists)')
    .option(
      '--context-window <tokens>',
      "the endpoint's context window, for an endpoint that does not report it (used over what it reports)",
    )
    .option('--kv-pool-tokens <tokens>', "the KV pool of the endpoint's smallest worker, likewise")
    .option('--seed <n>', 'seed of the random draws (default: random, logged)')
    .option(
      '--cycle-seconds <s>',
      `mean time between cycles, jittered ±20 % (default ${watchDefaults.cycleSeconds})`,
    )
    .option(
      '--max-tokens-per-hour <n>',
      `tokens (prompt + max_tokens) in any hour at most (default ${watchDefaults.maxTokensPerHour})`,
    )
    .option(
      '--max-requests-per-hour <n>',
      `requests in any hour at most (default ${watchDefaults.maxRequestsPerHour})`,
    )
    .option(
      '--metrics-port <port>',
      `port of GET /metrics (default ${watchDefaults.metricsPort}; 0 picks one)`,
    )
    .option('--metrics-host <host>', `address of /metrics (default ${watchDefaults.metricsHost})`)
    .option(
      '--resolve-after-cycles <n>',
      `resolve a finding after this many cycles without it (default ${watchDefaults.resolveAfterCycles})`,
    )
    .option(
      '--request-timeout-seconds <s>',
      `upper bound of one request (default ${watchDefaults.requestTimeoutSeconds})`,
    )
    .option('--webhook <url>', 'POST each new and each resolved finding here')
    .addOption(
      new Option('--webhook-format <format>', 'body of the webhook (default alertmanager)').choices(
        webhookFormats,
      ),
    )
    .option(
      '--authorized',
      'the target is one you may watch (needed for a non-loopback target not in authorized_targets)',
    )
    .option(
      '--plan',
      'print what a cycle and an hour send at most (sends nothing, reads nothing) and exit 0',
    )
    .addOption(new Option('--log-level <level>', 'log level').choices(logLevels).default('info'))
    .showHelpAfterError(false)
    .action(async (flags: WatchFlags) => {
      try {
        process.exitCode = await watch(flags)
      } catch (err) {
        const message = err instanceof Error ? err.message : String(err)
        const prefix = err instanceof AuditError ? '' : 'internal error: '
        process.stderr.write(`kvfence watch: ${prefix}${message.split('\n')[0]}\n`)
        process.exitCode = 2
      }
    })
}

async function watch(flags: WatchFlags): Promise<number> {
  const file: WatchConfigFile =
    flags.config === undefined
      ? { audit: {}, watch: {} }
      : await loadWatchConfig(flags.config, process.env)
  const target = flags.target ?? file.audit.target
  if (target === undefined) {
    throw new AuditError(
      'invalid_options',
      "required option '--target <url>' not specified (or target: in --config)",
    )
  }
  // As the audit's, before any request (and any DNS lookup): the watch probes the target for as
  // long as it runs, so a typo must not aim it at someone else's endpoint.
  checkAuthorizedTarget(target, file.audit.authorizedTargets ?? [], flags.authorized === true)
  const tenants =
    flags.tenant !== undefined || file.audit.tenants === undefined
      ? parseTenants(flags.tenant ?? [], process.env)
      : [...file.audit.tenants]
  const config = validateWatchOptions(
    {
      target,
      tenants,
      model: flags.model ?? file.audit.model,
      contextWindow: count('--context-window', flags.contextWindow, 2),
      kvPoolTokens: count('--kv-pool-tokens', flags.kvPoolTokens, 2),
      seed: count('--seed', flags.seed, 0) ?? file.audit.seed,
      cycleSeconds:
        bounded('--cycle-seconds', flags.cycleSeconds, 'cycleSeconds') ?? file.watch.cycleSeconds,
      maxTokensPerHour:
        bounded('--max-tokens-per-hour', flags.maxTokensPerHour, 'maxTokensPerHour') ??
        file.watch.maxTokensPerHour,
      maxRequestsPerHour:
        bounded('--max-requests-per-hour', flags.maxRequestsPerHour, 'maxRequestsPerHour') ??
        file.watch.maxRequestsPerHour,
      metricsPort:
        bounded('--metrics-port', flags.metricsPort, 'metricsPort') ?? file.watch.metricsPort,
      metricsHost: flags.metricsHost ?? file.watch.metricsHost,
      resolveAfterCycles:
        bounded('--resolve-after-cycles', flags.resolveAfterCycles, 'resolveAfterCycles') ??
        file.watch.resolveAfterCycles,
      requestTimeoutSeconds:
        bounded(
          '--request-timeout-seconds',
          flags.requestTimeoutSeconds,
          'requestTimeoutSeconds',
        ) ?? file.watch.requestTimeoutSeconds,
      webhookUrl: flags.webhook ?? file.watch.webhookUrl,
      webhookFormat: flags.webhookFormat ?? file.watch.webhookFormat,
    },
    randomInt(0, 2 ** 32 - 1),
  )
  const cost = cycleCostBound(config)
  // A budget that cannot pay for one cycle would skip every cycle for ever: refuse it now.
  refuseBudgetBelowOneCycle(config, cost, flags)
  if (flags.plan === true) {
    process.stdout.write(`${formatWatchPlan(config)}\n`)
    return 0
  }
  // As the audit's, before any cycle: a refused key is one line and exit 2, not an hour of
  // cycles spending the other tenants' budget on requests that can see nothing.
  const numKeyChecks = await checkTenantKeys(
    config.baseUrl,
    config.tenants,
    config.requestTimeoutMs,
  )
  const log = pino(
    { name: 'kvfence-watch', level: flags.logLevel },
    pino.destination({ dest: 1, sync: true }),
  )
  const metrics = createWatchMetrics()
  // A port already taken is the operator's to fix, like a bad flag: one line, exit 2.
  const served = await serveMetrics(metrics.registry, config.metricsHost, config.metricsPort).catch(
    (err: unknown) => {
      throw new AuditError('invalid_options', err instanceof Error ? err.message : String(err))
    },
  )
  const stop = new AbortController()
  const onSignal = (signal: NodeJS.Signals) => {
    log.info({ signal }, 'stopping')
    stop.abort()
  }
  process.once('SIGTERM', onSignal)
  process.once('SIGINT', onSignal)
  log.info(
    {
      target: config.baseUrl,
      tenants: config.tenants.map((t) => t.name),
      seed: config.seed,
      cycleSeconds: config.cycleSeconds,
      budget: {
        maxTokensPerHour: config.maxTokensPerHour,
        maxRequestsPerHour: config.maxRequestsPerHour,
      },
      cycleCost: {
        maxRequests: cost.maxRequests,
        maxCanaryTokens: cost.maxCanaryTokens,
        overCapacityTokens: 'pool + 1 to context, with boundary pool + 1, each + 32; when they fit',
        allowancePerCycle: cost.allowance,
      },
      metrics: served.url,
      webhook: config.webhook === null ? null : config.webhook.format,
    },
    `watch started: one cycle costs at most ${cost.maxRequests} requests and ${cost.maxCanaryTokens} tokens of canary prompts (plus any over-capacity or boundary prompt); a cycle may spend ${cost.allowance.tokens} tokens and ${cost.allowance.requests} requests`,
  )
  await runWatch(config, {
    log,
    metrics,
    signal: stop.signal,
    spentAtStart: { tokens: 0, requests: numKeyChecks },
  })
  served.server.closeAllConnections()
  await new Promise<void>((resolve) => served.server.close(() => resolve()))
  log.info('watch stopped')
  // Ending the process cuts the abandoned cycle's requests (their sockets close).
  process.exit(0)
}

/** Throws AuditError `invalid_options` naming the flag (or the file's field) of an hourly budget
 *  smaller than one cycle's least cost `cost.minCycle`. */
function refuseBudgetBelowOneCycle(
  config: ReturnType<typeof validateWatchOptions>,
  cost: ReturnType<typeof cycleCostBound>,
  flags: WatchFlags,
): void {
  for (const [perHour, least, flag, key, unit] of [
    [
      config.maxTokensPerHour,
      cost.minCycle.tokens,
      '--max-tokens-per-hour',
      'maxTokensPerHour',
      'tokens',
    ],
    [
      config.maxRequestsPerHour,
      cost.minCycle.requests,
      '--max-requests-per-hour',
      'maxRequestsPerHour',
      'requests',
    ],
  ] as const) {
    if (perHour < least) {
      const given = flags[key] !== undefined ? flag : `watch.${key} (in ${flags.config})`
      throw new AuditError(
        'invalid_options',
        `${given} ${perHour} cannot pay for one cycle: a cycle needs at least ${least} ${unit} (its reads, a plant and one look), so every cycle would be skipped`,
      )
    }
  }
}

function count(flag: string, value: string | undefined, min: number): number | undefined {
  if (value === undefined) return undefined
  if (!/^\d+$/.test(value) || Number(value) < min || !Number.isSafeInteger(Number(value))) {
    throw new AuditError(
      'invalid_options',
      `${flag} must be an integer ≥ ${min}, got ${JSON.stringify(value)}`,
    )
  }
  return Number(value)
}

/** A flag's value within its {@link watchBounds}, or one line naming the flag, the range and the
 *  value as typed (`Number()` would echo 99999999999999999999 as 1e20). */
function bounded(
  flag: string,
  value: string | undefined,
  key: keyof typeof watchBounds,
): number | undefined {
  if (value === undefined) return undefined
  const bound = watchBounds[key]
  const n = (bound.integer ? /^\d+$/ : /^\d+(\.\d+)?$/).test(value) ? Number(value) : NaN
  if (!(n >= bound.min && n <= bound.max)) {
    throw new AuditError(
      'invalid_options',
      `${flag} ${describeWatchBound(bound)}, got ${JSON.stringify(value)}`,
    )
  }
  return n
}
