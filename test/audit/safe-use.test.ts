/** Using the auditor safely in CI: `--plan` says what an audit would send without sending a
 *  completion, and a target nobody authorized is refused before any request. The real CLI against
 *  stand-ins, as in cli.test.ts: in this process, and in a child process for the watch's first
 *  line (stopped with SIGTERM). */
import assert from 'node:assert/strict'
import { spawn } from 'node:child_process'
import { mkdtemp, rm, writeFile } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { fileURLToPath } from 'node:url'
import { describe, test } from 'node:test'
import {
  checkAuthorizedTarget,
  isLoopbackHost,
  probeNames,
  probes,
  runAudit,
} from '../../src/audit/index.js'
import { formatJsonReport } from '../../src/audit/reporters/json.js'
import { standInTenants, startStandIn, tenantKeys } from './standins.js'
import { kvfenceWithEnv } from '../helpers/cli.js'

const mainJs = fileURLToPath(new URL('../../src/cli/main.js', import.meta.url))

interface Run {
  code: number | null
  stdout: string
  stderr: string
}

/** `kvfence …` in this process (test/helpers/cli.ts: the same parsing, action and exit code). */
function kvfence(args: string[]): Promise<Run> {
  return kvfenceWithEnv({}, ...args)
}

/** Starts the CLI with `args` and resolves with its first stdout line once it has printed one
 *  (then stops it with SIGTERM), or with its stderr when it exits first. */
function watchStartLine(args: string[]): Promise<string> {
  return new Promise((resolve) => {
    const child = spawn(process.execPath, [mainJs, ...args], { stdio: ['ignore', 'pipe', 'pipe'] })
    let stdout = ''
    let stderr = ''
    child.stderr.setEncoding('utf8').on('data', (chunk: string) => (stderr += chunk))
    child.stdout.setEncoding('utf8').on('data', (chunk: string) => {
      stdout += chunk
      if (stdout.includes('\n')) child.kill('SIGTERM')
    })
    child.on('exit', () => resolve(stdout.includes('\n') ? stdout.split('\n')[0] : stderr))
  })
}

const tenantFlags = ['--tenant', `alice=${tenantKeys.alice}`, '--tenant', `bob=${tenantKeys.bob}`]

/** The row of `probe` in the plan's table: [requests, tokens, cost?]. */
/** A probe's row of a priced plan: its requests, tokens and cost (its share's columns follow). */
function planRow(stdout: string, probe: string): string[] {
  const line = stdout.split('\n').find((l) => l.startsWith(`${probe} `))
  assert.ok(line, `no row for ${probe}:\n${stdout}`)
  return line.trim().split(/\s+/).slice(1, 4)
}

/** Each row of the plan's table, from the header to the total, ends its requests and tokens
 *  cells where the header ends `requests` and `tokens`: a probe name longer than the name
 *  column (operational-endpoints, 21 characters) pushed its cells right. */
function assertColumnsAligned(stdout: string): void {
  const lines = stdout.split('\n')
  const first = lines.findIndex((l) => l.startsWith('probe '))
  const last = lines.findIndex((l) => l.startsWith('total '))
  assert.ok(first >= 0 && last > first, stdout)
  const ends = (line: string): number[] =>
    [...line.matchAll(/\S+/g)].map((m) => m.index + m[0].length)
  const [, requestsEnd, tokensEnd] = ends(lines[first])
  const rows = lines.slice(first + 1, last + 1)
  assert.ok(
    rows.some((l) => l.startsWith('operational-endpoints ')),
    stdout,
  )
  for (const row of rows) {
    const [, requests, tokens] = ends(row)
    assert.deepEqual([requests, tokens], [requestsEnd, tokensEnd], row)
  }
  // The share cells too: 'share: req' is two words of the header, a row's share cells three.
  const headerEnds = [...lines[first].matchAll(/\S+/g)]
    .filter((m) => m[0] !== 'share:')
    .map((m) => m.index + m[0].length)
  for (const row of rows) {
    const cells = ends(row)
    if (cells.length === headerEnds.length)
      assert.deepEqual(cells.slice(1), headerEnds.slice(1), row)
  }
  assert.ok(
    rows.some((row) => ends(row).length === headerEnds.length),
    stdout,
  )
}

describe('--plan', () => {
  test("a refused key or an unlisted --model is the audit's tool error: one line, exit 2, no completion", async () => {
    const standIn = await startStandIn('leaky')
    try {
      const refused = await kvfence([
        'audit',
        '--target',
        standIn.url,
        '--tenant',
        `alice=${tenantKeys.alice}`,
        '--tenant',
        'bob=sk-revoked',
        '--plan',
      ])
      assert.equal(refused.code, 2, refused.stdout)
      assert.equal(refused.stdout, '')
      assert.equal(
        refused.stderr,
        "kvfence audit: tenant bob's key was refused by the target (HTTP 401)\n",
      )
      const unlisted = await kvfence([
        'audit',
        '--target',
        standIn.url,
        ...tenantFlags,
        '--model',
        'nope',
        '--plan',
      ])
      assert.equal(unlisted.code, 2, unlisted.stdout)
      assert.equal(unlisted.stdout, '')
      assert.match(
        unlisted.stderr,
        /^kvfence audit: model "nope" is not listed by http:\/\/127\.0\.0\.1:\d+: \/v1\/models lists [^\n]+ \(--plan sends no completion to try it\): check --model\n$/,
      )
      assert.ok(
        standIn.stats.paths.every((p) => p.startsWith('GET ')),
        `a completion was sent: ${standIn.stats.paths.join(', ')}`,
      )
    } finally {
      await standIn.close()
    }
  })

  test('prints per probe the requests and tokens it would send, priced, and sends no completion', async () => {
    // The incident's stand-in: context 1024, pool 384 tokens, reported on /server_info.
    const standIn = await startStandIn('leaky')
    try {
      const run = await kvfence([
        'audit',
        '--target',
        standIn.url,
        ...tenantFlags,
        '--plan',
        '--price-per-million-tokens',
        '2.5',
      ])
      assert.equal(run.code, 0, run.stderr)
      // Discovery's reads, then each tenant's key check (as the audit's).
      assert.deepEqual(standIn.stats.paths, [
        'GET /v1/models',
        'GET /server_info',
        'GET /metrics',
        'GET /v1/models',
        'GET /v1/models',
      ])
      assert.match(run.stdout, /no completion was sent/)
      assert.match(run.stdout, /context 1024 tokens, KV pool 384 tokens/)
      // Worked by hand from the probes' constants: boundary sends pool−1 and pool twice each
      // (a resize), pool+1 and context−1/context/context+1 once: 8 prompts of 383…1025 tokens
      // plus max_tokens 1.
      assert.deepEqual(planRow(run.stdout, 'boundary'), ['8', '4999', '0.0125'])
      assert.deepEqual(planRow(run.stdout, 'capacity'), ['0', '0', '0.0000'])
      // concurrency: bursts of 1, 2, 4, 8, 16 (--max-concurrency 16), each (165-token prompt + 32).
      assert.deepEqual(planRow(run.stdout, 'concurrency'), ['31', '6107', '0.0153'])
      // abort-race: 8 cuts each beside another tenant's request, then waves of 2, 4 and 8
      // mid-stream cuts likewise (28), then 4 fresh: 48 × (165 + 48).
      assert.deepEqual(planRow(run.stdout, 'abort-race'), ['48', '10224', '0.0256'])
      // abort-retry: 6 attempts of 5 requests; no chunk reported, so 2,048 assumed, but the pool
      // (384) − max_tokens 16 − 8 spare − 96 (first word and canary tail) leaves 264 filler
      // tokens: 30 × (264 + 96 + 16).
      assert.deepEqual(planRow(run.stdout, 'abort-retry'), ['30', '11280', '0.0282'])
      // cache-fields: a plain control, then 4 requests for each of cache_salt and extra_key.
      assert.deepEqual(planRow(run.stdout, 'cache-fields'), ['9', '1494', '0.0037'])
      // warm-equals-cold: no page size reported, so powers of two whose +1 fits 384 − 16: 16…256,
      // 5 edges × 3 lengths × 3 prompts of ≤ 257 + 16 tokens, 2 canary measurements of 47, 2
      // re-aimed edges × 3 prompts and 4 salt controls: 2 × 47 + 55 × 273.
      assert.deepEqual(planRow(run.stdout, 'warm-equals-cold'), ['57', '15109', '0.0378'])
      // evict-then-return: 4 prefixes cold, one warm, 3 checks and 4 returns, 12 × (96 + 16);
      // each tenant's canary cost, 2 × 48; churn of 4 × 384 in prompts of 368:
      // ⌈1,536 / 368⌉ = 5, ⌈5 × 1.5⌉ = 8 at most, × (368 + 16).
      assert.deepEqual(planRow(run.stdout, 'evict-then-return'), ['22', '4512', '0.0113'])
      // canary: 3 plants, then per round of 6 a re-plant (165 + 32), a normal prompt (165 + 64)
      // and an over-capacity one (at most 960 + 64), and one plant of 352 + 32 covering the
      // 384-token pool: 9 × 197 + 384 + 6 × 229 + 6 × 1024.
      assert.deepEqual(planRow(run.stdout, 'canary'), ['22', '9675', '0.0242'])
      // entrypoints: a 3-word prompt (8 tokens) to each of 9 entrypoints; 17 trials of 3 requests
      // (9 same-path, 8 from the hub) of 165 + 50 + 8; the tool round trip, 4 × (215 + 80 + 8).
      assert.deepEqual(planRow(run.stdout, 'entrypoints'), ['64', '12657', '0.0316'])
      // race-load: 2 reads of the endpoint's limit; alone, a structured check and 3 twins; then
      // arrivals ramped 2, 4, 8 (one each per slot) and held at 16 (two per slot): 46. Its long
      // prompts are the short ones' 160 tokens here (half the 384-token pool shared among 16 in
      // flight is 12): 50 × (160 + 32).
      assert.deepEqual(planRow(run.stdout, 'race-load'), ['52', '9600', '0.0240'])
      // stall: the smallest limit (pool 384) − max_tokens 8 = 376; the ladder starts at a quarter
      // of it: 94, 188, 376, each bound at 376 + 8; 4 reads before it and 2 × 2 after a stall.
      assert.deepEqual(planRow(run.stdout, 'stall'), ['11', '1152', '0.0029'])
      // With operational-endpoints, near-duplicates and request-ids (62 requests, their rows not
      // worked here): 669 requests, within the default budget (800), so no probe's share is cut.
      assert.deepEqual(planRow(run.stdout, 'total'), ['669', '115738', '0.2893'])
      assertColumnsAligned(run.stdout)
      assert.doesNotMatch(run.stdout, /exceed --max-requests/)
      for (const key of Object.values(tenantKeys)) assert.ok(!run.stdout.includes(key))
    } finally {
      await standIn.close()
    }
  })

  test('a budget smaller than the plan says where the audit stops; no price prints tokens only', async () => {
    const standIn = await startStandIn('safe')
    try {
      const run = await kvfence([
        'audit',
        '--target',
        standIn.url,
        ...tenantFlags,
        '--plan',
        '--max-requests',
        '50',
      ])
      assert.equal(run.code, 0, run.stderr)
      assert.ok(!standIn.stats.paths.some((p) => p.startsWith('POST')), standIn.stats.paths.join())
      assert.match(
        run.stdout,
        /exceed --max-requests 50: each probe gets its share \(every probe runs; none starves the ones after it\)/,
      )
      assert.match(run.stdout, /^ {2}prefix-timing needs up to \d+ requests/m)
      assert.match(run.stdout, /tokens only: give --price-per-million-tokens/)
    } finally {
      await standIn.close()
    }
  })

  // --plan ignored --resume and planned the whole audit again.
  test('--plan --resume plans the resumed run: the pending probes only, the kept ones named', async () => {
    const standIn = await startStandIn('safe')
    const dir = await mkdtemp(join(tmpdir(), 'kvfence-plan-resume-'))
    try {
      // An audit of boundary and canary interrupted as boundary ends: canary is pending.
      const stop = new AbortController()
      const interrupted = await runAudit({
        target: standIn.url,
        tenants: standInTenants,
        seed: 3,
        probes: ['boundary', 'canary'],
        signal: stop.signal,
        onProgress: (e) => void (e.type === 'probe-end' && stop.abort('SIGINT')),
      })
      assert.deepEqual(interrupted.pendingProbes, ['canary'])
      const file = join(dir, 'audit.json')
      await writeFile(file, formatJsonReport(interrupted))
      const posts = standIn.stats.paths.filter((p) => p.startsWith('POST')).length
      const args = ['audit', '--target', standIn.url, ...tenantFlags, '--seed', '3']
      const plan = await kvfence([
        ...args,
        '--probes',
        'boundary,canary',
        '--plan',
        '--resume',
        file,
      ])
      assert.equal(plan.code, 0, plan.stderr)
      assert.match(plan.stdout, /^resumed: kept from the report, not sent again: boundary$/m)
      assert.deepEqual(
        plan.stdout
          .split('\n')
          .filter((l) => /^(boundary|canary) /.test(l))
          .map((l) => l.split(' ')[0]),
        ['canary'],
      )
      assert.equal(standIn.stats.paths.filter((p) => p.startsWith('POST')).length, posts)
      // A report of another audit (other probes chosen) is refused as the audit itself would.
      const other = await kvfence([...args, '--probes', 'canary', '--plan', '--resume', file])
      assert.equal(other.code, 2)
      assert.match(other.stderr, /^kvfence audit: cannot resume /)
    } finally {
      await standIn.close()
      await rm(dir, { recursive: true, force: true })
    }
  })

  test('every probe states its plan', () => {
    for (const name of probeNames) assert.equal(typeof probes[name].plan, 'function', name)
  })
})

describe('authorized targets', () => {
  test('a non-loopback target is refused before any connection: exit 2, one line saying how to authorize', async () => {
    // 192.0.2.1 is TEST-NET-1 (RFC 5737): never routed. Were it connected to, the CLI would
    // report it unreachable after a timeout, not this refusal.
    const started = Date.now()
    const run = await kvfence(['audit', '--target', 'http://192.0.2.1:8000', ...tenantFlags])
    assert.equal(run.code, 2)
    assert.equal(
      run.stderr,
      'kvfence audit: 192.0.2.1:8000 is not loopback and not an authorized target: audit only endpoints you are allowed to test, then list it under authorized_targets in --config or pass --authorized\n',
    )
    assert.ok(Date.now() - started < 30_000)
  })

  test('a target without http(s):// is told so, not that it is unauthorized', async () => {
    // Found by a trial: `localhost:18143` parses with the scheme `localhost:` and an empty host,
    // and was refused as " is not loopback and not an authorized target".
    for (const [target, scheme] of [
      ['localhost:18143', 'localhost:'],
      ['ftp://192.0.2.1', 'ftp:'],
    ]) {
      const run = await kvfence(['audit', '--target', target, ...tenantFlags])
      assert.equal(run.code, 2)
      assert.equal(run.stderr, `kvfence audit: target must be an http(s) URL, got ${scheme}\n`)
    }
  })

  test('--plan is refused the same way (its discovery reads are requests too)', async () => {
    const run = await kvfence(['audit', '--target', 'http://192.0.2.1', ...tenantFlags, '--plan'])
    assert.equal(run.code, 2)
    assert.match(run.stderr, /^kvfence audit: 192\.0\.2\.1 is not loopback/)
  })

  test('authorized_targets in the config, or --authorized, lets the audit reach the host', async () => {
    // Authorized, the TEST-NET address gets past the check to a connection attempt, which fails
    // ("cannot reach", within --max-seconds): the refusal above came before any.
    const dir = await mkdtemp(join(tmpdir(), 'kvfence-auth-'))
    try {
      const file = join(dir, 'audit.yaml')
      await writeFile(file, 'authorized_targets: ["192.0.2.1:9"]\n')
      assert.doesNotThrow(() =>
        checkAuthorizedTarget('http://192.0.2.1:9/v1', ['192.0.2.1:9'], false),
      )
      assert.doesNotThrow(() =>
        checkAuthorizedTarget('https://LLM.example.com', ['llm.example.com'], false),
      )
      assert.doesNotThrow(() =>
        checkAuthorizedTarget('https://llm.example.com:8443', ['https://llm.example.com'], false),
      )
      assert.throws(() => checkAuthorizedTarget('http://192.0.2.1:10', ['192.0.2.1:9'], false), {
        code: 'unauthorized_target',
      })
      assert.throws(
        () => checkAuthorizedTarget('http://llm.example.com.evil.test', ['llm.example.com'], false),
        {
          code: 'unauthorized_target',
        },
      )
      assert.doesNotThrow(() => checkAuthorizedTarget('http://192.0.2.1', [], true))
      const run = await kvfence([
        'audit',
        '--config',
        file,
        '--target',
        'http://192.0.2.1:9',
        ...tenantFlags,
        '--max-seconds',
        '2',
        '--plan',
      ])
      assert.equal(run.code, 2)
      assert.doesNotMatch(run.stderr, /not an authorized target/)
      assert.match(run.stderr, /cannot reach http:\/\/192\.0\.2\.1:9/)
    } finally {
      await rm(dir, { recursive: true, force: true })
    }
  })

  test('kvfence watch refuses a non-loopback target the same way: exit 2, the same line', async () => {
    const run = await kvfence(['watch', '--target', 'http://192.0.2.1:8000', ...tenantFlags])
    assert.equal(run.code, 2)
    assert.equal(
      run.stderr,
      'kvfence watch: 192.0.2.1:8000 is not loopback and not an authorized target: audit only endpoints you are allowed to test, then list it under authorized_targets in --config or pass --authorized\n',
    )
    assert.equal(run.stdout, '')
  })

  test('kvfence watch --plan: a cycle and an hour at most, before anything is sent', async () => {
    const standIn = await startStandIn('safe')
    try {
      const run = await kvfence([
        'watch',
        '--target',
        standIn.url,
        ...tenantFlags,
        '--plan',
        '--cycle-seconds',
        '60',
        '--max-requests-per-hour',
        '600',
      ])
      assert.equal(run.code, 0, run.stderr)
      assert.deepEqual(standIn.stats.paths, [])
      // cycle.ts: 7 reads at most, the plant, the cut stream and its fresh request, the look, a
      // burst of 3 and one over-capacity prompt (8), and 20 follow-up rounds of 2.
      assert.match(run.stdout, /a cycle sends at most 55 requests/)
      assert.match(run.stdout, /60\.0 cycles an hour/)
      assert.match(run.stdout, /an hour: at most 600 requests \(--max-requests-per-hour\)/)
    } finally {
      await standIn.close()
    }
  })

  test('kvfence watch: authorized_targets in the config, or --authorized, lets it through', async () => {
    // Authorized, the watch gets past the check to its plan, which reads nothing: its start checks
    // the tenants' keys with a request, and no test sends one to an address not loopback.
    const dir = await mkdtemp(join(tmpdir(), 'kvfence-watch-auth-'))
    try {
      const file = join(dir, 'audit.yaml')
      await writeFile(file, 'authorized_targets: ["192.0.2.1:9"]\n')
      const target = ['--target', 'http://192.0.2.1:9', ...tenantFlags, '--plan']
      for (const extra of [['--config', file], ['--authorized']]) {
        const run = await kvfence(['watch', ...target, ...extra])
        assert.equal(run.code, 0, `${extra.join(' ')}: ${run.stderr}`)
        assert.match(run.stdout, /a cycle sends at most \d+ requests/, extra.join(' '))
      }
    } finally {
      await rm(dir, { recursive: true, force: true })
    }
  })

  test("kvfence watch refuses a tenant's refused key at start as the audit does: one line, exit 2, no cycle", async () => {
    const standIn = await startStandIn('safe')
    try {
      const run = await kvfenceWithEnv(
        { KVFENCE_TEST_KEY_A: tenantKeys.alice },
        'watch',
        '--target',
        standIn.url,
        '--tenant',
        'alice=env:KVFENCE_TEST_KEY_A',
        '--tenant',
        'bob=wrong',
        '--metrics-port',
        '0',
      )
      assert.equal(run.code, 2, run.stdout)
      assert.equal(run.stdout, '')
      assert.equal(
        run.stderr,
        "kvfence watch: tenant bob's key was refused by the target (HTTP 401)\n",
      )
      // The audit's check, nothing more: one GET /v1/models per tenant, no completion.
      assert.deepEqual(standIn.stats.paths, ['GET /v1/models', 'GET /v1/models'])
    } finally {
      await standIn.close()
    }
  })

  test('kvfence watch with accepted keys starts after the same check', async () => {
    const standIn = await startStandIn('safe')
    try {
      const line = await watchStartLine([
        'watch',
        '--target',
        standIn.url,
        ...tenantFlags,
        '--metrics-port',
        '0',
      ])
      assert.match(line, /"msg":"watch started: /)
      assert.deepEqual(standIn.stats.paths.slice(0, 2), ['GET /v1/models', 'GET /v1/models'])
    } finally {
      await standIn.close()
    }
  })

  // URL drops a scheme's default port: "host:80" read as "any port" (it authorized
  // http://host:8000), and "host:443" never matched https://host.
  test("an entry's port is the one it writes, :80 and :443 included; a target without one reaches its scheme's default", () => {
    const allows = (target: string, entry: string): boolean => {
      try {
        checkAuthorizedTarget(target, [entry], false)
        return true
      } catch (err) {
        assert.equal((err as { code?: string }).code, 'unauthorized_target')
        return false
      }
    }
    assert.equal(allows('https://llm.example.com', 'llm.example.com:443'), true)
    assert.equal(allows('https://llm.example.com/v1', 'https://llm.example.com:443/v1'), true)
    assert.equal(allows('http://llm.example.com', 'llm.example.com:80'), true)
    assert.equal(allows('http://llm.example.com:8000', 'llm.example.com:80'), false)
    assert.equal(allows('https://llm.example.com:8443', 'llm.example.com:443'), false)
    assert.equal(allows('http://llm.example.com:443', 'http://llm.example.com:80'), false)
    assert.equal(allows('http://[2001:db8::1]:8000', '[2001:db8::1]:8000'), true)
    assert.equal(allows('http://[2001:db8::1]:8001', '[2001:db8::1]:8000'), false)
    assert.equal(allows('http://[2001:db8::1]:8001', '[2001:DB8:0::1]'), true)
  })

  test('loopback is always allowed: 127.0.0.0/8, ::1, localhost', () => {
    for (const host of [
      '127.0.0.1',
      '127.9.8.7',
      '[::1]',
      'localhost',
      'api.localhost',
      '[::ffff:7f00:1]',
    ])
      assert.ok(isLoopbackHost(host), host)
    for (const host of [
      '192.0.2.1',
      '10.0.0.1',
      '128.0.0.1',
      '[::2]',
      '127.0.0.1.nip.io',
      'localhost.example.com',
    ])
      assert.ok(!isLoopbackHost(host), host)
  })
})
