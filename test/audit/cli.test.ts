/** `kvfence audit` as a user runs it, against stand-ins: the real CLI in a child process for the
 *  first test, in this process (test/helpers/cli.ts: the same parsing, action and exit code) for
 *  the rest. Exit codes: 1 leak, 0 clean, 2 tool error (one line on stderr, no stack trace). */
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { mkdtemp, readFile, rm, writeFile } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { fileURLToPath } from 'node:url'
import { after, before, describe, test } from 'node:test'
import { z } from 'zod'
import { probeNames } from '../../src/audit/index.js'
import { kvfenceWithEnv } from '../helpers/cli.js'
import { startStandIn, tenantKeys, unreachableUrl, type StandIn } from './standins.js'

const mainJs = fileURLToPath(new URL('../../src/cli/main.js', import.meta.url))

interface Run {
  code: number | null
  stdout: string
  stderr: string
}

/** `kvfence …` in this process, with `env` added to its environment while it runs. */
function kvfence(args: string[], env: Record<string, string> = {}): Promise<Run> {
  return kvfenceWithEnv(env, ...args)
}

/** `kvfence …` as a child process with `env` added to this one's. */
function kvfenceProcess(args: string[], env: Record<string, string> = {}): Promise<Run> {
  return new Promise((resolve) => {
    execFile(
      process.execPath,
      [mainJs, ...args],
      { env: { ...process.env, ...env }, timeout: 60_000 },
      (err, stdout, stderr) => {
        const code = err && typeof err.code === 'number' ? err.code : err ? null : 0
        resolve({ code, stdout, stderr })
      },
    )
  })
}

const tenantFlags = [
  '--tenant',
  `alice=${tenantKeys.alice}`,
  '--tenant',
  'bob=env:KVFENCE_TEST_BOB_KEY',
]
const env = { KVFENCE_TEST_BOB_KEY: tenantKeys.bob }

function assertNoKeys(run: Run): void {
  for (const key of Object.values(tenantKeys)) {
    assert.ok(!run.stdout.includes(key) && !run.stderr.includes(key), 'a key was printed')
  }
}

function assertOneLineError(run: Run, pattern: RegExp): void {
  assert.equal(run.code, 2, `exit code ${run.code}; stderr: ${run.stderr}`)
  const lines = run.stderr.trimEnd().split('\n')
  assert.equal(lines.length, 1, `stderr has ${lines.length} lines:\n${run.stderr}`)
  assert.match(lines[0], pattern)
  assert.doesNotMatch(run.stderr, /\n\s+at /, 'no stack trace')
}

const Report = z.object({
  schemaVersion: z.literal(2),
  tool: z.literal('kvfence audit'),
  target: z.string(),
  model: z.string().nullable(),
  startedAt: z.iso.datetime(),
  durationMs: z.number().nonnegative(),
  seed: z.number().int(),
  budget: z.object({ maxRequests: z.number(), maxSeconds: z.number(), concurrency: z.number() }),
  requestsSent: z.number().int(),
  findings: z
    .array(
      z.object({
        probe: z.enum(probeNames),
        verdict: z.enum(['leak', 'clean', 'inconclusive', 'warning']),
        severity: z.enum(['critical', 'high', 'medium', 'low', 'info']),
        title: z.string(),
        evidence: z.record(z.string(), z.unknown()),
        remediation: z.string(),
      }),
    )
    .min(3),
})

describe('kvfence audit (CLI)', () => {
  const standIns: Partial<Record<'leaky' | 'safe' | 'broken', StandIn>> = {}
  let dir: string
  before(async () => {
    dir = await mkdtemp(join(tmpdir(), 'kvfence-audit-'))
    for (const kind of ['leaky', 'safe', 'broken'] as const)
      standIns[kind] = await startStandIn(kind)
  })
  after(async () => {
    for (const s of Object.values(standIns)) await s.close()
    await rm(dir, { recursive: true, force: true })
  })

  test('exits 1 on a leaky endpoint, prints a line per probe and a summary, writes the JSON report', async () => {
    const file = join(dir, 'leaky.json')
    const run = await kvfenceProcess(
      ['audit', '--target', standIns.leaky!.url, ...tenantFlags, '--seed', '9', '--json', file],
      env,
    )
    assert.equal(run.code, 1, run.stderr)
    for (const probe of ['capacity', 'boundary', 'canary'])
      assert.match(run.stdout, new RegExp(`\\[${probe}\\] running`))
    assert.match(run.stdout, /canary\s+leak\s+critical/)
    assert.match(run.stdout, /LEAK/)
    assertNoKeys(run)
    // Not a terminal: every line (progress, table, result) fits 100 columns.
    const widest = Math.max(...run.stdout.split('\n').map((l) => [...l].length))
    assert.ok(widest <= 100, `a line of ${widest} columns:\n${run.stdout}`)
    const report = Report.parse(JSON.parse(await readFile(file, 'utf8')))
    assert.equal(report.seed, 9)
    assert.ok(report.findings.some((f) => f.verdict === 'leak'))
    const text = JSON.stringify(report)
    for (const key of Object.values(tenantKeys)) assert.ok(!text.includes(key))
  })

  test('exits 0 on a safe endpoint', async () => {
    const run = await kvfence(
      [
        'audit',
        '--target',
        `${standIns.safe!.url}/v1`,
        ...tenantFlags,
        '--probes',
        'capacity,boundary,canary,abort-race,concurrency,determinism,error-handling',
      ],
      env,
    )
    assert.equal(run.code, 0, run.stderr)
    assert.match(run.stdout, /clean: every probe passed/)
    assert.doesNotMatch(run.stdout, /NOT PROVEN/)
    assertNoKeys(run)
  })

  test('--fail-on: a warning fails only when asked; inconclusive fails only when asked', async () => {
    const leakyCapacity = await kvfence(
      [
        'audit',
        '--target',
        standIns.leaky!.url,
        ...tenantFlags,
        '--probes',
        'capacity',
        '--fail-on',
        'warning',
      ],
      env,
    )
    assert.equal(leakyCapacity.code, 1)
    // The stand-in has no prefix cache: cache-fields' positive control (a tenant's own salted
    // prefix sent twice) reports no cached tokens, so it cannot tell: inconclusive, with its other
    // requests answered (the audit did audit something, so this is not a tool error).
    const partial = ['--probes', 'capacity,cache-fields']
    const safe = await kvfence(
      ['audit', '--target', standIns.safe!.url, ...tenantFlags, ...partial],
      env,
    )
    assert.equal(safe.code, 0, `inconclusive is reported, not failed, by default: ${safe.stderr}`)
    assert.match(safe.stdout, /isolation not proven/)
    assert.match(
      safe.stdout,
      /^!! ISOLATION NOT PROVEN: 1 probe\(s\) could not tell: cache-fields/m,
    )
    const safeStrict = await kvfence(
      [
        'audit',
        '--target',
        standIns.safe!.url,
        ...tenantFlags,
        ...partial,
        '--fail-on',
        'inconclusive',
      ],
      env,
    )
    assert.equal(safeStrict.code, 1)
    // An endpoint that answers no completion is a tool error, not an inconclusive pass.
    const broken = await kvfence(['audit', '--target', standIns.broken!.url, ...tenantFlags], env)
    assertOneLineError(broken, /the target answered none of the \d+ valid completions/)
  })

  test('exits 2 with one line on stderr when the target is unreachable', async () => {
    const run = await kvfence(['audit', '--target', await unreachableUrl(), ...tenantFlags], env)
    assertOneLineError(run, /cannot reach http:\/\/127\.0\.0\.1:\d+: ECONNREFUSED/)
    assertNoKeys(run)
    // Port 1 is one fetch never connects to: say so, not undici's bare "bad port".
    const blocked = await kvfence(['audit', '--target', 'http://127.0.0.1:1', ...tenantFlags], env)
    assertOneLineError(
      blocked,
      /cannot reach http:\/\/127\.0\.0\.1:1: fetch refuses to connect to this port \(a "bad port" of the Fetch standard/,
    )
  })

  test('exits 2 naming the tenant when the target refuses its key (never a silent pass)', async () => {
    const run = await kvfence(
      [
        'audit',
        '--target',
        standIns.safe!.url,
        '--tenant',
        'alice=sk-revoked',
        '--tenant',
        'bob=env:KVFENCE_TEST_BOB_KEY',
      ],
      env,
    )
    assertOneLineError(run, /tenant alice's key was refused by the target \(HTTP 401\)/)
  })

  test('exits 2 when two tenants share one key (they would be one tenant)', async () => {
    const run = await kvfence(
      [
        'audit',
        '--target',
        standIns.safe!.url,
        '--tenant',
        'alice=env:KVFENCE_TEST_BOB_KEY',
        '--tenant',
        'bob=env:KVFENCE_TEST_BOB_KEY',
      ],
      env,
    )
    assertOneLineError(run, /two tenants share one key/)
    assertNoKeys(run)
  })

  test('exits 2 with one line on stderr for bad flags, naming no key', async () => {
    const url = standIns.safe!.url
    assertOneLineError(
      await kvfence(['audit', '--target', url, '--tenant', `alice=${tenantKeys.alice}`]),
      /at least two tenants/,
    )
    assertOneLineError(
      await kvfence(['audit', '--target', url, ...tenantFlags, '--bogus'], env),
      /unknown option/,
    )
    assertOneLineError(await kvfence(['audit', ...tenantFlags], env), /--target/)
    assertOneLineError(
      await kvfence(['audit', '--target', url, ...tenantFlags, '--probes', 'capacity,nope'], env),
      /unknown probe "nope"/,
    )
    assertOneLineError(
      await kvfence(['audit', '--target', url, ...tenantFlags, '--max-requests', '0'], env),
      /--max-requests/,
    )
    // Out of runAudit's range: the line names the flag and the value as typed.
    for (const [flag, value, range] of [
      ['--max-concurrency', '1024', 'from 1 to 256'],
      ['--concurrency', '300', 'from 1 to 256'],
      ['--max-requests', '1000001', 'from 1 to 1000000'],
    ]) {
      assertOneLineError(
        await kvfence(['audit', '--target', url, ...tenantFlags, flag, value], env),
        new RegExp(`^kvfence audit: ${flag} must be an integer ${range}, got "${value}"$`),
      )
    }
    assertOneLineError(
      await kvfence(['audit', '--target', url, ...tenantFlags, '--fail-on', 'never'], env),
      /fail-on/,
    )
    const missingEnv = await kvfence(['audit', '--target', url, ...tenantFlags])
    assertOneLineError(
      missingEnv,
      /tenant bob: environment variable KVFENCE_TEST_BOB_KEY is not set/,
    )
    const dup = await kvfence([
      'audit',
      '--target',
      url,
      '--tenant',
      `alice=${tenantKeys.alice}`,
      '--tenant',
      `alice=${tenantKeys.bob}`,
    ])
    assertOneLineError(dup, /tenant alice is given twice/)
    assertNoKeys(dup)
    // Names are compared ignoring case, as the router compares them.
    const cased = await kvfence([
      'audit',
      '--target',
      url,
      '--tenant',
      `a=${tenantKeys.alice}`,
      '--tenant',
      `A=${tenantKeys.bob}`,
    ])
    assertOneLineError(
      cased,
      /^kvfence audit: tenants a and A differ only in case \(tenant names are compared ignoring case\)$/,
    )
    assertNoKeys(cased)
  })

  test('a report that cannot be written is refused before any request (exit 2, one line)', async () => {
    const safe = standIns.safe!
    const before = safe.stats.numRequests
    for (const [flag, path, reason] of [
      ['--json', '/nonexistent-kvfence-dir/report.json', 'ENOENT'],
      ['--html', tmpdir(), 'EISDIR'],
      // The folder's mode allows it, yet no file can be made there.
      ['--json', '/proc/kvfence-report.json', 'ENOENT'],
    ]) {
      const run = await kvfence(['audit', '--target', safe.url, ...tenantFlags, flag, path], env)
      const kind = flag === '--json' ? 'JSON' : 'HTML'
      assertOneLineError(
        run,
        new RegExp(`^kvfence audit: cannot write the ${kind} report to ${path}: ${reason}$`),
      )
    }
    assert.equal(safe.stats.numRequests, before, 'the audit sent requests before refusing')
  })

  test('--list-probes prints every probe with its description and exits 0 without a target', async () => {
    const run = await kvfence(['audit', '--list-probes'])
    assert.equal(run.code, 0, run.stderr)
    const names = run.stdout
      .trimEnd()
      .split('\n')
      .map((l) => l.split(/\s+/)[0])
    assert.deepEqual(names, [...probeNames])
    assert.match(run.stdout, /^prefix-timing\s+TTFT of another tenant's prefix/m)
  })

  test('--config supplies target, tenants (keys from env), probes, seed and reports; flags override it', async () => {
    const config = join(dir, 'audit.yaml')
    const junit = join(dir, 'from-config.xml')
    const html = join(dir, 'from-flag.html')
    await writeFile(
      config,
      [
        `target: ${standIns.leaky!.url}`,
        'tenants:',
        '  - { name: alice, keyEnv: KVFENCE_TEST_ALICE_KEY }',
        '  - { name: bob, keyEnv: KVFENCE_TEST_BOB_KEY }',
        'probes: [capacity, canary]',
        'seed: 31',
        'failOn: warning',
        `reports: { junit: ${junit}, html: ${join(dir, 'overridden.html')} }`,
      ].join('\n'),
    )
    const run = await kvfence(
      ['audit', '--config', config, '--probes', 'capacity', '--html', html],
      {
        ...env,
        KVFENCE_TEST_ALICE_KEY: tenantKeys.alice,
      },
    )
    assert.equal(run.code, 1, 'failOn: warning from the file, capacity warns')
    assert.match(run.stdout, /seed 31\)/)
    assert.doesNotMatch(run.stdout, /\[canary\]/, '--probes overrides the file')
    assertNoKeys(run)
    const xml = await readFile(junit, 'utf8')
    assert.match(xml, /tests="1" failures="1" errors="0" skipped="0"/)
    assert.match(xml, /<testcase classname="kvfence\.audit" name="capacity"/)
    assert.match(await readFile(html, 'utf8'), /^<!doctype html>/)
    await assert.rejects(readFile(join(dir, 'overridden.html')), /ENOENT/)
  })

  test('a bad --config is a tool error: one line, exit 2', async () => {
    const config = join(dir, 'bad.yaml')
    await writeFile(config, 'budget: { concurrency: 0 }\n')
    assertOneLineError(
      await kvfence(['audit', '--config', config]),
      /^kvfence audit: config .*bad\.yaml: budget\.concurrency: /,
    )
    // Out of range in the file: the line names the key.
    await writeFile(config, 'budget: { maxRequests: 1000001 }\n')
    assertOneLineError(
      await kvfence(['audit', '--config', config]),
      /^kvfence audit: config .*bad\.yaml: budget\.maxRequests: must be an integer from 1 to 1000000$/,
    )
    await writeFile(
      config,
      'tenants:\n  - { name: bob, keyEnv: KVFENCE_TEST_BOB_KEY }\n  - { name: Bob, keyEnv: KVFENCE_TEST_ALICE_KEY }\n',
    )
    assertOneLineError(
      await kvfence(['audit', '--config', config], {
        ...env,
        KVFENCE_TEST_ALICE_KEY: tenantKeys.alice,
      }),
      /^kvfence audit: config .*bad\.yaml: tenants: tenants bob and Bob differ only in case \(tenant names are compared ignoring case\)$/,
    )
    assertOneLineError(
      await kvfence(['audit', '--config', join(dir, 'missing.yaml')]),
      /^kvfence audit: cannot read config .*missing\.yaml: ENOENT$/,
    )
  })
})
