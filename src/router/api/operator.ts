/** The router's operator actions: requests only the operator may make, authenticated by the
 *  control plane's credential — the cluster token (`KVFENCE_CLUSTER_TOKEN`, sent as
 *  `x-kvfence-cluster-token`), which the operator already sets on the router and its workers —
 *  never by a tenant's key. A router started without the token refuses every operator action.
 *  `POST /isolation_self_check` (gateway mode): runs the engine's isolation self-check now;
 *  the paths it refuses or serves change at once, and the answer is its report, the value of
 *  `/server_info`'s `isolationSelfCheck`.
 *  Knows the token's header and the backend's interface; logs neither the token nor keys. */
import type { IncomingMessage, ServerResponse } from 'node:http'
import type { Logger } from 'pino'
import { KvfenceError } from '../../common/errors.js'
import {
  clusterTokenEnv,
  clusterTokenHeader,
  isClusterTokenValid,
} from '../../control/cluster-token.js'
import type { Backend } from '../backend.js'
import { sendJson } from './http.js'

/** The path of the on-demand isolation self-check. */
export const selfCheckPath = '/isolation_self_check'

/** Throws unless `req` carries the cluster token `token`: `permission_denied` (403) when the
 *  router has none (operator actions are off), `invalid_api_key` (401) when the header is absent
 *  or wrong — the same answer whatever else the request carries (a tenant's key included). */
export function authenticateOperator(token: string | null, req: IncomingMessage): void {
  if (token === null) {
    throw new KvfenceError(
      'permission_denied',
      `Operator actions are off on this router: start it with ${clusterTokenEnv} set, and send that token as ${clusterTokenHeader}.`,
    )
  }
  if (!isClusterTokenValid(token, req.headers[clusterTokenHeader])) {
    throw new KvfenceError(
      'invalid_api_key',
      `This is an operator action: send the cluster token (${clusterTokenEnv}) as ${clusterTokenHeader}; a tenant's API key is not accepted.`,
    )
  }
}

/** `POST /isolation_self_check`: the operator's token checked, then the self-check run and its
 *  report sent (200). Throws `not_found` when the backend has no self-check (kvfence's own
 *  workers). */
export async function runSelfCheckNow(
  token: string | null,
  backend: Backend,
  log: Logger,
  req: IncomingMessage,
  res: ServerResponse,
): Promise<void> {
  authenticateOperator(token, req)
  if (backend.runIsolationSelfCheck === null) {
    throw new KvfenceError(
      'not_found',
      `${selfCheckPath} is an action of gateway mode: kvfence's own workers have no engine to check`,
    )
  }
  log.info('isolation self-check asked for by the operator')
  sendJson(res, 200, await backend.runIsolationSelfCheck())
}
