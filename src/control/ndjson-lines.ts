/** The lines of a streamed NDJSON reply as an async iterator of parsed values, read with the
 *  stream's own events rather than its async iterator, and without a generator between them: a
 *  decode worker's reply is one line per token, and each layer of promises a line passes through
 *  costs every token of every stream. A line reaches the consumer in the turn its bytes arrive.
 *  Knows a readable stream of UTF-8 text and newlines; knows nothing of what the lines mean. */
import { finished } from 'node:stream'
import type { IncomingMessage } from 'node:http'

/** Lines read ahead of the consumer before the reply is paused (TCP then holds the rest back). */
const maxQueuedLines = 64

/** Options of {@link ndjsonLines}. */
export interface NdjsonLinesOptions<T> {
  /** Parses one non-empty line (trimmed); what it throws ends the iteration with that error. */
  parse: (line: string) => T
  /** The longest line accepted, bytes (UTF-16 code units of the decoded text). */
  maxLineChars: number
  /** The error for a line over `maxLineChars`. */
  tooLong: () => Error
  /** What the iteration throws for `err` (any failure above); default: `err` itself. */
  asError?: (err: unknown) => unknown
}

/** The parsed lines of `res`, in order; a last line without a newline counts. The iteration
 *  throws what `parse` throws, {@link NdjsonLinesOptions.tooLong}, or the stream's own error (a
 *  reply cut before its end is one: `ERR_STREAM_PREMATURE_CLOSE` or the socket's), each through
 *  `asError`. Leaving early
 *  (`return`) destroys `res`, which closes its request. */
export function ndjsonLines<T>(
  res: IncomingMessage,
  options: NdjsonLinesOptions<T>,
): AsyncIterableIterator<T> {
  const queue: T[] = []
  let pending = ''
  let isEnded = false
  let failure: { error: unknown } | null = null
  let waiter: { resolve: (r: IteratorResult<T>) => void; reject: (e: unknown) => void } | null =
    null

  const settle = () => {
    if (waiter === null) return
    const w = waiter
    if (queue.length > 0) {
      waiter = null
      w.resolve({ value: queue.shift()!, done: false })
    } else if (failure !== null) {
      waiter = null
      w.reject(failure.error)
    } else if (isEnded) {
      waiter = null
      w.resolve({ value: undefined, done: true })
    }
  }
  const fail = (error: unknown) => {
    failure ??= { error: options.asError === undefined ? error : options.asError(error) }
    res.destroy()
    settle()
  }
  const take = (line: string) => {
    const trimmed = line.trim()
    if (trimmed !== '') queue.push(options.parse(trimmed))
  }

  res.setEncoding('utf8')
  res.on('data', (chunk: string) => {
    if (failure !== null) return
    try {
      let start = 0
      let newline: number
      while ((newline = chunk.indexOf('\n', start)) !== -1) {
        take(pending + chunk.slice(start, newline))
        pending = ''
        start = newline + 1
      }
      pending += start === 0 ? chunk : chunk.slice(start)
      if (pending.length > options.maxLineChars) throw options.tooLong()
    } catch (err) {
      return fail(err)
    }
    if (queue.length >= maxQueuedLines) res.pause()
    settle()
  })
  finished(res, (err) => {
    if (err) return fail(err)
    try {
      take(pending)
      pending = ''
    } catch (e) {
      return fail(e)
    }
    isEnded = true
    settle()
  })

  const iterator: AsyncIterableIterator<T> = {
    next() {
      if (queue.length > 0) {
        const value = queue.shift()!
        if (queue.length < maxQueuedLines && res.isPaused() && !isEnded) res.resume()
        return Promise.resolve({ value, done: false })
      }
      if (failure !== null) return Promise.reject(failure.error)
      if (isEnded) return Promise.resolve({ value: undefined, done: true })
      return new Promise((resolve, reject) => (waiter = { resolve, reject }))
    },
    return() {
      isEnded = true
      queue.length = 0
      res.destroy()
      return Promise.resolve({ value: undefined, done: true })
    },
    [Symbol.asyncIterator]() {
      return iterator
    },
  }
  return iterator
}
