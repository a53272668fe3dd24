/** The response sentinel as the router runs it: events counted in the router's metrics and
 *  logged (request ids, tenant names, run lengths: never text, never keys), and the texts of a
 *  parsed request that the sentinel fingerprints.
 *  Knows the router's metrics, its logger and parsed requests; knows nothing of backends. */
import type { Logger } from 'pino'
import type { RouterMetrics } from '../metrics.js'
import type { ParsedRequest } from '../schemas.js'
import { type Sentinel, type SentinelSettings, createSentinel } from './sentinel.js'

/** A sentinel under `settings` whose events go to `metrics` and `log` (warn: suspected, error:
 *  confirmed). */
export function createRouterSentinel(
  settings: SentinelSettings,
  metrics: Pick<RouterMetrics, 'sentinelSuspected' | 'sentinelConfirmed'>,
  log: Logger,
): Sentinel {
  const action = settings.mode === 'block' ? 'blocked' : 'observed'
  return createSentinel({
    settings,
    onEvent(event) {
      const fields = {
        rid: event.rid,
        tenant: event.tenant,
        sourceTenant: event.sourceTenant,
        runTokens: event.runTokens,
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

/** The texts of a request's prompt the sentinel fingerprints: each chat message's content, or
 *  a completion's text. A prompt given as token ids has no text here and adds nothing (its
 *  tenant's answers are still checked). */
export function promptTextsOf(parsed: ParsedRequest): string[] {
  if (parsed.endpoint === 'chat') return parsed.messages.map((m) => m.content)
  return 'text' in parsed.prompt ? [parsed.prompt.text] : []
}
