/** `GET /v1/responses/{id}/input_items`: the input items a stored response was created from, as
 *  OpenAI's `ResponseItemList` (`object: "list"`, `data`, `first_id`, `last_id`, `has_more`),
 *  paged by the query's `limit` (1–100, default 20), `order` (`asc` or `desc`, default `desc`:
 *  the last input item first) and `after` (an item id of this list: the items that follow it in
 *  that order). The items are the request's own `input` (a string input is one user message);
 *  `instructions` are no item, and a continued conversation's earlier turns are listed by the
 *  responses that created them.
 *  Knows the Responses item shapes and the query; knows nothing of tenants, HTTP or backends. */
import { randomBytes } from 'node:crypto'
import { KvfenceError } from '../../common/errors.js'
import { outputText } from './render.js'

/** One input message as the request gave it: its role and its text parts, in order. */
export interface InputMessage {
  role: 'user' | 'assistant' | 'system' | 'developer'
  parts: readonly { type: 'input_text' | 'output_text'; text: string }[]
}

/** An input item as listed: OpenAI's `InputMessageResource` (user, system, developer), or its
 *  `OutputMessage` for an assistant message given back. */
export type InputItem = Readonly<Record<string, unknown>> & { readonly id: string }

/** The listed items of `input`, each with an id of its own (`msg_` and 32 hex digits, 128
 *  random bits: an item id tells nothing of the response or of other tenants). */
export function inputItemsOf(input: readonly InputMessage[]): InputItem[] {
  return input.map((m) => {
    const id = `msg_${randomBytes(16).toString('hex')}`
    if (m.role === 'assistant') {
      return {
        id,
        type: 'message',
        status: 'completed',
        role: 'assistant',
        content: m.parts.map((p) => outputText(p.text)),
      }
    }
    return {
      id,
      type: 'message',
      status: 'completed',
      role: m.role,
      content: m.parts.map((p) => ({ type: 'input_text', text: p.text })),
    }
  })
}

/** The query of an input-item list, parsed. */
export interface InputItemsQuery {
  limit: number
  order: 'asc' | 'desc'
  after: string | null
}

/** The default and the bounds of `limit` (OpenAI's). */
const defaultLimit = 20
const maxLimit = 100

/** Parses the query string of `url` (the path's `?…`). Throws `invalid_request` naming the
 *  parameter: a `limit` that is not an integer in 1–100, an `order` other than `asc` or `desc`, a
 *  parameter given twice, or one this server does not take (`include` is taken when empty: no
 *  includable field exists on a text message). */
export function parseInputItemsQuery(url: string | undefined): InputItemsQuery {
  const at = (url ?? '').indexOf('?')
  const params = new URLSearchParams(at === -1 ? '' : (url ?? '').slice(at + 1))
  const query: InputItemsQuery = { limit: defaultLimit, order: 'desc', after: null }
  const seen = new Set<string>()
  for (const [name, value] of params) {
    const bad = (why: string) =>
      new KvfenceError('invalid_request', `Invalid '${name}': ${why}.`, name)
    if (seen.has(name) && name !== 'include' && name !== 'include[]') throw bad('given twice')
    seen.add(name)
    if (name === 'limit') {
      const n = Number(value)
      if (!/^[0-9]+$/.test(value) || n < 1 || n > maxLimit) {
        throw bad(`expected an integer from 1 to ${maxLimit}, got ${JSON.stringify(value)}`)
      }
      query.limit = n
    } else if (name === 'order') {
      if (value !== 'asc' && value !== 'desc') {
        throw bad(`expected 'asc' or 'desc', got ${JSON.stringify(value)}`)
      }
      query.order = value
    } else if (name === 'after') query.after = value
    else if (name === 'include' || name === 'include[]') {
      if (value !== '') throw bad('no field can be included in a text message item')
    } else throw bad('this server does not take this parameter')
  }
  return query
}

/** One page of `items` (in input order) under `query`, as OpenAI's `ResponseItemList`. Throws
 *  `invalid_request` (param `after`) when `after` names no item of the list. An empty page has
 *  `first_id` and `last_id` "" (the spec requires both strings). */
export function inputItemList(items: readonly InputItem[], query: InputItemsQuery) {
  const ordered = query.order === 'asc' ? items : [...items].reverse()
  let start = 0
  if (query.after !== null) {
    const index = ordered.findIndex((item) => item.id === query.after)
    if (index === -1) {
      throw new KvfenceError(
        'invalid_request',
        `Invalid 'after': no input item of this response has the id '${query.after}'.`,
        'after',
      )
    }
    start = index + 1
  }
  const data = ordered.slice(start, start + query.limit)
  return {
    object: 'list' as const,
    data,
    first_id: data[0]?.id ?? '',
    last_id: data.at(-1)?.id ?? '',
    has_more: start + data.length < ordered.length,
  }
}
