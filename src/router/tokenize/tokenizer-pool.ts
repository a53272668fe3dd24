/** Prompt tokenization off the router's event loop: a small pool of child processes
 *  (tokenizer-process.ts), each with its own copy of the model's tokenizer (loaded from the model
 *  directory), so that one tenant's long prompt never holds up the loop every tenant's requests
 *  share. Processes, not worker threads: a thread's isolate shares the process's garbage
 *  collection helpers with the router's loop, and tokenizing a 1 MB prompt allocates ~1.5 GB, so
 *  its collections took the CPU the loop needed (another tenant's small requests' p99 rose by
 *  12–16 ms; measured with `npm run bench -- fairness --part big`). Each process collects on its
 *  own thread (`--single-threaded-gc`) at a lower priority ({@link tokenizerNiceness}). They start
 *  with the pool (or, with `startNow: false`, when the first prompt needs one), and again when a
 *  prompt needs one after one exited.
 *  Prompts up to `inlineMaxChars` (and chats of at most {@link inlineMaxMessages} messages) are
 *  tokenized inline: sending them to a process costs more than they do. Queued prompts are taken
 *  from the tenants in turn, so one tenant's many long prompts delay another tenant's by at most
 *  one prompt per process.
 *  How a member starts is the caller's {@link StartTokenizer}: `forkTokenizer`
 *  (tokenizer-fork.ts) in the router, so that this module starts no process itself.
 *  Knows parsed requests, tenants' names and the tokenizer; knows nothing of HTTP or workers. */
import { availableParallelism } from 'node:os'
import { KvfenceError, isErrorCode } from '../../common/errors.js'
import type { Tokenizer } from '../../model/tokenizer.js'
import { checkedPromptTokenIds } from './prompt-ids.js'
import type { ParsedRequest } from '../api/schemas.js'
import type { TokenizerJob, TokenizerReply } from './tokenizer-job.js'

export type { TokenizerJob, TokenizerReply } from './tokenizer-job.js'

/** Tokenizes prompts; see the module's header. */
export interface TokenizerPool {
  /** The prompt's token ids (as `promptTokenIds`) and their number, after refusing text the
   *  tokenizer would drop. The ids of a prompt tokenized in a process come as an Int32Array (a
   *  prompt refused for its length is never turned into an array), those of one tokenized here
   *  as the array the tokenizer made; and from a process only when fewer than `keepBelow` (tokens; default:
   *  always): a 1 MB prompt over the window is ~1M ids, 4 MB to carry back and collect for
   *  nothing. Rejects with the `invalid_request` either throws, `request_aborted` when `signal`
   *  fires while the prompt waits for a process, or `internal_error` when its process exits
   *  before answering (or fails to start, or is killed for not answering within
   *  `answerTimeoutMs`) or the pool is closed. */
  tokenize(
    parsed: ParsedRequest,
    tenant: string,
    signal: AbortSignal,
    options?: { keepBelow?: number },
  ): Promise<TokenizedPrompt>
  /** Stops the processes (SIGKILL: they hold nothing to save, and it ends even a stopped one);
   *  prompts queued or being tokenized reject with `internal_error`. Resolves once every process
   *  has exited. */
  close(): Promise<void>
}

/** What {@link TokenizerPool.tokenize} resolves to. */
export interface TokenizedPrompt {
  numTokens: number
  /** The ids; null when not kept (`keepBelow`). */
  ids: Int32Array | readonly number[] | null
}

/** The pool's handle on one tokenizer it started (a child process in the router). */
export interface TokenizerChild {
  /** Hands it a job; its reply comes to the `message` event given to {@link StartTokenizer}. */
  send(job: TokenizerJob): void
  /** Whether it keeps the event loop alive (while a prompt waits on it, not while idle). */
  hold(isHeld: boolean): void
  /** Ends it at once (SIGKILL for a process); `gone` follows. */
  kill(): void
  /** Whether it has ended. */
  hasExited(): boolean
  /** Resolves when it has ended. */
  exited: Promise<void>
}

/** Starts one tokenizer for the model directory `modelDir`: it says `{ ready: true }` once it has
 *  loaded the tokenizer, then one {@link TokenizerReply} per job, through `events.message`;
 *  `events.gone` hears how it ended (once or twice: a failed send's error, then its exit). */
export type StartTokenizer = (
  modelDir: string,
  events: {
    message: (message: TokenizerReply | { ready: true }) => void
    gone: (how: string) => void
  },
) => TokenizerChild

/** Options of {@link createTokenizerPool}. */
export interface TokenizerPoolOptions {
  /** The model directory the processes load the tokenizer from (the same one as `tokenizer`). */
  modelDir: string
  /** Starts a member (`forkTokenizer` of tokenizer-fork.ts: a child process). */
  startTokenizer: StartTokenizer
  /** The main thread's tokenizer, for inline prompts. */
  tokenizer: Tokenizer
  /** Processes (default {@link defaultNumProcesses}). */
  numProcesses?: number
  /** Prompts of at most this many characters are tokenized inline (default
   *  {@link defaultInlineMaxChars}). */
  inlineMaxChars?: number
  /** Start the processes now (default), not with the first prompt that needs one: with Qwen3's
   *  tokenizer a process takes ~1 s to load it, which that prompt would otherwise wait. */
  startNow?: boolean
  /** How long a process may take to load its tokenizer or to answer one prompt before it is
   *  killed (ms; default {@link defaultAnswerTimeoutMs}): a stopped or stuck one would otherwise
   *  hold its prompt, and every prompt queued behind it, for ever. */
  answerTimeoutMs?: number
}

/** Processes of the pool: at most 2 (a router tokenizes; it does not compute). */
export const defaultNumProcesses = Math.max(1, Math.min(2, availableParallelism() - 1))

/** The niceness a tokenizer process gives itself (`os.setPriority`; 0 is the router's, 19 the
 *  lowest): on a busy machine the router's loop gets ~9× its CPU share (Linux's weights for 0 and
 *  10), yet it is not starved the way 19 (~70×) would leave it behind other processes' work. */
export const tokenizerNiceness = 10

/** A process's longest turn, ms: a minute, ~100× what loading Qwen3's tokenizer (~1 s) or a
 *  1 MB prompt (~0.5 s) takes here, so that only a process that has stopped answering meets it. */
export const defaultAnswerTimeoutMs = 60_000

/** Inline up to 512 characters: about where a worker thread's round trip (posting the request,
 *  the answer's event) cost as much as tokenizing inline (measured: see the commit that set it);
 *  a process's round trip, over a pipe, costs more still. */
export const defaultInlineMaxChars = 512

interface Job {
  id: number
  parsed: ParsedRequest
  tenant: string
  keepBelow: number
  resolve: (prompt: TokenizedPrompt) => void
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

/** Whether tokenizing `parsed` costs less inline than a process's round trip. */
function isInline(parsed: ParsedRequest, inlineMaxChars: number): boolean {
  if (parsed.endpoint === 'chat' && parsed.messages.length > inlineMaxMessages) return false
  return numChars(parsed) <= inlineMaxChars
}

/** Whether `member` keeps the event loop alive: while it starts or tokenizes (a prompt waits for
 *  it), not while idle. */
function holdsLoop(member: Member, isHeld: boolean): void {
  member.child.hold(isHeld)
}

/** One process of the pool. */
interface Member {
  child: TokenizerChild
  /** Whether it has loaded its tokenizer (said `{ ready: true }`). */
  isReady: boolean
  /** The prompt it is tokenizing. */
  job: Job | null
  /** Kills it when it has not answered (said ready, or answered its job) in time. */
  answerTimer: NodeJS.Timeout | undefined
  /** Why {@link Member.answerTimer} killed it; null while it has not. */
  killedFor: string | null
}

/** Starts one member with `startTokenizer`: `onMessage` hears what it says, `onGone` how it
 *  ended. */
function startMember(
  startTokenizer: StartTokenizer,
  modelDir: string,
  onMessage: (member: Member, message: TokenizerReply | { ready: true }) => void,
  onGone: (member: Member, how: string) => void,
): Member {
  const member: Member = {
    child: undefined as unknown as TokenizerChild, // set below, before any event can come
    isReady: false,
    job: null,
    answerTimer: undefined,
    killedFor: null,
  }
  member.child = startTokenizer(modelDir, {
    message: (message) => onMessage(member, message),
    gone: (how) => onGone(member, how),
  })
  return member
}

/** Starts (a deadline in ms) or ends (null) `member`'s wait for an answer: SIGKILL at the
 *  deadline, after which its exit fails the prompt it held (or, when it never started, the
 *  waiting ones). */
function awaitAnswerOf(member: Member, timeoutMs: number | null): void {
  clearTimeout(member.answerTimer)
  member.answerTimer =
    timeoutMs === null
      ? undefined
      : setTimeout(() => {
          member.killedFor = `did not answer within ${timeoutMs} ms and was killed`
          member.child.kill()
        }, timeoutMs).unref() // the process's own handles hold the loop while it owes one
}

/** Settles `job` with its process's `reply`. */
function answer(job: Job, reply: TokenizerReply): void {
  job.signal.removeEventListener('abort', job.onAbort)
  if ('tokenIds' in reply) job.resolve({ numTokens: reply.tokenIds.length, ids: reply.tokenIds })
  else if ('numTokens' in reply) job.resolve({ numTokens: reply.numTokens, ids: null })
  else {
    const { code, message, param } = reply.error
    job.reject(new KvfenceError(isErrorCode(code) ? code : 'internal_error', message, param))
  }
}

/** The next job's id (a reply names the job it answers). */
let nextJobId = 0

/** A job for `fields.tenant`'s queue in `queues`; `signal` firing rejects it with
 *  `request_aborted` at once, and takes it out of its queue if it waits there (on a process, the
 *  answer that comes later settles nothing: the drain's deadline must not wait for it). */
function newJob(queues: Map<string, Job[]>, fields: Omit<Job, 'id' | 'onAbort'>): Job {
  const job: Job = { ...fields, id: nextJobId++, onAbort: () => {} }
  job.onAbort = () => {
    const queue = queues.get(job.tenant)
    const at = queue?.indexOf(job) ?? -1
    if (at !== -1) {
      queue!.splice(at, 1)
      if (queue!.length === 0) queues.delete(job.tenant)
    }
    job.reject(new KvfenceError('request_aborted', 'the client went away'))
  }
  job.signal.addEventListener('abort', job.onAbort, { once: true })
  return job
}

/** Rejects every job queued in `queues` with `err`, and empties them. */
function rejectAll(queues: Map<string, Job[]>, err: KvfenceError): void {
  for (const queue of queues.values()) {
    for (const job of queue) {
      job.signal.removeEventListener('abort', job.onAbort)
      job.reject(err)
    }
  }
  queues.clear()
}

/** Makes the pool and (unless `startNow` is false) starts its processes. */
export function createTokenizerPool(options: TokenizerPoolOptions): TokenizerPool {
  const inlineMaxChars = options.inlineMaxChars ?? defaultInlineMaxChars
  const numProcesses = options.numProcesses ?? defaultNumProcesses
  /** Each tenant's waiting prompts, in arrival order; the map's order is the turn order. */
  const queues = new Map<string, Job[]>()
  const members: Member[] = []
  let isClosed = false

  const answerTimeoutMs = options.answerTimeoutMs ?? defaultAnswerTimeoutMs
  const awaitAnswer = (member: Member, owes: boolean) =>
    awaitAnswerOf(member, owes ? answerTimeoutMs : null)
  const settle = (member: Member, reply: TokenizerReply) => {
    const job = member.job
    member.job = null
    awaitAnswer(member, false)
    holdsLoop(member, false)
    if (job !== null && job.id === reply.id) answer(job, reply)
    dispatch()
  }
  const onExit = (member: Member, how: string) => {
    const at = members.indexOf(member)
    if (at === -1) return // said twice ('error' then 'exit')
    members.splice(at, 1)
    awaitAnswer(member, false)
    // An 'error' (a send that failed) may come from a process still running: not to be left.
    if (!member.child.hasExited()) member.child.kill()
    const err = new KvfenceError(
      'internal_error',
      `the tokenizer process ${member.killedFor ?? how}`,
    )
    if (member.job !== null) {
      member.job.signal.removeEventListener('abort', member.job.onAbort)
      member.job.reject(err)
      member.job = null
    }
    // One that never started will not start for the next prompt either: the waiting prompts
    // are refused rather than each starting (and losing) another process.
    if (!member.isReady) rejectAll(queues, err)
    if (!isClosed) dispatch()
  }
  const onMessage = (member: Member, message: TokenizerReply | { ready: true }) => {
    if (!('ready' in message)) return settle(member, message)
    member.isReady = true
    awaitAnswer(member, false)
    holdsLoop(member, false)
    dispatch()
  }
  const start = (): Member => {
    const member = startMember(options.startTokenizer, options.modelDir, onMessage, onExit)
    members.push(member)
    awaitAnswer(member, true) // its tokenizer loaded
    return member
  }
  /** Gives idle processes the next prompt of each tenant in turn; starts a process when prompts
   *  wait and the pool has fewer than it may. */
  const dispatch = () => {
    while (queues.size > 0) {
      const member = members.find((m) => m.isReady && m.job === null)
      if (member === undefined) {
        if (members.length < numProcesses && !members.some((m) => !m.isReady)) start()
        // Prompts wait for a process to start: it holds the loop until it is ready.
        for (const m of members) if (!m.isReady) holdsLoop(m, true)
        return
      }
      const [tenant, queue] = queues.entries().next().value as [string, Job[]]
      const job = queue.shift()!
      queues.delete(tenant)
      if (queue.length > 0) queues.set(tenant, queue) // to the back of the turn
      member.job = job
      holdsLoop(member, true)
      awaitAnswer(member, true)
      member.child.send({
        id: job.id,
        parsed: job.parsed,
        keepBelow: job.keepBelow,
      } satisfies TokenizerJob)
    }
  }

  if (options.startNow ?? true) {
    for (let i = 0; i < numProcesses; i++) holdsLoop(start(), false)
  }

  return {
    async tokenize(parsed, tenant, signal, { keepBelow = Infinity } = {}) {
      if (isInline(parsed, inlineMaxChars)) {
        // Kept as the array the router sends on: no round trip through an Int32Array.
        const ids = checkedPromptTokenIds(options.tokenizer, parsed)
        return { numTokens: ids.length, ids }
      }
      if (isClosed) throw new KvfenceError('internal_error', 'the tokenizer pool is closed')
      if (signal.aborted) throw new KvfenceError('request_aborted', 'the client went away')
      return new Promise<TokenizedPrompt>((resolve, reject) => {
        const job = newJob(queues, { parsed, tenant, keepBelow, signal, resolve, reject })
        const queue = queues.get(tenant)
        if (queue === undefined) queues.set(tenant, [job])
        else queue.push(job)
        dispatch()
      })
    },
    async close() {
      isClosed = true
      const stopped = new KvfenceError('internal_error', 'router stopped')
      rejectAll(queues, stopped)
      const exits = members.splice(0).map((member) => {
        awaitAnswer(member, false)
        if (member.job !== null) member.job.reject(stopped)
        const { child } = member
        if (child.hasExited()) return Promise.resolve()
        holdsLoop(member, true) // its exit is awaited
        child.kill()
        return child.exited
      })
      await Promise.all(exits)
    },
  }
}
