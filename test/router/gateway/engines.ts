/** The router in gateway mode in front of a stand-in engine (test/helpers/engines.ts), for the
 *  gateway's tests. Not a test file itself. */
import { startRouter, type RunningRouter } from '../../../src/router/start.js'
import { apiKeyDigest } from '../../../src/router/tenants/tenants.js'
import type { Engine } from '../../helpers/engines.js'
import { captureLogs, keys } from '../helpers.js'

/** A router (port 0, served name `served`, tenants alpha and beta) in gateway mode in front of `engine`;
 *  discovery only at start unless `discoveryIntervalMs` says otherwise. */
export async function startGatewayRouter(
  engine: Engine,
  extra: {
    tokenizerDir?: string
    contextWindow?: number
    discoveryIntervalMs?: number
    /** Served model name; null: none configured (the engine's own id is served). */
    modelName?: string | null
  } = {},
): Promise<RunningRouter> {
  return startRouter({
    gateway: {
      kind: engine.kind,
      url: engine.url,
      tokenizerDir: extra.tokenizerDir,
      discoveryIntervalMs: extra.discoveryIntervalMs ?? 0,
    },
    ...(extra.modelName === null ? {} : { modelName: extra.modelName ?? 'served' }),
    contextWindow: extra.contextWindow,
    tenants: [
      { name: 'alpha', keySha256: apiKeyDigest(keys.alpha) },
      { name: 'beta', keySha256: apiKeyDigest(keys.beta) },
    ],
    port: 0,
    log: captureLogs().log,
  })
}
