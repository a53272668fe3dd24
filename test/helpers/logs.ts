/** Reading what was logged in tests: a pino logger that writes into memory. The log of a stopped
 *  part is read with `stoppedPartLog` of processes.ts. */
import { Writable } from 'node:stream'
import { type Logger, pino } from 'pino'

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
