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
  limitMarkers,
  parseAuditConfig,
  plotData,
  readChartJs,
  runAudit,
  type AuditReport,
  type Finding,
} from '../../src/audit/index.js'
import { standInTenants, startStandIn, tenantKeys } from './standins.js'

const chromium = '/usr/bin/chromium'

/** What {@link inChromium} reads from the page: per canvas, its painted pixels and its chart's
 *  datasets (label, colour, points, and `areaPixels`: pixels inside the chart area, legend and
 *  axes left out, of exactly the dataset's colour); the tenant matrix's cells. */
interface PageCheck {
  charts: {
    id: string
    painted: number
    datasets:
      { label: string; color: unknown; points: [unknown, unknown][]; areaPixels: number }[] | null
  }[]
  cells: [string, string, number][]
}

/** Opens `html` (written to `file`) in headless Chromium with the network off and returns what
 *  a script run in the page after load found (see {@link PageCheck}). */
async function inChromium(html: string, file: string): Promise<PageCheck> {
  const checker = `<script>addEventListener('load', () => {
    const charts = [...document.querySelectorAll('canvas')].map((c) => {
      const px = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
      let painted = 0;
      for (let i = 3; i < px.length; i += 4) if (px[i] !== 0) painted++;
      const chart = Chart.getChart(c);
      const inArea = (color) => {
        const m = /^#([0-9a-f]{2})([0-9a-f]{2})([0-9a-f]{2})$/i.exec(color);
        if (!m || !chart) return 0;
        const [r, g, b] = m.slice(1).map((h) => parseInt(h, 16));
        const { left, right, top, bottom } = chart.chartArea;
        const ratio = c.width / chart.width;
        let n = 0;
        for (let y = Math.ceil(top * ratio); y < Math.floor(bottom * ratio); y++)
          for (let x = Math.ceil(left * ratio); x < Math.floor(right * ratio); x++) {
            const i = (y * c.width + x) * 4;
            if (px[i] === r && px[i + 1] === g && px[i + 2] === b && px[i + 3] === 255) n++;
          }
        return n;
      };
      const datasets = chart ? chart.data.datasets.map((d) => ({ label: d.label, color: d.backgroundColor, points: d.data.map((p) => [p.x, p.y]), areaPixels: inArea(d.backgroundColor) })) : null;
      return { id: c.id, painted, datasets };
    });
    const cells = [...document.querySelectorAll('#tenant-matrix td')].map((td) => [td.dataset.observer, td.dataset.source, Number(td.textContent)]);
    const pre = document.createElement('pre');
    pre.id = 'kvfence-check';
    pre.textContent = JSON.stringify({ charts, cells });
    document.body.appendChild(pre);
  });</script>`
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
  const unescape = (text: string) =>
    text
      .replace(/&quot;/g, '"')
      .replace(/&lt;/g, '<')
      .replace(/&gt;/g, '>')
      .replace(/&amp;/g, '&')
  return JSON.parse(unescape(check[1])) as PageCheck
}

function finding(probe: Finding['probe'], verdict: Finding['verdict'], title: string): Finding {
  return { probe, verdict, severity: 'info', title, evidence: {}, remediation: 'fix <it> & "go"' }
}

const handMade: AuditReport = {
  schemaVersion: 2,
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
  test('default gate: the content leak fails, the warning passes, inconclusive is skipped', () => {
    const xml = formatJunitReport(handMade)
    assert.match(
      xml,
      /^<\?xml version="1\.0" encoding="UTF-8"\?>\n<testsuites name="kvfence audit" tests="4" failures="1" errors="0" skipped="1" time="12\.345">/,
    )
    assert.match(
      xml,
      /<testcase classname="kvfence\.audit" name="boundary" time="1\.500">\n {6}<system-out>\[warning\/info\] misconfiguration CWE-1284 CWE-20: accepted 385 &gt; 384/,
    )
    assert.match(
      xml,
      /<testcase classname="kvfence\.audit" name="canary" time="2\.000">\n {6}<failure type="content-leak" message="bob's output held alice's canary">/,
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
    assert.match(xml, /<failure type="misconfiguration" message="accepted 385 &gt; 384">/)
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
      failOn: ['warning'],
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
        probes: ['capacity', 'boundary', 'canary', 'page-leak', 'prefix-timing'],
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
      data.boundary?.sizes.map((b) => [b.promptTokens, b.status, b.meaning]),
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

  test("headless Chromium draws every chart and the tenant matrix, from the report's data", async (t) => {
    if (!existsSync(chromium)) {
      t.skip(`${chromium} is not installed (apt-get install -y chromium)`)
      return
    }
    const { charts, cells } = await inChromium(html, join(dir, 'report.html'))
    assert.deepEqual(charts.map((c) => c.id).sort(), [
      'boundary-chart',
      'pool-chart',
      'timeline-chart',
      'ttft-chart',
    ])
    for (const c of charts) {
      assert.ok(c.datasets !== null, `${c.id} has a Chart.js chart`)
      assert.ok(c.painted > 2000, `${c.id}: only ${c.painted} painted pixels`)
      // One colour per dataset, so that each legend entry shows the colour of what it names.
      for (const d of c.datasets!) assert.equal(typeof d.color, 'string', `${c.id} ${d.label}`)
    }
    const chart = (id: string) => charts.find((c) => c.id === id)!.datasets!

    // Boundary: outcomes, not HTTP statuses, as the height; the limits drawn as markers.
    const boundaryEvidence = report.findings.find((f) => f.probe === 'boundary')!.evidence as {
      sizes: { promptTokens: number; status: number; outcome: string; mustReject: boolean }[]
    }
    const boundary = chart('boundary-chart')
    const outcomes = boundary
      .filter((d) => !/tokens$/.test(d.label))
      .flatMap((d) => d.points.map(([x, y]) => [x, y, d.label]))
      .sort((a, b) => (a[0] as number) - (b[0] as number))
    assert.deepEqual(
      outcomes,
      boundaryEvidence.sizes.map((s, i) => [
        i,
        s.outcome === 'accepted' ? 'accepted (200)' : 'refused (4xx)',
        s.outcome === 'rejected'
          ? 'refused with a 4xx'
          : s.mustReject
            ? 'accepted over the limit (the incident)'
            : 'accepted, fits',
      ]),
    )
    // Six sizes (slots 0–5): the pool between 384 and 385, the context between 1024 and 1025;
    // each marker seen in the chart area in its own colour.
    const limits = boundary.filter((d) => /tokens$/.test(d.label))
    assert.deepEqual(
      limits.map((d) => [d.label, d.points[0][0]]),
      [
        ['KV pool: 384 tokens', 1.5],
        ['advertised context: 1024 tokens', 4.5],
      ],
    )
    for (const d of limits) assert.ok(d.areaPixels > 20, `${d.label}: ${d.areaPixels} pixels`)

    // Pool usage: exactly the samples page-leak read, as points, and its baseline.
    const pageLeak = report.findings.find((f) => f.probe === 'page-leak')!.evidence as {
      samples: { tMs: number; used: number }[]
    }
    const readings = chart('pool-chart').filter((d) => d.label.endsWith('readings (pages)'))
    assert.deepEqual(
      readings.flatMap((d) => d.points).sort((a, b) => (a[0] as number) - (b[0] as number)),
      pageLeak.samples.map((s) => [s.tMs, s.used]).sort((a, b) => a[0] - b[0]),
    )
    assert.ok(pageLeak.samples.length >= 8, `only ${pageLeak.samples.length} pool samples`)

    // Matrix: bob's answers that held alice's canaries, as the canary findings count them.
    const canary = report.findings.filter((f) => f.probe === 'canary' && f.verdict === 'leak')
    const numLeaking = canary[0].evidence.numLeakingRequests as number
    assert.ok(numLeaking >= 1)
    assert.deepEqual(cells, [
      ['alice', 'alice', 0],
      ['alice', 'bob', 0],
      ['bob', 'alice', numLeaking],
      ['bob', 'bob', 0],
    ])

    // Timeline: every completion once per tenant, the leaking ones marked on bob's row.
    const timeline = chart('timeline-chart')
    const marked = timeline.find((d) => d.label === 'held foreign material')!.points
    assert.equal(marked.length, numLeaking)
    assert.ok(marked.every(([, y]) => y === 'bob'))
    const drawn = timeline.filter((d) => d.label !== 'held foreign material')
    assert.equal(
      drawn.reduce((n, d) => n + d.points.length, 0),
      report.completions.length,
    )
  })

  test('a report without plot data says so instead of drawing empty charts', async () => {
    const bare = formatHtmlReport(handMade, '/* no chart library needed */')
    for (const id of [
      'ttft-chart',
      'boundary-chart',
      'pool-chart',
      'timeline-chart',
      'tenant-matrix',
    ]) {
      assert.ok(bare.includes(`id="${id}-none"`), id)
      assert.ok(!bare.includes(`<canvas id="${id}"`), id)
    }
    assert.match(bare, /LEAK: data crossed tenants/)
  })
})

/** A report whose only finding is a boundary one, with these sizes (accepted up to `fitsUpTo`
 *  tokens, refused past it) and limits. */
function boundaryReport(
  promptTokens: readonly number[],
  fitsUpTo: number,
  poolTokens: number,
  contextTokens: number,
): AuditReport {
  const sizes = promptTokens.map((t) => ({
    labels: `${t}`,
    promptTokens: t,
    status: t <= fitsUpTo ? 200 : 400,
    outcome: t <= fitsUpTo ? 'accepted' : 'rejected',
    mustReject: t > Math.min(poolTokens, contextTokens),
  }))
  return {
    ...handMade,
    findings: [
      {
        ...finding('boundary', 'clean', 'every size over a limit was refused'),
        evidence: { sizes, poolTokens, contextTokens },
      },
    ],
  }
}

describe('the boundary chart shows both limits, whatever they are', () => {
  test('limitMarkers: apart, equal, or between the same two sizes', () => {
    const sizes = [383, 384, 385, 1023, 1024, 1025]
    assert.deepEqual(limitMarkers(sizes, 384, 1024), [
      { label: 'KV pool: 384 tokens', x: 1.5, color: '#6a3d9a' },
      { label: 'advertised context: 1024 tokens', x: 4.5, color: '#ff7f0e' },
    ])
    // Equal: one marker naming both (two would be drawn one over the other).
    assert.deepEqual(limitMarkers([383, 384, 385], 384, 384), [
      { label: 'KV pool = context window: 384 tokens', x: 1.5, color: '#6a3d9a' },
    ])
    // 384 and 386 both fall between 384 and 390 (slot 1.5): side by side, the smaller left,
    // 0.24 slots apart.
    assert.deepEqual(limitMarkers([383, 384, 390], 384, 386), [
      { label: 'KV pool: 384 tokens', x: 1.38, color: '#6a3d9a' },
      { label: 'advertised context: 386 tokens', x: 1.62, color: '#ff7f0e' },
    ])
    assert.deepEqual(limitMarkers([383, 384, 390], 386, 384), [
      { label: 'KV pool: 386 tokens', x: 1.62, color: '#6a3d9a' },
      { label: 'advertised context: 384 tokens', x: 1.38, color: '#ff7f0e' },
    ])
    assert.deepEqual(limitMarkers([383, 384], null, 384), [
      { label: 'advertised context: 384 tokens', x: 1.5, color: '#ff7f0e' },
    ])
    assert.deepEqual(limitMarkers([383, 384], null, null), [])
  })

  test('headless Chromium: pool = context is one labelled marker; two limits between the same sizes are both seen', async (t) => {
    if (!existsSync(chromium)) {
      t.skip(`${chromium} is not installed (apt-get install -y chromium)`)
      return
    }
    const dir = await mkdtemp(join(tmpdir(), 'kvfence-limits-'))
    try {
      const chartJs = await readChartJs()
      const limitsOf = async (report: AuditReport, name: string) => {
        const { charts } = await inChromium(formatHtmlReport(report, chartJs), join(dir, name))
        const boundary = charts.find((c) => c.id === 'boundary-chart')!.datasets!
        return boundary
          .filter((d) => /tokens$/.test(d.label))
          .map((d) => ({ label: d.label, x: d.points[0][0], areaPixels: d.areaPixels }))
      }
      const equal = await limitsOf(boundaryReport([383, 384, 385, 1024], 384, 384, 384), 'eq.html')
      assert.deepEqual(
        equal.map((m) => [m.label, m.x]),
        [['KV pool = context window: 384 tokens', 1.5]],
      )
      assert.ok(equal[0].areaPixels > 20, `${equal[0].areaPixels} pixels`)
      // Was: the context's marker drawn over the pool's at the same x, the pool's unseen.
      const close = await limitsOf(boundaryReport([383, 384, 390, 1024], 384, 384, 386), 'c.html')
      assert.deepEqual(
        close.map((m) => [m.label, m.x]),
        [
          ['KV pool: 384 tokens', 1.38],
          ['advertised context: 386 tokens', 1.62],
        ],
      )
      for (const m of close) assert.ok(m.areaPixels > 20, `${m.label}: ${m.areaPixels} pixels`)
    } finally {
      await rm(dir, { recursive: true, force: true })
    }
  })
})
