/** The auditor's public API: `runAudit` (used by `kvfence audit` and `kvfence demo`) and the
 *  reporters. The auditor speaks HTTP only and imports nothing from the rest of kvfence, so it
 *  audits any OpenAI-compatible endpoint (kvfence, SGLang, vLLM, ...). */
export {
  runAudit,
  planAudit,
  checkTenantKeys,
  exitCodeFor,
  auditDefaults,
  type AuditOptions,
  type ProgressEvent,
} from './run.js'
export { maxAuditSeconds, minAuditSeconds } from './budget.js'
export { writeJsonReport, formatJsonReport } from './reporters/json.js'
export {
  consoleWidth,
  defaultConsoleWidth,
  formatProgress,
  countedVerdicts,
  formatSummary,
} from './reporters/console.js'
export { formatJunitReport, writeJunitReport } from './reporters/junit.js'
export {
  formatHtmlReport,
  writeHtmlReport,
  readChartJs,
  plotData,
  limitMarkers,
  type LimitMarker,
} from './reporters/html.js'
export { checkAuthorizedTarget, isLoopbackHost } from './authorize.js'
export { formatPlan, type AuditPlan, type ProbePlan, type PlannedRequests } from './plan.js'
export { loadAuditConfig, parseAuditConfig, type AuditConfigFile } from './config.js'
export { probes } from './probes/index.js'
export {
  AuditError,
  probeNames,
  verdictRank,
  type AuditReport,
  type BudgetLimits,
  type Finding,
  type ProbeName,
  type ProbeRun,
  type Severity,
  type Tenant,
  type Verdict,
} from './types.js'
