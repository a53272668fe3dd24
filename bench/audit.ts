/** Audit benchmark: how fast the default audit finds each fault of the engine, and whether it ever
 *  cries wolf on the engine as shipped. Starts real clusters (router, prefill and decode workers as
 *  OS processes, the bundled model) in the demo's shape: prefill pool 384 tokens, decode pool
 *  1,024, advertised context 1,024.
 *  - Per fault (injected into both workers, every guard off): the default audit (all probes,
 *    default budget) with one seed; `detectRequests` and `detectSeconds` are the request number
 *    and time of the first answer that carried another tenant's canary (null: not detected).
 *    `placeholder-forward`'s are reported as `incident_detect_requests` / `_seconds` (target ≤ 30).
 *  - As shipped (guards on, context clamped to the pool): the default audit over `--seeds N`
 *    seeds (default 5); `false_findings` counts leak and warning findings (target 0).
 *
 *  Args: `--faults a,b` (default: every fault), `--seeds N` (default 5), `--seed S` (first seed,
 *  default 1). */
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { runAudit, type AuditReport } from '../src/audit/index.js'
import { newApiKey, tenantsYaml } from '../src/cli/keys.js'
import { startCluster, type ClusterOptions } from '../src/engine/cluster.js'
import { faultDescriptions } from '../src/engine/faults.js'
import { echoModelDir } from '../test/helpers/paths.js'

interface FaultResult {
  readonly fault: string
  readonly detected: boolean
  readonly detectRequests: number | null
  readonly detectSeconds: number | null
  /** Probes that reported a leak. */
  readonly leakProbes: string[]
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
  if (!Number.isInteger(numSeeds) || numSeeds < 0) throw new Error('--seeds must be an integer ≥ 0')

  const dir = mkdtempSync(join(tmpdir(), 'kvfence-bench-audit-'))
  const tenants = [
    { name: 'tenant-a', key: newApiKey() },
    { name: 'tenant-b', key: newApiKey() },
  ]
  writeFileSync(join(dir, 'tenants.yaml'), tenantsYaml(tenants))
  const shape: ClusterOptions = {
    modelDir: echoModelDir,
    pageSize: 16,
    prefillPages: 24,
    decodePages: 64,
    contextWindow: 1024,
    tenantsFile: join(dir, 'tenants.yaml'),
    logDir: join(dir, 'logs'),
  }
  const audit = async (options: ClusterOptions, seed: number): Promise<AuditReport> => {
    const cluster = await startCluster(options)
    try {
      return await runAudit({ target: cluster.routerUrl, tenants, seed })
    } finally {
      await cluster.stop()
    }
  }

  try {
    const perFault: FaultResult[] = []
    for (const fault of faults) {
      const report = await audit(
        {
          ...shape,
          prefillFaults: [fault],
          decodeFaults: [fault],
          disableGuards: true,
          env: { ...process.env, KVFENCE_ALLOW_FAULTS: '1' },
        },
        firstSeed,
      )
      const leaks = report.findings.filter((f) => f.verdict === 'leak')
      const numbers = leaks
        .map((f) => f.evidence.requestNumber)
        .filter((n): n is number => typeof n === 'number')
      const first = numbers.length > 0 ? Math.min(...numbers) : null
      const firstLeak = leaks.find((f) => f.evidence.requestNumber === first)
      perFault.push({
        fault,
        detected: leaks.length > 0,
        detectRequests: first,
        detectSeconds:
          firstLeak && typeof firstLeak.evidence.atMs === 'number'
            ? firstLeak.evidence.atMs / 1000
            : null,
        leakProbes: [...new Set(leaks.map((f) => f.probe))],
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
    return {
      incident_detect_requests: incident?.detectRequests ?? null,
      incident_detect_seconds: incident?.detectSeconds ?? null,
      incident_detect_target_requests: 30,
      false_findings: shipped.reduce((n, s) => n + s.falseFindings.length, 0),
      shipped_seeds: numSeeds,
      faults: perFault,
      shipped,
    }
  } finally {
    rmSync(dir, { recursive: true, force: true })
  }
}

function flag(args: string[], name: string): string | undefined {
  const at = args.indexOf(name)
  return at >= 0 ? args[at + 1] : undefined
}
