/** The response sentinel as the router runs it: events counted in the router's metrics and
 *  logged (request ids, tenant names, run lengths: never text, never keys), and the texts of a
 *  parsed request that the sentinel fingerprints.
 *  Knows the router's metrics, its logger and parsed requests; knows nothing of backends. */
import type { Logger } from 'pino'
import type { PreparedPrompt } from '../backend.js'
import type { RouterMetrics } from '../metrics/metrics.js'
import type { ParsedRequest } from '../api/schemas.js'
import {
  type Sentinel,
  type SentinelPrompt,
  type SentinelSettings,
  type SentinelUnit,
  createSentinel,
} from './sentinel.js'

/** A sentinel under `settings`, matching `unit`s (the backend's), whose events go to `metrics`
 *  and `log` (warn: suspected, error: confirmed). Its counters start at 0 (an alert's
 *  `increase()` needs a sample before the first event) and its cap is published. */
export function createRouterSentinel(
  settings: SentinelSettings,
  unit: SentinelUnit,
  metrics: Pick<
    RouterMetrics,
    'sentinelSuspected' | 'sentinelConfirmed' | 'sentinelMaxBytes' | 'sentinelWindowSeconds'
  >,
  log: Logger,
): Sentinel {
  const action = settings.mode === 'block' ? 'blocked' : 'observed'
  metrics.sentinelSuspected.inc({ action }, 0)
  metrics.sentinelConfirmed.inc({ action }, 0)
  metrics.sentinelMaxBytes.set(settings.maxBytes)
  metrics.sentinelWindowSeconds.set(settings.windowSeconds)
  return createSentinel({
    settings,
    unit,
    onEvent(event) {
      const fields = {
        rid: event.rid,
        tenant: event.tenant,
        sourceTenant: event.sourceTenant,
        runTokens: event.runTokens,
        runCharacters: event.runCharacters,
        action,
      }
      if (event.kind === 'suspected') {
        metrics.sentinelSuspected.inc({ action })
        log.warn(
          fields,
          "sentinel: suspected cross-tenant answer (a run of another tenant's prompt)",
        )
      } else {
        metrics.sentinelConfirmed.inc({ action })
        log.error(fields, "sentinel: confirmed cross-tenant leak (a canary tenant's canary)")
      }
    },
  })
}

/** What the sentinel takes of an admitted request's prompt: each chat message's content, or a
 *  completion's text — a completion given as token ids decoded by `detokenize` (the model's
 *  tokenizer, when the router holds one; without it such a prompt has no text here) — the
 *  prompt's token ids as the backend runs them, and its counted tokens. The texts are decoded
 *  only when read. */
export function sentinelPromptOf(
  parsed: ParsedRequest,
  prompt: PreparedPrompt,
  detokenize: ((ids: readonly number[]) => string) | null,
): SentinelPrompt {
  let texts: string[] | null = null
  const textsOf = (): string[] => {
    if (parsed.endpoint === 'chat') return parsed.messages.map((m) => m.content)
    if ('text' in parsed.prompt) return [parsed.prompt.text]
    return detokenize === null ? [] : [detokenize(parsed.prompt.tokenIds)]
  }
  return {
    get texts() {
      return (texts ??= textsOf())
    },
    get tokenIds() {
      return prompt.tokenIds
    },
    numTokens: prompt.numPromptTokens,
  }
}
