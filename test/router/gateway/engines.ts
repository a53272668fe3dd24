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
    /** The engine's model id (`backend.model`). */
    backendModel?: string
    /** `backend.kvPoolTokens`. */
    kvPoolTokens?: number
    /** `backend.allowUnsalted`. */
    allowUnsalted?: ('chat' | 'completion')[]
    /** The engine's API key (`backend.apiKeyEnv`'s value). */
    apiKey?: string
    /** The secret of the tenants' salts. */
    saltSecret?: Uint8Array
    /** The isolation self-check's interval, ms (default 0: only at start). */
    selfCheckIntervalMs?: number
    /** The cluster token (`KVFENCE_CLUSTER_TOKEN`): operator actions' credential. */
    clusterToken?: string
    log?: import('pino').Logger
  } = {},
): Promise<RunningRouter> {
  return startRouter({
    gateway: {
      kind: engine.kind,
      url: engine.url,
      tokenizerDir: extra.tokenizerDir,
      discoveryIntervalMs: extra.discoveryIntervalMs ?? 0,
      selfCheckIntervalMs: extra.selfCheckIntervalMs ?? 0,
      ...(extra.backendModel === undefined ? {} : { backendModel: extra.backendModel }),
      ...(extra.kvPoolTokens === undefined ? {} : { kvPoolTokens: extra.kvPoolTokens }),
      ...(extra.allowUnsalted === undefined ? {} : { allowUnsalted: extra.allowUnsalted }),
      ...(extra.apiKey === undefined ? {} : { apiKey: extra.apiKey }),
      ...(extra.saltSecret === undefined ? {} : { saltSecret: extra.saltSecret }),
    },
    ...(extra.modelName === null ? {} : { modelName: extra.modelName ?? 'served' }),
    contextWindow: extra.contextWindow,
    tenants: [
      { name: 'alpha', keySha256: apiKeyDigest(keys.alpha) },
      { name: 'beta', keySha256: apiKeyDigest(keys.beta) },
    ],
    port: 0,
    ...(extra.clusterToken === undefined ? {} : { clusterToken: extra.clusterToken }),
    log: extra.log ?? captureLogs().log,
  })
}
