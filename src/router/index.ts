/** The router's public surface: build a handler ({@link createRouter}) or a whole listening
 *  router ({@link startRouter}), and the parts they are made of. */
export { createRouter, type RequestHandler, type RouterDeps } from './api/routes.js'
export {
  startRouter,
  type GatewayBackendOptions,
  type RunningRouter,
  type StartRouterOptions,
} from './start.js'
export { buildRouterConfig, routerConfigDefaults, type RouterConfig } from './config.js'
export {
  createCapacityMonitor,
  defaultCapacityRecheckMs,
  type CapacityMonitor,
  type CapacityState,
} from './native/capacity-monitor.js'
export {
  decideContextWindow,
  effectiveCapacity,
  type ContextWindowDecision,
  type ContextWindowOptions,
  type WorkerReport,
} from './admission/capacity.js'
export {
  apiKeyDigest,
  createTenantRegistry,
  loadTenants,
  TenantRecord,
  type TenantRegistry,
} from './tenants/tenants.js'
export {
  createWorkerClient,
  type GenerationEvent,
  type WorkerClient,
  type WorkerClientOptions,
} from '../control/worker-client.js'
export { createRouterMetrics, type RouterMetrics } from './metrics/metrics.js'
export { createLimiter, type Limiter } from './admission/limits.js'
export { LimitError } from './admission/limit-error.js'
export { queueLimitDefaults, type QueueLimits } from './admission/queue-limits.js'
export {
  startGateway,
  type BackendKind,
  type Gateway,
  type GatewayOptions,
} from './gateway/backend.js'
export { createNativeBackend, type NativeBackendOptions } from './native/backend.js'
export type { Backend, GenerationJob, Outcome, PreparedPrompt } from './backend.js'
export { PoolFullError } from '../control/worker-client.js'
