/** The HTML report: one self-contained file (no network access when opened) with the summary, every
 *  finding with its evidence, and three plots drawn by Chart.js, whose UMD build is read from
 *  node_modules when the report is written and inlined into the file:
 *  - TTFT distributions (empirical CDFs of the prefix-timing probe's hit and miss samples, the
 *    curves its Kolmogorov–Smirnov test compares);
 *  - boundary outcomes (accepted, refused or failed per prompt size, against the KV pool and the
 *    advertised context);
 *  - KV pool usage over time (the page-leak probe's samples, as points: what was read, not a line
 *    between readings, against its idle baseline);
 *  - requests per tenant over time, those whose answer held foreign material marked;
 *  and a tenant × tenant table of foreign material found (observer rows, source columns).
 *  A plot without data says so instead. Evidence holds no key and only redacted outputs. */
import { readFile, writeFile } from 'node:fs/promises'
import { createRequire } from 'node:module'
import { dirname, join } from 'node:path'
import type { AuditReport, Finding } from '../types.js'
import { formatControls } from '../controls.js'
import { withClass } from '../classes.js'

/** Chart.js's UMD build (a dependency), as text. */
export async function readChartJs(): Promise<string> {
  const entry = createRequire(import.meta.url).resolve('chart.js')
  return readFile(join(dirname(entry), 'chart.umd.min.js'), 'utf8')
}

/** One crossing: an answer to `observer` (request `requestNumber`) held material `source`
 *  planted. */
export interface CrossingPoint {
  readonly observer: string
  readonly source: string
  readonly requestNumber: number | null
}

/** The data the plots draw, taken from the findings' evidence and the report's completions (null
 *  when a probe did not run or gathered none). */
export interface PlotData {
  readonly ttft: { readonly label: string; readonly samplesMs: readonly number[] }[] | null
  /** Each sized prompt and what became of it, with the limits it was sized against (tokens). */
  readonly boundary: {
    readonly sizes: readonly {
      readonly label: string
      readonly promptTokens: number
      readonly status: number | null
      readonly meaning: 'accepted' | 'accepted-over-limit' | 'rejected' | 'failed'
    }[]
    readonly poolTokens: number | null
    readonly contextTokens: number | null
    /** The limits as dashed markers (see {@link limitMarkers}). */
    readonly markers: readonly LimitMarker[]
  } | null
  /** The page-leak probe's samples: only what was read, never a value between two readings. */
  readonly pool: {
    readonly unit: string
    readonly baseline: number | null
    readonly samples: readonly { tMs: number; used: number; phase: string }[]
  } | null
  /** Foreign material found: `counts[i][j]` answers to `tenants[i]` (the observer) that held
   *  material `tenants[j]` planted (the source; i = j: another request of the same tenant). */
  readonly matrix: { readonly tenants: readonly string[]; readonly counts: number[][] } | null
  /** Every completion in time, per tenant, with the ones that held foreign material marked. */
  readonly timeline: {
    readonly tenants: readonly string[]
    readonly points: readonly {
      readonly atMs: number
      readonly tenant: string
      readonly fate: string
      readonly status: number | null
      readonly probe: string | null
      readonly requestNumber: number
      readonly isContaminated: boolean
    }[]
  } | null
}

/** A limit drawn on the boundary chart: a dashed vertical line at `x` (in size slots: the sizes
 *  are evenly spaced at 0, 1, 2, …), named in the legend by `label`, in `color`. */
export interface LimitMarker {
  readonly label: string
  readonly x: number
  readonly color: string
}

/** How far apart (in size slots) two limits that fall between the same two sizes are drawn, so
 *  that neither hides the other. */
const markerSpread = 0.24

/** The boundary chart's markers for the KV pool and the advertised context (tokens; null when
 *  unknown). Each sits between the last size that fits it and the first that does not. A pool
 *  equal to the context is one marker, `KV pool = context window`; two limits that differ but
 *  fall between the same two sizes are drawn side by side, the smaller to the left, so that both
 *  are seen (one used to be drawn over the other, and the pool's marker was lost). */
export function limitMarkers(
  promptTokens: readonly number[],
  poolTokens: number | null,
  contextTokens: number | null,
): LimitMarker[] {
  const slotOf = (tokens: number): number => promptTokens.filter((t) => t <= tokens).length - 0.5
  if (poolTokens !== null && poolTokens === contextTokens)
    return [
      {
        label: `KV pool = context window: ${poolTokens} tokens`,
        x: slotOf(poolTokens),
        color: '#6a3d9a',
      },
    ]
  const markers: LimitMarker[] = []
  if (poolTokens !== null)
    markers.push({
      label: `KV pool: ${poolTokens} tokens`,
      x: slotOf(poolTokens),
      color: '#6a3d9a',
    })
  if (contextTokens !== null)
    markers.push({
      label: `advertised context: ${contextTokens} tokens`,
      x: slotOf(contextTokens),
      color: '#ff7f0e',
    })
  if (markers.length === 2 && markers[0].x === markers[1].x) {
    const [pool, context] = markers
    const isPoolFirst = (poolTokens as number) < (contextTokens as number)
    return [
      { ...pool, x: pool.x + (isPoolFirst ? -1 : 1) * (markerSpread / 2) },
      { ...context, x: context.x + (isPoolFirst ? 1 : -1) * (markerSpread / 2) },
    ]
  }
  return markers
}

/** Extracts {@link PlotData} from `report`. */
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

  const boundaryEvidence = evidenceOf('boundary') as {
    sizes?: {
      labels: string
      promptTokens: number
      status: number | null
      outcome: string
      mustReject: boolean
    }[]
    poolTokens?: number | null
    contextTokens?: number | null
  } | null
  const sizes =
    boundaryEvidence?.sizes?.map((s) => ({
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
    })) ?? []
  const boundary =
    sizes.length === 0
      ? null
      : {
          sizes,
          poolTokens: boundaryEvidence?.poolTokens ?? null,
          contextTokens: boundaryEvidence?.contextTokens ?? null,
          markers: limitMarkers(
            sizes.map((s) => s.promptTokens),
            boundaryEvidence?.poolTokens ?? null,
            boundaryEvidence?.contextTokens ?? null,
          ),
        }

  const leak = evidenceOf('page-leak') as {
    source?: { unit?: string } | null
    baseline?: number | null
    samples?: { tMs: number; used: number; phase: string }[]
  } | null
  const pool =
    leak?.samples && leak.samples.length > 0
      ? { unit: leak.source?.unit ?? '', baseline: leak.baseline ?? null, samples: leak.samples }
      : null

  const crossings = crossingsOf(report)
  const tenants = [
    ...new Set([
      ...report.completions.map((c) => c.tenant),
      ...crossings.flatMap((c) => [c.observer, c.source]),
    ]),
  ]
  const matrix =
    tenants.length === 0
      ? null
      : {
          tenants,
          counts: tenants.map((observer) =>
            tenants.map(
              (source) =>
                crossings.filter((c) => c.observer === observer && c.source === source).length,
            ),
          ),
        }
  const contaminated = new Set(crossings.map((c) => c.requestNumber))
  const timeline =
    report.completions.length === 0
      ? null
      : {
          tenants,
          points: report.completions.map((c) => ({
            atMs: c.atMs,
            tenant: c.tenant,
            fate: c.fate,
            status: c.status,
            probe: c.probe,
            requestNumber: c.requestNumber,
            isContaminated: contaminated.has(c.requestNumber),
          })),
        }

  return { ttft: ttft.length > 0 ? ttft : null, boundary, pool, matrix, timeline }
}

/** Every answer that held foreign material, once: from a leak finding's `crossings` (all of its
 *  probe's, listed in each of its findings), else from the finding's own observer and source when
 *  it names the canary found. A leak of another kind (prefix-timing's side channel) put no
 *  material in an answer and is not counted. */
function crossingsOf(report: AuditReport): CrossingPoint[] {
  const out: CrossingPoint[] = []
  const seen = new Set<string>()
  for (const f of report.findings) {
    if (f.verdict !== 'leak') continue
    const e = f.evidence as {
      crossings?: CrossingPoint[]
      observerTenant?: string
      victimTenant?: string
      requestNumber?: number
      canary?: string
    }
    const list: CrossingPoint[] = Array.isArray(e.crossings)
      ? e.crossings
      : typeof e.canary === 'string' &&
          typeof e.observerTenant === 'string' &&
          typeof e.victimTenant === 'string'
        ? [
            {
              observer: e.observerTenant,
              source: e.victimTenant,
              requestNumber: typeof e.requestNumber === 'number' ? e.requestNumber : null,
            },
          ]
        : []
    for (const c of list) {
      const key = `${f.probe} ${c.observer} ${c.source} ${c.requestNumber ?? out.length}`
      if (seen.has(key)) continue
      seen.add(key)
      out.push(c)
    }
  }
  return out
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
table.matrix { width: auto; } table.matrix td { text-align: right; min-width: 4rem; }
table.matrix td.hit { background: #fde7ea; color: #b00020; font-weight: bold; }
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
<thead><tr><th>probe</th><th>verdict</th><th>class</th><th>CWE</th><th>severity</th><th>controls</th><th>finding</th></tr></thead>
<tbody>
${report.findings.map(row).join('\n')}
</tbody>
</table>
<h2>Plots</h2>
${plot('ttft-chart', 'TTFT distributions (prefix-timing, empirical CDF)', data.ttft !== null, 'the prefix-timing probe gathered no samples')}
${plot('boundary-chart', 'Boundary: accepted or refused per prompt size, against the KV pool and the context window', data.boundary !== null, 'the boundary probe sent no sized prompt')}
${plot('pool-chart', 'KV pool usage over time (page-leak; each point one reading)', data.pool !== null, 'the endpoint exposed no pool usage, or page-leak did not run')}
${matrixTable(data.matrix)}
${plot('timeline-chart', 'Requests per tenant over time (red ✕: the answer held foreign material)', data.timeline !== null, 'no completion was sent')}
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
  const warned = [
    ...new Set(
      report.findings.filter((f) => f.verdict === 'warning').map((f) => withClass(f).class),
    ),
  ]
  if (warned.length > 0)
    return `<div class="banner inconclusive">No content leak found; warnings of class ${esc(warned.join(', '))}: see the findings below.</div>`
  return '<div class="banner clean">No leak found; every probe that could tell passed.</div>'
}

/** The tenant × tenant table of foreign material found. */
function matrixTable(matrix: PlotData['matrix']): string {
  const title =
    '<h3>Foreign material found (rows: the tenant whose answer held it; columns: the tenant who planted it)</h3>'
  if (matrix === null)
    return `<section class="plot">${title}<p class="nodata" id="tenant-matrix-none">No data: no completion was sent</p></section>`
  const head = matrix.tenants.map((t) => `<th scope="col">${esc(t)}</th>`).join('')
  const rows = matrix.tenants.map(
    (observer, i) =>
      `<tr><th scope="row">${esc(observer)}</th>` +
      matrix.counts[i]
        .map(
          (n, j) =>
            `<td class="${n > 0 ? 'hit' : 'zero'}" data-observer="${esc(observer)}" data-source="${esc(matrix.tenants[j])}">${n}</td>`,
        )
        .join('') +
      '</tr>',
  )
  return (
    `<section class="plot">${title}<table class="matrix" id="tenant-matrix">` +
    `<thead><tr><th>observer \\ source</th>${head}</tr></thead><tbody>${rows.join('')}</tbody></table>` +
    '<p>Each count is one answer. On the diagonal: another request of the same tenant (requests crossed).</p></section>'
  )
}

function row(finding: Finding): string {
  const f = withClass(finding)
  return `<tr><td>${esc(f.probe)}</td><td class="${f.verdict}">${f.verdict}</td><td class="class-${f.class}">${f.class}</td><td>${esc(f.cwe.join(', '))}</td><td>${f.severity}</td><td>${esc(formatControls(f.controls))}</td><td>${esc(f.title)}</td></tr>`
}

function details(f: Finding, i: number): string {
  return (
    `<details id="finding-${i}"><summary><span class="${f.verdict}">${f.verdict}</span> ${withClass(f).class} ${esc(f.probe)}: ${esc(f.title)}</summary>` +
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

/** Runs in the browser: draws the plots from `data` (no animation, fixed size, so a headless
 *  browser's first paint shows them). Each legend entry is its dataset, in its own colour. */
const plotScript = `
const colors = ['#1f77b4', '#aec7e8', '#d62728', '#ff9896'];
const base = { animation: false, responsive: false };
function ecdf(xs) {
  const s = [...xs].sort((a, b) => a - b);
  return s.map((x, i) => ({ x, y: (i + 1) / s.length }));
}
function marker(label, x, ys, color) {
  return { label, data: ys.map((y) => ({ x, y })), showLine: true, borderColor: color, backgroundColor: color, borderDash: [6, 4], pointRadius: 0, borderWidth: 2 };
}
if (data.ttft) {
  new Chart(document.getElementById('ttft-chart'), {
    type: 'scatter',
    data: { datasets: data.ttft.map((s, i) => ({ label: s.label, data: ecdf(s.samplesMs), showLine: true, stepped: true, borderColor: colors[i % 4], backgroundColor: colors[i % 4] })) },
    options: { ...base, scales: { x: { title: { display: true, text: 'TTFT (ms)' } }, y: { min: 0, max: 1, title: { display: true, text: 'fraction of requests' } } } },
  });
}
if (data.boundary) {
  // Sizes evenly spaced (pool−1, pool and pool+1 would overlap on a token scale), each limit a
  // dashed line between the last size that fits it and the first that does not (limitMarkers).
  const sizes = data.boundary.sizes;
  const rows = ['refused (4xx)', 'failed (5xx, timeout)', 'accepted (200)'];
  const rowOf = { 'accepted': rows[2], 'accepted-over-limit': rows[2], 'rejected': rows[0], 'failed': rows[1] };
  const kinds = [
    ['accepted', 'accepted, fits', '#1b7f3b'],
    ['accepted-over-limit', 'accepted over the limit (the incident)', '#b00020'],
    ['rejected', 'refused with a 4xx', '#1f77b4'],
    ['failed', 'failed (no 4xx, no 200)', '#999999'],
  ];
  const datasets = kinds
    .map(([meaning, label, color]) => ({ label, data: sizes.map((s, i) => ({ x: i, y: rowOf[s.meaning], s })).filter((d) => d.s.meaning === meaning), borderColor: color, backgroundColor: color, pointRadius: 8, pointStyle: meaning === 'accepted-over-limit' ? 'crossRot' : 'circle', borderWidth: meaning === 'accepted-over-limit' ? 4 : 1 }))
    .filter((d) => d.data.length > 0);
  for (const m of data.boundary.markers) datasets.push(marker(m.label, m.x, [rows[0], rows[2]], m.color));
  new Chart(document.getElementById('boundary-chart'), {
    type: 'scatter',
    data: { datasets },
    options: { ...base,
      plugins: { tooltip: { callbacks: { label: (c) => (c.raw.s ? c.raw.s.label + ': HTTP ' + (c.raw.s.status ?? 'none') : c.dataset.label) } } },
      scales: {
        x: { min: -0.5, max: sizes.length - 0.5, afterBuildTicks: (axis) => { axis.ticks = sizes.map((_, i) => ({ value: i })); }, ticks: { autoSkip: false, callback: (v) => (sizes[v] ? sizes[v].label : '') }, title: { display: true, text: 'prompt size (tokens)' } },
        y: { type: 'category', labels: [...rows].reverse(), offset: true, title: { display: true, text: 'outcome' } },
      } },
  });
}
if (data.pool) {
  const samples = data.pool.samples;
  const phases = [['idle', '#555555'], ['workload', '#1f77b4'], ['settle', '#2ca02c']];
  const datasets = phases
    .map(([phase, color]) => ({ label: phase + ' readings (' + data.pool.unit + ')', data: samples.filter((s) => s.phase === phase).map((s) => ({ x: s.tMs, y: s.used })), borderColor: color, backgroundColor: color, pointRadius: 3 }))
    .filter((d) => d.data.length > 0);
  if (data.pool.baseline !== null) datasets.push({ label: 'idle baseline (read before any probe)', data: [{ x: samples[0].tMs, y: data.pool.baseline }, { x: samples[samples.length - 1].tMs, y: data.pool.baseline }], showLine: true, borderDash: [6, 4], borderColor: '#b00020', backgroundColor: '#b00020', pointRadius: 0 });
  new Chart(document.getElementById('pool-chart'), {
    type: 'scatter',
    data: { datasets },
    options: { ...base, scales: { x: { title: { display: true, text: 'ms since page-leak started' } }, y: { beginAtZero: true, title: { display: true, text: data.pool.unit } } } },
  });
}
if (data.timeline) {
  const fates = [['answered', '#1b7f3b'], ['refused', '#1f77b4'], ['failed', '#ff7f0e'], ['cut', '#bbbbbb']];
  const pts = data.timeline.points;
  const datasets = fates
    .map(([fate, color]) => ({ label: fate, data: pts.filter((p) => p.fate === fate).map((p) => ({ x: p.atMs / 1000, y: p.tenant, p })), borderColor: color, backgroundColor: color, pointRadius: 3 }))
    .filter((d) => d.data.length > 0);
  const bad = pts.filter((p) => p.isContaminated);
  if (bad.length > 0) datasets.unshift({ label: 'held foreign material', data: bad.map((p) => ({ x: p.atMs / 1000, y: p.tenant, p })), borderColor: '#d62728', backgroundColor: '#d62728', pointStyle: 'crossRot', pointRadius: 9, borderWidth: 3 });
  new Chart(document.getElementById('timeline-chart'), {
    type: 'scatter',
    data: { datasets },
    options: { ...base,
      plugins: { tooltip: { callbacks: { label: (c) => '#' + c.raw.p.requestNumber + ' ' + (c.raw.p.probe ?? '') + ' ' + c.raw.p.fate + ' HTTP ' + (c.raw.p.status ?? 'none') } } },
      scales: { x: { title: { display: true, text: 's since the audit started' } }, y: { type: 'category', labels: data.timeline.tenants, offset: true, title: { display: true, text: 'tenant' } } } },
  });
}
`
