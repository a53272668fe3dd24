/** Reading Prometheus text exposition (a worker's or vLLM's `/metrics`) through the well-kept
 *  `parse-prometheus-text-format` parser, typed for the few values the router needs.
 *  Knows the exposition format; knows nothing of what any metric means. */
import { createRequire } from 'node:module'

/** One sample: its labels and value. */
export interface Sample {
  labels: Record<string, string>
  value: number
}

type Parsed = { name: string; metrics: { labels?: Record<string, string>; value?: string }[] }[]

// The package ships CommonJS without types.
const parse = createRequire(import.meta.url)('parse-prometheus-text-format') as (
  text: string,
) => Parsed

/** The samples of metric `name` in `text` (empty when absent). Throws on text that is not
 *  Prometheus exposition format. */
export function samplesOf(text: string, name: string): Sample[] {
  const family = parse(text).find((f) => f.name === name)
  if (family === undefined) return []
  return family.metrics.map((m) => ({ labels: m.labels ?? {}, value: Number(m.value) }))
}
