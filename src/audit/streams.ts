/** Streams checked chunk by chunk: for answers streamed at once to several tenants, every event
 *  (not only the joined text, where a crossed chunk can hide among the right ones or be split
 *  across two events) is checked for another stream's canary, and for an `id` that belongs to
 *  another stream (a relay that writes one upstream's events to another client's connection:
 *  LiteLLM#35023). Use: collect each stream's {@link StreamUnderCheck} and call
 *  {@link checkStreams}; a probe turns the crossings into findings with {@link crossingEvidence}.
 *  Knows canaries and stream events; knows nothing of HTTP or of how the streams were sent. */
import { findCanaries, findFragment, type CanaryMatch } from './canaries.js'
import type { StreamChunk } from './target.js'

/** One stream to check: whose it is, the canaries its own prompt carried, its events. */
export interface StreamUnderCheck {
  /** Unique among the streams checked together, e.g. `alice-2`. */
  readonly label: string
  readonly tenant: string
  readonly canaries: readonly string[]
  readonly chunks: readonly StreamChunk[]
}

/** A crossing seen in one event of `stream`: another stream's canary (`canary`), or an event
 *  whose `id` is the id the other stream's events carry (`foreign-id`). */
export interface StreamCrossing {
  readonly stream: StreamUnderCheck
  readonly source: StreamUnderCheck
  readonly kind: 'canary' | 'foreign-id'
  /** Index of the event in `stream.chunks` (for a canary split across events: the first). */
  readonly chunkIndex: number
  readonly match: CanaryMatch | null
}

/** The id a stream's events carry: the most frequent non-null one (a crossed event is a
 *  minority), or null when none has one. */
export function streamId(chunks: readonly StreamChunk[]): string | null {
  const counts = new Map<string, number>()
  for (const c of chunks) if (c.id !== null) counts.set(c.id, (counts.get(c.id) ?? 0) + 1)
  let best: string | null = null
  for (const [id, n] of counts) if (best === null || n > counts.get(best)!) best = id
  return best
}

/** Every crossing among `streams`: for each stream, each event (and each pair of neighbouring
 *  events, where a canary may be cut in two) holding another stream's canary fragment
 *  (≥ 8 characters, canaries.ts `minFragmentLength`), and each event carrying another stream's id while
 *  its own stream has a different one. Streams of one tenant are checked against each other too
 *  (requests crossed: next time the other may be someone else's). */
export function checkStreams(streams: readonly StreamUnderCheck[]): StreamCrossing[] {
  const ids = new Map(streams.map((s) => [s.label, streamId(s.chunks)]))
  const out: StreamCrossing[] = []
  for (const stream of streams) {
    const ownId = ids.get(stream.label) ?? null
    for (const source of streams) {
      if (source.label === stream.label) continue
      const found = firstCanaryChunk(stream, source.canaries)
      if (found !== null) out.push({ stream, source, kind: 'canary', ...found })
      const sourceId = ids.get(source.label) ?? null
      if (sourceId === null || sourceId === ownId) continue
      const at = stream.chunks.findIndex((c) => c.id === sourceId)
      if (at >= 0) out.push({ stream, source, kind: 'foreign-id', chunkIndex: at, match: null })
    }
  }
  return out
}

function firstCanaryChunk(
  stream: StreamUnderCheck,
  canaries: readonly string[],
): { chunkIndex: number; match: CanaryMatch } | null {
  const { chunks } = stream
  for (let i = 0; i < chunks.length; i++) {
    const [inOne] = findCanaries(chunks[i].text, canaries)
    if (inOne) return { chunkIndex: i, match: inOne }
    if (i + 1 < chunks.length) {
      const joined = chunks[i].text + chunks[i + 1].text
      for (const canary of canaries) {
        const match = findFragment(joined, canary)
        if (match) return { chunkIndex: i, match }
      }
    }
  }
  return null
}

/** Evidence for one crossing: no text but the matched canary fragment (the auditor's own). */
export function crossingEvidence(crossing: StreamCrossing): Record<string, unknown> {
  return {
    stream: crossing.stream.label,
    streamTenant: crossing.stream.tenant,
    sourceStream: crossing.source.label,
    sourceTenant: crossing.source.tenant,
    kind: crossing.kind,
    chunkIndex: crossing.chunkIndex,
    numChunks: crossing.stream.chunks.length,
    ...(crossing.match === null
      ? {}
      : { canary: crossing.match.canary, matchedFragment: crossing.match.fragment }),
  }
}
