/** Probe `abort-race`: the victim's requests are cut at random points (before the first byte,
 *  during prefill, mid-stream) or abandoned (non-streamed), while the other tenants run requests
 *  of their own; then the other tenants send fresh requests, and every answer is scanned for the
 *  aborted prompts' canaries. Catches pages freed on abort while a write into them was still in
 *  flight, and buffers or connections reused after an abort (sglang#24527, the 2023 redis-py
 *  incident). An abort the server never saw (the request had finished) still counts as sent. */
import { materialPromptTokens } from '../plan.js'
import { runUntilExhausted, type Budget } from '../budget.js'
import type { Probe } from '../probe.js'
import { aisvsKvPartitioning, inconclusiveRemediation } from '../probe.js'
import { createRng, type Rng } from '../rng.js'
import { isAnsweredWhole, type CompletionRequest } from '../target.js'
import type { Finding, Tenant } from '../types.js'
import {
  crossingRemediation,
  findCrossings,
  leakFindings,
  plantMaterial,
  requestLog,
  type Observed,
  type Planted,
} from './material.js'
import { rampLevels } from './concurrency.js'

/** How a victim request is cut. */
const cutModes = ['before-first-byte', 'mid-prefill', 'mid-stream', 'abandoned'] as const
type CutMode = (typeof cutModes)[number]

const numCuts = 8
const numFreshPerTenant = 4

/** After the pairs, waves of mid-stream cuts, each beside another tenant's request: 2, 4, 8 at
 *  once (as `--max-concurrency` allows: a wave of w is 2w in flight), for release races that open
 *  only with many in flight. Mid-stream only: a cut after the first chunk always reached the
 *  server, while a timed cut among many connections may fire before its request was sent. */
function waveWidths(maxInFlight: number): number[] {
  return rampLevels(Math.floor(maxInFlight / 2)).filter((w) => w >= 2)
}
const maxTokens = 48

export const abortRaceProbe: Probe = {
  name: 'abort-race',
  description:
    "the victim's streams are cut at random points and non-streamed requests abandoned while others run; fresh requests of other tenants must carry none of the aborted canaries",
  class: 'content-leak',
  controls: { aisvs: [aisvsKvPartitioning], guards: ['G5', 'G6', 'G7', 'G8'] },
  plan: ({ numTenants, limits }) => [
    {
      what: 'requests cut, each beside another tenant’s',
      numRequests: 2 * numCuts,
      tokensEach: materialPromptTokens + maxTokens,
    },
    {
      what: 'waves of mid-stream cuts, each beside another tenant’s',
      numRequests:
        2 *
        waveWidths(Math.max(limits.concurrency, limits.maxConcurrency ?? 0)).reduce(
          (a, b) => a + b,
          0,
        ),
      tokensEach: materialPromptTokens + maxTokens,
    },
    {
      what: 'fresh requests after the cuts',
      numRequests: numFreshPerTenant * (numTenants - 1),
      tokensEach: materialPromptTokens + maxTokens,
    },
  ],
  async run(target, budget, context): Promise<Finding[]> {
    const [victim, ...others] = target.tenants
    const rng = createRng(context.seed, 'abort-race')
    const cutIds = Array.from({ length: numCuts }, (_, i) => `cut${i}`)
    const cutPlanted = plantMaterial(rng, [victim], cutIds)
    const concurrentPlanted = plantMaterial(
      rng,
      others,
      Array.from({ length: numCuts }, (_, i) => `during${i}`),
    )
    const freshPlanted = plantMaterial(
      rng,
      others,
      Array.from({ length: numFreshPerTenant * others.length }, (_, i) => `fresh${i}`),
    )
    const cuts = cutIds.map((_, i) => cutPlan(cutModes[i % cutModes.length], rng.int(1, 40)))
    // Drawn after everything above, so a seed plants the pairs' material as it always did.
    const widths = waveWidths(budget.maxInFlightLimit)
    const waves = plantWaves(rng, victim, others, widths)
    const { waveCutPlanted, waveConcurrentPlanted } = waves
    const planted = [
      ...cutPlanted,
      ...concurrentPlanted,
      ...freshPlanted,
      ...waveCutPlanted,
      ...waveConcurrentPlanted,
    ]

    const observed: Observed[] = []
    const send = async (
      p: Planted,
      label: string,
      stream: boolean,
      extra: Partial<CompletionRequest> = {},
    ): Promise<void> => {
      const result = await target.complete({
        tenant: p.tenant,
        prompt: p.prompt,
        maxTokens,
        stream,
        ...extra,
      })
      observed.push({ planted: p, label, stream, result })
    }
    const stoppedBy = await runUntilExhausted(async () => {
      for (let i = 0; i < numCuts; i++) {
        const { mode, stream, cut } = cuts[i]
        await Promise.all([
          send(cutPlanted[i], `cut ${mode}`, stream, cut),
          send(concurrentPlanted[i], 'concurrent with a cut', i % 2 === 0),
        ])
      }
      await sendWaves(budget, widths, waves, send)
      for (let i = 0; i < freshPlanted.length; i++) {
        await send(freshPlanted[i], 'fresh after the cuts', i % 2 === 1)
      }
    })

    const crossings = findCrossings(observed, planted)
    const summary = {
      victimTenant: victim.name,
      cutModes: cuts.map((c) => c.mode),
      waveWidths: widths,
      numCutSent: observed.filter((o) => o.planted.id.startsWith('cut')).length,
      numCutBeforeEnd: observed.filter((o) => o.result.failure === 'aborted').length,
      stoppedBy,
      requests: requestLog(observed),
    }
    context.log(
      observed.map((o) => `${o.planted.id}:${o.result.status ?? o.result.failure}`).join(' '),
    )
    if (crossings.length > 0) {
      return leakFindings('abort-race', crossings, planted, summary, crossingRemediation)
    }
    const numFreshAccepted = observed.filter(
      (o) => o.planted.id.startsWith('fresh') && isAnsweredWhole(o.result),
    ).length
    // Another tenant's answer that never ended (cut at the deadline or at its size cap: a
    // stream that does not stop) was not seen whole: the canary could be in the part not read,
    // so such answers forbid `clean`.
    const unfinished = observed.filter(
      (o) =>
        !o.planted.id.startsWith('cut') &&
        (o.result.failure === 'timeout' || o.result.failure === 'truncated'),
    )
    if (summary.numCutBeforeEnd === 0 || numFreshAccepted === 0 || unfinished.length > 0) {
      return [
        {
          probe: 'abort-race',
          verdict: 'inconclusive',
          severity: 'medium',
          title:
            summary.numCutBeforeEnd === 0
              ? 'no request could be cut before it ended'
              : unfinished.length > 0
                ? `${unfinished.length} answers to other tenants never ended (${unfinished.filter((o) => o.result.failure === 'timeout').length} cut by the time limit, ${unfinished.filter((o) => o.result.failure === 'truncated').length} past their size cap): what they would have carried was not seen`
                : 'no fresh request of another tenant was answered after the cuts',
          evidence: summary,
          remediation: inconclusiveRemediation,
        },
      ]
    }
    return [
      {
        probe: 'abort-race',
        verdict: 'clean',
        severity: 'info',
        title: `${summary.numCutBeforeEnd} requests cut before their end; ${numFreshAccepted} fresh answers to other tenants carried none of their canaries`,
        evidence: summary,
        remediation: 'None needed.',
      },
    ]
  },
}

/** Sends the waves one after the other, each wave's cuts and their neighbours all at once. */
async function sendWaves(
  budget: Budget,
  widths: readonly number[],
  waves: ReturnType<typeof plantWaves>,
  send: (
    p: Planted,
    label: string,
    stream: boolean,
    extra?: Partial<CompletionRequest>,
  ) => Promise<void>,
): Promise<void> {
  let first = 0
  for (const width of widths) {
    const wave = Array.from({ length: width }, (_, j) => first + j)
    first += width
    await budget.withInFlightLimit(2 * width, () =>
      Promise.all(
        wave.flatMap((i) => [
          send(
            waves.waveCutPlanted[i],
            `cut mid-stream, wave of ${width}`,
            true,
            waves.waveCuts[i].cut,
          ),
          send(waves.waveConcurrentPlanted[i], `beside a wave of ${width}`, i % 2 === 0),
        ]),
      ),
    )
  }
}

/** The waves' material: per cut, the victim's planted request, another tenant's beside it, and
 *  its mid-stream cut (ids continue the pairs' numbering). */
function plantWaves(
  rng: Rng,
  victim: Tenant,
  others: readonly Tenant[],
  widths: readonly number[],
): {
  waveCutPlanted: Planted[]
  waveConcurrentPlanted: Planted[]
  waveCuts: ReturnType<typeof cutPlan>[]
} {
  const numWaveCuts = widths.reduce((a, b) => a + b, 0)
  const waveIds = Array.from({ length: numWaveCuts }, (_, i) => numCuts + i)
  const waveCutPlanted = plantMaterial(
    rng,
    [victim],
    waveIds.map((i) => `cut${i}`),
  )
  const waveConcurrentPlanted = plantMaterial(
    rng,
    others,
    waveIds.map((i) => `during${i}`),
  )
  const waveCuts = waveIds.map(() => cutPlan('mid-stream', rng.int(1, 40)))
  return { waveCutPlanted, waveConcurrentPlanted, waveCuts }
}

function cutPlan(
  mode: CutMode,
  randomMs: number,
): { mode: CutMode; stream: boolean; cut: Partial<CompletionRequest> } {
  switch (mode) {
    case 'before-first-byte':
      return { mode, stream: true, cut: { abortAfterMs: 0 } }
    case 'mid-prefill':
      return { mode, stream: true, cut: { abortAfterMs: randomMs } }
    case 'mid-stream':
      return { mode, stream: true, cut: { abortAfterChunks: 1 + (randomMs % 3) } }
    case 'abandoned':
      return { mode, stream: false, cut: { abortAfterMs: randomMs } }
  }
}
