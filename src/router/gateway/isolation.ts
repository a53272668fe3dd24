/** What the gateway does with the self-check's results (self-check.ts): which paths it serves,
 *  which it refuses, and whether it sends the tenant's salt on each.
 *  - `isolated`: served, salted.
 *  - `cannot-tell`: served, salted, with a warning (no prefix cache was seen to test).
 *  - `shared` (the engine ignores the salt) and `salt-refused` (the engine refuses the field):
 *    refused — at start the gateway does not start, later each request on the path gets 503
 *    `path_refused` — unless the operator names the path in `allowUnsalted`: then `shared` is
 *    served (salted, uselessly) and `salt-refused` is served without the salt, each with a
 *    warning. With guards off nothing is refused.
 *  A path the engine did not answer for (down, redeploying) keeps the standing of the last
 *  answered check. The check runs at start, every `intervalMs`, and on demand (`recheck`).
 *  Knows endpoints and self-check results; knows nothing of tenants or requests' bodies. */
import type { Logger } from 'pino'
import { KvfenceError } from '../../common/errors.js'
import type { Endpoint } from '../api/schemas.js'
import { type PathCheck, type SelfCheckReport, enginePaths } from './self-check.js'

/** What the gateway does with a path after a self-check: `served` (isolated, or no cache seen to
 *  test), `served-anyway` (not isolated, but allowed by `allowUnsalted` or guards off), or
 *  `refused`. */
export type PathStanding = 'served' | 'served-anyway' | 'refused'

/** A self-check's report with the gateway's standing on each path (what `/server_info` and
 *  `POST /isolation_self_check` show). */
export interface GuardedSelfCheckReport extends SelfCheckReport {
  readonly paths: readonly (PathCheck & { readonly standing: PathStanding })[]
}

/** The gateway's standing on each path after the last self-check. */
export interface PathIsolationGuard {
  /** The last self-check, each path with its standing (null before the first). */
  last(): GuardedSelfCheckReport | null
  /** Whether the tenant's salt goes to the engine on `endpoint`. */
  isSalted(endpoint: Endpoint): boolean
  /** Throws `path_refused` when `endpoint` must not be served now. */
  checkServed(endpoint: Endpoint): void
  /** Takes a new self-check's report; at start (`isStart`) throws `guard_violation` for a path
   *  that must be refused, naming it and how to allow it. */
  apply(report: SelfCheckReport, isStart: boolean): void
}

/** Options of {@link createPathIsolationGuard}. */
export interface PathIsolationOptions {
  /** Paths the operator serves even where the engine does not isolate tenants' caches. */
  allowUnsalted: readonly Endpoint[]
  guardsEnabled: boolean
  kind: string
  log: Logger
}

/** A guard with no report yet: every path salted and served. */
export function createPathIsolationGuard(options: PathIsolationOptions): PathIsolationGuard {
  let report: GuardedSelfCheckReport | null = null
  const unsalted = new Set<Endpoint>()
  const refused = new Map<Endpoint, string>()
  const isAllowed = (e: Endpoint) => options.allowUnsalted.includes(e) || !options.guardsEnabled
  return {
    last: () => report,
    isSalted: (endpoint) => !unsalted.has(endpoint),
    checkServed(endpoint) {
      const why = refused.get(endpoint)
      if (why !== undefined) throw new KvfenceError('path_refused', why)
    },
    apply(next, isStart) {
      const problems: string[] = []
      const previous = report
      const kept = (p: PathCheck) =>
        p.isUnanswered ? previous?.paths.find((q) => q.endpoint === p.endpoint) : undefined
      for (const path of next.paths) {
        // An engine that did not answer (down, redeploying) showed nothing of its isolation:
        // the path keeps the standing the last answered check gave it (its salt, or its
        // refusal), rather than being served salted as "cannot tell".
        const before = kept(path)
        if (before !== undefined) {
          options.log.warn(
            { endpoint: path.endpoint, standing: before.standing },
            `isolation self-check: ${options.kind} backend did not answer (${path.detail}); the path keeps its standing`,
          )
          continue
        }
        const problem = decide(path, isAllowed(path.endpoint), options, { unsalted, refused })
        if (problem !== null) problems.push(problem)
      }
      report = {
        ...next,
        paths: next.paths.map((p) => ({
          ...p,
          standing: kept(p)?.standing ?? standingOf(p, refused),
        })),
      }
      const unanswered = next.paths.filter((p) => p.isUnanswered)
      if (isStart && unanswered.length > 0 && unanswered.length === next.paths.length) {
        throw new KvfenceError(
          'worker_unavailable',
          `${options.kind} backend did not answer the isolation self-check: ${unanswered[0].detail}`,
        )
      }
      if (isStart && problems.length > 0) {
        throw new KvfenceError(
          'guard_violation',
          `isolation self-check: ${problems.join('; ')}; to serve such a path anyway, name it in backend.allowUnsalted`,
        )
      }
    },
  }
}

function standingOf(path: PathCheck, refused: ReadonlyMap<Endpoint, string>): PathStanding {
  if (refused.has(path.endpoint)) return 'refused'
  return path.result === 'isolated' || path.result === 'cannot-tell' ? 'served' : 'served-anyway'
}

/** Applies one path's result to the sets; returns the refusal's reason, or null. Logs each
 *  result that is not `isolated`. */
function decide(
  path: PathCheck,
  isAllowed: boolean,
  options: PathIsolationOptions,
  state: { unsalted: Set<Endpoint>; refused: Map<Endpoint, string> },
): string | null {
  const where = `${options.kind} backend ${enginePaths[path.endpoint]}`
  const fields = { endpoint: path.endpoint, result: path.result }
  state.refused.delete(path.endpoint)
  state.unsalted.delete(path.endpoint)
  if (path.result === 'isolated') {
    options.log.info(fields, `isolation self-check: ${where}: ${path.detail}`)
    return null
  }
  if (path.result === 'cannot-tell') {
    options.log.warn(fields, `isolation self-check: ${where}: cannot tell: ${path.detail}`)
    return null
  }
  if (isAllowed) {
    if (path.result === 'salt-refused') state.unsalted.add(path.endpoint)
    options.log.warn(
      fields,
      `isolation self-check: ${where}: ${path.detail}; served anyway (allowUnsalted${options.guardsEnabled ? '' : ', guards off'}): tenants' prefix caches are not kept apart on it`,
    )
    return null
  }
  const reason = `${where}: ${path.detail}`
  state.refused.set(
    path.endpoint,
    `The ${path.endpoint === 'chat' ? 'chat completions' : 'completions'} path is not served: the engine behind the gateway does not keep tenants' prefix caches apart on it.`,
  )
  options.log.error(fields, `isolation self-check: ${reason}; the path is refused`)
  return reason
}
