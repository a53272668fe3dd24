/** The trials of the `entrypoints` probe and their judgement: a trial is one cross-tenant check
 *  on one path (the first tenant, A, primes a prefix on one entrypoint; the second, B, sends the
 *  same prefix with its own canaries on another or the same one), with its positive control (A
 *  then sends the same prefix on B's path: its reuse shows that a hit is visible there). The
 *  control comes after B's request, so B's hit can only come from A's prime; were the control's
 *  reuse B's entry (a cache shared across tenants on B's path), that path's same-path trial has
 *  B hit A's prime and says so. Judged per path:
 *  - any canary of A in an answer to B (or of B in one to A): `content-leak` (verdict `leak`);
 *  - B served at least half the cached tokens A's own control was (and at least
 *    {@link minReusedTokens}): `side-channel` (a warning): B can see that A sent that prefix;
 *  - otherwise clean only where every answer was read whole and the control showed reuse;
 *    inconclusive naming what was not exercised where it did not.
 *  Knows canaries and findings; knows nothing of HTTP. */
import { findCanaries, redact } from '../canaries.js'
import { inconclusiveRemediation } from '../probe.js'
import type { Finding } from '../types.js'
import type { EntrypointAnswer } from './entrypoint-shapes.js'

/** Cached tokens that count as reuse of the shared prefix (tens of tokens at least): one 16-token page (vLLM's default
 *  block) is the coarsest granularity engines cache at. */
export const minReusedTokens = 16

/** One sent request and its answer. */
export interface Exchange {
  readonly tenant: 'A' | 'B'
  /** Where it was sent: an entrypoint's name, or the tool continuation's. */
  readonly path: string
  readonly prompt: string
  readonly answer: EntrypointAnswer
}

/** One cross-tenant check on `path`, primed on `primedOn`. */
export interface Trial {
  readonly primedOn: string
  readonly path: string
  /** A's own request with the prefix, after B's: shows whether reuse is visible there. */
  readonly control: EntrypointAnswer
  /** B's request with the prefix A primed. */
  readonly test: EntrypointAnswer
}

/** Each tenant's canaries, and its name (for titles). */
export interface Canaries {
  readonly A: readonly string[]
  readonly B: readonly string[]
  readonly names: { readonly A: string; readonly B: string }
}

const leakRemediation =
  "Key every entrypoint's prefix and response caches by the tenant (the same cache salt on " +
  'completions, chat, Responses and its tool-call continuations, Anthropic messages and native ' +
  'generate routes); treat the affected answers as disclosed. vLLM: pass cache_salt on every route ' +
  '(/v1/messages since PR #49498).'
const sideRemediation =
  'Key the prefix cache by the tenant on this entrypoint as on completions: the entrypoint drops ' +
  "the tenant's cache salt (vLLM /v1/messages before PR #49498; Responses tool-call " +
  'continuations, vLLM PR #51818), so any tenant can tell which prefixes others sent.'

/** The findings for requests landing on `path`: leaks first, then side channels, else one
 *  clean or inconclusive finding. `served`: the discovery table, kept in every finding. */
export function judgePath(
  path: string,
  endpoint: string,
  trials: readonly Trial[],
  exchanges: readonly Exchange[],
  canaries: Canaries,
  served: readonly Record<string, unknown>[],
): Finding[] {
  const here = exchanges.filter((e) => e.path === path)
  const leaks = here.flatMap((e) => {
    const foreign = e.tenant === 'B' ? canaries.A : canaries.B
    const matches = findCanaries(e.answer.text, foreign)
    return matches.length === 0 ? [] : [{ e, matches }]
  })
  const findings: Finding[] = leaks.slice(0, 5).map(({ e, matches }) => ({
    probe: 'entrypoints',
    verdict: 'leak',
    severity: 'critical',
    title: `${endpoint}: tenant ${canaries.names[e.tenant]}'s answer carried ${matches.length} canary(ies) only tenant ${canaries.names[e.tenant === 'B' ? 'A' : 'B']} sent`,
    evidence: {
      endpoint,
      entrypoint: path,
      fragments: matches.map((m) => m.fragment),
      answer: redact(e.answer.text, [...canaries.A, ...canaries.B], matches[0].index),
      entrypoints: served,
    },
    remediation: leakRemediation,
  }))
  const isControlled = (t: Trial) => (t.control.cachedTokens ?? 0) >= minReusedTokens
  const shared = trials.filter(
    (t) =>
      isControlled(t) &&
      (t.test.cachedTokens ?? 0) >= minReusedTokens &&
      2 * (t.test.cachedTokens ?? 0) >= (t.control.cachedTokens ?? 0),
  )
  if (shared.length > 0)
    findings.push({
      probe: 'entrypoints',
      verdict: 'warning',
      class: 'side-channel',
      severity: 'high',
      title: `${endpoint}: tenant ${canaries.names.B} was served cached tokens of a prefix only tenant ${canaries.names.A} sent (primed on ${shared.map((t) => t.primedOn).join(', ')}): the prefix cache is shared across tenants here`,
      evidence: {
        endpoint,
        entrypoint: path,
        trials: shared.map(trialEvidence),
        entrypoints: served,
      },
      remediation: sideRemediation,
    })
  if (findings.length > 0) return findings
  return [cleanOrInconclusive(path, endpoint, trials, here, served, canaries.names)]
}

function cleanOrInconclusive(
  path: string,
  endpoint: string,
  trials: readonly Trial[],
  here: readonly Exchange[],
  served: readonly Record<string, unknown>[],
  names: Canaries['names'],
): Finding {
  const numWhole = here.filter((e) => e.answer.isAnswered).length
  const controlled = trials.filter((t) => (t.control.cachedTokens ?? 0) >= minReusedTokens)
  const uncontrolled = trials.filter((t) => !controlled.includes(t))
  const same = trials.find((t) => t.primedOn === path)
  const gaps: string[] = []
  if (here.length === 0 || numWhole < here.length)
    gaps.push(`${here.length - numWhole} of ${here.length} answers not read whole`)
  if (same === undefined) gaps.push('no same-path trial ran')
  else if (!controlled.includes(same))
    gaps.push(
      `tenant ${names.A}'s own repeat showed no reused prefix (cached tokens: ${same.control.cachedTokens ?? 'not reported'}), so cache isolation was not exercised`,
    )
  const evidence = {
    endpoint,
    entrypoint: path,
    answersChecked: here.length,
    trials: trials.map(trialEvidence),
    entrypoints: served,
  }
  const crossNote =
    uncontrolled.length === 0
      ? ''
      : `; not shared even for one tenant, so not a cross-tenant question: ${uncontrolled.map((t) => `${t.primedOn}→${t.path}`).join(', ')}`
  if (gaps.length > 0)
    return {
      probe: 'entrypoints',
      verdict: 'inconclusive',
      class: 'side-channel',
      severity: 'medium',
      title: `${endpoint}: could not tell: ${gaps.join('; ')}${here.length > 0 ? `; no foreign canary in ${numWhole} answers` : ''}`,
      evidence,
      remediation: inconclusiveRemediation,
    }
  return {
    probe: 'entrypoints',
    verdict: 'clean',
    severity: 'info',
    title: `${endpoint}: no foreign canary in ${here.length} answers; tenant ${names.B} was served none of tenant ${names.A}'s cached prefixes primed on ${controlled.map((t) => t.primedOn).join(', ')} (${names.A}'s own repeats reused ${controlled.map((t) => t.control.cachedTokens).join(', ')} tokens)${crossNote}`,
    evidence,
    remediation: 'None needed.',
  }
}

function trialEvidence(t: Trial): Record<string, unknown> {
  return {
    primedOn: t.primedOn,
    path: t.path,
    controlCachedTokens: t.control.cachedTokens,
    testCachedTokens: t.test.cachedTokens,
    testPromptTokens: t.test.promptTokens,
  }
}
