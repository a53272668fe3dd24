/** `kvfence audit`: proves (or disproves) tenant isolation of any OpenAI-compatible endpoint from
 *  outside. Parses flags (merged over an optional YAML `--config` file, flags winning), runs the
 *  audit, prints progress and a summary, writes the JSON, JUnit XML and HTML reports asked for, and
 *  sets the exit code: 1 for a finding `--fail-on` names (always for a leak), 2 for a tool
 *  error (one line on stderr), 130 or 143 when interrupted by SIGINT or SIGTERM (one line on
 *  stderr), 0 otherwise. With `--json` the report is rewritten after every probe, so an
 *  interrupted or killed audit leaves what it had established, and `--resume FILE` continues it.
 *  `--list-probes` prints the probes and exits 0. Never prints a tenant's key. */
import { closeSync, existsSync, openSync, rmSync } from 'node:fs'
import { readFile } from 'node:fs/promises'
import { MultiBar, Presets } from 'cli-progress'
import type { Command } from 'commander'
import {
  AuditError,
  auditDefaults,
  formatProgress,
  formatSummary,
  formatPlan,
  planAudit,
  checkAuthorizedTarget,
  consoleWidth,
  exitCodeFor,
  loadAuditConfig,
  maxAuditSeconds,
  minAuditSeconds,
  probeNames,
  probes,
  runAudit,
  writeHtmlReport,
  writeJsonReport,
  writeJunitReport,
  type AuditConfigFile,
  type ProbeName,
  type ProgressEvent,
  type Tenant,
} from '../audit/index.js'
import {
  defaultFailOn,
  failOnTerms,
  formatFailOn,
  parseFailOn,
  type FailOnTerm,
} from '../audit/gate.js'
import { auditBounds, sameTenantNameFault } from '../audit/config.js'
import { recordedAudit } from '../audit/resume.js'

interface AuditFlags {
  target?: string
  config?: string
  listProbes?: boolean
  tenant?: string[]
  model?: string
  json?: string
  junit?: string
  html?: string
  probes?: string
  seed?: string
  maxRequests?: string
  maxSeconds?: string
  concurrency?: string
  maxConcurrency?: string
  failOn?: string
  plan?: boolean
  pricePerMillionTokens?: string
  authorized?: boolean
  aggressive?: boolean
  contextWindow?: string
  kvPoolTokens?: string
  resume?: string
}

/** Exit codes of an interrupted audit: 128 + the signal's number, as a shell reports it. */
const interruptExitCodes = { SIGINT: 130, SIGTERM: 143 } as const

export function registerAudit(program: Command): void {
  program
    .command('audit')
    .description(
      'Audit any OpenAI-compatible endpoint for cross-tenant KV-cache leaks (see --list-probes).',
    )
    .option('--target <url>', 'base URL of the endpoint, e.g. http://127.0.0.1:8000')
    .option(
      '--config <file>',
      'YAML config (target, tenants with keyEnv, probes, budget, seed, reports); flags override it',
    )
    .option('--list-probes', 'print the probes, what each sends and concludes, and exit')
    .option(
      '--tenant <name=key>',
      'a tenant and its API key, or NAME=env:VARNAME to read the key from the environment (at least twice)',
      (value: string, previous: string[] | undefined) => [...(previous ?? []), value],
    )
    .option('--model <id>', 'model id (default: the first one /v1/models lists)')
    .option(
      '--json <file>',
      'write the JSON report to this file (rewritten after every probe and on SIGINT/SIGTERM, so --resume can continue an interrupted audit)',
    )
    .option('--junit <file>', 'write a JUnit XML report (a test case per probe) to this file')
    .option('--html <file>', 'write a self-contained HTML report with plots to this file')
    .option(
      '--probes <list>',
      `comma-separated probes to run (default: all: ${probeNames.join(',')})`,
    )
    .option('--seed <n>', 'seed for canaries, prompt sizes and order (default: random, reported)')
    .option('--max-requests <n>', `request budget (default ${auditDefaults.maxRequests})`)
    .option('--max-seconds <n>', `time budget in seconds (default ${auditDefaults.maxSeconds})`)
    .option(
      '--concurrency <n>',
      `requests in flight at most (default ${auditDefaults.concurrency})`,
    )
    .option(
      '--max-concurrency <n>',
      `in flight at most for the probes that ramp their load 1, 2, 4, 8, 16 (default ${auditDefaults.maxConcurrency}, or --concurrency when given)`,
    )
    .option(
      '--fail-on <terms>',
      `exit 1 on a finding of these classes, severities (and above), tags or verdicts (and worse), comma-separated: ${failOnTerms.join(', ')} (default ${formatFailOn(defaultFailOn)}; a leak always fails)`,
    )
    .option(
      '--plan',
      'print the requests and tokens each probe would send (reads discovery only, sends no completion) and exit 0',
    )
    .option(
      '--price-per-million-tokens <price>',
      'with --plan: price the tokens (default 0: tokens only)',
    )
    .option(
      '--authorized',
      'the target is one you may audit (needed for a non-loopback target not in authorized_targets)',
    )
    .option(
      '--resume <report>',
      "continue the interrupted audit whose JSON report this is: keep the probes it ran to their end, run the others (its target, model, probes and seed are taken from it, and must match if given; give its tenants' keys again, in any order; the report is rewritten unless --json names another file)",
    )
    .option(
      '--aggressive',
      "also send what could disturb a shared engine: cache-fields' engine-internal fields aimed at an unrouted host, and, where the endpoint reports no context or pool, prompts past 1,024 tokens and an unbounded max_tokens",
    )
    .option(
      '--context-window <tokens>',
      "the endpoint's context window, for an endpoint that does not report it (used over what it reports; a difference is named in the capacity finding)",
    )
    .option(
      '--kv-pool-tokens <tokens>',
      "the KV pool of the endpoint's smallest worker, in tokens, likewise",
    )
    .addHelpText(
      'after',
      '\nExit codes: 0 no finding --fail-on names; 1 one it names (a leak always is);\n' +
        '2 tool error, nothing audited (bad options, target unreachable, a key refused, --model not\n' +
        'served, no valid completion answered whole, a --resume report of another audit);\n' +
        '130/143 interrupted by SIGINT/SIGTERM (continue with --resume FILE when --json was given).',
    )
    .showHelpAfterError(false)
    .action(async (flags: AuditFlags) => {
      try {
        process.exitCode = await audit(flags)
      } catch (err) {
        const message = err instanceof Error ? err.message : String(err)
        const prefix = err instanceof AuditError ? '' : 'internal error: '
        process.stderr.write(`kvfence audit: ${prefix}${message.split('\n')[0]}\n`)
        process.exitCode = 2
      }
    })
}

/** `--list-probes`: one block per probe, in the order an audit runs them. */
export function formatProbeList(): string {
  const width = Math.max(...probeNames.map((n) => n.length))
  return probeNames.map((name) => `${name.padEnd(width)}  ${probes[name].description}`).join('\n')
}

async function audit(flags: AuditFlags): Promise<number> {
  if (flags.listProbes) {
    process.stdout.write(`${formatProbeList()}\n`)
    return 0
  }
  const { numbers, file, resume, options } = await auditInputs(flags)
  // Parsed before --plan too: a plan that passed a gate the audit refuses would promise a run
  // that never starts.
  const failOn: readonly FailOnTerm[] =
    flags.failOn === undefined ? (file.failOn ?? defaultFailOn) : parseFailOn(flags.failOn)
  if (flags.plan) {
    process.stdout.write(
      `${formatPlan(await planAudit({ ...options, resume, pricePerMillionTokens: numbers.price }))}\n`,
    )
    return 0
  }
  if (flags.pricePerMillionTokens !== undefined) {
    throw new AuditError('invalid_options', '--price-per-million-tokens is only read with --plan')
  }
  const reports = {
    json: flags.json ?? file.reports?.json ?? flags.resume,
    junit: flags.junit ?? file.reports?.junit,
    html: flags.html ?? file.reports?.html,
  }
  // A report that cannot be written is an error now, not after the audit spent its budget.
  checkWritable('JSON', reports.json)
  checkWritable('JUnit', reports.junit)
  checkWritable('HTML', reports.html)
  const progress = makeProgress((options.probes ?? probeNames).length)
  const interrupt = new AbortController()
  const onSignal = (signal: 'SIGINT' | 'SIGTERM'): void => {
    // A second signal does not wait for the report to be written.
    if (interrupt.signal.aborted) process.exit(interruptExitCodes[signal])
    interrupt.abort(signal)
  }
  const onInt = () => onSignal('SIGINT')
  const onTerm = () => onSignal('SIGTERM')
  process.on('SIGINT', onInt)
  process.on('SIGTERM', onTerm)
  const json = reports.json
  let report
  try {
    report = await runAudit({
      ...options,
      resume,
      signal: interrupt.signal,
      onProgress: progress.onEvent,
      onReport: json === undefined ? undefined : (r) => writeJsonReport(r, json),
    })
  } catch (err) {
    if (interrupt.signal.aborted) {
      // Stopped before the probes began (discovery's requests were cut): nothing to keep.
      const signal = interrupt.signal.reason as 'SIGINT' | 'SIGTERM'
      process.stderr.write(
        `kvfence audit: interrupted by ${signal} before any probe ended; nothing was kept\n`,
      )
      return interruptExitCodes[signal]
    }
    // The tool error's report (state tool-error, no verdict) replaces the progress written.
    if (err instanceof AuditError && err.report !== undefined && json !== undefined)
      await writeJsonReport(err.report, json).catch(() => {})
    throw err
  } finally {
    progress.stop()
    process.off('SIGINT', onInt)
    process.off('SIGTERM', onTerm)
  }
  if (report.state === 'interrupted') {
    const signal = report.interruptedBy ?? 'SIGINT'
    const numDone = (report.probes ?? []).length - (report.pendingProbes ?? []).length
    const kept =
      json === undefined
        ? 'no --json was given, so nothing was kept to resume'
        : `${json} holds them: continue with --resume ${json}`
    if (json !== undefined) await writeReport('JSON', json, (f) => writeJsonReport(report, f))
    process.stderr.write(
      `kvfence audit: interrupted by ${signal}: ${numDone} of ${(report.probes ?? []).length} probes ran to their end; ${kept}\n`,
    )
    return interruptExitCodes[signal]
  }
  process.stdout.write(`\n${formatSummary(report, stdoutWidth())}\n`)
  await writeReport('JSON', reports.json, (f) => writeJsonReport(report, f))
  await writeReport('JUnit', reports.junit, (f) => writeJunitReport(report, f, failOn))
  await writeReport('HTML', reports.html, (f) => writeHtmlReport(report, f))
  return exitCodeFor(report, failOn)
}

/** What an audit runs with: the flags' numbers (checked first: one line naming the flag,
 *  whatever else is missing), the `--config` file, the report `--resume` names, and the run's
 *  options, each from the flags, else the file, else the resumed report. Throws AuditError
 *  `invalid_options` for a missing target or missing tenant keys, and for an unauthorized
 *  target before any request. */
async function auditInputs(flags: AuditFlags) {
  // Bad numbers first: one line naming the flag, whatever else is missing.
  const numbers = {
    seed: parseCount('--seed', flags.seed, { min: 0 }),
    maxRequests: parseCount('--max-requests', flags.maxRequests, auditBounds.maxRequests),
    maxSeconds: parseSeconds(flags.maxSeconds),
    concurrency: parseCount('--concurrency', flags.concurrency, auditBounds.concurrency),
    maxConcurrency: parseCount(
      '--max-concurrency',
      flags.maxConcurrency,
      auditBounds.maxConcurrency,
    ),
    price: parsePrice(flags.pricePerMillionTokens),
    contextWindow: parseCount('--context-window', flags.contextWindow, { min: 2 }),
    kvPoolTokens: parseCount('--kv-pool-tokens', flags.kvPoolTokens, { min: 2 }),
  }
  const file: AuditConfigFile =
    flags.config === undefined ? {} : await loadAuditConfig(flags.config, process.env)
  const resume =
    flags.resume === undefined
      ? undefined
      : { report: await readResumed(flags.resume), source: flags.resume }
  // What the report records is taken when not given again; what is given must match it
  // (runAudit refuses another target, model, probes or tenants with one line).
  const recorded = resume === undefined ? undefined : recordedAudit(resume)
  const target = flags.target ?? file.target ?? recorded?.target
  if (target === undefined) {
    throw new AuditError(
      'invalid_options',
      "required option '--target <url>' not specified (or target: in --config)",
    )
  }
  // Before any request (and any DNS lookup): a typo must not aim the audit at someone else.
  checkAuthorizedTarget(target, file.authorizedTargets ?? [], flags.authorized === true)
  if (recorded !== undefined && flags.tenant === undefined && file.tenants === undefined) {
    const names = recorded.tenants.join(', ')
    throw new AuditError(
      'invalid_options',
      `--resume ${flags.resume}: give the keys of its tenants ${names} (--tenant NAME=KEY or NAME=env:VAR each, or --config with keyEnv); the report holds no key`,
    )
  }
  const given =
    flags.tenant !== undefined || file.tenants === undefined
      ? parseTenants(flags.tenant ?? [], process.env)
      : [...file.tenants]
  const tenants = recorded === undefined ? given : inRecordedOrder(given, recorded.tenants)
  const probesToRun =
    flags.probes === undefined ? (file.probes ?? recorded?.probes) : parseProbes(flags.probes)
  const options = {
    target,
    tenants,
    model: flags.model ?? file.model ?? recorded?.model ?? undefined,
    probes: probesToRun,
    seed: numbers.seed ?? file.seed,
    maxRequests: numbers.maxRequests ?? file.maxRequests,
    maxSeconds: numbers.maxSeconds ?? file.maxSeconds,
    concurrency: numbers.concurrency ?? file.concurrency,
    maxConcurrency: numbers.maxConcurrency ?? file.maxConcurrency,
    isAggressive: flags.aggressive === true,
    contextWindow: numbers.contextWindow,
    kvPoolTokens: numbers.kvPoolTokens,
  }
  return { numbers, file, resume, options }
}

/** The JSON of the report `--resume` names; one line (`cannot_resume`) when it cannot be read. */
async function readResumed(file: string): Promise<unknown> {
  let text: string
  try {
    text = await readFile(file, 'utf8')
  } catch (err) {
    const reason = (err as { code?: string }).code ?? String(err)
    throw new AuditError('cannot_resume', `cannot resume ${file}: ${reason}`)
  }
  try {
    return JSON.parse(text) as unknown
  } catch {
    throw new AuditError('cannot_resume', `cannot resume ${file}: it is not JSON`)
  }
}

/** Throws `invalid_options` (as {@link writeReport} would, later) when `file` cannot be opened for
 *  writing: the file is opened for appending (nothing is written) and, if this made it, removed.
 *  Checking the folder's permissions is not enough (under /proc they allow what open refuses). */
function checkWritable(kind: string, file: string | undefined): void {
  if (file === undefined) return
  const existed = existsSync(file)
  try {
    closeSync(openSync(file, 'a'))
  } catch (err) {
    const reason = (err as { code?: string }).code ?? String(err)
    throw new AuditError('invalid_options', `cannot write the ${kind} report to ${file}: ${reason}`)
  }
  if (!existed) rmSync(file, { force: true })
}

async function writeReport(
  kind: string,
  file: string | undefined,
  write: (file: string) => Promise<void>,
): Promise<void> {
  if (file === undefined) return
  try {
    await write(file)
  } catch (err) {
    const reason = (err as { code?: string }).code ?? (err instanceof Error ? err.message : '')
    throw new AuditError('invalid_options', `cannot write the ${kind} report to ${file}: ${reason}`)
  }
  process.stdout.write(`${kind} report written to ${file}\n`)
}

/** `tenants` in the order of the resumed report's `names` when they are the same names (the order
 *  seeds the canaries); as given otherwise, for runAudit to refuse naming both lists. */
function inRecordedOrder(tenants: readonly Tenant[], names: readonly string[]): Tenant[] {
  const byName = new Map(tenants.map((t) => [t.name, t]))
  const isSame = names.length === tenants.length && names.every((n) => byName.has(n))
  return isSame ? names.map((n) => byName.get(n)!) : [...tenants]
}

/** `NAME=KEY` or `NAME=env:VARNAME`. Errors name the tenant, never the key; two names equal
 *  ignoring case are refused (see `sameTenantNameFault`). */
export function parseTenants(
  values: readonly string[],
  env: Readonly<Record<string, string | undefined>>,
): Tenant[] {
  if (values.length < 2) {
    throw new AuditError(
      'invalid_options',
      `need at least two tenants (--tenant NAME=KEY twice), got ${values.length}`,
    )
  }
  const tenants = values.map((value, i) => {
    const at = value.indexOf('=')
    if (at <= 0) {
      throw new AuditError(
        'invalid_options',
        `--tenant #${i + 1} must look like NAME=KEY or NAME=env:VARNAME`,
      )
    }
    const name = value.slice(0, at)
    const raw = value.slice(at + 1)
    if (!raw.startsWith('env:')) return { name, key: raw }
    const variable = raw.slice('env:'.length)
    const key = env[variable]
    if (key === undefined || key === '') {
      throw new AuditError(
        'invalid_options',
        `tenant ${name}: environment variable ${variable} is not set`,
      )
    }
    return { name, key }
  })
  const fault = sameTenantNameFault(tenants.map((t) => t.name))
  if (fault !== null) throw new AuditError('invalid_options', fault)
  return tenants
}

function parseProbes(list: string): ProbeName[] {
  const names = list
    .split(',')
    .map((s) => s.trim())
    .filter((s) => s !== '')
  for (const name of names) {
    if (!(probeNames as readonly string[]).includes(name)) {
      throw new AuditError(
        'invalid_options',
        `unknown probe ${JSON.stringify(name)} (known: ${probeNames.join(', ')})`,
      )
    }
  }
  return names as ProbeName[]
}

/** A flag's integer within `bound` (`max` absent: up to the largest safe integer), or one line
 *  naming the flag, the range and the value as typed. */
function parseCount(
  flag: string,
  value: string | undefined,
  bound: { readonly min: number; readonly max?: number },
): number | undefined {
  if (value === undefined) return undefined
  const { min, max = Number.MAX_SAFE_INTEGER } = bound
  const n = /^\d+$/.test(value) ? Number(value) : NaN
  if (!(Number.isSafeInteger(n) && n >= min && n <= max)) {
    const range = bound.max === undefined ? `≥ ${min}` : `from ${min} to ${max}`
    throw new AuditError(
      'invalid_options',
      `${flag} must be an integer ${range}, got ${JSON.stringify(value)}`,
    )
  }
  return n
}

function parsePrice(value: string | undefined): number {
  if (value === undefined) return 0
  if (!/^\d+(\.\d+)?$/.test(value)) {
    throw new AuditError(
      'invalid_options',
      `--price-per-million-tokens must be a number ≥ 0, got ${JSON.stringify(value)}`,
    )
  }
  return Number(value)
}

function parseSeconds(value: string | undefined): number | undefined {
  if (value === undefined) return undefined
  const n = Number(value)
  if (!/^\d+(\.\d+)?$/.test(value) || !(n >= minAuditSeconds && n <= maxAuditSeconds)) {
    throw new AuditError(
      'invalid_options',
      `--max-seconds must be a number from ${minAuditSeconds} to ${maxAuditSeconds}, got ${JSON.stringify(value)}`,
    )
  }
  return n
}

/** The columns stdout's lines fit: the terminal's, or the default width for a CI log or a pipe. */
function stdoutWidth(): number {
  return consoleWidth(process.stdout.isTTY ? process.stdout.columns : undefined)
}

/** Console progress: in a terminal, a bar over the probes (on stderr) with each probe's result
 *  printed above it; elsewhere (CI logs, pipes), one plain line per event on stdout. */
function makeProgress(numProbes: number): {
  onEvent: (event: ProgressEvent) => void
  stop: () => void
} {
  if (!process.stderr.isTTY) {
    return {
      onEvent: (event) => process.stdout.write(`${formatProgress(event, stdoutWidth())}\n`),
      stop: () => {},
    }
  }
  const bars = new MultiBar(
    {
      format: 'audit [{bar}] {value}/{total} probes  {probe}',
      hideCursor: true,
      clearOnComplete: true,
    },
    Presets.shades_classic,
  )
  const bar = bars.create(numProbes, 0, { probe: '' })
  return {
    onEvent: (event) => {
      if (event.type === 'probe-start') bar.update({ probe: event.probe })
      if (event.type === 'probe-end') {
        bars.log(`${formatProgress(event, consoleWidth(process.stderr.columns))}\n`)
        bar.increment()
        bars.update() // render now: a log line waits for the next redraw, and stop() may come first
      }
    },
    stop: () => bars.stop(),
  }
}
