/** prom-client's default process metrics (`process_resident_memory_bytes`,
 *  `nodejs_heap_size_used_bytes`, GC durations, event-loop lag, …), collected once per process in
 *  a registry of their own. Routers and workers append it to what their `/metrics` serves, so an
 *  operator can tell a leak (a rising heap floor) from GC sawtooth; creating many routers or
 *  workers in one process (tests, embedders) does not start one GC observer each. */
import { Registry, collectDefaultMetrics } from 'prom-client'

let shared: Registry | undefined

/** This process's default-metrics registry (created on first use). */
export function processRegistry(): Registry {
  if (!shared) {
    shared = new Registry()
    collectDefaultMetrics({ register: shared })
  }
  return shared
}

/** The Prometheus text of `own`'s metrics followed by this process's default metrics (distinct
 *  names, so the two expositions concatenate into one valid one). */
export async function metricsText(own: Registry): Promise<string> {
  return (await own.metrics()) + (await processRegistry().metrics())
}
