/** The auditor's tool errors: the audit could not run at all. Apart from types.ts so that a
 *  module the probes use can throw one without loading types.ts, which loads the probe registry
 *  (a probe loaded first would then be read by the registry before its module had run).
 *  Knows nothing of HTTP. */
import type { AuditReport } from './types.js'

/** `no_completion_answered`: the target answered none of the valid completions the audit sent
 *  whole, or none could be sent (not an OpenAI endpoint, a wrong path prefix, an engine failing
 *  every request, answers that never end, a budget spent before any).
 *  `model_not_served`: `--model` is not one `/v1/models` lists and a completion naming it was
 *  not answered. `unauthorized_target`: a non-loopback target nobody authorized (authorize.ts).
 *  `cannot_resume`: the report given to `--resume` is not one this audit can continue. */
export type AuditErrorCode =
  | 'invalid_options'
  | 'invalid_config'
  | 'target_unreachable'
  | 'no_completion_answered'
  | 'model_not_served'
  | 'unauthorized_target'
  | 'cannot_resume'

/** A tool error: the audit could not run at all (bad options, target unreachable). The message
 *  is one line, names tenants but never keys. */
export class AuditError extends Error {
  /** `report`: what the audit saw before it gave up, when it got that far (for
   *  `no_completion_answered`). */
  constructor(
    readonly code: AuditErrorCode,
    message: string,
    readonly report?: AuditReport,
  ) {
    super(message)
    this.name = 'AuditError'
  }
}
