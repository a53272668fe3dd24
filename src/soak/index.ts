/** The soak as a library: `startSoakCluster` then `runSoak`, or `runSoak` against any kvfence
 *  cluster whose URLs and process ids are known. */
export { runSoak, failuresOf, type SoakTarget, type ProgressFn } from './run.js'
export { startSoakCluster, soakShape, type SoakCluster } from './cluster.js'
export { Oracle, type SoakRequest, type Expected } from './oracle.js'
export {
  soakDefaults,
  maxRssGrowthRatio,
  soakSentinelWindowSeconds,
  type SoakOptions,
  type SoakReport,
} from './types.js'
