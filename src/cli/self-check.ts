/** `kvfence self-check --url ROUTER`: asks a running router in gateway mode to run its isolation
 *  self-check of the engine now (`POST /isolation_self_check`, src/router/api/operator.ts) and
 *  prints the result per path and its cost; `--json` prints the report as the router gave it.
 *  The credential is the cluster token, read from `KVFENCE_CLUSTER_TOKEN` (never a flag: argv is
 *  visible to every local user) and never printed.
 *  Exit status: 0 when no path was found unisolated, 1 when one was (`shared` or
 *  `salt-refused`: the router now refuses it unless `allowUnsalted` names it; the line says
 *  which, and 1 stands either way: the engine does not isolate that path), 2 when the router
 *  refused or did not answer, or the engine answered none of the checks (one line saying why;
 *  the router then keeps each path's earlier standing). */
import { InvalidArgumentError, type Command } from 'commander'
import { clusterTokenEnv, clusterTokenFrom, clusterTokenHeader } from '../control/cluster-token.js'

interface SelfCheckFlags {
  url: string
  json?: boolean
}

/** The part of the router's report printed here. */
interface Report {
  paths: {
    endpoint: string
    result: string
    detail: string
    standing?: string
    isUnanswered?: boolean
  }[]
  numRequests: number
  numTokens: number
  durationMs: number
}

/** Results that mean the engine does not keep tenants' prefix caches apart on a path. */
const unisolated = new Set(['shared', 'salt-refused'])

export function registerSelfCheck(program: Command): void {
  program
    .command('self-check')
    .description(
      `run a gateway router's isolation self-check of its engine now (credential: ${clusterTokenEnv} from the environment); exit 1 when a path is not isolated`,
    )
    .requiredOption('--url <url>', "the router's base URL (http://host:port)", routerUrlOption)
    .option('--json', 'print the report as the router gave it')
    .action(async (flags: SelfCheckFlags) => {
      const token = clusterTokenFrom(process.env)
      if (token === null) {
        throw new Error(`${clusterTokenEnv} is not set: it is the credential of operator actions`)
      }
      const report = await askRouter(flags.url, token)
      process.stdout.write(flags.json ? `${JSON.stringify(report, null, 2)}\n` : describe(report))
      if (report.paths.length > 0 && report.paths.every((p) => p.isUnanswered === true)) {
        // Nothing was checked: the router keeps each path's earlier standing.
        process.stderr.write(
          `kvfence: the engine behind ${flags.url} did not answer the self-check; each path keeps its earlier standing\n`,
        )
        process.exitCode = 2
      } else if (report.paths.some((p) => unisolated.has(p.result))) process.exitCode = 1
    })
}

/** Posts the request; throws a one-line error for anything but a 200 with a report. */
async function askRouter(url: string, token: string): Promise<Report> {
  const res = await fetch(`${url}/isolation_self_check`, {
    method: 'POST',
    headers: { [clusterTokenHeader]: token },
  }).catch((err: unknown) => {
    const cause = (err as { cause?: { message?: string } }).cause?.message
    throw new Error(`the router at ${url} did not answer: ${cause ?? String(err)}`)
  })
  const body = (await res.json().catch(() => null)) as
    (Report & { error?: { message?: string } }) | null
  if (res.status !== 200 || body === null || !Array.isArray(body.paths)) {
    throw new Error(
      `the router at ${url} answered HTTP ${res.status}: ${body?.error?.message ?? 'no report'}`,
    )
  }
  return body
}

/** What the router does with a path that is not isolated, as the router's report says it. */
const standingWords: Record<string, string> = {
  'served-anyway': ': served anyway (allowUnsalted or guards off)',
  refused: ': refused by the router',
}

/** One line per path (a path not isolated says whether the router serves it), then the cost. */
function describe(report: Report): string {
  const lines = report.paths.map(
    (p) => `${p.endpoint}: ${p.result} (${p.detail})${standingWords[p.standing ?? ''] ?? ''}`,
  )
  lines.push(
    `${report.numRequests} requests, ${report.numTokens} tokens, ${(report.durationMs / 1000).toFixed(2)} s`,
  )
  return `${lines.join('\n')}\n`
}

/** An http(s) URL with no path (trailing slash dropped). */
function routerUrlOption(value: string): string {
  let url: URL | null = null
  try {
    url = new URL(value)
  } catch {
    // refused below
  }
  if (
    url === null ||
    (url.protocol !== 'http:' && url.protocol !== 'https:') ||
    url.pathname !== '/'
  )
    throw new InvalidArgumentError(
      `expected the router's base URL (http://host:port), got "${value}"`,
    )
  return url.origin
}
