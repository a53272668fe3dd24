/** `kvfence demo` (= `npm start`): the incident reproduced, then fenced, then caught. Runs a real
 *  cluster twice — once with the incident's configuration (advertised context larger than the
 *  prefill pool, the `placeholder-forward` fault, guards off), once as shipped — audits both with
 *  two tenants, and prints the two outcomes one after the other (80 columns); writes both audit
 *  reports to `--out`. Then a third act (demo-production.ts): a cluster serving as shipped with
 *  `kvfence watch` and the router's sentinel running, the fault switched on by a redeploy, and the
 *  seconds each took to catch it. */
import { writeFileSync } from 'node:fs'
import { join, resolve } from 'node:path'
import type { Command } from 'commander'
import {
  formatProgress,
  runAudit,
  writeHtmlReport,
  writeJsonReport,
  type AuditReport,
  type Finding,
} from '../audit/index.js'
import { startCluster, type ClusterOptions } from '../config/launch.js'
import { makeDir } from '../common/make-dir.js'
import { bundledModelDir } from '../common/paths.js'
import { newApiKey, tenantsYaml } from '../router/tenants/tenant-keys.js'
import { intOption, threadArgs, threadsHelp, threadsOption } from './options.js'
import { isCaught, productionLines, runProductionAct } from './demo-production.js'
import { exitOnStopSignals, stopInProgress, unlessStopped } from './stop-children.js'

interface DemoFlags {
  out: string
  model: string
  seed: number
  verbose: boolean
  threads?: number
}

/** The demo's deployment: the incident's shape, scaled down to the bundled model. */
export const demoShape = {
  pageSize: 16,
  /** Prefill pool: 24 pages × 16 = 384 tokens. */
  prefillPages: 24,
  /** Decode pool: 64 pages × 16 = 1,024 tokens. */
  decodePages: 64,
  /** What the incident's deployment advertised: more than the prefill pool holds. */
  advertisedContext: 1024,
} as const

/** The outcome of one run, for the outcome table. */
interface RunOutcome {
  title: string
  startup: string
  contextWindow: string
  report: AuditReport
}

/** Register `kvfence demo`. */
export function registerDemo(program: Command): void {
  program
    .command('demo')
    .description(
      'reproduce the incident with guards off, then run as shipped; audit both and compare',
    )
    .option('--out <dir>', 'folder for the audit reports and logs', 'kvfence-demo')
    .option('--model <dir>', 'model directory', bundledModelDir)
    .option('--seed <n>', 'audit seed (same seed, same canaries)', intOption, 20260909)
    .option('--verbose', 'print every probe step', false)
    .option('--threads <n>', threadsHelp, threadsOption)
    .action(async (flags: DemoFlags) => {
      exitOnStopSignals('kvfence demo')
      const code = await unlessStopped(() => runDemo(flags))
      process.exitCode = code
    })
}

async function runDemo(flags: DemoFlags): Promise<number> {
  const out = resolve(flags.out)
  makeDir(out)
  const tenants = [
    { name: 'tenant-a', key: newApiKey() },
    { name: 'tenant-b', key: newApiKey() },
  ]
  // Only digests go to disk; the keys live in this process and are handed to the auditor.
  const tenantsFile = join(out, 'tenants.yaml')
  writeFileSync(tenantsFile, tenantsYaml(tenants), { mode: 0o600 })
  const say = (line = '') => process.stdout.write(`${line}\n`)
  const base: ClusterOptions = {
    modelDir: flags.model,
    pageSize: demoShape.pageSize,
    prefillPages: demoShape.prefillPages,
    decodePages: demoShape.decodePages,
    tenantsFile,
    logLevel: 'info',
    ...threadArgs(flags.threads),
  }
  const poolTokens = demoShape.prefillPages * demoShape.pageSize

  say('kvfence demo: the incident reproduced, then fenced')
  say(
    `deployment: prefill KV pool ${poolTokens} tokens, decode KV pool ${demoShape.decodePages * demoShape.pageSize} tokens,`,
  )
  say(`            advertised context ${demoShape.advertisedContext} tokens`)
  say()

  // 1. The incident.
  const unsafe = await runIncidentAct(base, tenants, flags, out, say)
  say()

  // 2. As shipped: the same advertised context is refused (G1), then clamped to the pool.
  say('── 2/3  as shipped: guards on ──')
  let refusal = 'started'
  try {
    const c = await startCluster({
      ...base,
      contextWindow: demoShape.advertisedContext,
      logDir: join(out, 'logs', 'safe-refused'),
    })
    await c.stop()
    refusal = 'started (G1 did not refuse!)'
  } catch (err) {
    // A stop signal fails this start-up too (its parts are stopped under it): that is no refusal.
    const stop = stopInProgress()
    if (stop !== null) return stop
    refusal = (err as Error).message
    say(`G1 refused to start with an advertised context of ${demoShape.advertisedContext} tokens:`)
    for (const line of wrapWords(refusal, tableColumns - 2)) say(`  ${line}`)
  }
  const safeCluster = await startCluster({
    ...base,
    contextWindow: demoShape.advertisedContext,
    clampContext: true,
    logDir: join(out, 'logs', 'safe'),
  })
  let safe: RunOutcome
  try {
    say(`restarted with --clamp-context at ${safeCluster.routerUrl}`)
    const report = await audit(safeCluster.routerUrl, tenants, flags, say)
    await writeJsonReport(report, join(out, 'safe.json'))
    await writeHtmlReport(report, join(out, 'safe.html'))
    safe = {
      title: 'as shipped (guards on)',
      startup: refusal.startsWith('started')
        ? refusal
        : `refused ${demoShape.advertisedContext} (G1); clamped`,
      contextWindow: `${poolTokens} (clamped)`,
      report,
    }
  } finally {
    await safeCluster.stop()
  }
  say()

  // 3. In production: the watch and the sentinel running when the fault is switched on.
  say('── 3/3  in production: the fault switched on while the watch and sentinel run ──')
  const production = await runProductionAct(base, demoShape.advertisedContext, out, say)
  say()
  say(outcomeTable([unsafe, safe]))
  say()
  say('3/3  the fault switched on in production')
  for (const line of productionLines(production)) say(`  ${line}`)
  say()
  // One report a line: a path is as long as the folder the user chose, the screen is 80 columns.
  say('reports:')
  for (const f of ['unsafe.json', 'unsafe.html', 'safe.json', 'safe.html']) say(`  ${join(out, f)}`)
  const isExpected = hasLeak(unsafe.report) && !hasLeak(safe.report)
  if (!isExpected) {
    say('UNEXPECTED: the incident run should leak and the shipped run should not; see the reports.')
    return 1
  }
  if (!isCaught(production)) {
    say('UNEXPECTED: the watch and the sentinel should both catch the fault; see logs/production*.')
    return 1
  }
  return 0
}

/** Act 1, the incident: the cluster started with fault placeholder-forward and its guards off,
 *  audited; its reports written to `out`. */
async function runIncidentAct(
  base: ClusterOptions,
  tenants: { name: string; key: string }[],
  flags: DemoFlags,
  out: string,
  say: (line?: string) => void,
): Promise<RunOutcome> {
  say('── 1/3  the incident: fault placeholder-forward injected, guards off ──')
  const unsafeCluster = await startCluster({
    ...base,
    contextWindow: demoShape.advertisedContext,
    prefillFaults: ['placeholder-forward'],
    disableGuards: true,
    env: { ...process.env, KVFENCE_ALLOW_FAULTS: '1' },
    logDir: join(out, 'logs', 'unsafe'),
  })
  try {
    say(`cluster up at ${unsafeCluster.routerUrl} (3 processes)`)
    say(`  logs in ${join(out, 'logs', 'unsafe')}`)
    const report = await audit(unsafeCluster.routerUrl, tenants, flags, say)
    await writeJsonReport(report, join(out, 'unsafe.json'))
    await writeHtmlReport(report, join(out, 'unsafe.html'))
    return {
      title: 'incident (fault, guards off)',
      startup: `started, advertising ${demoShape.advertisedContext} tokens`,
      contextWindow: `${demoShape.advertisedContext}`,
      report,
    }
  } finally {
    await unsafeCluster.stop()
  }
}

async function audit(
  target: string,
  tenants: { name: string; key: string }[],
  flags: DemoFlags,
  say: (l: string) => void,
): Promise<AuditReport> {
  return runAudit({
    target,
    tenants,
    seed: flags.seed,
    probes: ['capacity', 'boundary', 'canary'],
    onProgress: (event) => {
      // 78: the demo's lines stay within 80 columns, indent included.
      if (flags.verbose || event.type !== 'probe-log') say(`  ${formatProgress(event, 78)}`)
    },
  })
}

function hasLeak(report: AuditReport): boolean {
  return report.findings.some((f) => f.verdict === 'leak')
}

/** A canary shown redacted: its first 4 characters, then its length. */
function redactCanary(canary: string): string {
  return `${canary.slice(0, 4)}${'•'.repeat(Math.max(0, canary.length - 4))}`
}

/** Tenant B's over-capacity requests as "HTTP status (error code)" counts, e.g. "6× HTTP 200". */
function overCapacityOutcome(report: AuditReport): string {
  const canary = report.findings.find((f) => f.probe === 'canary')
  const requests = (canary?.evidence.observerRequests ?? []) as {
    kind: string
    status: number | null
    errorCode?: string | null
  }[]
  const counts = new Map<string, number>()
  for (const r of requests.filter((x) => x.kind === 'over-capacity')) {
    const key =
      r.status === null ? 'no answer' : `HTTP ${r.status}${r.errorCode ? ` ${r.errorCode}` : ''}`
    counts.set(key, (counts.get(key) ?? 0) + 1)
  }
  return [...counts].map(([k, n]) => `${n}× ${k}`).join(', ') || 'none sent'
}

function leakCell(report: AuditReport): string[] {
  const leaks = report.findings.filter((f) => f.verdict === 'leak')
  if (leaks.length === 0) return ['none']
  const first = leaks[0] as Finding & {
    evidence: { canary?: string; excerpt?: string; numLeakingRequests?: number }
  }
  const canary = String(first.evidence.canary ?? '')
  // Every planted word shows only its first 4 characters; the auditor already replaced the rest of
  // B's answer (anything it did not plant itself) with '·'.
  const excerpt = String(first.evidence.excerpt ?? '')
    .split(/(·+| )/)
    .map((part) => (/^(·+| )$/.test(part) ? part : redactCanary(part)))
    .join('')
  return [
    `YES: ${first.evidence.numLeakingRequests ?? leaks.length} answer(s) to tenant-b carried tenant-a's canary ${redactCanary(canary)}`,
    `B's answer (redacted): ${excerpt.replace(/·+/g, '…')}`,
  ]
}

/** Verdicts by probe, e.g. `capacity=warning canary=leak×4`. */
function verdicts(report: AuditReport): string {
  const counts = new Map<string, number>()
  for (const f of report.findings)
    counts.set(`${f.probe}=${f.verdict}`, (counts.get(`${f.probe}=${f.verdict}`) ?? 0) + 1)
  return [...counts].map(([k, n]) => (n > 1 ? `${k}×${n}` : k)).join(' ')
}

/** The demo's acts: the incident, as shipped, the fault switched on in production. */
const numActs = 3

/** Columns the outcome table fits in: a default terminal's. */
const tableColumns = 80

/** The two runs one after the other, each as rows of `label │ value`, values wrapped between
 *  words so that no line is wider than {@link tableColumns} (a canary is never cut). */
function outcomeTable(runs: readonly RunOutcome[]): string {
  const rowsOf = (r: RunOutcome): [string, string[]][] => [
    ['start-up', [r.startup]],
    ['context window', [r.contextWindow]],
    ["B's over-capacity prompts", [overCapacityOutcome(r.report)]],
    ["A's data in B's answers", leakCell(r.report)],
    ['audit verdicts', [verdicts(r.report)]],
  ]
  const indent = '  '
  const labelWidth = Math.max(...rowsOf(runs[0]).map(([label]) => label.length))
  const valueWidth = tableColumns - indent.length - labelWidth - ' │ '.length
  const lines: string[] = []
  runs.forEach((run, n) => {
    if (n > 0) lines.push('')
    lines.push(`${n + 1}/${numActs}  ${run.title}`)
    for (const [label, values] of rowsOf(run)) {
      const parts = values.flatMap((v) => wrapWords(v, valueWidth))
      parts.forEach((part, i) =>
        lines.push(`${indent}${(i === 0 ? label : '').padEnd(labelWidth)} │ ${part}`.trimEnd()),
      )
    }
  })
  return lines.join('\n')
}

/** `text` cut into lines of at most `width` characters, between words (a word longer than
 *  `width` is cut where it must be). */
function wrapWords(text: string, width: number): string[] {
  const lines: string[] = []
  let line = ''
  for (let word of text.split(' ')) {
    while (word.length > width) {
      if (line) lines.push(line)
      lines.push(word.slice(0, width))
      word = word.slice(width)
      line = ''
    }
    if (!line) line = word
    else if (line.length + 1 + word.length <= width) line += ` ${word}`
    else {
      lines.push(line)
      line = word
    }
  }
  lines.push(line)
  return lines
}
