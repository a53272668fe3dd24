/** `kvfence watch` against stand-in OpenAI-compatible endpoints (real HTTP servers from
 *  standins.ts), as a real CLI process: it alerts once on the incident's leak (log line, metric,
 *  webhook), stays quiet on a safe endpoint, never sends more than its hourly budget, survives an
 *  endpoint that is down and comes back, ends cleanly on SIGTERM mid-cycle and refuses bad input
 *  with one line and exit 2. */
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { createServer, connect, type Socket } from 'node:net'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { after, describe, test } from 'node:test'
import { cliPath } from '../helpers/paths.js'
import { startStandIn, tenantKeys, unreachableUrl } from './standins.js'
import { metricValue, scrape, startReceiver, startWatch, type LogLine } from './watch-process.js'

const tenantFlags = [
  '--tenant',
  `alice=${tenantKeys.alice}`,
  '--tenant',
  'bob=env:KVFENCE_TEST_BOB_KEY',
]
const env = { KVFENCE_TEST_BOB_KEY: tenantKeys.bob }
const fastCycles = ['--cycle-seconds', '0.3', '--metrics-port', '0', '--seed', '7']
/** A budget no test reaches (the budget test sets its own). */
const ampleBudget = ['--max-tokens-per-hour', '100000000', '--max-requests-per-hour', '1000000']

function assertNoKeys(text: string): void {
  for (const key of Object.values(tenantKeys)) assert.ok(!text.includes(key), 'a key was printed')
}

const isCycle = (outcome: string) => (l: LogLine) => l.msg === 'cycle' && l.outcome === outcome

/** A leak from one tenant to another (a same-tenant crossing, requests crossed, is a leak too). */
const isCrossTenantLeak = (l: LogLine): boolean => {
  const e = l.evidence as Record<string, unknown> | undefined
  return l.msg === 'finding' && l.verdict === 'leak' && e?.victimTenant !== e?.observerTenant
}

describe('kvfence watch against the incident stand-in', () => {
  test('a read that finds the plant one time in nine: the first cycle, at the default budget, runs 8 follow-up rounds and raises the leak', async (t) => {
    // The stand-in decodes only its 9th prompt over the pool over the pages the previous request
    // left (the others over words no tenant sent, as a read that lost the race for the freed pages
    // to a busy workload): the cycle's own over-capacity or boundary prompt is the 1st, follow-up
    // round k's read the (k + 1)-th, right after that round's plant.
    const standIn = await startStandIn('leaky', { staleReadEvery: 9 })
    const watch = startWatch(
      ['--target', standIn.url, ...tenantFlags, '--metrics-port', '0', '--seed', '7'],
      env,
    )
    t.after(async () => {
      watch.child.kill('SIGKILL')
      await standIn.close()
    })
    const leak = await watch.waitFor(isCrossTenantLeak, 60_000, 'with a cross-tenant leak finding')
    assert.match(String(leak.title), /over-capacity \d+ tokens \(follow-up 8\) answer/)
    // The cycle's findings are announced one after another: the boundary warning comes last.
    await watch.waitFor(
      (l) => l.msg === 'finding' && l.probe === 'boundary',
      10_000,
      'with the boundary warning',
    )
    const cycles = watch.lines.filter((l) => l.msg === 'cycle')
    assert.deepEqual(
      cycles.map((l) => [l.cycle, l.outcome, l.followUps]),
      [[1, 'finding', 8]],
    )
    assert.equal(standIn.stats.numOverCapacity, 9)
    // The read's 32 words may reach past the last plant into an earlier one of its own tenant (a
    // same-tenant leak besides): the kinds, not the count, are exact.
    const kinds = watch.lines
      .filter((l) => l.msg === 'finding')
      .map((l) => `${String(l.verdict)}:${String(l.probe)}`)
    assert.deepEqual([...new Set(kinds)].sort(), [
      'leak:canary',
      'warning:boundary',
      'warning:capacity',
    ])
  })

  test('a leak is one finding: a log line with its evidence, the metrics, one webhook', async (t) => {
    const standIn = await startStandIn('leaky')
    const receiver = await startReceiver()
    const watch = startWatch(
      [
        '--target',
        standIn.url,
        ...tenantFlags,
        ...fastCycles,
        ...ampleBudget,
        '--webhook',
        receiver.url,
      ],
      env,
    )
    t.after(async () => {
      watch.child.kill('SIGKILL')
      await Promise.all([standIn.close(), receiver.close()])
    })
    const leak = await watch.waitFor(
      (l) => l.msg === 'finding' && isCrossTenantLeak(l),
      60_000,
      'with a cross-tenant leak finding',
    )
    assert.equal(leak.level, 50, 'a leak is logged at error level')
    assert.equal(leak.severity, 'critical')
    const evidence = leak.evidence as Record<string, string>
    assert.ok(['alice', 'bob'].includes(evidence.victimTenant))
    assert.notEqual(evidence.victimTenant, evidence.observerTenant)
    assert.ok(evidence.canary.includes(evidence.matchedFragment))
    assert.ok(evidence.matchedFragment.length >= 8)
    // Only canary material stays readable in the excerpt; everything else is '·'.
    assert.match(evidence.excerpt, /^[A-Za-z0-9· ]+$/)
    const leakCycle = leak.cycle as number
    // Let more cycles run: the leak recurs, but is not announced again.
    await watch.waitFor(
      (l) => l.msg === 'cycle' && (l.cycle as number) >= leakCycle + 4,
      60_000,
      'four cycles after the leak',
    )
    const metrics = await scrape(await watch.metricsUrl())
    const leakKey = leak.finding as string
    const probe = leak.probe as string
    assert.equal(
      metricValue(metrics, 'kvfence_watch_active_findings', { verdict: 'leak', probe }) !== null,
      true,
    )
    assert.ok(
      metricValue(metrics, 'kvfence_watch_findings_total', { verdict: 'leak', probe })! >= 1,
    )
    // The stand-in advertises 1024 tokens over a 384-token pool.
    assert.equal(metricValue(metrics, 'kvfence_watch_capacity_gap_tokens'), 1024 - 384)
    assert.equal(metricValue(metrics, 'kvfence_watch_target_unreachable'), 0)
    const firing = receiver.bodies.filter((b) => (b as { status: string }).status === 'firing') as {
      alerts: { labels: Record<string, string>; annotations: Record<string, string> }[]
    }[]
    const forLeak = firing.filter((b) => b.alerts[0].labels.finding === leakKey)
    assert.equal(forLeak.length, 1, 'one webhook for the leak, however often it recurs')
    const body = forLeak[0] as unknown as Record<string, unknown>
    assert.equal(body.version, '4')
    assert.deepEqual(
      { ...forLeak[0].alerts[0].labels, target: undefined },
      {
        alertname: 'KvfenceCrossTenantLeak',
        severity: 'critical',
        verdict: 'leak',
        class: 'content-leak',
        probe,
        finding: leakKey,
        target: undefined,
      },
    )
    assert.equal(forLeak[0].alerts[0].labels.target, standIn.url)
    assert.equal(
      (JSON.parse(forLeak[0].alerts[0].annotations.evidence) as { canary: string }).canary,
      evidence.canary,
    )
    const keys = firing.map((b) => b.alerts[0].labels.finding)
    assert.equal(new Set(keys).size, keys.length, 'no alert fired twice')
    assertNoKeys(JSON.stringify(watch.lines) + watch.stderr() + JSON.stringify(receiver.bodies))
  })
})

describe('kvfence watch against a safe stand-in', () => {
  test('no finding, clean cycles, and never more requests or tokens than the hourly budget', async (t) => {
    const standIn = await startStandIn('safe')
    const watch = startWatch(
      [
        '--target',
        standIn.url,
        ...tenantFlags,
        ...fastCycles,
        '--max-requests-per-hour',
        '40',
        '--max-tokens-per-hour',
        '3000',
      ],
      env,
    )
    t.after(async () => {
      watch.child.kill('SIGKILL')
      await standIn.close()
    })
    await watch.waitFor(isCycle('clean'), 60_000, 'of a clean cycle')
    await watch.waitFor(
      (l) => isCycle('skipped')(l) && String(l.reason).includes('hourly budget'),
      60_000,
      'of a cycle skipped for the budget',
    )
    // More cycles come and are skipped: nothing more is sent.
    const numSkipped = watch.lines.filter(isCycle('skipped')).length
    await watch.waitFor(
      (l) => l.msg === 'cycle' && watch.lines.filter(isCycle('skipped')).length >= numSkipped + 3,
      30_000,
      'three more skipped cycles',
    )
    const metrics = await scrape(await watch.metricsUrl())
    assert.ok(standIn.stats.numRequests <= 40, `${standIn.stats.numRequests} requests > 40`)
    assert.equal(
      metricValue(metrics, 'kvfence_watch_requests_sent_total'),
      standIn.stats.numRequests,
    )
    assert.ok(metricValue(metrics, 'kvfence_watch_tokens_spent_total')! <= 3000)
    assert.ok(
      metricValue(metrics, 'kvfence_watch_budget_spent_last_hour', { resource: 'requests' })! <= 40,
    )
    assert.ok(metricValue(metrics, 'kvfence_watch_cycles_total', { outcome: 'clean' })! >= 1)
    assert.equal(metricValue(metrics, 'kvfence_watch_capacity_gap_tokens'), 0)
    // Every prompt over the limit was refused: no follow-up round ran.
    assert.deepEqual(
      watch.lines.filter((l) => l.msg === 'cycle' && l.followUps !== undefined),
      [],
    )
    assert.deepEqual(
      watch.lines.filter((l) => l.msg === 'finding'),
      [],
    )
    const start = watch.lines.find((l) => String(l.msg).startsWith('watch started'))!
    assert.match(start.msg, /one cycle costs at most \d+ requests and \d+ tokens/)
  })
})

describe('kvfence watch against a stand-in failing valid requests', () => {
  // The stand-in fails every valid completion with the given status (its prompts that cannot fit
  // are still refused with 400): a broken decode path (500) is an availability warning, once; an
  // endpoint shedding load (503) says so on purpose and is none.
  for (const [status, isFinding] of [
    [500, true],
    [503, false],
  ] as const) {
    test(`every valid completion answered ${status}: ${isFinding ? 'one availability warning' : 'no finding'}, and the cycles stay inconclusive`, async (t) => {
      const standIn = await startStandIn('safe', { failValid: { status, every: 1 } })
      const watch = startWatch(
        ['--target', standIn.url, ...tenantFlags, ...fastCycles, ...ampleBudget],
        env,
      )
      t.after(async () => {
        watch.child.kill('SIGKILL')
        await standIn.close()
      })
      await watch.waitFor(
        (l) => isCycle('inconclusive')(l) && Number(l.cycle) >= 3,
        60_000,
        'of a third inconclusive cycle',
      )
      const findings = watch.lines.filter((l) => l.msg === 'finding')
      if (!isFinding) return assert.deepEqual(findings, [])
      assert.deepEqual(
        findings.map((l) => [l.finding, l.verdict, l.probe, l.level]),
        [['warning:availability', 'warning', 'availability', 40]],
      )
      const evidence = findings[0].evidence as Record<string, unknown>
      // Every valid completion of the cycle failed: the plant, the look and whatever was drawn.
      assert.equal(evidence.numFailed, evidence.numValidSent)
      assert.deepEqual(evidence.failedBy, { 'HTTP 500 transfer_failed': evidence.numFailed })
      assert.ok(!watch.lines.some(isCycle('clean')) && !watch.lines.some(isCycle('finding')))
    })
  }
})

describe('kvfence watch with a key the endpoint refuses', () => {
  test("at start: the process exits 2 with the audit's one line, and no completion is sent", async () => {
    const standIn = await startStandIn('safe')
    const watch = startWatch(
      [
        '--target',
        standIn.url,
        '--tenant',
        `alice=${tenantKeys.alice}`,
        '--tenant',
        'bob=env:KVFENCE_TEST_BOB_KEY',
        ...fastCycles,
        ...ampleBudget,
      ],
      { KVFENCE_TEST_BOB_KEY: 'sk-not-a-key-of-this-endpoint' },
    )
    try {
      assert.deepEqual(await watch.exited, { code: 2, signal: null })
      assert.equal(
        watch.stderr(),
        "kvfence watch: tenant bob's key was refused by the target (HTTP 401)\n",
      )
      assert.deepEqual(standIn.stats.paths, ['GET /v1/models', 'GET /v1/models'])
    } finally {
      watch.child.kill('SIGKILL')
      await standIn.close()
    }
  })

  test('revoked while it runs: the inconclusive cycles name the tenant whose key was refused', async (t) => {
    // A trial's wrong key for one tenant gave "no other tenant's answer was read whole" and "the
    // plant was not accepted (401)": nothing said which key, or that it was a key.
    const standIn = await startStandIn('safe')
    const watch = startWatch(
      ['--target', standIn.url, ...tenantFlags, ...fastCycles, ...ampleBudget],
      env,
    )
    t.after(async () => {
      watch.child.kill('SIGKILL')
      await standIn.close()
    })
    await watch.waitFor(isCycle('clean'), 60_000, 'of a clean cycle')
    standIn.revokeKey!(tenantKeys.bob)
    const numBefore = watch.lines.length
    await watch.waitFor(
      (l) => isCycle('inconclusive')(l) && watch.lines.indexOf(l) >= numBefore,
      60_000,
      'of an inconclusive cycle after the revocation',
    )
    const reasons = new Set(
      watch.lines
        .slice(numBefore)
        .filter(isCycle('inconclusive'))
        .map((l) => l.reason),
    )
    assert.deepEqual(
      [...reasons],
      ["bob's key was refused (HTTP 401): check the key and that the endpoint has this tenant"],
    )
  })
})

describe('kvfence watch as a service', () => {
  test('an endpoint that is down is unreachable (metric, log line), and watched again once it is back', async (t) => {
    const standIn = await startStandIn('safe')
    const url = await unreachableUrl()
    const port = Number(new URL(url).port)
    const watch = startWatch(['--target', url, ...tenantFlags, ...fastCycles, ...ampleBudget], env)
    const sockets = new Set<Socket>()
    const forwarder = createServer((socket) => {
      const upstream = connect(Number(new URL(standIn.url).port), '127.0.0.1')
      sockets.add(socket).add(upstream)
      socket.pipe(upstream).pipe(socket)
      socket.on('error', () => upstream.destroy())
      upstream.on('error', () => socket.destroy())
    })
    t.after(async () => {
      watch.child.kill('SIGKILL')
      for (const s of sockets) s.destroy()
      await new Promise((r) => forwarder.close(r))
      await standIn.close()
    })
    const down = await watch.waitFor((l) => l.msg === 'target unreachable', 30_000, 'unreachable')
    assert.match(String(down.reason), /ECONNREFUSED/)
    const metricsUrl = await watch.metricsUrl()
    const during = await scrape(metricsUrl)
    assert.equal(metricValue(during, 'kvfence_watch_target_unreachable'), 1)
    assert.ok(metricValue(during, 'kvfence_watch_cycles_total', { outcome: 'unreachable' })! >= 1)
    await new Promise<void>((resolve) => forwarder.listen(port, '127.0.0.1', resolve))
    await watch.waitFor((l) => l.msg === 'target reachable again', 30_000, 'reachable again')
    const clean = await watch.waitFor(isCycle('clean'), 30_000, 'of a clean cycle')
    assert.ok((clean.cycle as number) > (down.cycle as number))
    const onceBack = await scrape(metricsUrl)
    assert.equal(metricValue(onceBack, 'kvfence_watch_target_unreachable'), 0)
    assert.equal(watch.child.exitCode, null, 'still running')
  })

  test('SIGTERM mid-cycle: exit 0 at once, the request in flight is cut', async (t) => {
    // 2 s per generated token: a plant (16 tokens) takes ~32 s, so an exit within the hang
    // bound below (generous for a loaded machine) can only be the cycle abandoned mid-way.
    const standIn = await startStandIn('safe', { tokenDelayMs: 2000 })
    const watch = startWatch(
      ['--target', standIn.url, ...tenantFlags, ...fastCycles, ...ampleBudget],
      env,
    )
    t.after(async () => {
      watch.child.kill('SIGKILL')
      await standIn.close()
    })
    const until = Date.now() + 30_000
    while (
      !standIn.stats.paths.some((p) => p.startsWith('POST /v1/completions')) ||
      standIn.stats.numInFlight === 0
    ) {
      assert.ok(Date.now() < until, 'no completion in flight within 30 s')
      await new Promise((r) => setTimeout(r, 20))
    }
    const signalledAt = Date.now()
    watch.child.kill('SIGTERM')
    const { code } = await watch.exited
    const exitMs = Date.now() - signalledAt
    assert.equal(code, 0)
    assert.ok(exitMs < 15_000, `took ${exitMs} ms to end`)
    const cutUntil = Date.now() + 2_000
    while (standIn.stats.numInFlight > 0 && Date.now() < cutUntil)
      await new Promise((r) => setTimeout(r, 20))
    assert.equal(standIn.stats.numInFlight, 0, 'the request in flight was cut')
    assert.deepEqual(
      watch.lines.slice(-2).map((l) => l.msg),
      ['stopping', 'watch stopped'],
    )
  })
})

describe('kvfence watch refuses bad input with one line and exit 2', () => {
  const run = (args: string[]): Promise<{ code: number | null; stderr: string }> =>
    new Promise((resolve) => {
      execFile(
        process.execPath,
        [cliPath, 'watch', ...args],
        { env: { ...process.env, ...env }, timeout: 30_000 },
        (err, _stdout, stderr) =>
          resolve({
            code: err && typeof err.code === 'number' ? err.code : err ? null : 0,
            stderr,
          }),
      )
    })
  const cases: [string, string[], RegExp][] = [
    [
      'a bad URL',
      ['--target', 'not a url', ...tenantFlags],
      /^kvfence watch: target "not a url" is not a URL$/,
    ],
    [
      'one tenant',
      ['--target', 'http://127.0.0.1:1', '--tenant', `alice=${tenantKeys.alice}`],
      /^kvfence watch: need at least two tenants/,
    ],
    [
      'a zero budget',
      ['--target', 'http://127.0.0.1:1', ...tenantFlags, '--max-tokens-per-hour', '0'],
      /^kvfence watch: --max-tokens-per-hour must be an integer from 1 to 1000000000000, got "0"$/,
    ],
    [
      'a budget that is not a number',
      ['--target', 'http://127.0.0.1:1', ...tenantFlags, '--max-requests-per-hour', 'lots'],
      /^kvfence watch: --max-requests-per-hour must be an integer from 1 to 1000000000, got "lots"$/,
    ],
    // Below one cycle's least cost (the figures a fresh-user trial read in the skip line of a
    // watch that skipped every cycle for ever): refused at start.
    [
      'an hourly token budget below one cycle',
      ['--target', 'http://127.0.0.1:1', ...tenantFlags, '--max-tokens-per-hour', '1'],
      /^kvfence watch: --max-tokens-per-hour 1 cannot pay for one cycle: a cycle needs at least 489 tokens /,
    ],
    [
      'an hourly request budget below one cycle',
      ['--target', 'http://127.0.0.1:1', ...tenantFlags, '--max-requests-per-hour', '8'],
      /^kvfence watch: --max-requests-per-hour 8 cannot pay for one cycle: a cycle needs at least 9 requests /,
    ],
    // Out of range: the line names the flag and echoes the value as typed (not 1e20).
    ...(
      [
        ['--cycle-seconds', '86401', 'a number from 0.1 to 86400'],
        ['--cycle-seconds', '99999999999999999999', 'a number from 0.1 to 86400'],
        ['--request-timeout-seconds', '3000000', 'an integer from 1 to 3600'],
        ['--resolve-after-cycles', '99999999999', 'an integer from 1 to 100000'],
        ['--metrics-port', '70000', 'an integer from 0 to 65535'],
      ] as const
    ).map(([flag, value, range]): [string, string[], RegExp] => [
      `${flag} ${value}`,
      ['--target', 'http://127.0.0.1:1', ...tenantFlags, flag, value],
      new RegExp(`^kvfence watch: ${flag} must be ${range}, got "${value}"$`),
    ]),
  ]
  test('a metrics port already taken', async (t) => {
    const taken = createServer()
    await new Promise<void>((resolve) => taken.listen(0, '127.0.0.1', resolve))
    t.after(() => new Promise((r) => taken.close(r)))
    const port = String((taken.address() as { port: number }).port)
    const { code, stderr } = await run([
      '--target',
      'http://127.0.0.1:1',
      ...tenantFlags,
      '--metrics-port',
      port,
    ])
    assert.equal(code, 2, stderr)
    assert.equal(stderr, `kvfence watch: cannot serve metrics on 127.0.0.1:${port}: EADDRINUSE\n`)
  })
  for (const [what, args, pattern] of cases) {
    test(what, async () => {
      const { code, stderr } = await run(args)
      assert.equal(code, 2, stderr)
      const lines = stderr.trimEnd().split('\n')
      assert.equal(lines.length, 1, stderr)
      assert.match(lines[0], pattern)
      assertNoKeys(stderr)
    })
  }
})

describe('kvfence watch --config: the audit config with a watch: section', () => {
  const dir = mkdtempSync(join(tmpdir(), 'kvfence-watch-config-'))
  const write = (name: string, text: string): string => {
    const file = join(dir, name)
    writeFileSync(file, text)
    return file
  }
  const tenantsYaml =
    'tenants:\n  - { name: alice, keyEnv: KVFENCE_TEST_ALICE_KEY }\n  - { name: bob, keyEnv: KVFENCE_TEST_BOB_KEY }\n'
  const configEnv = { ...env, KVFENCE_TEST_ALICE_KEY: tenantKeys.alice }
  after(() => rmSync(dir, { recursive: true, force: true }))

  test('tenants, target and the watch section come from the file', async (t) => {
    const standIn = await startStandIn('safe')
    const file = write(
      'watch.yaml',
      `target: ${standIn.url}\n${tenantsYaml}seed: 5\nwatch:\n  cycleSeconds: 0.3\n  metricsPort: 0\n  maxTokensPerHour: 100000000\n  maxRequestsPerHour: 1000000\n`,
    )
    const watch = startWatch(['--config', file], configEnv)
    t.after(async () => {
      watch.child.kill('SIGKILL')
      await standIn.close()
    })
    const start = await watch.waitFor((l) => 'cycleSeconds' in l, 30_000, 'of the start')
    assert.deepEqual(
      [start.target, start.tenants, start.seed, start.cycleSeconds, start.budget],
      [
        standIn.url,
        ['alice', 'bob'],
        5,
        0.3,
        { maxTokensPerHour: 100000000, maxRequestsPerHour: 1000000 },
      ],
    )
    await watch.waitFor(isCycle('clean'), 30_000, 'of a clean cycle')
  })

  test('a bad watch section or a key in the file: one line, exit 2', async () => {
    const bad = write(
      'bad.yaml',
      `target: http://127.0.0.1:1\n${tenantsYaml}watch:\n  cycleSeconds: fast\n`,
    )
    const keyed = write(
      'keyed.yaml',
      'target: http://127.0.0.1:1\ntenants:\n  - { name: alice, key: sk-in-a-file }\n  - { name: bob, keyEnv: KVFENCE_TEST_BOB_KEY }\n',
    )
    for (const [file, pattern] of [
      [bad, /^kvfence watch: config .*bad\.yaml: watch\.cycleSeconds: /],
      [keyed, /^kvfence watch: config .*keyed\.yaml: tenants\.0: a key is never read from a file/],
      [
        write(
          'range.yaml',
          `target: http://127.0.0.1:1\n${tenantsYaml}watch:\n  cycleSeconds: 86401\n`,
        ),
        /^kvfence watch: config .*range\.yaml: watch\.cycleSeconds: must be a number from 0\.1 to 86400\n$/,
      ],
    ] as const) {
      const run = startWatch(['--config', file], configEnv)
      const { code } = await run.exited
      assert.equal(code, 2, run.stderr())
      assert.equal(run.stderr().trimEnd().split('\n').length, 1, run.stderr())
      assert.match(run.stderr(), pattern)
    }
  })
})
