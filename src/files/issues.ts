/** Describing a zod validation issue of a tenants or config file in one line that quotes no file
 *  content beyond field names. zod's messages name no values, except `unrecognized_keys`, which
 *  quotes the keys themselves: a plain API key pasted as a key (`sk-…: x`) would be quoted into
 *  logs and terminals. Keys that look like field names are still named (the useful case:
 *  `Unrecognized key: "prefixCachePages"`).
 *  Knows zod's issue shape; knows nothing of the schemas. */
import type { z } from 'zod'

/** A key that looks like a field name: letters, then optionally digits (`keySha256`), at most
 *  40 characters. A key or digest has digits among its letters, or a `-`/`_`, or is longer. */
const fieldNameLike = /^[A-Za-z]{1,32}[0-9]{0,8}$/

/** "path.to.field: message" (or the message alone at the top level) for `issue`, naming
 *  unrecognized keys only when they look like field names. */
export function describeIssue(issue: z.core.$ZodIssue | undefined): string {
  if (issue === undefined) return 'invalid'
  const path = issue.path.map(String).join('.')
  let message = issue.message
  if (issue.code === 'unrecognized_keys' && !issue.keys.every((k) => fieldNameLike.test(k))) {
    message = 'Unrecognized key (not shown: it does not look like a field name)'
  }
  return path === '' ? message : `${path}: ${message}`
}
