/** Finding classes: what kind of harm a finding is about, from one fixed list, each with the CWE
 *  weaknesses it maps to (MITRE CWE 4.x names). A class answers "what happened"; the verdict
 *  answers "did the probe see it" (types.ts). `leak` is the verdict of `content-leak` alone: a
 *  side channel, a changed answer or a refused pool is a `warning` of its own class.
 *  Knows the probes' names and the verdicts; knows nothing of how probes judge answers. */
import { probes } from './probes/index.js'
import type { Finding, FindingSource, Severity } from './types.js'

export const findingClasses = [
  'content-leak',
  'side-channel',
  'integrity',
  'availability',
  'resource-leak',
  'misconfiguration',
  'error-handling',
  'credential-exposure',
] as const
export type FindingClass = (typeof findingClasses)[number]

/** One class: its meaning (one line for the docs and `--help`), its CWE ids and an example. */
export interface ClassInfo {
  readonly meaning: string
  readonly cwe: readonly string[]
  readonly example: string
}

/** The class table. CWE ids, most specific first:
 *  - CWE-488 Exposure of Data Element to Wrong Session, CWE-226 Sensitive Information in Resource
 *    Not Removed Before Reuse (stale KV pages), CWE-200 Exposure of Sensitive Information to an
 *    Unauthorized Actor;
 *  - CWE-208 Observable Timing Discrepancy, CWE-203 Observable Discrepancy (a cached-token count
 *    or an eviction another tenant can see);
 *  - CWE-362 Concurrent Execution using Shared Resource with Improper Synchronization, CWE-668
 *    Exposure of Resource to Wrong Sphere (another tenant's request changed one's answer);
 *  - CWE-400 Uncontrolled Resource Consumption, CWE-770 Allocation of Resources Without Limits or
 *    Throttling;
 *  - CWE-772 Missing Release of Resource after Effective Lifetime, CWE-401 Missing Release of
 *    Memory after Effective Lifetime;
 *  - CWE-1284 Improper Validation of Specified Quantity in Input (a prompt over the pool taken),
 *    CWE-20 Improper Input Validation;
 *  - CWE-522 Insufficiently Protected Credentials (a status body serializing `api_key`);
 *  - CWE-755 Improper Handling of Exceptional Conditions, CWE-754 Improper Check for Unusual or
 *    Exceptional Conditions. */
export const classTable: Readonly<Record<FindingClass, ClassInfo>> = {
  'content-leak': {
    meaning:
      "another tenant's material reached a tenant: in an answer, a stream or an endpoint's body",
    cwe: ['CWE-488', 'CWE-226', 'CWE-200'],
    example: "bob's answer carried a canary alice planted",
  },
  'side-channel': {
    meaning:
      "another tenant's activity is observable, without its material: cache hits, timing, counts",
    cwe: ['CWE-208', 'CWE-203'],
    example: "bob's request was served cached tokens of a prefix only alice sent",
  },
  integrity: {
    meaning: "another tenant's request changed an answer without its material showing",
    cwe: ['CWE-362', 'CWE-668'],
    example: 'a temperature-0 answer differs from its cold one after the pool was churned',
  },
  availability: {
    meaning: 'the endpoint failed or stopped answering valid requests during the audit',
    cwe: ['CWE-400', 'CWE-770'],
    example: '159 of 195 valid requests got 503 while /health said 200',
  },
  'resource-leak': {
    meaning: 'KV pages or slots stay held after the request that took them ended',
    cwe: ['CWE-772', 'CWE-401'],
    example: 'aborted requests left pages in use that never came back',
  },
  misconfiguration: {
    meaning: 'limits the endpoint states or enforces do not match its KV pool or context',
    cwe: ['CWE-1284', 'CWE-20'],
    example: 'a prompt larger than the reported KV pool was accepted with 200',
  },
  'error-handling': {
    meaning: 'an invalid request was not refused with a clear error',
    cwe: ['CWE-755', 'CWE-754'],
    example: 'an invalid request was answered 200 with an error text',
  },
  'credential-exposure': {
    meaning:
      'a credential (an API key, a password, a token, a private key) is served to a tenant or to anyone',
    cwe: ['CWE-522', 'CWE-200'],
    example: "GET /server_info with bob's key served the server's admin_api_key",
  },
}

/** The class of every finding of `source` unless the finding names its own (a clean or
 *  inconclusive finding's class is the harm its probe looks for): its probe's (the registry,
 *  probes/index.ts), `availability` for the audit's own check. */
export function probeClass(source: FindingSource): FindingClass {
  return source === 'availability' ? 'availability' : probes[source].class
}

/** Marks on a finding that a gate can name besides classes and severities.
 *  `over-pool-accepted`: a prompt larger than the KV pool the endpoint reports was accepted with
 *  200, and no other tier that could hold it is reported: the incident's precondition. */
export const findingTags = ['over-pool-accepted'] as const
export type FindingTag = (typeof findingTags)[number]

/** `finding` with its class and CWE ids: the class it names, else `content-leak` for a `leak`
 *  (the only class of that verdict), else its probe's. A finding that names another class with
 *  verdict `leak` is a probe's bug. */
export function withClass<F extends Omit<Finding, 'class' | 'cwe'> & { class?: FindingClass }>(
  finding: F,
): F & { class: FindingClass; cwe: readonly string[] } {
  const cls =
    finding.verdict === 'leak' ? 'content-leak' : (finding.class ?? probeClass(finding.probe))
  return { ...finding, class: cls, cwe: classTable[cls].cwe }
}

/** Severities from least to most urgent. */
export const severityRank: Readonly<Record<Severity, number>> = {
  info: 0,
  low: 1,
  medium: 2,
  high: 3,
  critical: 4,
}
