/** prom-client's default process metrics (`process_resident_memory_bytes`,
 *  `nodejs_heap_size_used_bytes`, GC durations, event-loop lag, …), collected once per process in
 *  a registry of their own, plus `kvfence_heap_used_after_major_gc_bytes`. Routers and workers
 *  append it to what their `/metrics` serves, so an operator can tell a leak (a rising heap floor)
 *  from GC sawtooth and V8 growing its heap; creating many routers or workers in one process
 *  (tests, embedders) does not start one GC observer each. */
import { PerformanceObserver, constants, type PerformanceEntry } from 'node:perf_hooks'
import { getHeapStatistics } from 'node:v8'
import { Gauge, Registry, collectDefaultMetrics } from 'prom-client'

let shared: Registry | undefined

/** Name of the gauge of the heap in use just after the latest major (mark-sweep-compact) GC. */
export const heapAfterMajorGcMetric = 'kvfence_heap_used_after_major_gc_bytes'

/** This process's default-metrics registry (created on first use). */
export function processRegistry(): Registry {
  if (!shared) {
    shared = new Registry()
    collectDefaultMetrics({ register: shared })
    watchMajorGc(shared)
  }
  return shared
}

/** The Prometheus text of `own`'s metrics followed by this process's default metrics (distinct
 *  names, so the two expositions concatenate into one valid one). */
export async function metricsText(own: Registry): Promise<string> {
  return (await own.metrics()) + (await processRegistry().metrics())
}

/** Keep {@link heapAfterMajorGcMetric} at the heap in use right after each major GC: what the
 *  process retains, the floor under GC sawtooth. It rises with a leak and stays flat while V8
 *  merely grows its heap (which RSS alone cannot tell apart). Read when the GC entry is
 *  delivered (a few ms after the collection), so it can include that much new garbage. */
function watchMajorGc(register: Registry): void {
  const gauge = new Gauge({
    name: heapAfterMajorGcMetric,
    help: 'V8 heap in use just after the latest major (mark-sweep-compact) GC, bytes; 0 before the first',
    registers: [register],
  })
  gauge.set(0)
  const observer = new PerformanceObserver((list) => {
    const isMajor = (e: PerformanceEntry & { detail?: { kind?: number } }) =>
      e.detail?.kind === constants.NODE_PERFORMANCE_GC_MAJOR
    if (list.getEntries().some(isMajor)) gauge.set(getHeapStatistics().used_heap_size)
  })
  observer.observe({ entryTypes: ['gc'] }) // holds no handle: it never keeps a process alive
}
