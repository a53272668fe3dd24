/** Prompt tokenization off the router's event loop: a small pool of `node:worker_threads`, each
 *  with its own copy of the model's tokenizer (loaded from the model directory), so that one
 *  tenant's long prompt never holds up the loop every tenant's requests share. Prompts up to
 *  `inlineMaxChars` (and chats of at most {@link inlineMaxMessages} messages) are tokenized inline:
 *  posting to a thread costs more than they do. Queued
 *  prompts are taken from the tenants in turn, so one tenant's many long prompts delay another
 *  tenant's by at most one prompt per thread.
 *  Knows parsed requests, tenants' names and the tokenizer; knows nothing of HTTP or workers. */
import { availableParallelism } from 'node:os'
import { Worker } from 'node:worker_threads'
import { KvfenceError, isErrorCode } from '../errors.js'
import { type Tokenizer, unrepresentableTextError } from '../model/tokenizer.js'
import { checkedNotEmpty, completionPromptTokenIds, hasLeadingBos } from './admission.js'
import type { ParsedRequest } from './schemas.js'

/** Tokenizes prompts; see the module's header. */
export interface TokenizerPool {
  /** The prompt's token ids (as `promptTokenIds`), after refusing text the tokenizer would drop.
   *  The ids come as an Int32Array: a thread hands its buffer over without a copy, and a prompt
   *  refused for its length is never turned into an array.
   *  Rejects with the `invalid_request` either throws, or `request_aborted` when `signal` fires
   *  while the prompt waits for a thread. */
  tokenize(parsed: ParsedRequest, tenant: string, signal: AbortSignal): Promise<Int32Array>
  /** Stops the threads; prompts still queued reject with `internal_error`. */
  close(): void
}

/** Options of {@link createTokenizerPool}. */
export interface TokenizerPoolOptions {
  /** The model directory the threads load the tokenizer from (the same one as `tokenizer`). */
  modelDir: string
  /** The main thread's tokenizer, for inline prompts. */
  tokenizer: Tokenizer
  /** Threads (default {@link defaultNumThreads}). */
  numThreads?: number
  /** Prompts of at most this many characters are tokenized inline (default
   *  {@link defaultInlineMaxChars}). */
  inlineMaxChars?: number
}

/** Threads of the pool: at most 2 (a router tokenizes; it does not compute). */
export const defaultNumThreads = Math.max(1, Math.min(2, availableParallelism() - 1))

/** Inline up to 512 characters: about where a thread's round trip (posting the request, the
 *  answer's event) costs as much as tokenizing inline (measured: see the commit that set it). */
export const defaultInlineMaxChars = 512

/** A prompt's ids with its lost text refused: what the threads (and inline calls) run. The text
 *  is encoded once: the ids the workers get are the ones the check decoded (a chat's rendered
 *  prompt is checked whole; only when it loses a character are the messages checked one by one,
 *  to name the one that holds it). */
export function checkedPromptTokenIds(tokenizer: Tokenizer, parsed: ParsedRequest): number[] {
  if (parsed.endpoint === 'chat') {
    const text = tokenizer.applyChatTemplate(parsed.messages)
    const { ids, lost } = tokenizer.encodeChecked(text, {
      addSpecialTokens: !hasLeadingBos(tokenizer, text),
    })
    if (lost !== null) throw lostInMessages(tokenizer, parsed.messages, lost)
    return ids
  }
  if (!('text' in parsed.prompt)) return completionPromptTokenIds(tokenizer, parsed.prompt)
  const { ids, lost } = tokenizer.encodeChecked(parsed.prompt.text)
  if (lost !== null) throw unrepresentableTextError(lost, 'prompt')
  return checkedNotEmpty(ids)
}

/** The error for a chat whose rendered prompt loses `lost`: the first message that loses a
 *  character on its own is named, as the character it loses; else (lost only in context, or in
 *  the template's own text) the messages as a whole. */
function lostInMessages(
  tokenizer: Tokenizer,
  messages: readonly { content: string }[],
  lost: string,
): KvfenceError {
  for (const [i, m] of messages.entries()) {
    const first = tokenizer.firstLostCharacter(m.content)
    if (first !== null) return unrepresentableTextError(first, `messages[${i}].content`)
  }
  return unrepresentableTextError(lost, 'messages')
}

/** A message from a thread: the ids of job `id`, or the error it threw. */
export type ThreadReply =
  | { id: number; tokenIds: Int32Array }
  | { id: number; error: { code: string; message: string; param: string | null } }

interface Job {
  id: number
  parsed: ParsedRequest
  tenant: string
  resolve: (ids: Int32Array) => void
  reject: (err: KvfenceError) => void
  onAbort: () => void
  signal: AbortSignal
}

/** Chat prompts of at most this many messages may be tokenized inline: each message costs a
 *  turn of the chat template (tens of µs with the bundled model's), whatever its length, so two
 *  thousand empty messages would hold the loop for a tenth of a second. */
export const inlineMaxMessages = 8

/** Characters of a prompt's text. */
function numChars(parsed: ParsedRequest): number {
  if (parsed.endpoint === 'chat') return parsed.messages.reduce((n, m) => n + m.content.length, 0)
  return 'text' in parsed.prompt ? parsed.prompt.text.length : 0
}

/** Whether tokenizing `parsed` costs less inline than a thread's round trip. */
function isInline(parsed: ParsedRequest, inlineMaxChars: number): boolean {
  if (parsed.endpoint === 'chat' && parsed.messages.length > inlineMaxMessages) return false
  return numChars(parsed) <= inlineMaxChars
}

/** Starts the pool's threads (`unref()`ed: they never keep the process alive). */
export function createTokenizerPool(options: TokenizerPoolOptions): TokenizerPool {
  const inlineMaxChars = options.inlineMaxChars ?? defaultInlineMaxChars
  const script = new URL('./tokenizer-thread.js', import.meta.url)
  /** Each tenant's waiting prompts, in arrival order; the map's order is the turn order. */
  const queues = new Map<string, Job[]>()
  const idle: Worker[] = []
  const running = new Map<Worker, Job>()
  let nextId = 0
  let isClosed = false

  const settle = (worker: Worker, reply: ThreadReply) => {
    const job = running.get(worker)
    running.delete(worker)
    idle.push(worker)
    if (job !== undefined && job.id === reply.id) {
      job.signal.removeEventListener('abort', job.onAbort)
      if ('tokenIds' in reply) job.resolve(reply.tokenIds)
      else {
        const { code, message, param } = reply.error
        job.reject(new KvfenceError(isErrorCode(code) ? code : 'internal_error', message, param))
      }
    }
    dispatch()
  }
  /** Gives idle threads the next prompt of each tenant in turn. */
  const dispatch = () => {
    while (idle.length > 0 && queues.size > 0) {
      const [tenant, queue] = queues.entries().next().value as [string, Job[]]
      const job = queue.shift()!
      queues.delete(tenant)
      if (queue.length > 0) queues.set(tenant, queue) // to the back of the turn
      const worker = idle.pop()!
      running.set(worker, job)
      worker.postMessage({ id: job.id, parsed: job.parsed })
    }
  }

  const workers = Array.from({ length: options.numThreads ?? defaultNumThreads }, () => {
    const worker = new Worker(script, { workerData: { modelDir: options.modelDir } })
    worker.unref()
    worker.on('message', (reply: ThreadReply) => settle(worker, reply))
    worker.on('error', (err) => {
      const job = running.get(worker)
      running.delete(worker)
      job?.reject(new KvfenceError('internal_error', `tokenizer thread failed: ${err.message}`))
    })
    idle.push(worker)
    return worker
  })

  return {
    async tokenize(parsed, tenant, signal) {
      if (isInline(parsed, inlineMaxChars)) {
        return Int32Array.from(checkedPromptTokenIds(options.tokenizer, parsed))
      }
      if (isClosed) throw new KvfenceError('internal_error', 'the tokenizer pool is closed')
      if (signal.aborted) throw new KvfenceError('request_aborted', 'the client went away')
      return new Promise<Int32Array>((resolve, reject) => {
        const job: Job = {
          id: nextId++,
          parsed,
          tenant,
          resolve,
          reject,
          signal,
          onAbort: () => {},
        }
        job.onAbort = () => {
          const queue = queues.get(tenant)
          const at = queue?.indexOf(job) ?? -1
          if (at === -1) return // on a thread: its answer is dropped when it comes
          queue!.splice(at, 1)
          if (queue!.length === 0) queues.delete(tenant)
          reject(new KvfenceError('request_aborted', 'the client went away'))
        }
        signal.addEventListener('abort', job.onAbort, { once: true })
        const queue = queues.get(tenant)
        if (queue === undefined) queues.set(tenant, [job])
        else queue.push(job)
        dispatch()
      })
    },
    close() {
      isClosed = true
      for (const queue of queues.values()) {
        for (const job of queue) job.reject(new KvfenceError('internal_error', 'router stopped'))
      }
      queues.clear()
      for (const worker of workers) void worker.terminate()
    },
  }
}
