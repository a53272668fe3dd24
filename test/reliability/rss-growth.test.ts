/** The soak's RSS growth rule on hand-made samples: a GC sawtooth is not growth, a steady rise
 *  is, by exactly the amount a line through it says. And the retained-heap trend: one point per
 *  major GC, however often the same value is sampled. */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import { heapTrends, rssGrowth } from '../../src/soak/sampler.js'
import type { RssSample } from '../../src/soak/types.js'

const MB = 1024 * 1024

/** One sample a second for 100 s; `mbAt(t)` gives each process's RSS in MB at second t. */
function samples(mbAt: (t: number) => Record<string, number>): RssSample[] {
  return Array.from({ length: 101 }, (_, t) => ({
    atMs: t * 1000,
    bytes: Object.fromEntries(Object.entries(mbAt(t)).map(([k, v]) => [k, v * MB])),
  }))
}

describe('rssGrowth', () => {
  it('a sawtooth symmetric about the fitted range has slope 0 and ratio 1', () => {
    // Warm-up ends at 25 s; the fit covers t = 25..100, centred on 62.5. A sawtooth in
    // |t − 62.5| (period 20 s, 100..138 MB) is symmetric about the centre: its least-squares
    // slope is exactly 0, whatever phase the windows would catch.
    const saw = samples((t) => ({ prefill: 100 + 2 * (Math.abs(t - 62.5) % 20), decode: 50 }))
    const g = rssGrowth(saw, 100_000, 0.25)
    assert.ok(Math.abs(g.ratio - 1) < 1e-12, `ratio ${g.ratio}`)
    assert.ok(Math.abs(g.slopePerMinute.prefill) < 1e-6)
    assert.equal(g.slopePerMinute.decode, 0)
    assert.equal(g.hasSamples, true)
  })

  it('a rise of 1 MB a second on one process: the line reads 125 + 75 MB then 200 + 75 MB', () => {
    const leak = samples((t) => ({ router: 100 + t, decode: 75 }))
    const g = rssGrowth(leak, 100_000, 0.25)
    assert.ok(Math.abs(g.fittedAfterWarmup - 200 * MB) < 1e-3)
    assert.ok(Math.abs(g.fittedAtEnd - 275 * MB) < 1e-3)
    assert.ok(Math.abs(g.ratio - 275 / 200) < 1e-12)
    assert.ok(Math.abs(g.slopePerMinute.router - 60 * MB) < 1e-3)
  })

  it('fewer than 3 samples after warm-up: ratio 0 and hasSamples false', () => {
    const few = samples((t) => ({ p: 100 + t })).filter((s) => s.atMs < 27_000)
    const g = rssGrowth(few, 100_000, 0.25)
    assert.equal(g.ratio, 0)
    assert.equal(g.hasSamples, false)
  })
})

describe('heapTrends', () => {
  it('fits one point per collection: a value sampled many times counts once', () => {
    // Post-GC heap of the router steps 20 → 22 → 24 → 26 MB at t = 25, 50, 75, 100 s and is
    // sampled every second; the decode worker stays at 30 MB (one collection seen). Distinct
    // router points after warm-up (25 s): (25, 20), (50, 22), (75, 24), (100, 26): exactly on
    // the line 20 + 2·(t − 25)/25 MB, so 20 MB at 25 s, 26 MB at 100 s, 4.8 MB per minute.
    const steps = samples((t) => ({ router: 20 + 2 * Math.floor((t - 25) / 25), decode: 30 }))
    const trends = heapTrends(
      steps.filter((s) => s.atMs >= 25_000),
      100_000,
      0.25,
    )
    assert.equal(trends.router.collections, 4)
    assert.ok(Math.abs(trends.router.fittedAfterWarmup - 20 * MB) < 1e-3)
    assert.ok(Math.abs(trends.router.fittedAtEnd - 26 * MB) < 1e-3)
    assert.ok(Math.abs(trends.router.slopePerMinute - 4.8 * MB) < 1e-3)
    assert.deepEqual(trends.decode, {
      collections: 1,
      fittedAfterWarmup: 0,
      fittedAtEnd: 0,
      slopePerMinute: 0,
    })
  })
})
