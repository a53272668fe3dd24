/** Reading what was logged in tests: a pino logger that writes into memory, and the log of a
 *  stopped part. */
import type { ChildProcess } from 'node:child_process'
import { readFileSync } from 'node:fs'
import { Writable } from 'node:stream'
import { type Logger, pino } from 'pino'
import { stopAll } from '../../src/engine/processes.js'
import { waitUntil } from './poll.js'

/** What a {@link captureLogs} logger wrote. */
export interface LogCapture {
  log: Logger
  /** Each write, as written (one pino JSON line each). */
  lines: string[]
  /** Everything written, joined. */
  text(): string
  /** Each line parsed (pino's fields: `level`, `msg`, and the logged object's). */
  records(): { level: number; msg: string; [field: string]: unknown }[]
}

/** A logger at `level` (default debug) whose output is kept in memory. */
export function captureLogs(level = 'debug'): LogCapture {
  const lines: string[] = []
  const sink = new Writable({
    write(chunk: Buffer, _encoding, done) {
      lines.push(chunk.toString('utf8'))
      done()
    },
  })
  return {
    log: pino({ level }, sink),
    lines,
    text: () => lines.join(''),
    records: () => lines.map((l) => JSON.parse(l) as ReturnType<LogCapture['records']>[number]),
  }
}

/** Stops the parts in `started` and returns the whole log `forkPart` wrote to `logFile` once it
 *  has ended (its last line is the parent's "ended (…)"). A part's ready message comes over IPC
 *  and its log lines over a stdout pipe, so a log read while the part runs may miss lines it has
 *  already written (CI read an empty log once; a full run missed a router's error line). */
export async function stoppedPartLog(started: ChildProcess[], logFile: string): Promise<string> {
  await stopAll(started)
  await waitUntil(() => readFileSync(logFile, 'utf8').includes('ended ('), {
    timeoutMs: 10_000,
    intervalMs: 50,
    what: 'the log of the stopped part ends',
  })
  return readFileSync(logFile, 'utf8')
}
