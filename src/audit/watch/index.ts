/** The watch's public API: `runWatch` (used by `kvfence watch`), its options and metrics. */
export { runWatch, cycleCostBound, type WatchDeps } from './loop.js'
export { formatWatchPlan } from './plan.js'
export {
  loadWatchConfig,
  validateWatchOptions,
  watchDefaults,
  webhookFormats,
  type WatchConfig,
  type WatchConfigFile,
  type WatchOptions,
  type WebhookFormat,
} from './options.js'
export { createWatchMetrics, serveMetrics, type WatchMetrics } from './metrics.js'
export { planCycle, runCycle, triggerProbes, type CycleReport, type TriggerName } from './cycle.js'
export { HourlyBudget } from './hourly.js'
export { AlertTracker } from './alerts.js'
export { webhookBody, postWebhook } from './webhook.js'
