/** The reports: JUnit XML (a test case per probe, failing exactly when the exit code is 1), the YAML
 *  config file, and the self-contained HTML report, which a headless Chromium opens with the network
 *  off to check that the three plots were drawn (canvases with painted pixels). */
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { existsSync } from 'node:fs'
import { mkdtemp, rm, writeFile } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { after, before, describe, test } from 'node:test'
import {
  AuditError,
  formatHtmlReport,
  formatJunitReport,
  parseAuditConfig,
  plotData,
  readChartJs,
  runAudit,
  type AuditReport,
  type Finding,
} from '../../src/audit/index.js'
import { standInTenants, startStandIn, tenantKeys } from './standins.js'

const chromium = '/usr/bin/chromium'

function finding(probe: Finding['probe'], verdict: Finding['verdict'], title: string): Finding {
  return { probe, verdict, severity: 'info', title, evidence: {}, remediation: 'fix <it> & "go"' }
}

const handMade: AuditReport = {
  schemaVersion: 1,
  tool: 'kvfence audit',
  target: 'http://127.0.0.1:8000',
  model: 'tiny-echo',
  startedAt: '2026-11-30T10:00:00.000Z',
  durationMs: 12_345,
  seed: 7,
  budget: { maxRequests: 300, maxSeconds: 300, concurrency: 4 },
  requestsSent: 42,
  probeRuns: [
    {
      probe: 'capacity',
      durationMs: 10,
      requestsSent: 0,
      completions: { sent: 0, answered: 0, refused: 0, failed: 0, cut: 0 },
      inconclusiveReasons: [],
    },
    {
      probe: 'boundary',
      durationMs: 1500,
      requestsSent: 8,
      completions: { sent: 8, answered: 4, refused: 4, failed: 0, cut: 0 },
      inconclusiveReasons: [],
    },
    {
      probe: 'canary',
      durationMs: 2000,
      requestsSent: 20,
      completions: { sent: 20, answered: 14, refused: 6, failed: 0, cut: 0 },
      inconclusiveReasons: [],
    },
    {
      probe: 'page-leak',
      durationMs: 250,
      requestsSent: 3,
      completions: { sent: 0, answered: 0, refused: 0, failed: 0, cut: 0 },
      inconclusiveReasons: ['no usage exposed'],
    },
  ],
  findings: [
    finding('capacity', 'clean', 'fits'),
    finding('boundary', 'warning', 'accepted 385 > 384'),
    finding('canary', 'leak', "bob's output held alice's canary"),
    finding('canary', 'leak', 'again'),
    finding('page-leak', 'inconclusive', 'no usage exposed'),
  ],
  completions: [],
}

describe('JUnit XML report', () => {
  test('default --fail-on leak: the leak fails, the warning passes, inconclusive is skipped', () => {
    const xml = formatJunitReport(handMade)
    assert.match(
      xml,
      /^<\?xml version="1\.0" encoding="UTF-8"\?>\n<testsuites name="kvfence audit" tests="4" failures="1" errors="0" skipped="1" time="12\.345">/,
    )
    assert.match(
      xml,
      /<testcase classname="kvfence\.audit" name="boundary" time="1\.500">\n {6}<system-out>\[warning\/info\] accepted 385 &gt; 384/,
    )
    assert.match(
      xml,
      /<testcase classname="kvfence\.audit" name="canary" time="2\.000">\n {6}<failure type="leak" message="bob's output held alice's canary">/,
    )
    assert.match(
      xml,
      /<testcase classname="kvfence\.audit" name="page-leak" time="0\.250">\n {6}<skipped message="inconclusive: no usage exposed"\/>/,
    )
    assert.match(xml, /fix: fix &lt;it&gt; &amp; &quot;go&quot;/)
    assert.match(xml, /<property name="seed" value="7"\/>/)
  })

  test('--fail-on inconclusive: the warning fails and inconclusive is an error', () => {
    const xml = formatJunitReport(handMade, 'inconclusive')
    assert.match(xml, /tests="4" failures="2" errors="1" skipped="0"/)
    assert.match(xml, /<failure type="warning" message="accepted 385 &gt; 384">/)
    assert.match(xml, /<error type="inconclusive" message="no usage exposed">/)
  })
})

describe('YAML config', () => {
  const env = { A_KEY: 'sk-a-1234', B_KEY: 'sk-b-5678' }

  test('reads target, tenants (keys from the environment), probes, budget, seed, reports', () => {
    const config = parseAuditConfig(
      [
        'target: http://10.0.0.1:8000',
        'tenants:',
        '  - { name: alice, keyEnv: A_KEY }',
        '  - { name: bob, keyEnv: B_KEY }',
        'probes: [capacity, prefix-timing]',
        'budget: { maxRequests: 50, maxSeconds: 30, concurrency: 8 }',
        'seed: 99',
        'failOn: warning',
        'reports: { junit: out.xml }',
      ].join('\n'),
      'audit.yaml',
      env,
    )
    assert.deepEqual(config, {
      target: 'http://10.0.0.1:8000',
      model: undefined,
      tenants: [
        { name: 'alice', key: 'sk-a-1234' },
        { name: 'bob', key: 'sk-b-5678' },
      ],
      probes: ['capacity', 'prefix-timing'],
      maxRequests: 50,
      maxSeconds: 30,
      concurrency: 8,
      seed: 99,
      failOn: 'warning',
      reports: { junit: 'out.xml' },
    })
  })

  test('a bad file is one clear AuditError naming the file and the field, never a key', () => {
    const bad = (text: string, pattern: RegExp) =>
      assert.throws(
        () => parseAuditConfig(text, 'a.yaml', env),
        (err: unknown) =>
          err instanceof AuditError && pattern.test(err.message) && !err.message.includes('sk-'),
      )
    bad('probes: [canary, nope]', /^config a\.yaml: probes\.1: /)
    bad('budget: { maxRequests: 0 }', /^config a\.yaml: budget\.maxRequests: /)
    bad(
      'tenants: [{ name: alice, key: sk-a-1234 }]',
      /^config a\.yaml: tenants\.0: a key is never read from a file; put it in an environment variable named by keyEnv$/,
    )
    bad(
      'tenants: [{ name: carol, keyEnv: C_KEY }]',
      /^config a\.yaml: tenant carol: environment variable C_KEY is not set$/,
    )
    bad('target: [unclosed', /^config a\.yaml is not valid YAML: /)
    bad('colour: blue', /^config a\.yaml: \(top level\): /)
  })
})

describe('HTML report', () => {
  let report: AuditReport
  let html: string
  let dir: string
  before(async () => {
    dir = await mkdtemp(join(tmpdir(), 'kvfence-html-'))
    const standIn = await startStandIn('leaky', { prefixCache: 'shared', tokenDelayMs: 2 })
    try {
      report = await runAudit({
        target: standIn.url,
        tenants: standInTenants,
        seed: 5,
        probes: ['capacity', 'boundary', 'page-leak', 'prefix-timing'],
      })
    } finally {
      await standIn.close()
    }
    html = formatHtmlReport(report, await readChartJs())
  })
  after(async () => rm(dir, { recursive: true, force: true }))

  test('is one self-contained file: Chart.js inlined, no external script, style, image or font', () => {
    assert.match(html, /^<!doctype html>/)
    assert.ok(html.includes('Chart.js v4.'), 'Chart.js is inlined')
    assert.doesNotMatch(html, /<(script|img|link|iframe)[^>]+(src|href)=/i)
    assert.doesNotMatch(html, /url\(/)
    for (const key of Object.values(tenantKeys)) assert.ok(!html.includes(key))
  })

  test('carries the data of all three plots, from the findings', () => {
    const data = plotData(report)
    assert.equal(data.ttft?.length, 4)
    assert.deepEqual(
      data.boundary?.map((b) => [b.promptTokens, b.status, b.meaning]),
      [
        [383, 200, 'accepted'],
        [384, 200, 'accepted'],
        [385, 200, 'accepted-over-limit'],
        [1023, 200, 'accepted-over-limit'],
        [1024, 400, 'rejected'],
        [1025, 400, 'rejected'],
      ],
    )
    assert.ok((data.pool?.samples.length ?? 0) >= 3)
  })

  test('headless Chromium draws the three charts (canvases with painted pixels)', async (t) => {
    if (!existsSync(chromium)) {
      t.skip(`${chromium} is not installed (apt-get install -y chromium)`)
      return
    }
    // The check runs in the page after load: it counts painted pixels of every canvas.
    const checker = `<script>addEventListener('load', () => {
      const rows = [...document.querySelectorAll('canvas')].map((c) => {
        const px = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let painted = 0;
        for (let i = 3; i < px.length; i += 4) if (px[i] !== 0) painted++;
        return c.id + '=' + painted + (Chart.getChart(c) ? ':chart' : ':none');
      });
      const pre = document.createElement('pre');
      pre.id = 'kvfence-check';
      pre.textContent = rows.join(' ');
      document.body.appendChild(pre);
    });</script>`
    const file = join(dir, 'report.html')
    await writeFile(file, html.replace('</body>', `${checker}</body>`), 'utf8')
    const dom = await new Promise<string>((resolve, reject) =>
      execFile(
        chromium,
        [
          '--headless',
          '--no-sandbox',
          '--disable-gpu',
          '--disable-background-networking',
          '--virtual-time-budget=5000',
          '--dump-dom',
          `file://${file}`,
        ],
        { timeout: 60_000, maxBuffer: 64 * 1024 * 1024 },
        (err, stdout) => (err ? reject(err) : resolve(stdout)),
      ),
    )
    const check = /<pre id="kvfence-check">([^<]*)<\/pre>/.exec(dom)
    assert.ok(check, 'the page ran its scripts')
    const canvases = Object.fromEntries(
      check[1].split(' ').map((row) => {
        const [id, rest] = row.split('=')
        const [painted, chart] = rest.split(':')
        return [id, { painted: Number(painted), chart }]
      }),
    )
    assert.deepEqual(Object.keys(canvases).sort(), ['boundary-chart', 'pool-chart', 'ttft-chart'])
    for (const [id, c] of Object.entries(canvases)) {
      assert.equal(c.chart, 'chart', `${id} has a Chart.js chart`)
      assert.ok(c.painted > 2000, `${id}: only ${c.painted} painted pixels`)
    }
  })

  test('a report without plot data says so instead of drawing empty charts', async () => {
    const bare = formatHtmlReport(handMade, '/* no chart library needed */')
    for (const id of ['ttft-chart', 'boundary-chart', 'pool-chart']) {
      assert.ok(bare.includes(`id="${id}-none"`), id)
      assert.ok(!bare.includes(`<canvas id="${id}"`), id)
    }
    assert.match(bare, /LEAK: data crossed tenants/)
  })
})
