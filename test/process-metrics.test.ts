/** The heap-after-major-GC gauge that lets an operator (and the soak) tell retained memory from
 *  V8 growing its heap: it follows what is reachable, read right after each major collection. */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import { setTimeout as sleep } from 'node:timers/promises'
import { setFlagsFromString } from 'node:v8'
import { runInNewContext } from 'node:vm'
import { heapAfterMajorGcMetric, processRegistry } from '../src/common/process-metrics.js'
import { samplesOf } from '../src/router/metrics/prometheus-text.js'

setFlagsFromString('--expose-gc')
const gc = runInNewContext('gc') as () => void
const registry = processRegistry() // starts the GC observer

async function gaugeAfterMajorGc(): Promise<number> {
  gc() // a full, major collection
  await sleep(50) // the GC entry is delivered to the observer asynchronously
  const [sample] = samplesOf(await registry.metrics(), heapAfterMajorGcMetric)
  return sample.value
}

describe(heapAfterMajorGcMetric, () => {
  it('rises by what a major GC cannot free and falls once it is unreachable', async () => {
    const base = await gaugeAfterMajorGc()
    assert.ok(base > 0, 'set after the first major GC')
    // 5,000,000 doubles in a packed array: 40 MB of V8 heap (8 bytes each), kept reachable.
    let kept: number[] | null = Array.from({ length: 5_000_000 }, (_, i) => i + 0.5)
    const withKept = await gaugeAfterMajorGc()
    assert.ok(withKept - base >= 40e6, `grew by ${withKept - base} bytes, not ≥ 40 MB`)
    assert.ok(withKept - base < 60e6, `grew by ${withKept - base} bytes`)
    assert.equal(kept.length, 5_000_000)
    kept = null
    const freed = await gaugeAfterMajorGc()
    assert.ok(withKept - freed >= 40e6, `fell by ${withKept - freed} bytes, not ≥ 40 MB`)
  })
})
