/** Errors of the control plane's transports as one line for a message: a socket's or TLS's
 *  failure, and a schema's first issue. Knows Node's errors and zod's issues; knows nothing of
 *  workers. */
import type { z } from 'zod'
import { describeTlsError } from '../link/tls.js'

/** `err` as one line: a TLS failure in words (src/link/tls.ts), else its message with its code
 *  (`ECONNREFUSED …`). */
export function describeError(err: unknown): string {
  if (err instanceof Error) {
    const tlsText = describeTlsError(err)
    if (tlsText !== err.message) return tlsText
    const code = (err as NodeJS.ErrnoException).code
    return code !== undefined && !err.message.includes(code)
      ? `${code} ${err.message}`
      : err.message
  }
  return String(err)
}

/** A schema's issue as `path: message` (or the message alone at the top). */
export function issueText(issue: z.core.$ZodIssue | undefined): string {
  if (issue === undefined) return 'invalid'
  const path = issue.path.map(String).join('.')
  return path === '' ? issue.message : `${path}: ${issue.message}`
}
