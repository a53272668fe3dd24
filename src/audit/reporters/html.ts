/** The HTML report: one self-contained file (no network access when opened) with the summary, every
 *  finding with its evidence, and three plots drawn by Chart.js, whose UMD build is read from
 *  node_modules when the report is written and inlined into the file:
 *  - TTFT distributions (empirical CDFs of the prefix-timing probe's hit and miss samples, the
 *    curves its Kolmogorov–Smirnov test compares);
 *  - boundary outcomes (HTTP status per prompt size, coloured by what it means);
 *  - KV pool usage over time (the page-leak probe's samples against its idle baseline).
 *  A plot without data says so instead. Evidence holds no key and only redacted outputs. */
import { readFile, writeFile } from 'node:fs/promises'
import { createRequire } from 'node:module'
import { dirname, join } from 'node:path'
import type { AuditReport, Finding } from '../types.js'

/** Chart.js's UMD build (a dependency), as text. */
export async function readChartJs(): Promise<string> {
  const entry = createRequire(import.meta.url).resolve('chart.js')
  return readFile(join(dirname(entry), 'chart.umd.min.js'), 'utf8')
}

/** The data the plots draw, taken from the findings' evidence (null when a probe did not run or
 *  gathered none). */
export interface PlotData {
  readonly ttft: { readonly label: string; readonly samplesMs: readonly number[] }[] | null
  readonly boundary:
    | {
        readonly label: string
        readonly promptTokens: number
        readonly status: number | null
        readonly meaning: 'accepted' | 'accepted-over-limit' | 'rejected' | 'failed'
      }[]
    | null
  readonly pool: {
    readonly unit: string
    readonly baseline: number | null
    readonly samples: readonly { tMs: number; used: number; phase: string }[]
  } | null
}

/** Extracts {@link PlotData} from the findings of `report`. */
export function plotData(report: AuditReport): PlotData {
  const evidenceOf = (probe: string): Record<string, unknown> | null =>
    report.findings.find((f) => f.probe === probe)?.evidence ?? null

  const timing = evidenceOf('prefix-timing') as {
    control?: { ttftMs?: { hit?: number[]; miss?: number[] } }
    cross?: { ttftMs?: { hit?: number[]; miss?: number[] } }
  } | null
  const ttft = [
    {
      label: 'same tenant, prefix reused (control hit)',
      samplesMs: timing?.control?.ttftMs?.hit ?? [],
    },
    {
      label: 'same tenant, fresh prefix (control miss)',
      samplesMs: timing?.control?.ttftMs?.miss ?? [],
    },
    { label: "other tenant's prefix (cross hit)", samplesMs: timing?.cross?.ttftMs?.hit ?? [] },
    { label: 'fresh prefix (cross miss)', samplesMs: timing?.cross?.ttftMs?.miss ?? [] },
  ].filter((s) => s.samplesMs.length > 0)

  const sizes = (evidenceOf('boundary')?.sizes ?? null) as
    | {
        labels: string
        promptTokens: number
        status: number | null
        outcome: string
        mustReject: boolean
      }[]
    | null
  const boundary =
    sizes?.map((s) => ({
      label: `${s.labels} (${s.promptTokens})`,
      promptTokens: s.promptTokens,
      status: s.status,
      meaning:
        s.outcome === 'accepted'
          ? s.mustReject
            ? ('accepted-over-limit' as const)
            : ('accepted' as const)
          : s.outcome === 'rejected'
            ? ('rejected' as const)
            : ('failed' as const),
    })) ?? null

  const leak = evidenceOf('page-leak') as {
    source?: { unit?: string } | null
    baseline?: number | null
    samples?: { tMs: number; used: number; phase: string }[]
  } | null
  const pool =
    leak?.samples && leak.samples.length > 0
      ? { unit: leak.source?.unit ?? '', baseline: leak.baseline ?? null, samples: leak.samples }
      : null

  return {
    ttft: ttft.length > 0 ? ttft : null,
    boundary: boundary && boundary.length > 0 ? boundary : null,
    pool,
  }
}

/** The whole HTML document. `chartJs` is Chart.js's UMD source (see {@link readChartJs}). */
export function formatHtmlReport(report: AuditReport, chartJs: string): string {
  const data = plotData(report)
  const counts = (['leak', 'warning', 'inconclusive', 'clean'] as const).map(
    (v) => `${report.findings.filter((f) => f.verdict === v).length} ${v}`,
  )
  const plot = (id: string, title: string, isPresent: boolean, why: string): string =>
    `<section class="plot"><h3>${esc(title)}</h3>` +
    (isPresent
      ? `<canvas id="${id}" width="720" height="320"></canvas>`
      : `<p class="nodata" id="${id}-none">No data: ${esc(why)}</p>`) +
    '</section>'
  return `<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:">
<title>kvfence audit of ${esc(report.target)}</title>
<style>
body { font: 14px/1.45 system-ui, sans-serif; margin: 2rem auto; max-width: 60rem; color: #222; }
table { border-collapse: collapse; width: 100%; }
td, th { border-bottom: 1px solid #ddd; padding: .3rem .5rem; text-align: left; vertical-align: top; }
.leak { color: #b00020; font-weight: bold; } .warning { color: #b26a00; }
.inconclusive { color: #555; font-style: italic; } .clean { color: #1b7f3b; }
.banner { padding: .6rem 1rem; border-radius: 4px; margin: 1rem 0; font-weight: bold; }
.banner.leak { background: #fde7ea; } .banner.inconclusive { background: #eee; } .banner.clean { background: #e6f4ea; }
pre { background: #f6f6f6; padding: .5rem; overflow-x: auto; font-size: 12px; }
.plot { margin: 1.5rem 0; } .nodata { color: #777; }
</style>
</head>
<body>
<h1>kvfence audit</h1>
<p>Target <code>${esc(report.target)}</code>, model <code>${esc(report.model ?? 'unknown')}</code>, seed ${report.seed},
started ${esc(report.startedAt)}, ${report.requestsSent} requests in ${(report.durationMs / 1000).toFixed(1)} s
(budget ${report.budget.maxRequests} requests, ${report.budget.maxSeconds} s, ${report.budget.concurrency} in flight).</p>
${banner(report)}
<p>${esc(counts.join(', '))}</p>
<h2>Findings</h2>
<table>
<thead><tr><th>probe</th><th>verdict</th><th>severity</th><th>finding</th></tr></thead>
<tbody>
${report.findings.map(row).join('\n')}
</tbody>
</table>
<h2>Plots</h2>
${plot('ttft-chart', 'TTFT distributions (prefix-timing, empirical CDF)', data.ttft !== null, 'the prefix-timing probe gathered no samples')}
${plot('boundary-chart', 'Boundary outcomes (HTTP status per prompt size)', data.boundary !== null, 'the boundary probe sent no sized prompt')}
${plot('pool-chart', 'KV pool usage over time (page-leak)', data.pool !== null, 'the endpoint exposed no pool usage, or page-leak did not run')}
<h2>Evidence</h2>
${report.findings.map(details).join('\n')}
<script>${chartJs.replace(/<\/script/gi, '<\\/script')}</script>
<script>
const data = ${jsonForScript(data)};
${plotScript}
</script>
</body>
</html>
`
}

/** Writes the HTML report to `file` (Chart.js read from node_modules). Throws the file system's
 *  error when the file cannot be written. */
export async function writeHtmlReport(report: AuditReport, file: string): Promise<void> {
  await writeFile(file, formatHtmlReport(report, await readChartJs()), 'utf8')
}

function banner(report: AuditReport): string {
  const has = (v: string) => report.findings.some((f) => f.verdict === v)
  if (has('leak'))
    return '<div class="banner leak">LEAK: data crossed tenants. See the findings below.</div>'
  if (has('inconclusive'))
    return '<div class="banner inconclusive">ISOLATION NOT PROVEN: some probes could not tell.</div>'
  return '<div class="banner clean">No leak found; every probe that could tell passed.</div>'
}

function row(f: Finding): string {
  return `<tr><td>${esc(f.probe)}</td><td class="${f.verdict}">${f.verdict}</td><td>${f.severity}</td><td>${esc(f.title)}</td></tr>`
}

function details(f: Finding, i: number): string {
  return (
    `<details id="finding-${i}"><summary><span class="${f.verdict}">${f.verdict}</span> ${esc(f.probe)}: ${esc(f.title)}</summary>` +
    `<p><b>Remediation:</b> ${esc(f.remediation)}</p>` +
    `<pre>${esc(JSON.stringify(f.evidence, null, 2))}</pre></details>`
  )
}

function esc(text: string): string {
  return text
    .replace(/&/g, '&amp;')
    .replace(/</g, '&lt;')
    .replace(/>/g, '&gt;')
    .replace(/"/g, '&quot;')
}

/** JSON that cannot close the script element it sits in. */
function jsonForScript(value: unknown): string {
  return JSON.stringify(value)
    .replace(/</g, '\\u003c')
    .replace(/\u2028|\u2029/g, ' ')
}

/** Runs in the browser: draws the three plots from `data` (no animation, fixed size, so a headless
 *  browser's first paint shows them). */
const plotScript = `
const colors = ['#1f77b4', '#aec7e8', '#d62728', '#ff9896'];
const base = { animation: false, responsive: false };
function ecdf(xs) {
  const s = [...xs].sort((a, b) => a - b);
  return s.map((x, i) => ({ x, y: (i + 1) / s.length }));
}
if (data.ttft) {
  new Chart(document.getElementById('ttft-chart'), {
    type: 'scatter',
    data: { datasets: data.ttft.map((s, i) => ({ label: s.label, data: ecdf(s.samplesMs), showLine: true, stepped: true, borderColor: colors[i % 4], backgroundColor: colors[i % 4] })) },
    options: { ...base, scales: { x: { title: { display: true, text: 'TTFT (ms)' } }, y: { min: 0, max: 1, title: { display: true, text: 'fraction of requests' } } } },
  });
}
if (data.boundary) {
  const meaningColor = { 'accepted': '#1b7f3b', 'accepted-over-limit': '#b00020', 'rejected': '#1f77b4', 'failed': '#999999' };
  new Chart(document.getElementById('boundary-chart'), {
    type: 'bar',
    data: { labels: data.boundary.map((b) => b.label), datasets: [{ label: 'HTTP status (red: accepted over the limit)', data: data.boundary.map((b) => b.status ?? 0), backgroundColor: data.boundary.map((b) => meaningColor[b.meaning]) }] },
    options: { ...base, scales: { y: { min: 0, max: 600, title: { display: true, text: 'HTTP status' } } } },
  });
}
if (data.pool) {
  const samples = data.pool.samples;
  const datasets = [{ label: 'pool usage (' + data.pool.unit + ')', data: samples.map((s) => ({ x: s.tMs, y: s.used })), showLine: true, borderColor: '#1f77b4', backgroundColor: '#1f77b4' }];
  if (data.pool.baseline !== null) datasets.push({ label: 'idle baseline', data: [{ x: samples[0].tMs, y: data.pool.baseline }, { x: samples[samples.length - 1].tMs, y: data.pool.baseline }], showLine: true, borderDash: [6, 4], borderColor: '#555555', pointRadius: 0 });
  new Chart(document.getElementById('pool-chart'), {
    type: 'scatter',
    data: { datasets },
    options: { ...base, scales: { x: { title: { display: true, text: 'time (ms)' } }, y: { beginAtZero: true, title: { display: true, text: data.pool.unit } } } },
  });
}
`
