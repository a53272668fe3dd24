/** Webhook bodies for a fired or resolved alert, and the POST that sends one.
 *  - `alertmanager`: the JSON Alertmanager sends to a `webhook_config` receiver (version 4:
 *    `status`, `alerts[]` with `labels`, `annotations`, `startsAt`, `endsAt`, `fingerprint`), so
 *    any receiver written for Alertmanager takes it;
 *  - `slack`: a Slack incoming-webhook body (`text`, plus one `blocks` section).
 *  Bodies name tenants and canaries (synthetic), never keys and never other answer text.
 *  Knows HTTP and JSON; knows nothing of how a finding was made. */
import { createHash } from 'node:crypto'
import type { Finding } from '../types.js'
import { withClass } from '../classes.js'
import type { ActiveAlert } from './alerts.js'
import type { WebhookFormat } from './options.js'

export type AlertStatus = 'firing' | 'resolved'

/** The name of the alert rule (deploy/kvfence-watch-rules.yml) that fires for `finding`, so
 *  that Alertmanager groups the webhook's alert with the rule's: a leak is
 *  `KvfenceCrossTenantLeak`, the capacity warning `KvfenceCapacityGap` (the rule on
 *  `kvfence_watch_capacity_gap_tokens`; `KvfenceWatchWarning` leaves it out), any other warning
 *  `KvfenceWatchWarning`. */
export function alertNameOf(finding: Pick<Finding, 'verdict' | 'probe'>): string {
  if (finding.verdict === 'leak') return 'KvfenceCrossTenantLeak'
  return finding.probe === 'capacity' ? 'KvfenceCapacityGap' : 'KvfenceWatchWarning'
}

/** Labels an alert carries (Alertmanager) and that the Slack text names. */
function labelsOf(alert: ActiveAlert): Record<string, string> {
  const { finding } = alert
  return {
    alertname: alertNameOf(finding),
    severity: finding.verdict === 'leak' ? 'critical' : 'warning',
    verdict: finding.verdict,
    // What kind of harm (classes.ts): a routing rule can page on content-leak alone.
    class: withClass(finding).class,
    probe: finding.probe,
    finding: alert.key,
  }
}

/** The body for `format`. `endsAt` is now for a resolved alert. */
export function webhookBody(
  format: WebhookFormat,
  status: AlertStatus,
  alert: ActiveAlert,
  target: string,
  now: number = Date.now(),
): Record<string, unknown> {
  const { finding } = alert
  const evidence = alertEvidence(finding.evidence)
  if (format === 'slack') {
    const head = status === 'firing' ? ':rotating_light: FIRING' : ':white_check_mark: RESOLVED'
    const text = `${head} kvfence watch ${finding.verdict} (${finding.probe}) on ${target}: ${finding.title}`
    const details = Object.entries(evidence)
      .map(([k, v]) => `*${k}*: \`${typeof v === 'string' ? v : JSON.stringify(v)}\``)
      .join('\n')
    return {
      text,
      blocks: [{ type: 'section', text: { type: 'mrkdwn', text: `${text}\n${details}` } }],
    }
  }
  const labels = { ...labelsOf(alert), target }
  const fingerprint = createHash('sha256').update(JSON.stringify(labels)).digest('hex').slice(0, 16)
  return {
    version: '4',
    groupKey: `kvfence-watch:${alert.key}`,
    truncatedAlerts: 0,
    status,
    receiver: 'kvfence-watch',
    groupLabels: { finding: alert.key },
    commonLabels: labels,
    commonAnnotations: { summary: finding.title, remediation: finding.remediation },
    externalURL: '',
    alerts: [
      {
        status,
        labels,
        annotations: {
          summary: finding.title,
          remediation: finding.remediation,
          evidence: JSON.stringify(evidence),
        },
        startsAt: new Date(alert.startedAt).toISOString(),
        endsAt: status === 'resolved' ? new Date(now).toISOString() : '0001-01-01T00:00:00Z',
        generatorURL: '',
        fingerprint,
      },
    ],
  }
}

/** The evidence fields an alert may carry: tenants, the request, the canary and its matched
 *  fragment, the redacted excerpt (only canary material stays readable), sizes and counts. */
export function alertEvidence(evidence: Record<string, unknown>): Record<string, unknown> {
  const kept = [
    'victimTenant',
    'observerTenant',
    'request',
    'canary',
    'matchedFragment',
    'excerpt',
    'numCrossings',
    'numCrossTenant',
    'trigger',
    'advertisedContextTokens',
    'effectivePoolTokens',
    'limitTokens',
    'requests',
    'baseline',
    'readings',
    'numValidSent',
    'numFailed',
    'failedBy',
  ]
  return Object.fromEntries(kept.filter((k) => k in evidence).map((k) => [k, evidence[k]]))
}

/** POSTs `body`; resolves with the HTTP status, or the failure (never throws). The URL is never
 *  logged by the caller: a Slack webhook URL is itself a secret. */
export async function postWebhook(
  url: string,
  body: unknown,
  timeoutMs: number = 10_000,
): Promise<{ readonly status: number | null; readonly error: string | null }> {
  const stop = new AbortController()
  const timer = setTimeout(() => stop.abort(), timeoutMs)
  try {
    const res = await fetch(url, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify(body),
      signal: stop.signal,
    })
    await res.arrayBuffer().catch(() => null)
    return { status: res.status, error: null }
  } catch (err) {
    const cause = (err as { cause?: { code?: string } }).cause
    return { status: null, error: cause?.code ?? (err instanceof Error ? err.name : String(err)) }
  } finally {
    clearTimeout(timer)
  }
}
