/** Audit benchmark: which faults of the engine the auditor finds from the outside, how fast it
 *  finds the incident, and whether it ever cries wolf on the engine as shipped. Starts real
 *  clusters (router, prefill and decode workers as OS processes, the bundled model) in the demo's
 *  shape: prefill pool 384 tokens, decode pool 1,024, advertised context 1,024.
 *  - Baseline: every guard off, no fault, the default audit. With guards off the router advertises
 *    1,024 tokens over a 384-token pool (G1 off), so `capacity` warns there already; a probe counts
 *    as seeing a fault only when it is more alarmed than in this baseline.
 *  - Per fault (injected into both workers, every guard off): the probes that can see that fault's
 *    effect ({@link probesFor}), one seed, at most `--fault-seconds` (default 120). `outcome` is
 *    `detected` when one of them gave a `leak` or `warning` above its baseline verdict
 *    (`detectedBy` names them), else `inconclusive` when one could not tell (e.g. every request
 *    hung: the auditor never calls that clean), else `not detected`.
 *    `detectRequests` / `detectSeconds`: request number and time of the first answer that carried
 *    another tenant's canary (leaks only; null otherwise). `placeholder-forward`'s are also
 *    reported as `incident_detect_requests` / `_seconds` (target ≤ 30); its probes are the default
 *    audit's first three, so its request numbers are the default audit's.
 *    `firstFinding`: the alarm (leak or warning) with the lowest request number, its probe and
 *    time: docs/faults.md's fault × probe matrix is written from it (bench/audit-matrix.ts).
 *  - As shipped (guards on, context clamped to the pool): the default audit over `--seeds N`
 *    seeds (default 5); `false_findings` counts leak and warning findings (target 0).
 *  A fault whose effect needs more than the demo's shape gets its own ({@link shapeFor}).
 *
 *  Args: `--faults a,b` (default: every fault), `--seeds N` (default 5), `--seed S` (first seed,
 *  default 1), `--fault-seconds N` (default 120), `--merge FILE` (the result is this run's rows
 *  merged into FILE's JSON, an earlier run's: {@link mergeBenchJson}; with `--faults` it updates
 *  those faults' rows of the whole matrix), `--docs FILE` (rewrite FILE's fault-matrix section
 *  from the result: `npm run bench -- audit --json bench/results/audit.json --docs
 *  docs/faults.md`, or with `--faults a,b --merge bench/results/audit.json` and the same
 *  `--json`). */
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { AuditError, runAudit, type AuditReport } from '../src/audit/index.js'
import { verdictRank, type Finding, type ProbeName, type Verdict } from '../src/audit/types.js'
import { newApiKey, tenantsYaml } from '../src/router/tenants/tenant-keys.js'
import { demoShape } from '../src/cli/demo.js'
import { startCluster, type ClusterOptions } from '../src/config/launch.js'
import { faultDescriptions, type FaultName } from '../src/engine/faults.js'
import { echoModelDir } from '../test/helpers/paths.js'
import { faultMatrixTable, mergeBenchJson, withMatrix, type FaultRow } from './audit-matrix.js'

/** Per fault, the probes whose observation can show its effect from outside (docs/faults.md,
 *  "guards off, observable as"), in the order an audit runs them:
 *  - foreign text in a 200 (the incident): `canary`, after `boundary` sized the prompts;
 *  - pages freed under a live request, aborts ignored, a transfer never acknowledged: the pool
 *    stays above its idle baseline or requests hang (`page-leak`, `abort-race`, `error-handling`);
 *  - damaged or missing KV: answers that change with load or between runs (`determinism`), or
 *    another tenant's stale KV read in place of the missing page (`canary`, `concurrency`);
 *  - stale KV kept on free (`skip-scrub`), reuse without a new epoch (`stale-epoch`): only a read of
 *    it would show, so the probes that look for foreign text (`canary`, `abort-race`). */
export const probesFor: Readonly<Record<FaultName, readonly ProbeName[]>> = {
  'placeholder-forward': ['capacity', 'boundary', 'canary'],
  'early-release': ['concurrency', 'page-leak', 'determinism'],
  'skip-scrub': ['canary', 'abort-race', 'concurrency'],
  'drop-abort': ['abort-race', 'page-leak'],
  'stale-epoch': ['canary', 'abort-race', 'concurrency'],
  'corrupt-transfer': ['canary', 'concurrency', 'determinism'],
  'truncate-transfer': ['canary', 'concurrency', 'determinism'],
  'lost-ack': ['page-leak', 'error-handling'],
  // An aborted prefill's unwritten pages published: wrong answers when its prompt comes back,
  // sent again right after a cut during prefill (`abort-retry`).
  'publish-partial': ['abort-race', 'abort-retry', 'determinism'],
  // A corrupt page loaded back, or another tenant's: changed answers, or a cross-tenant hit.
  'offload-load-as-hit': ['determinism', 'evict-then-return'],
  // Another tenant's evicted prefix found in the tier: that tenant's cached_tokens for it.
  'offload-key-without-tenant': ['evict-then-return'],
  // No effect of its own (D sees every abort and frees the reservation): the probes that would
  // see pages a cut before BEGIN left held.
  'delay-begin': ['abort-race', 'page-leak'],
}

/** Per fault, what its effect needs beyond the demo's shape:
 *  - `publish-partial`: a prefix cache that can hold a prompt past one prefill chunk (256 tokens)
 *    while that prompt's own pages are still leased: the demo's 24-page prefill pool caches 6
 *    pages (96 tokens, all written by the first chunk), so nothing unwritten could be published.
 *    256 prefill pages with 128 for the cache, a 2,048-token context;
 *  - the offload faults: a host offload tier (`--prefix-cache-offload-bytes`), split per tenant
 *    as shipped, the size of the prefill pool (24 pages of 16 KiB on the echo model, 384 KiB):
 *    small enough that the audit's churn (4 × the largest pool) wraps each tenant's share, so
 *    that a load finds its slot written over (the failure `offload-load-as-hit` counts as a hit;
 *    with the split, by the tenant's own pages), large enough that a prefix evicted at the churn's
 *    first stage is still there for another tenant's lookup (the split bounds bytes, not which
 *    keys a lookup reaches, so `offload-key-without-tenant` still finds another tenant's entry). */
const offloadTier = ['--prefix-cache-offload-bytes', String(24 * 16 * 1024)]
export const shapeFor: Readonly<Partial<Record<FaultName, Partial<ClusterOptions>>>> = {
  'publish-partial': {
    prefillPages: 256,
    decodePages: 128,
    prefixCachePages: 128,
    contextWindow: 2048,
  },
  'offload-load-as-hit': { prefillArgs: offloadTier },
  'offload-key-without-tenant': { prefillArgs: offloadTier },
}

interface FaultResult extends FaultRow {
  readonly fault: string
  readonly probes: readonly ProbeName[]
  /** `detected`: a probe alarmed above its baseline; `tool error`: the audit ended with exit 2
   *  (e.g. no valid completion answered while /health said 200), which fails any CI gate and
   *  names the failure; `inconclusive`: no alarm, and at least one probe could not tell (the
   *  auditor never calls that clean); `not detected`: every probe was clean. */
  readonly outcome: FaultRow['outcome']
  readonly detected: boolean
  /** `probe: verdict: title` of each finding above its probe's baseline verdict. */
  readonly detectedBy: string[]
  /** `probe: title` of each inconclusive finding. */
  readonly inconclusive: string[]
  readonly detectRequests: number | null
  readonly detectSeconds: number | null
  readonly requestsSent: number
  readonly auditSeconds: number
}

/** Runs the benchmark and returns its JSON. */
export async function benchAudit(args: string[]): Promise<object> {
  const faults = (flag(args, '--faults') ?? Object.keys(faultDescriptions).join(','))
    .split(',')
    .filter((f) => f !== '')
  for (const f of faults) {
    if (!Object.hasOwn(faultDescriptions, f)) throw new Error(`unknown fault "${f}"`)
  }
  const numSeeds = Number(flag(args, '--seeds') ?? 5)
  const firstSeed = Number(flag(args, '--seed') ?? 1)
  const faultSeconds = Number(flag(args, '--fault-seconds') ?? 120)
  const docsFile = flag(args, '--docs')
  const mergeFile = flag(args, '--merge')
  // Read before anything runs: a missing or malformed file is found in a second, not at the end.
  const earlier =
    mergeFile === undefined ? undefined : (JSON.parse(readFileSync(mergeFile, 'utf8')) as unknown)
  if (!Number.isInteger(numSeeds) || numSeeds < 0) throw new Error('--seeds must be an integer ≥ 0')
  if (!(faultSeconds > 0)) throw new Error('--fault-seconds must be > 0')

  const dir = mkdtempSync(join(tmpdir(), 'kvfence-bench-audit-'))
  const tenants = [
    { name: 'tenant-a', key: newApiKey() },
    { name: 'tenant-b', key: newApiKey() },
  ]
  writeFileSync(join(dir, 'tenants.yaml'), tenantsYaml(tenants))
  const shape: ClusterOptions = {
    modelDir: echoModelDir,
    pageSize: demoShape.pageSize,
    prefillPages: demoShape.prefillPages,
    decodePages: demoShape.decodePages,
    contextWindow: demoShape.advertisedContext,
    tenantsFile: join(dir, 'tenants.yaml'),
    logDir: join(dir, 'logs'),
  }
  const unsafe = (fault: string | null): ClusterOptions => ({
    ...shape,
    prefillFaults: fault === null ? [] : [fault],
    decodeFaults: fault === null ? [] : [fault],
    disableGuards: true,
    env: { ...process.env, KVFENCE_ALLOW_FAULTS: '1' },
  })
  const audit = async (
    options: ClusterOptions,
    seed: number,
    limits: { probes?: readonly ProbeName[]; maxSeconds?: number } = {},
  ): Promise<AuditReport> => {
    const cluster = await startCluster(options)
    try {
      return await runAudit({ target: cluster.routerUrl, tenants, seed, ...limits })
    } finally {
      await cluster.stop()
    }
  }

  try {
    const baseline = worstVerdicts((await audit(unsafe(null), firstSeed)).findings)
    const perFault: FaultResult[] = []
    for (const fault of faults as FaultName[]) {
      const probes = probesFor[fault]
      let report: AuditReport
      let toolError: string | null = null
      try {
        report = await audit({ ...unsafe(fault), ...shapeFor[fault] }, firstSeed, {
          probes,
          maxSeconds: faultSeconds,
        })
      } catch (err) {
        // A fault that makes every valid request fail ends the audit with exit 2 (a tool error
        // naming the failure): an outcome of that fault, not of the benchmark.
        if (!(err instanceof AuditError)) throw err
        toolError = err.message
        report = err.report ?? emptyReport()
      }
      const alarms = report.findings.filter(
        (f) =>
          (f.verdict === 'leak' || f.verdict === 'warning') &&
          verdictRank[f.verdict] > verdictRank[baseline.get(f.probe) ?? 'clean'],
      )
      const leaks = alarms.filter((f) => f.verdict === 'leak')
      const numbers = leaks
        .map((f) => f.evidence.requestNumber)
        .filter((n): n is number => typeof n === 'number')
      const first = numbers.length > 0 ? Math.min(...numbers) : null
      const firstLeak = leaks.find((f) => f.evidence.requestNumber === first)
      const numbered = alarms.filter((f) => typeof f.evidence.requestNumber === 'number')
      const firstAlarm = numbered.reduce<Finding | null>(
        (a, f) =>
          a === null || (f.evidence.requestNumber as number) < (a.evidence.requestNumber as number)
            ? f
            : a,
        null,
      )
      const inconclusive = report.findings
        .filter((f) => f.verdict === 'inconclusive')
        .map((f) => `${f.probe}: ${f.title}`)
      perFault.push({
        fault,
        probes,
        outcome:
          alarms.length > 0
            ? 'detected'
            : toolError !== null
              ? 'tool error'
              : inconclusive.length > 0
                ? 'inconclusive'
                : 'not detected',
        detected: alarms.length > 0,
        toolError,
        detectedBy: alarms.map((f) => `${f.probe}: ${f.verdict}: ${f.title}`),
        inconclusive,
        firstFinding:
          firstAlarm === null
            ? null
            : {
                probe: firstAlarm.probe,
                verdict: firstAlarm.verdict,
                requestNumber: firstAlarm.evidence.requestNumber as number,
                seconds:
                  typeof firstAlarm.evidence.atMs === 'number'
                    ? firstAlarm.evidence.atMs / 1000
                    : null,
              },
        detectRequests: first,
        detectSeconds:
          firstLeak && typeof firstLeak.evidence.atMs === 'number'
            ? firstLeak.evidence.atMs / 1000
            : null,
        requestsSent: report.requestsSent,
        auditSeconds: report.durationMs / 1000,
      })
    }

    const shipped: { seed: number; falseFindings: string[]; inconclusive: string[] }[] = []
    for (let i = 0; i < numSeeds; i++) {
      const report = await audit({ ...shape, clampContext: true }, firstSeed + i)
      shipped.push({
        seed: firstSeed + i,
        falseFindings: report.findings
          .filter((f) => f.verdict === 'leak' || f.verdict === 'warning')
          .map((f) => `${f.probe}: ${f.title}`),
        inconclusive: report.findings
          .filter((f) => f.verdict === 'inconclusive')
          .map((f) => f.probe),
      })
    }

    const incident = perFault.find((r) => r.fault === 'placeholder-forward')
    const result = {
      seed: firstSeed,
      fault_seconds: faultSeconds,
      incident_detect_requests: incident?.detectRequests ?? null,
      incident_detect_seconds: incident?.detectSeconds ?? null,
      incident_detect_target_requests: 30,
      faults_detected: perFault.filter((r) => r.outcome === 'detected').map((r) => r.fault),
      faults_inconclusive: perFault.filter((r) => r.outcome === 'inconclusive').map((r) => r.fault),
      faults_tool_error: perFault.filter((r) => r.outcome === 'tool error').map((r) => r.fault),
      faults_not_detected: perFault.filter((r) => r.outcome === 'not detected').map((r) => r.fault),
      false_findings: shipped.reduce((n, s) => n + s.falseFindings.length, 0),
      shipped_seeds: numSeeds,
      baseline: Object.fromEntries(baseline),
      faults: perFault,
      shipped,
    }
    const merged = earlier === undefined ? result : mergeBenchJson(earlier, result)
    if (docsFile !== undefined) {
      const table = faultMatrixTable(merged as unknown as Parameters<typeof faultMatrixTable>[0])
      writeFileSync(docsFile, withMatrix(readFileSync(docsFile, 'utf8'), table))
    }
    return merged
  } finally {
    rmSync(dir, { recursive: true, force: true })
  }
}

/** The most alarming verdict of each probe among `findings`. */
function worstVerdicts(findings: readonly Finding[]): Map<Finding['probe'], Verdict> {
  const worst = new Map<Finding['probe'], Verdict>()
  for (const f of findings) {
    const seen = worst.get(f.probe)
    if (seen === undefined || verdictRank[f.verdict] > verdictRank[seen])
      worst.set(f.probe, f.verdict)
  }
  return worst
}

function flag(args: string[], name: string): string | undefined {
  const at = args.indexOf(name)
  return at >= 0 ? args[at + 1] : undefined
}

/** What a fault's row is built from when the audit ended before it had a report. */
function emptyReport(): AuditReport {
  return { findings: [], requestsSent: 0, durationMs: 0 } as unknown as AuditReport
}
